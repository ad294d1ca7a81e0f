"""`cogview4`, `cogview3plus`, `glm_image`: the CogView family of ZhipuAI (diffusers `CogView4Transformer2DModel`,
`CogView3PlusTransformer2DModel`, `GlmImageTransformer2DModel`): one stack of joint text-image blocks each.

Merges the image part of every block's joint attention and feed-forward. CogView4 and GLM-Image call one ``ff`` on
the image, then on the text: only the first call is merged (``SharedPoint``). GLM-Image's condition-image passes,
which write its reference key/value cache, are neither merged nor a sampling step. The blocks, RoPE, masks and
received attention: docs/backbones/cogview.md.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, SharedPoint, Site
from ._diffusers import call_arg

_ROPE = Rope("image_rotary_emb", 3, "rows")  # image rows only [N, d], by keyword


class CogView4Adapter(DeclaredAdapter):
    """Adapter for diffusers `CogView4Transformer2DModel` (CogView4-6B); see the module docstring."""

    name: ClassVar[str] = "cogview4"
    model_class: ClassVar[str] = "CogView4Transformer2DModel"
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, original_size, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("cogview4", "transformer_blocks", ("CogView4TransformerBlock",), (
            Site("attn", "attn1", output=0, rope=_ROPE, mask="pass", probe="sdpa", text_keys=True),
            Site("mlp", "ff", point=SharedPoint),
        ), text_arg="encoder_hidden_states", outputs=("hidden_states", "encoder_hidden_states")),
    )


class GlmImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `GlmImageTransformer2DModel` (GLM-Image's diffusion decoder); see the module
    docstring."""

    name: ClassVar[str] = "glm_image"
    model_class: ClassVar[str] = "GlmImageTransformer2DModel"
    timestep_index: ClassVar[int] = 4  # forward(hidden_states, encoder_hidden_states, prior_token_id, prior_token_drop, timestep, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("glm_image", "transformer_blocks", ("GlmImageTransformerBlock",), CogView4Adapter.kinds[0].sites,
             text_arg="encoder_hidden_states", outputs=("hidden_states", "encoder_hidden_states")),
    )

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        if self._writes_reference_cache(args, kwargs):
            self.model_text, self.grid_size = None, None  # a condition image's pass: nothing merged, no step
            return None
        return super().on_model_call(args, kwargs)

    @staticmethod
    def _writes_reference_cache(args: tuple, kwargs: dict) -> bool:
        caches = call_arg(args, kwargs, "kv_caches", 10)
        layers = getattr(caches, "caches", None) or ()
        return any(getattr(layer, "mode", None) == "write" for layer in layers)


class CogView3PlusAdapter(DeclaredAdapter):
    """Adapter for diffusers `CogView3PlusTransformer2DModel` (CogView3-Plus-3B); see the module docstring."""

    name: ClassVar[str] = "cogview3plus"
    model_class: ClassVar[str] = "CogView3PlusTransformer2DModel"
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, original_size, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("cogview3plus", "transformer_blocks", ("CogView3PlusTransformerBlock",), (
            Site("attn", "attn1", output=0, probe="sdpa", text_keys=True),
            Site("mlp", "ff", tokens="joint"),
        ), text_arg="encoder_hidden_states", outputs=("hidden_states", "encoder_hidden_states")),
    )
