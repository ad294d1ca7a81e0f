"""`MergeStrategy`: the interface a merging algorithm implements.

A strategy is a frozen dataclass whose fields are its options. It answers two questions for a block's tokens
``x [B, N, C]``: which tokens stay as destinations (:meth:`select_destinations`) and how every token maps onto the
slots (:meth:`merge_matrix`, returning a :class:`~tomerge.MergePlan`). Merging, unmerging, size tracking and the
contract tests come from the plan, so a new algorithm is these two methods. A complete strategy, and what the
core calls: docs/writing-a-strategy.md.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, ClassVar

from torch import Tensor

from .context import MergeContext, check_ratio
from .plan import MergePlan

SUBLAYERS = ("attn", "crossattn", "mlp")
INTERFACE = ("select_destinations", "merge_matrix", "unmerge", "merged_tokens", "plan", "identity_plan",
             "draw")  # what the core calls
CAPABILITIES = ("default_sublayers", "plan_input", "needs", "uses_generator", "generator_policy",
                "uses_streak")  # what the core reads (properties)
#: What :attr:`MergeStrategy.needs` may list: the per-token statistics backbone adapters record (received
#: attention: :meth:`BackboneAdapter.probe`).
RECORDED_NEEDS = frozenset({"received_attention"})


@dataclasses.dataclass(frozen=True, kw_only=True)
class MergeStrategy(abc.ABC):
    """Base class of every merging strategy (see the module docstring for a complete example).

    Class attribute: ``name``, the registry name (set by :func:`tomerge.register_strategy` if missing).

    :meth:`plan` validates, then calls :meth:`select_destinations` and :meth:`merge_matrix`; a strategy whose
    stages share work (facility location's tile similarities) overrides :meth:`plan`, validating with
    :meth:`identity_plan` first.

    Capabilities the core reads are read-only properties (override them; they may depend on the options):
    :attr:`default_sublayers`, :attr:`plan_input`, :attr:`needs`, :attr:`uses_generator`,
    :attr:`generator_policy`, :attr:`uses_streak`.

    Field:
        ratio: the default ratio when the strategy is applied without one; planning always uses
            ``ctx.ratio``.
    """

    name: ClassVar[str] = ""

    ratio: float | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        fields = {name for name, kind in cls.__dict__.get("__annotations__", {}).items()
                  if "ClassVar" not in str(kind)}  # ClassVar annotations are constants, not options
        hidden = sorted(fields & set(INTERFACE + CAPABILITIES))
        if hidden:  # a dataclass field of that name would replace what the core calls or reads
            raise TypeError(f"{cls.__qualname__}: option(s) {hidden} would hide the MergeStrategy method(s) or "
                            "capabilities of the same name; rename the option")

    def __post_init__(self) -> None:
        if self.ratio is not None:
            check_ratio(self.ratio)

    # ------------------------------------------------------------------ capabilities
    @property
    def default_sublayers(self) -> frozenset[str]:
        """Where it merges when applied alone: a subset of ``{"attn", "crossattn", "mlp"}``."""
        return frozenset({"attn", "mlp"})

    @property
    def plan_input(self) -> str:
        """The tensor attached hooks plan from: ``"sublayer"`` (the tokens entering the first merged sublayer)
        or ``"block_input"`` (the block's input hidden states, as ToMeSD does)."""
        return "sublayer"

    @property
    def needs(self) -> frozenset[str]:
        """Per-token statistics the adapter must record: a subset of :data:`RECORDED_NEEDS`. Attaching to a
        backbone that cannot record them for every block raises (``tomerge.apply``), and so does merging the
        attention with a strategy that needs received attention (recorded after the attention ran)."""
        return frozenset()

    @property
    def uses_generator(self) -> bool:
        """Whether :attr:`MergeContext.generator` must be provided."""
        return False

    @property
    def generator_policy(self) -> str:
        """Which generator the state provides: ``"per_step_layer"`` (one per (step, layer), from the apply's
        ``seed``: split and batched guidance see the same draws) or ``"fork_global"`` (one generator forked
        from the global RNG at first use and advanced by each draw, as the ``tomesd`` package)."""
        return "per_step_layer"

    @property
    def uses_streak(self) -> bool:
        """Whether the state keeps merge streaks (``ctx.streak``) for it."""
        return False

    # ------------------------------------------------------------------ the algorithm
    def draw(self, ctx: MergeContext, batch: int) -> Tensor | None:
        """The random numbers the plan of a ``batch``-sample call on ``ctx``'s grid needs, drawn from
        ``ctx.generator`` (strategies whose :attr:`uses_generator` is true). Attached to a model, the merge state
        calls it before the block runs, outside compiled graphs (a ``torch.Generator`` cannot be used inside
        one), and the plan reads the result as ``ctx.draws``; on bare tensors (``ctx.draws`` unset) a strategy
        calls it itself. Default: nothing drawn (``None``)."""
        return None

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
        theirs and reset the others', and a schedule's feature cache (``FeatureCaching.weight``) blends their
        outputs. Default: :meth:`MergePlan.merged_tokens` (every member of a slot of two or more tokens)."""
        return plan.merged_tokens()

    def plan(self, x: Tensor, ctx: MergeContext, destinations: Tensor | None = None) -> MergePlan:
        """Plans the merge of ``x [B, N, C]``: validates (:meth:`identity_plan`), then the destinations and the
        merge matrix.

        Args:
            x: ``[B, N, C]`` tokens.
            ctx: the merge context.
            destinations: ``[B, M]`` destinations kept from an earlier plan (``plan.dst``: a schedule that
                refreshes destinations less often than merge matrices); :meth:`select_destinations` is then
                skipped.

        Returns the identity plan when ``ctx`` asks to remove no token.
        """
        identity = self.identity_plan(x, ctx)
        if identity is not None:
            return identity
        if destinations is None:
            destinations = self.select_destinations(x, ctx)
        return self.merge_matrix(x, destinations, ctx)

    def identity_plan(self, x: Tensor, ctx: MergeContext) -> MergePlan | None:
        """Validates ``x [B, N, C]`` and ``ctx`` for this strategy: the identity plan when ``ctx`` asks to remove
        no token, else ``None`` (plan). Raises ``ValueError`` on a context missing what the strategy needs."""
        B, N, _ = ctx.check_tokens(x)
        if ctx.tokens_to_remove(N) == 0:
            return MergePlan.identity(B, N, device=x.device)
        missing = [need for need in self.needs if getattr(ctx, need) is None]
        if missing:
            raise ValueError(
                f"strategy {self.name!r} needs {missing} in the MergeContext; attached to a model the "
                "adapter records it, on bare tensors pass it, e.g. MergeContext(..., received_attention=a)"
            )
        if self.uses_generator and ctx.generator is None and ctx.draws is None:
            raise ValueError(f"strategy {self.name!r} draws random numbers: pass MergeContext(generator=...)")
        return None

    # ------------------------------------------------------------------ options
    @classmethod
    def option_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def to_dict(self) -> dict[str, Any]:
        """The strategy's name and options, for logging."""
        return {"strategy": self.name, **dataclasses.asdict(self)}
