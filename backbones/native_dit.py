"""`native_dit`: the native timm-based DiT of `backbones/timm_dit.py` (the reference model's
architecture, original DiT layout).

Merge points per `DiTBlock`: the input of ``attn`` (timm ``Attention``, ``"attn"``) and of ``mlp``
(timm ``Mlp``, ``"mlp"``), after the adaptive norm and before the gated residual. Positions are
absolute (added at the patch embedding), so merging needs no positional work. The grid is the input
size divided by the patch size; the timestep is the flow time in ``[0, 1]``. Received attention for
IDM comes from the ``qkv`` projection (or the q/k norms when ``qk_norm`` is on).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, KindSummary, MergePoint, class_names
from tomerge.probe import attention_probe, received_self_attention
from tomerge.state import MergeState

from ._diffusers import call_arg


class NativeDiTAdapter(BackboneAdapter):
    """Adapter for :class:`tomerge.backbones.timm_dit.DiT` and any timm-style DiT with the original
    layout (``blocks[i].attn``, ``blocks[i].mlp``, ``x_embedder.patch_size``)."""

    name: ClassVar[str] = "native_dit"
    block_names: ClassVar[tuple[str, ...]] = ("DiTBlock",)
    t_max: ClassVar[float] = 1.0

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.token_grid: tuple[int, int] | None = None

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        if isinstance(obj, nn.Module) and hasattr(obj, "x_embedder") and hasattr(obj, "blocks") \
                and "DiTTransformer2DModel" not in class_names(obj):
            return obj
        return None

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return (KindSummary("dit", ("attn", "mlp"), context="class label (adaLN modulation)"),)

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({"dit"})

    def blocks(self) -> list[BlockSpec]:
        return [BlockSpec(block, layer=i, kind="dit", arg="x",
                          points=(MergePoint("attn", block.attn, arg="x"), MergePoint("mlp", block.mlp, arg="x")))
                for i, block in enumerate(self.model.blocks) if "DiTBlock" in class_names(block)]

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        x = call_arg(args, kwargs, "x", 0)  # [B, C, H, W]
        p = self.model.x_embedder.patch_size
        p = p if isinstance(p, int) else p[0]
        self.token_grid = (x.shape[-2] // p, x.shape[-1] // p)
        return call_arg(args, kwargs, "t", 1)

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, int] | None:
        if self.token_grid is None or self.token_grid[0] * self.token_grid[1] != num_tokens:
            return None
        return self.token_grid

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState,
              max_queries: int = 64) -> list[Any]:
        """Captures q/k from timm ``Attention`` (``qkv`` output, or ``q_norm``/``k_norm`` outputs)."""
        attn = point.module
        heads = attn.num_heads

        def qkv_part(part: int):
            def pick(out: Tensor) -> Tensor:
                B, N, _ = out.shape
                return out.view(B, N, 3, heads, -1).permute(2, 0, 3, 1, 4)[part]  # [B, H, N, d]
            return pick

        normed = not isinstance(attn.q_norm, nn.Identity)  # q_norm/k_norm run after qkv: their output wins
        sources = [("q", attn.qkv, qkv_part(0)), ("k", attn.qkv, qkv_part(1)),
                   ("q", attn.q_norm if normed else None, None), ("k", attn.k_norm if normed else None, None)]
        return attention_probe(state, attn, sources, lambda captured, grid: received_self_attention(
            captured, grid, heads, attn.scale, max_queries))
