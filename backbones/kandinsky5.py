"""`kandinsky5`: Kandinsky 5.0 video (text- and image-to-video; diffusers `Kandinsky5Transformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_kandinsky.py``):

* Text blocks (``text_transformer_blocks``) refine the Qwen2.5-VL prompt alone, before the video blocks: they
  have no video tokens and are not merged. The video blocks (``Kandinsky5TransformerDecoderBlock``, kind
  ``"kandinsky5"``, in ``visual_transformer_blocks``) run ``self_attention(norm(x), rotary_emb=rope,
  sparse_params=...)`` (self-attention over the video tokens with the 3-D RoPE, ``[B, N, 1, d/2, 2, 2]``
  rotation matrices: tokens on axis 1 as in the ``"wan"`` layout), ``cross_attention(norm(x),
  encoder_hidden_states=text)`` and ``feed_forward(norm(x))``, each modulated before and gated after.
* Merge points: ``self_attention`` (``"attn"``), ``cross_attention`` (``"crossattn"``), ``feed_forward``
  (``"mlp"``). The attention's projections are ``to_query``/``to_key`` with per-head ``query_norm``/``key_norm``
  (applied to ``[B, N, heads, d]``), so the received-attention probe of ``self_attention`` is this adapter's
  :meth:`~Kandinsky5Adapter.probe`, on those norms' outputs (q and k before the rotation, scale ``d ** -0.5``).
* The processor rounds the rotated q and k to bfloat16 (``apply_rotary``) in every precision.
* Grid: the latent is channels-last, ``[B, F, H, W, C]`` (noise, condition and mask channels for
  ``visual_cond``), patchified by ``patch_size = (1, 2, 2)`` and flattened frame by frame: ``(F, H / 2, W / 2)``.
  With sparse attention (``sparse_params``, the "nabla" attention of the 10 s models) the tokens are put in a
  fractal order of 8 x 8 blocks and attend through a block mask computed from the full sequence: such calls are
  not merged. The pipelines pass the scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

from typing import Any, ClassVar

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.probe import attention_probe, received_self_attention
from tomerge.state import MergeState

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg


class Kandinsky5Adapter(DeclaredAdapter):
    """Adapter for diffusers `Kandinsky5Transformer3DModel` (Kandinsky 5.0 T2V / I2V); see the module docstring."""

    name: ClassVar[str] = "kandinsky5"
    model_class: ClassVar[str] = "Kandinsky5Transformer3DModel"
    grid_dims: ClassVar[int] = 3
    # forward(hidden_states, encoder_hidden_states, timestep, pooled_projections, visual_rope_pos, text_rope_pos,
    #         scale_factor, sparse_params)
    timestep_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("kandinsky5", "visual_transformer_blocks", ("Kandinsky5TransformerDecoderBlock",), (
            Site("attn", "self_attention", rope=Rope("rotary_emb", 3, "wan"), probe=True),  # probe(): its norms
            Site("crossattn", "cross_attention"),
            Site("mlp", "feed_forward"),
        ), arg="visual_embed"),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        if call_arg(args, kwargs, "sparse_params", 7) is not None:
            return None
        latent = call_arg(args, kwargs, "hidden_states", 0)  # [B, F, H, W, C]
        return tuple(int(size) // int(p) for size, p in zip(latent.shape[1:4], self.model.config.patch_size))

    def unknown_grid_reason(self) -> str:
        return "it uses sparse (nabla) attention: fractal token order and a block mask over the full sequence"

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        """The received-attention probe of the probed site, ``self_attention`` (the declared one reads
        ``to_q``/``to_k``); the image stream's context tokens are keys, not recorded."""
        if not isinstance(point, DeclaredPoint) or not point.site.probe:
            return super().probe(block, point, state)
        attn = point.module
        heads_first = lambda out: out.transpose(1, 2)  # noqa: E731  the norms' [B, L, heads, d] -> [B, heads, L, d]
        sources = [("q", attn.query_norm, heads_first), ("k", attn.key_norm, heads_first)]
        scale = attn.query_norm.normalized_shape[0] ** -0.5

        def compute(captured: dict[str, Any], grid: tuple[int, ...]) -> Any:
            around = point.around()  # the block call's context tokens (Kandinsky 6's reference frame)
            return received_self_attention(captured, grid, attn.num_heads, scale, context=(around.before, around.after))

        return attention_probe(state, attn, sources, compute)
