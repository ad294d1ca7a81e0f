"""`flux3`: FLUX.3 (diffusers `Flux3Transformer2DModel`): per-mode blocks, then joint single blocks.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_flux3.py``):

* Each token mode first runs its own ``Flux3ModeTransformerBlock`` s: the image tokens in
  ``mode_blocks["image"]`` (kind ``"mode"``), the text in ``txt_mode_blocks`` and reference-image tokens in
  ``mode_blocks["image_cond"]`` (neither is merged). A mode block is a parallel block: ``attn(hidden_states=
  norm, image_rotary_emb=image_rows)`` (a softmax self-attention over the image tokens alone, RoPE ``(cos,
  sin)`` of ``[N, d]``) and ``ff(norm)`` read the same normalised tokens and their outputs are summed before
  the gated residual. Merge points: ``attn`` (``"attn"``; its RoPE rows gathered per slot; the received-
  attention probe of ``idm``) and ``ff`` (``"mlp"``), both merging the same tensor once.
* ``Flux3SingleTransformerBlock`` (kind ``"single"``, ``single_transformer_blocks``) gets the image and the
  text streams separately, normalises and concatenates them to ``[text, image]`` and runs ``attn`` and ``ff``
  on that joint sequence in parallel (RoPE rows ``[T + N, d]``, text first). Merge points: ``attn``
  (``"attn"``) and ``ff`` (``"mlp"``), both on the image part of the joint sequence; ``T`` is the block's
  ``encoder_hidden_states`` length; the received-attention probe is the joint one (text queries).
* Grid: ``img_ids [N, 4]`` hold ``(t, h, w, l)`` of the image tokens, shared by the batch; the grid ``(H, W)``
  is read from them on every call. A call with reference images (``image_cond_hidden_states``: their tokens
  follow the image tokens in the single blocks) is not merged, with a warning. The pipeline passes the flow
  timestep in ``[0, 1]`` (``t_max = 1``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.state import MergeState

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg, probe_self_attention

_ROPE = Rope("image_rotary_emb", 2, "rows")  # Flux3Attention.forward(hidden_states, attention_mask, image_rotary_emb)


class Flux3Adapter(DeclaredAdapter):
    """Adapter for diffusers `Flux3Transformer2DModel` (FLUX.3, and its flow-map step-distilled checkpoints); see
    the module docstring."""

    name: ClassVar[str] = "flux3"
    model_class: ClassVar[str] = "Flux3Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, txt_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 3)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("mode", "mode_blocks.image", ("Flux3ModeTransformerBlock",), (
            Site("attn", "attn", rope=_ROPE, mask_index=1, probe=True),
            Site("mlp", "ff", arg="x"),
        )),
        Kind("single", "single_transformer_blocks", ("Flux3SingleTransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_ROPE, mask_index=1, probe=True),
            Site("mlp", "ff", arg="x", tokens="joint"),
        ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states")),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        if call_arg(args, kwargs, "image_cond_hidden_states", 5) is not None:
            return None
        return super().call_grid(args, kwargs)

    def unknown_grid_reason(self) -> str:
        return ("it has reference-image tokens (image_cond_hidden_states), or its img_ids are not one raster-ordered "
                "H x W grid")

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        if block.kind == "mode" and isinstance(point, DeclaredPoint) and point.site.probe:
            # Flux3AttnProcessor unflattens the heads before norm_q / norm_k: [B, N, heads, d]
            return probe_self_attention(block, point, state, heads_first=False)
        return super().probe(block, point, state)  # the single blocks' joint attention
