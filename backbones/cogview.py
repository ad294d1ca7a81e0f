"""`cogview4`, `cogview3plus`, `glm_image`: the CogView family of ZhipuAI (diffusers `CogView4Transformer2DModel`,
`CogView3PlusTransformer2DModel`, `GlmImageTransformer2DModel`): one stack of joint text-image blocks each.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_cogview4.py``,
``transformer_cogview3plus.py``, ``transformer_glm_image.py``):

* ``CogView4TransformerBlock`` (kind ``"cogview4"``, in ``transformer_blocks``) runs ``attn1(hidden_states=
  norm_image, encoder_hidden_states=norm_text, image_rotary_emb=..., attention_mask=...)``: the processor joins
  ``[text, image]``, applies RoPE to the image part of q/k with ``(cos, sin)`` tables ``[N, d]`` (image rows
  only) and returns ``(image, text)``; then one feed-forward ``ff`` twice, first on the image stream, then on the
  text stream. Merge points: ``attn1`` (``"attn"``; the rotary rows gathered per slot; the text mask ``[B, T]``
  is joined inside the processor with an all-ones image part of the call's own length: passed through) and the
  first ``ff`` call of every block call (``"mlp"``; its second call, on the text, runs untouched).
* ``GlmImageTransformerBlock`` (kind ``"glm_image"``) is the same block with a key/value cache for condition
  images; the RoPE tables are applied on ``[B, S, heads, d]`` (``sequence_dim=1``). GLM-Image's image-to-image
  calls first run the model on each condition image with the cache in ``"write"`` mode (timestep 0): those
  calls are reference tokens and are not merged, and their timestep is not a sampling step. Denoising calls
  read the cached reference keys/values, prepended to the (merged) image keys.
* ``CogView3PlusTransformerBlock`` (kind ``"cogview3plus"``) runs ``attn1`` with CogVideoX's joint processor
  (``[text, image]``, no RoPE: positions are absolute, added at the patch embedding) and one ``ff`` on the joint
  ``[text, image]`` sequence. Merge points: ``attn1`` (``"attn"``) and the image part of ``ff``'s input
  (``"mlp"``).
* Grid: the latent ``(H0 // p, W0 // p)``. Timesteps: the scheduler's, ``[0, 1000]`` (GLM-Image passes
  ``t - 1``).

Received attention (``idm``, the ``sdtm`` schedules): the joint attention ``attn1`` of every block, from its
SDPA call (:func:`~tomerge.backbones._diffusers.probe_sdpa_attention`: CogView4 normalises q/k over ``[B,
heads, L, d]``), text queries against all keys, the image keys' share. GLM-Image's image-to-image denoising
calls attend to the condition images' cached keys as well: the probe records nothing there and ``idm``
raises. Prompt reweighting (``Site(text_keys=True)``): the text keys of ``attn1``, the block call's ``T`` first.
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
