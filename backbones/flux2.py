"""`flux2`: FLUX.2 (diffusers `Flux2Transformer2DModel`): double-stream and parallel single-stream blocks.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_flux2.py``):

* ``Flux2TransformerBlock`` (kind ``"double"``, in ``transformer_blocks``) runs ``attn(hidden_states=norm1(x),
  encoder_hidden_states=norm1_context(c), image_rotary_emb=...)``: a joint attention whose processor puts
  text first and returns ``(image, text)``; then ``ff`` (``Flux2FeedForward``, SwiGLU) on the image stream.
  Merge points: ``attn`` (``"attn"``; the image rows of the ``[T + N, d]`` RoPE table gathered per slot) and
  ``ff`` (``"mlp"``); ``ff_context`` (text) is left alone.
* ``Flux2SingleTransformerBlock`` (kind ``"single"``, in ``single_transformer_blocks``) gets the joint
  ``[text, image]`` sequence from the model (``encoder_hidden_states=None``), so the text length ``T`` comes
  from the model call's ``encoder_hidden_states``. Its ``attn`` (``Flux2ParallelSelfAttention``) is the whole
  parallel block: one fused ``to_qkv_mlp_proj``, the attention, the SwiGLU and one fused ``to_out``. Merge
  points: ``attn`` (``"attn"``: the image part of the normalised joint sequence, RoPE rows gathered; attention
  and MLP both run merged) and ``attn.to_out`` (``"mlp"``: the image part of ``cat([attn, mlp])``). With both
  on, ``attn`` keeps its output merged and ``to_out`` unmerges once; ``"mlp"`` alone merges only ``to_out``.
* Grid: ``img_ids [B, N, 4]`` hold ``(t, h, w, l)``; the grid ``(H, W)`` is read from the ``h, w`` columns
  (raster order) on the host, once per ``img_ids`` tensor (:class:`~tomerge.backbones._host.HostFacts`). The
  pipeline calls the model with ``timestep / 1000`` (``t_max = 1``).
* Reference images (``Flux2Pipeline(image=...)``, klein): their latent tokens follow the generated image's in
  the image stream, with ids of other ``t`` (10, 20, ...); klein's KV-cache "extract" call puts them first.
  The target is the run of tokens with the smallest ``t`` (:func:`~tomerge.backbones._grid.split_ids`), the
  others are context tokens (:mod:`tomerge.backbones._context`): merged sites merge the target, the reference
  tokens pass through at full length with their RoPE rows (the processor's ``num_ref_tokens`` split of the
  extract call stays right: the tokens ahead of the target are not merged).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ._context import NO_CONTEXT, ContextTokens
from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg
from ._grid import split_ids
from ._host import HostFacts

_DOUBLE_ROPE = Rope("image_rotary_emb", 3, "rows")  # Flux2Attention.forward(hidden, encoder, mask, rope)
_SINGLE_ROPE = Rope("image_rotary_emb", 2, "rows")  # Flux2ParallelSelfAttention.forward(hidden, mask, rope)


class Flux2Adapter(DeclaredAdapter):
    """Adapter for diffusers `Flux2Transformer2DModel` (FLUX.2 dev / klein); see the module docstring."""

    name: ClassVar[str] = "flux2"
    model_class: ClassVar[str] = "Flux2Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("Flux2TransformerBlock",), (
            Site("attn", "attn", output=0, rope=_DOUBLE_ROPE, probe=True, text_keys=True),
            Site("mlp", "ff", arg="x"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
        Kind("single", "single_transformer_blocks", ("Flux2SingleTransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_SINGLE_ROPE, mask_index=1, stays_merged_with="mlp", probe=True,
                 text_keys=True),
            Site("mlp", "attn.to_out", arg="input", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self._layout = HostFacts(split_ids)  # read once per img_ids tensor

    def call_layout(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ContextTokens]:
        img_ids = call_arg(args, kwargs, "img_ids", 3)
        return self._layout(img_ids) if img_ids is not None else (None, NO_CONTEXT)

    def unknown_grid_reason(self) -> str:
        return "its img_ids hold no raster-ordered H x W grid of the generated image"
