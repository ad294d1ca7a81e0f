"""`MergeStrategy`: the interface a merging algorithm implements.

A strategy is a frozen dataclass whose fields are its options. It answers two questions for a block's
tokens ``x [B, N, C]``: which tokens stay as destinations (:meth:`select_destinations`) and how every
token maps onto the slots (:meth:`merge_matrix`, returning a :class:`~tomerge.MergePlan`). Merging,
unmerging, size tracking and the contract tests come from the plan.

Example (a complete strategy: merge each token of an odd column into its left neighbour):

    >>> import torch, dataclasses
    >>> from tomerge import MergeStrategy, MergePlan, MergeContext
    >>> @dataclasses.dataclass(frozen=True)
    ... class Columns(MergeStrategy):
    ...     name = "columns"
    ...     def select_destinations(self, x, ctx):
    ...         H, W = ctx.grid
    ...         pos = torch.arange(H * W).view(H, W)[:, 0::2].flatten()   # [M]
    ...         return pos.expand(x.shape[0], -1)                          # [B, M]
    ...     def merge_matrix(self, x, dst, ctx):
    ...         H, W = ctx.grid
    ...         slot = (torch.arange(W) // 2).repeat(H) + torch.arange(H).repeat_interleave(W) * ((W + 1) // 2)
    ...         return MergePlan.hard(slot.expand(x.shape[0], -1), dst)
    >>> plan = Columns().plan(torch.randn(2, 16, 8), MergeContext(grid=(4, 4), ratio=0.5))
    >>> plan.num_removed
    8
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from torch import Tensor

from .context import MergeContext, check_ratio
from .plan import MergePlan

SUBLAYERS = ("attn", "crossattn", "mlp")
INTERFACE = ("select_destinations", "merge_matrix", "unmerge", "merged_tokens", "plan")  # what the core calls


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeStrategy(abc.ABC):
    """Base class of every merging strategy (see the module docstring for a complete example).

    Class attributes a strategy may override:
        name: registry name (set by :func:`tomerge.register_strategy` if missing).
        default_sublayers: where it merges when applied alone: a subset of ``{"attn", "crossattn", "mlp"}``.
        metric: ``"sublayer"`` (plan from the normalised tokens entering the first merged sublayer)
            or ``"block_input"`` (plan from the block's input hidden states, as ToMeSD does).
        needs: per-token statistics the adapter must record: ``{"received_attention"}``.
        uses_generator: whether :attr:`MergeContext.generator` must be provided.
        uses_streak: whether the adapter should keep merge streaks (``ctx.streak``) for it.
        batch_independent: whether each sample's plan depends on that sample alone (the contract
            test then checks that a batch plans like its samples one by one).

    Field:
        ratio: the default ratio when the strategy is applied without one; planning always uses
            ``ctx.ratio``.
    """

    name: ClassVar[str] = ""
    default_sublayers: ClassVar[frozenset[str]] = frozenset({"attn", "mlp"})
    metric: ClassVar[str] = "sublayer"
    needs: ClassVar[frozenset[str]] = frozenset()
    uses_generator: ClassVar[bool] = False
    uses_streak: ClassVar[bool] = False
    batch_independent: ClassVar[bool] = True

    ratio: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        hidden = sorted(set(cls.__dict__.get("__annotations__", {})) & set(INTERFACE))
        if hidden:  # a dataclass field of that name would replace the method the hooks call
            raise TypeError(f"{cls.__qualname__}: option(s) {hidden} would hide the MergeStrategy method(s) of "
                            "the same name; rename the option")

    def __post_init__(self) -> None:
        if self.ratio is not None:
            check_ratio(self.ratio)

    # ------------------------------------------------------------------ the algorithm
    @abc.abstractmethod
    def select_destinations(self, x: Tensor, ctx: MergeContext) -> Tensor:
        """Returns ``[B, M']`` long token positions kept as destinations."""

    @abc.abstractmethod
    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: MergeContext) -> MergePlan:
        """Maps every token onto the slots; returns the plan."""

    def unmerge(self, y: Tensor, plan: MergePlan) -> Tensor:
        """``[B, M, C'] -> [B, N, C']``: what the hooks call on a merged sublayer's output; default
        ``plan.unmerge(y)``."""
        return plan.unmerge(y)

    def merged_tokens(self, plan: MergePlan, ctx: MergeContext) -> Tensor:
        """``[B, N]`` bool: the tokens this plan counts as merged. The merge streaks (``ctx.streak``) extend
        theirs and reset the others', and a schedule's feature cache (``Decision.cache_weight``) blends their
        outputs. Default: :meth:`MergePlan.merged_tokens` (every member of a slot of two or more tokens)."""
        return plan.merged_tokens()

    def plan(self, x: Tensor, ctx: MergeContext, destinations: Tensor | None = None) -> MergePlan:
        """Plans the merge of ``x [B, N, C]``: validates, then destinations, then the merge matrix.

        Args:
            x: ``[B, N, C]`` tokens.
            ctx: the merge context.
            destinations: ``[B, M]`` destinations kept from an earlier plan (``plan.dst``: a schedule that
                refreshes destinations less often than merge matrices); :meth:`select_destinations` is then
                skipped.

        Returns the identity plan when ``ctx`` asks to remove no token.
        """
        B, N, _ = ctx.check_tokens(x)
        if ctx.tokens_to_remove(N) == 0:
            return MergePlan.identity(B, N, device=x.device)
        missing = [need for need in self.needs if getattr(ctx, need) is None]
        if missing:
            raise ValueError(
                f"strategy {self.name!r} needs {missing} in the MergeContext; attached to a model the "
                "adapter records it, on bare tensors pass it, e.g. MergeContext(..., received_attention=a)"
            )
        if self.uses_generator and ctx.generator is None:
            raise ValueError(f"strategy {self.name!r} draws random numbers: pass MergeContext(generator=...)")
        dst = self.select_destinations(x, ctx) if destinations is None else destinations
        return self.merge_matrix(x, dst, ctx)

    # ------------------------------------------------------------------ options
    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """The strategy's name and options, for logging."""
        return {"strategy": self.name, **dataclasses.asdict(self)}
