"""A complete tomerge strategy in one file: strided destinations, most-similar matching.

Every ``stride``-th token (raster order) is a destination; the ``r`` other tokens most similar to
some destination merge into it. Register it, apply it, and the contract test checks it:

    import tomerge, strided_matching                       # registering happens on import
    tomerge.apply(unet, "strided_matching", ratio=0.4, stride=3)
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor

import tomerge
from tomerge.options import check_int


@tomerge.register_strategy("strided_matching")
@dataclasses.dataclass(frozen=True, kw_only=True)
class StridedMatching(tomerge.MergeStrategy):
    """Destinations on a fixed stride; sources merge into their most similar destination.

    Args:
        stride: one destination every ``stride`` tokens (>= 2).
    """

    stride: int = 4

    def __post_init__(self) -> None:
        super().__post_init__()  # validates ratio
        check_int(self.stride, "stride", "strided_matching", low=2)

    def select_destinations(self, x: Tensor, ctx: tomerge.MergeContext) -> Tensor:
        B, N, _ = x.shape
        return torch.arange(0, N, self.stride, device=x.device).expand(B, -1)  # [B, D]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: tomerge.MergeContext) -> tomerge.MergePlan:
        B, N, _ = x.shape
        S = N - dst.shape[1]  # sources: every token that is not a destination (a count known without the data)
        is_dst = torch.zeros(N, dtype=torch.int8, device=x.device)
        is_dst[dst[0]] = 1
        src = torch.sort(is_dst, stable=True).indices[:S]  # [S] sources in raster order, no nonzero()
        r = min(ctx.tokens_to_remove(N), S)

        unit = F.normalize(x.float(), dim=-1, eps=1e-6)  # [B, N, C], fp32 for the similarities
        best, target = (unit[:, src] @ unit[:, dst[0]].transpose(1, 2)).max(-1)  # [B, S] each
        order = best.argsort(dim=-1, descending=True, stable=True)  # [B, S], most similar first
        merged, kept = order[:, :r], order[:, r:]
        return tomerge.MergePlan.from_matching(
            dst=dst.contiguous(), unmerged=src[kept], merged=src[merged],
            merged_into=target.gather(1, merged), num_tokens=N)
