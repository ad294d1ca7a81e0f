"""The feature cache: merge points' full-length outputs kept from one block call for later calls of the block.

A schedule asks for it with :class:`FeatureCaching` in a decision: a call stores the outputs of
some sublayers (SDTM's protected steps, ToCa's fresh tokens, cached_detail's full steps); a later merged call
blends its unmerged outputs with them (SDTM's ``mcw``, ToCa), restores their detail (cached_detail), or does not
run a sublayer and returns the whole output its module returned when it stored (ToCa's attention). The merge
points' hooks (:class:`FeatureCacheState`'s hook points) read and write the call's :class:`FeatureCacheCall`;
:class:`FeatureCacheState` keeps the outputs across calls.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .technique import TechniqueOptions, TechniqueState

if TYPE_CHECKING:
    from .adapter import MergePoint
    from .plan import MergePlan
    from .schedule import Schedule
    from .state import BlockCall, MergeState

DETAIL = (None, "slot_offset", "merged_change")  # FeatureCaching.detail


def module_key(point: int) -> tuple[str, int]:
    """The feature-cache key of merge point ``point``'s whole module output and input shape (``reuse``)."""
    return ("module", point)


def reference_key(point: int) -> tuple[str, int]:
    """The feature-cache key of merge point ``point``'s reference output (``detail="merged_change"``)."""
    return ("reference", point)


@dataclasses.dataclass
class FeatureCacheCall:
    """What one block call reads from the feature cache (``cached``) and what it stores (``new``; ``None``: drop),
    by merge point index, :func:`reference_key` or :func:`module_key` (``(input shape, the module's whole output)``,
    for reused sublayers); ``input_shapes``: point -> the image input of a module output to store. The merge
    points' hooks use it inside compiled graphs; :meth:`FeatureCacheState.end_block` commits ``new``."""

    cached: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    new: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    input_shapes: dict[int, torch.Size] = dataclasses.field(default_factory=dict)
    wrapped: frozenset[str] = frozenset()  # the sublayers a reuse can skip (Schedule.reused_sublayers)

    def store_output(self, point: int, output: Tensor) -> None:
        """Keeps ``output [B, N, C']`` as the cached output of the block's merge point number ``point``."""
        self.new[point] = output.detach()
        self.new[reference_key(point)] = None  # a new cached output: "merged_change" starts again

    def store_module_output(self, point: int, output: Any) -> None:
        """Keeps the whole output of merge point ``point``'s module (a tensor or a tuple: a joint attention's text
        tokens included) with the shape of its image-token input, for the calls that reuse it."""
        shape = self.input_shapes.pop(point, None)
        if shape is None:
            return
        detached = tuple(t.detach() if isinstance(t, Tensor) else t for t in output) \
            if isinstance(output, tuple) else output.detach()
        self.new[module_key(point)] = (shape, detached)

    def blend(self, call: BlockCall, point: int, output: Tensor, plan: MergePlan) -> Tensor:
        """``output [B, N, C']`` (the unmerged output of merge point ``point``, merged with ``plan``) combined with
        the output this point stored last (``cached``), as the decision's :class:`FeatureCaching` says:

        * ``weight=w``: the tokens the plan counts as merged get ``w * output + (1 - w) * cached``;
        * ``detail="slot_offset"``: every token gets ``output + cached - unmerge(merge(cached))``;
        * ``detail="merged_change"``: ``cached`` (keeping ``output`` as the reference) on the first call after the
          store, ``cached + output - reference`` on the later ones.

        Unchanged without either, without a cached output of this point, or when the cached one has another
        shape (it is then dropped: it came from a call of another size)."""
        options = call.decision.technique(FeatureCaching)
        cached = self.cached.get(point)
        if cached is None or (options.weight is None and options.detail is None):
            return output
        if cached.shape != output.shape:
            self.new.setdefault(point, None)
            return output
        cached = cached.to(output.dtype)
        if options.detail == "merged_change":
            reference = self.cached.get(reference_key(point))
            if reference is None:
                self.new[reference_key(point)] = output.detach()
                return cached
            return cached + (output - reference.to(output.dtype))  # [B, N, C']
        if options.detail == "slot_offset":
            detail = cached - call.decision.strategy.unmerge(plan.merge(cached), plan)  # [B, N, C']: from the slot mean
            return output + detail
        if call.merged is None:
            return output
        blended = torch.lerp(cached, output, options.weight)  # [B, N, C'] = w * output + (1 - w) * cached
        return torch.where(call.merged.unsqueeze(-1), blended, output)  # [B, N, C']


class FeatureCacheState(TechniqueState):
    """The stored outputs of one application: ``outputs[(call index, layer)][key]``, ``key`` a merge point's index,
    :func:`reference_key` or :func:`module_key`.

    Memory: one entry per merge point, block and call index (a new store replaces the point's earlier one):
    bounded by the model, not by the step count.
    """

    kind = "feature_cache"

    def __init__(self) -> None:
        self.outputs: dict[tuple[int, int], dict[Hashable, Any]] = {}

    def reset(self) -> None:
        self.outputs.clear()

    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for stored in self.outputs.values():
            for output in stored.values():
                yield from ((self.kind, t) for t in _leaves(output))

    @classmethod
    def wrapped_sublayers(cls, schedule: Schedule) -> frozenset[str]:
        return schedule.reused_sublayers

    @classmethod
    def point_forward(cls, call: BlockCall, point: MergePoint, index: int, forward: Any, args: tuple,
                      kwargs: dict) -> Any:
        """A reusing call returns the whole output this point's module returned when it last stored one (a joint
        attention's text tokens and tuple outputs included) without running the sublayer (no FLOP is spent); other
        calls, and a reuse without a stored output for an input of this shape, run it."""
        options = call.decision.technique(FeatureCaching)
        if options is None or point.sublayer not in options.reuse or index in call.skipped:
            return forward(*args, **kwargs)
        stored = call.scratch[FeatureCacheState].cached.get(module_key(index))
        if stored is None or stored[0] != point.get_input(args, kwargs).shape:
            return forward(*args, **kwargs)
        return stored[1]  # what the module returned in the call that stored it

    @classmethod
    def point_input(cls, call: BlockCall, point: MergePoint, index: int, args: tuple, kwargs: dict) -> None:
        options, scratch = call.decision.technique(FeatureCaching), call.scratch[FeatureCacheState]
        if point.sublayer in options.store and point.sublayer in scratch.wrapped:
            scratch.input_shapes[index] = point.get_input(args, kwargs).shape  # what a reuse must match

    @classmethod
    def point_ran(cls, call: BlockCall, point: MergePoint, index: int, output: Any) -> None:
        scratch = call.scratch[FeatureCacheState]
        if point.sublayer in call.decision.technique(FeatureCaching).store:
            scratch.store_output(index, point.get_output(output))
            if point.sublayer in scratch.wrapped:
                scratch.store_module_output(index, output)

    @classmethod
    def point_unmerged(cls, call: BlockCall, point: MergePoint, index: int, output: Tensor, plan: MergePlan) -> Tensor:
        scratch = call.scratch[FeatureCacheState]
        output = scratch.blend(call, index, output, plan)
        if point.sublayer in call.decision.technique(FeatureCaching).store:
            scratch.store_output(index, output)
        return output

    def begin_block(self, call: BlockCall, state: MergeState) -> None:
        """Hands the call what its merge points read (the outputs its points stored last, when it blends, restores
        or reuses) and where they store."""
        options = call.decision.technique(FeatureCaching)
        if options is None:
            return
        scratch = call.scratch[FeatureCacheState] = FeatureCacheCall(wrapped=state.schedule.reused_sublayers)
        call.wants_merged |= options.weight is not None
        if call.reused is not None or call.block_input is None or not options.reads:
            return
        scratch.cached.update(self.outputs.get((state.call_index, call.where.layer), {}))

    def end_block(self, call: BlockCall, state: MergeState) -> None:
        """Keeps copies of what the call stored, drops what it dropped, and counts its reuses."""
        options = call.decision.technique(FeatureCaching)
        if options is None:
            return
        scratch = call.scratch[FeatureCacheState]
        stored = self.outputs.setdefault((state.call_index, call.where.layer), {})
        for key, output in scratch.new.items():
            if output is None:
                stored.pop(key, None)
            else:
                stored[key] = state.keep(output)
        state.counts.reuse_decisions += bool(options.reuse)
        if options.reuse and any(isinstance(key, tuple) and key[0] == "module" for key in scratch.cached):
            state.counts.sublayer_reused_calls += 1


@dataclasses.dataclass(frozen=True)
class FeatureCaching(TechniqueOptions):
    """A decision's use of the feature cache.

    Args:
        store: the sublayers (e.g. ``{"attn", "mlp"}``) whose full-length outputs this block call stores (one entry
            per merge point of the block and call index, replacing the previous one).
        weight: ``w``: where this call unmerges a sublayer's output, the tokens the strategy counts as merged
            (``strategy.merged_tokens``) get ``w * output + (1 - w) * cached``, the output this merge point stored
            last; other tokens keep their output. ``None``: no blending.
        detail: restore each token's detail where this call unmerges a sublayer's output (``cached``: the
            full-length output this merge point stored last; off without one of the output's shape).
            ``"slot_offset"``: every token gets ``output + cached - unmerge(merge(cached))``, its slot's current value
            plus its own offset from its slot's mean in ``cached`` (a token alone in its slot keeps its output).
            ``"merged_change"``: the first such call after ``cached`` was stored returns ``cached`` and keeps its own
            unmerged ``output`` as the reference; the later ones return ``cached + output - reference``, the cached
            output moved by the change of the merged output (the plan must stay the same meanwhile: a
            ``cache_key``). ``None``: off.
        reuse: the sublayers whose merge points do not run in this call: each returns what its module returned when
            it last stored its output (``store``; a joint attention's text tokens and tuple outputs included;
            token-wise caching, ToCa: the attention of a partial step). A point with no stored output for an input
            of this shape runs. Disjoint from the decision's ``sublayers``; only schedules whose
            :attr:`~tomerge.Schedule.reused_sublayers` name them may use it.
    """

    State = FeatureCacheState

    store: frozenset[str] = frozenset()
    weight: float | None = None
    detail: str | None = None
    reuse: frozenset[str] = frozenset()

    def __post_init__(self) -> None:
        if self.detail not in DETAIL:
            raise ValueError(f"FeatureCaching.detail must be one of {DETAIL}, got {self.detail!r}")
        if self.detail is not None and self.weight is not None:
            raise ValueError("a Decision either blends merged outputs with the feature cache (weight) or "
                             "restores their detail from it (detail), not both")

    @property
    def skips(self) -> frozenset[str]:
        return self.reuse

    @property
    def reads(self) -> bool:
        """Whether the call reads what was stored (to blend, restore or reuse)."""
        return self.weight is not None or self.detail is not None or bool(self.reuse)


def _leaves(kept: Any) -> Iterator[Tensor]:
    """The tensors of a feature-cache entry: a tensor, or ``(input shape, module output)`` with tuples inside."""
    if isinstance(kept, Tensor):
        yield kept
    elif isinstance(kept, tuple):
        for item in kept:
            yield from _leaves(item)
