"""The block cache: a skipped block call returns its input plus the residual its block kept at an earlier step.

A schedule asks for it with :class:`BlockCaching` in a decision (docs/schedules.md, "Caching"): a
storing call runs the block and keeps its residual (block output minus block input, per token stream), with the
Taylor terms of TaylorSeer's forecast and, for adaptive caching, the change the residual measured
(:class:`ChangeSignal`: ``Where.change``); a reusing call is skipped (``BlockCall.reused``: the block ``forward``
wrapped by :meth:`BlockCacheState.block_forward` returns its input plus it). :class:`BlockCacheState` keeps them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from . import plan as _plan
from .technique import Streams, TechniqueOptions, TechniqueState

if TYPE_CHECKING:
    from .adapter import BlockSpec
    from .schedule import Decision, Schedule
    from .state import BlockCall, MergeState

MODES = ("store", "reuse")  # BlockCaching.mode
MEASURES = (None, "accumulated", "since_full")  # BlockCaching.measure_change
REUSE_MISSED = "reuse_missed"  # the label of a reuse that found no kept residual (the block ran and stored one)


@dataclasses.dataclass
class KeptResidual:
    """The block cache of one block and call index: the Taylor terms of its residual at its last storing call.

    ``terms[0]`` is the residual (block output minus block input, per stream); ``terms[i]`` its ``i``-th finite
    difference over the last storing calls, each difference divided by the step distance of the last two stores
    (TaylorSeer's approximation of the ``i``-th derivative in steps). With ``order > 0`` every term is float32 (at
    least): a difference of half-precision residuals would be mostly their rounding.
    """

    step: int
    terms: list[Streams]
    order: int = 0
    inputs: tuple[torch.Size | None, ...] = ()  # the input streams' shapes at the last store (): those of terms[0]

    @staticmethod
    def residual(inputs: Streams, outputs: Streams, order: int) -> Streams:
        """``outputs - inputs`` per stream (``None`` where the block returned no tensor), computed eagerly: a new
        tensor that aliases nothing of the block call; in float32 (at least) for Taylor terms (``order > 0``),
        where the difference of two half-precision values is exact."""
        def minus(y: Tensor, x: Tensor) -> Tensor:
            if order == 0:
                return (y - x).detach()
            dtype = torch.promote_types(y.dtype, _plan.ACCUMULATE)
            return y.detach().to(dtype) - x.detach().to(dtype)
        return tuple(None if y is None else minus(y, x) for x, y in zip(inputs, outputs))

    def updated(self, step: int, residual: Streams, order: int,
                inputs: tuple[torch.Size | None, ...] = ()) -> KeptResidual:
        """The cache after a store of ``residual`` at ``step``, with differences up to ``order`` (as many as
        earlier stores allow; a residual of other shapes starts afresh)."""
        distance = step - self.step
        terms = [residual]
        if distance > 0 and _same_shapes(residual, self.terms[0]):
            for previous in self.terms[:order]:
                terms.append(tuple(None if new is None else (new - old) / distance
                                   for new, old in zip(terms[-1], previous)))
        return KeptResidual(step, terms, order, inputs)

    def capacity(self) -> int:
        """The bytes of this cache once all ``order + 1`` terms are kept."""
        return (self.order + 1) * sum(_bytes(t) for t in self.terms[0] if t is not None)

    def fits(self, streams: Streams) -> bool:
        """Whether a block call's ``streams`` have the shapes of the inputs the residual was kept from (``inputs``;
        an input may broadcast to its residual: :func:`broadcasts_to`), or without them the residual's shapes."""
        shapes = self.inputs or tuple(None if r is None else r.shape for r in self.terms[0])
        return len(streams) == len(self.terms[0]) and all(
            r is None or (x is not None and x.shape == shape) for x, r, shape in zip(streams, self.terms[0], shapes))

    def forecast(self, step: int) -> Streams:
        """The residual at ``step``: ``sum_i terms[i] * k^i / i!`` with ``k = step - self.step`` (the kept
        residual itself with one term), in the terms' dtype."""
        if len(self.terms) == 1:
            return self.terms[0]
        k = step - self.step
        forecast = []
        for index, residual in enumerate(self.terms[0]):
            if residual is None:
                forecast.append(None)
                continue
            value = residual
            for order, term in enumerate(self.terms[1:], start=1):
                value = value + term[index] * (k ** order / math.factorial(order))
            forecast.append(value)
        return tuple(forecast)


@dataclasses.dataclass
class ChangeSignal:
    """The criterion of adaptive caching for one call index: how much the measured block's residual changed
    (``BlockCaching.measure_change``; TeaCache, FirstBlockCache).

    The change from a residual ``ref`` to ``r`` is ``mean|r - ref| / mean|ref|`` over the whole call (every
    sample: the criterion decides for the batch). ``"accumulated"`` sums the changes from call to call since the
    last model call that ran every block; ``"since_full"`` is the change from the residual of that call.
    """

    last: Tensor | None = None  # [B, N, C] the residual measured in the last model call
    reference: Tensor | None = None  # the residual measured in the last model call that ran every block
    accumulated: float = 0.0
    last_full: bool = True  # the last model call ran every block (a reuse sets it False)

    def measure(self, residual: Tensor, rule: str) -> float:
        """The change of ``residual [B, N, C]`` by ``rule`` (``inf`` without an earlier residual of its shape).
        Reads one number on the host (runs eagerly, in :meth:`BlockCacheState.end_block`)."""
        if self.last_full:  # the last model call ran every block: the changes count from it
            self.reference, self.accumulated = self.last, 0.0
        change = relative_l1(residual, self.last if rule == "accumulated" else self.reference)
        self.accumulated = self.accumulated + change if rule == "accumulated" else change
        self.last, self.last_full = residual, True
        return self.accumulated


def relative_l1(x: Tensor, reference: Tensor | None) -> float:
    """``mean|x - reference| / mean|reference|`` (``inf`` without a reference of ``x``'s shape, or for a zero
    one): the means in float32 (at least), their quotient in float64 on the device, read on the host once."""
    if reference is None or reference.shape != x.shape:
        return math.inf
    dtype = torch.promote_types(x.dtype, torch.float32)  # bf16 / fp16 residuals are compared in float32
    scale = reference.to(dtype).abs().mean().double()
    change = (x.to(dtype) - reference.to(dtype)).abs().mean().double() / scale
    return float(torch.where(scale > 0, change, math.inf))


def broadcasts_to(shape: torch.Size, target: torch.Size) -> bool:
    """Whether a block input stream of ``shape`` gives an output of ``target``: the same shape, or one that broadcasts
    to it (a batch of 1: diffusers' Qwen-Image pipelines pass one negative prompt's text for a batch of images, and
    the joint attention broadcasts it), so that ``output - input`` is the residual of every sample."""
    if shape == target:
        return True
    try:
        return torch.broadcast_shapes(shape, target) == target
    except RuntimeError:
        return False


def check_outputs(call: BlockCall, outputs: Streams) -> None:
    """Raises when the block's ``outputs`` have no residual over its input streams.

    Raises:
        RuntimeError: an output stream of a shape its input does not broadcast to, or a tensor returned for a stream
            the block had no input of: the block's residual is not defined.
    """
    assert call.streams is not None  # begin_block kept them for a storing decision
    for index, (x, y) in enumerate(zip(call.streams, outputs)):
        if y is not None and (x is None or not broadcasts_to(x.shape, y.shape)):
            raise RuntimeError(
                f"tomerge: the {call.where.block_kind!r} block returned a {tuple(y.shape)} tensor as its output "
                f"stream {index}, for an input of {None if x is None else tuple(x.shape)}: the block cache keeps "
                "output minus input, which needs outputs of their inputs' shapes (BlockSpec.outputs)")


def _bytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def _same_shapes(a: Streams, b: Streams) -> bool:
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or x.shape == y.shape)
                                    for x, y in zip(a, b))


class BlockCacheState(TechniqueState):
    """The kept residuals (:class:`KeptResidual`, per call index and block) and the change signals of adaptive
    caching (:class:`ChangeSignal`, per call index) of one application.

    Memory: one residual per block and call index (with ``forecast_order + 1`` terms when forecasting) and one or two
    image-token residuals per call index for the signal: bounded by the model, not by the step count.
    """

    kind = "block_cache"

    def __init__(self) -> None:
        self.residuals: dict[tuple[int, int], KeptResidual] = {}  # (call index, layer) -> the block cache
        self.signals: dict[int, ChangeSignal] = {}  # call index -> the change signal of adaptive caching

    def reset(self) -> None:
        self.residuals.clear()
        self.signals.clear()

    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        for kept in self.residuals.values():
            yield from (("block_cache", t) for term in kept.terms for t in term if t is not None)
        for signal in self.signals.values():
            yield from (("change_signal", t) for t in (signal.last, signal.reference) if t is not None)

    def capacity(self) -> tuple[int, str]:
        orders = {r.order for r in self.residuals.values()}
        grows = f"the block cache grows to {max(orders) + 1} Taylor terms" if orders and max(orders) > 0 else ""
        return sum(r.capacity() for r in self.residuals.values()), grows

    @classmethod
    def wraps_blocks(cls, schedule: Schedule) -> bool:
        return schedule.caches_blocks

    @classmethod
    def block_forward(cls, call: BlockCall, block: BlockSpec, forward: Any, args: tuple, kwargs: dict) -> Any:
        """A reusing call returns its input plus the residual it was handed, without running the block (no sublayer
        runs, no FLOP is spent); a storing call runs the block and hands its output to :meth:`end_block`."""
        if call.decision.technique(BlockCaching) is None:
            return forward(*args, **kwargs)
        if call.reused is not None:  # a float32 forecast is added in float32, then rounded once
            return block.output_of(tuple(None if r is None else (x + r).to(x.dtype)
                                         for x, r in zip(call.streams, call.reused)))
        output = forward(*args, **kwargs)
        outputs = block.output_streams(output)
        check_outputs(call, outputs)
        call.scratch[BlockCacheState] = tuple(outputs)
        return output

    def begin_block(self, call: BlockCall, state: MergeState) -> None:
        """A reuse gets the residual it adds (forecast here, eagerly, so that the step never enters a compiled
        graph); a reuse without a kept residual that fits the input runs the block and stores one."""
        options = call.decision.technique(BlockCaching)
        if options is None:
            return
        if call.streams is None:
            raise RuntimeError(f"tomerge: schedule {state.schedule.name!r} decided {options.mode!r} for a block "
                               "cache, but its caches_blocks is False: the hooks did not wrap the blocks")
        if options.mode == "reuse":
            kept = self.residuals.get((state.call_index, call.where.layer))
            if kept is None or not kept.fits(call.streams):  # nothing to reuse: run the block and keep its residual
                stored = dataclasses.replace(options, mode="store")
                call.decision = dataclasses.replace(call.decision.using(stored), label=REUSE_MISSED)
            else:
                call.reused = kept.forecast(call.where.step)

    def end_block(self, call: BlockCall, state: MergeState) -> None:
        """Keeps a storing call's residual (with its Taylor terms), measures its change when asked, and counts."""
        options = call.decision.technique(BlockCaching)
        if options is None:
            return
        counts, missed = state.counts, call.decision.label == REUSE_MISSED
        counts.reuse_missed_calls += missed
        counts.reuse_decisions += call.reused is not None or missed
        if call.reused is not None:
            counts.forecast_calls += options.forecast_order > 0
            if state.call_index in self.signals:
                self.signals[state.call_index].last_full = False
        outputs = call.scratch.get(BlockCacheState)  # block_forward's
        if outputs is None:
            return
        key, step, order = (state.call_index, call.where.layer), call.where.step, options.forecast_order
        assert call.streams is not None
        residual = KeptResidual.residual(call.streams, outputs, order)
        kept = self.residuals.get(key)
        inputs = tuple(None if x is None else x.shape for x in call.streams)
        self.residuals[key] = (KeptResidual(step, [residual], order, inputs) if kept is None
                               else kept.updated(step, residual, order, inputs))
        rule = options.measure_change
        if rule is not None:
            image = residual[call.image_stream]
            if image is None:
                raise RuntimeError(f"tomerge: the {call.where.block_kind!r} block returned no image tokens; the change "
                                   "of adaptive caching is measured on them")
            state.change = self.signals.setdefault(state.call_index, ChangeSignal()).measure(image, rule)
            counts.changes_measured += 1
            counts.smallest_change = min(counts.smallest_change, state.change)


@dataclasses.dataclass(frozen=True)
class BlockCaching(TechniqueOptions):
    """A decision's use of the block cache (docs/schedules.md, "Caching"). Only schedules
    whose :attr:`~tomerge.Schedule.caches_blocks` is true may use it.

    Args:
        mode: ``"store"`` runs the block and keeps its residual (block output minus block input, per token stream)
            for this block and call index; ``"reuse"`` skips the block (none of its sublayers runs) and returns its
            input plus the kept residual (forecast to this step with ``forecast_order``); a reuse without a kept
            residual that fits the input runs the block unmerged and stores it (label ``"reuse_missed"``).
        forecast_order: the order of the Taylor forecast of kept residuals (TaylorSeer): a storing call keeps the
            residual's finite differences up to this order over the steps of the last storing calls, a reusing
            call returns ``sum_i d_i k^i / i!`` (``k``: steps since the last store). 0: the residual as it was.
        measure_change: this call (a ``"store"``) measures how much its residual changed, the ``Where.change``
            of the later block calls of the model call: ``"accumulated"`` (TeaCache's rule) sums the relative L1
            changes from step to step since the last model call that ran every block; ``"since_full"``
            (FirstBlockCache's) is the relative L1 change from the residual of that call. ``None``: no
            measurement.
    """

    State = BlockCacheState

    mode: str
    forecast_order: int = 0
    measure_change: str | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"BlockCaching.mode must be one of {MODES}, got {self.mode!r}")
        if isinstance(self.forecast_order, bool) or not isinstance(self.forecast_order, int) or self.forecast_order < 0:
            raise ValueError(f"BlockCaching.forecast_order must be an int >= 0, got {self.forecast_order!r}")
        if self.measure_change not in MEASURES:
            raise ValueError(f"BlockCaching.measure_change must be one of {MEASURES}, got {self.measure_change!r}")
        if self.measure_change is not None and self.mode != "store":
            raise ValueError("a Decision measures the change of the residual it stores: measure_change needs "
                             "BlockCaching('store')")

    @property
    def skips(self) -> frozenset[str]:
        return frozenset({"attn", "crossattn", "mlp"}) if self.mode == "reuse" else frozenset()

    def check(self, decision: Decision) -> None:
        if self.mode == "reuse" and (decision.strategy is not None or len(decision.techniques) > 1):
            raise ValueError("a Decision that reuses the block's residual runs no sublayer: its strategy must be None "
                             "and it takes no other technique")
