"""`MergeState`: everything one application of tomerge remembers between calls.

One object per :func:`tomerge.apply`, never module attributes: the trajectory clock (step index from
distinct timestep values), the block call in progress, cached plans and destinations, merge streaks,
received attention, the feature cache, the block cache (kept residuals and the change signal of adaptive
caching), random generators, and a record of every decision.

What is kept across calls is copied out of the block call by eager code (:meth:`MergeState.end_block`), so it
never aliases a tensor computed inside a compiled block, which CUDA graphs overwrite at their next replay; it is
bounded by the model, not by the step count (one plan per cache scope, one residual per block and call index;
docs/compile.md, "CUDA graphs").
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .context import Grid, MergeContext
from . import plan as _plan
from .plan import MergePlan
from .schedule import SKIP, Decision, Schedule, Where, check_attention_runs_before_its_merge


class TrajectoryClock:
    """Derives the denoising step from the timestep values the model is called with.

    Several calls with the same timestep (batched or split classifier-free guidance, skip-layer
    guidance) share a step; a new value advances it; a value noisier than the current one starts a
    new trajectory. When the pipeline's scheduler is known (``timesteps``), the steps are counted over the
    scheduler's timesteps this model actually runs: step 0 is the position of the trajectory's first timestep
    in the schedule (an img2img or inpainting call with ``strength < 1`` starts late), and ``num_steps`` counts
    the schedule's timesteps from there on that lie in ``bounds`` (a two-expert pipeline, Wan 2.2: each
    transformer runs the timesteps on its side of the boundary). Without a scheduler the step counts the
    distinct timesteps in call order, from 0 at each trajectory's first call.

    Each call reads its timestep on the host once (the one host read of a model call); ``timesteps`` is
    expected to return a host copy that it refreshes only when the scheduler sets new timesteps.

    Args:
        num_steps: the number of denoising steps, when known in advance.
        timesteps: a callable returning the scheduler's timesteps on the host (or ``None``).
        t_max: the largest timestep value (progress ``1 - t / t_max`` when the step count is unknown).
        bounds: ``(low, high)``: the model runs the scheduler's timesteps ``low <= t < high`` (in call units) and
            the others go to another model; ``None``: all of them.

    Example:
        >>> import torch
        >>> clock = TrajectoryClock(timesteps=lambda: torch.tensor([900., 700., 500., 300., 100.]))
        >>> for t in (500., 300., 100.):                 # strength 0.6: the pipeline runs the last 3 of 5
        ...     _ = clock.observe(t)
        ...     print(clock.step, clock.num_steps)
        0 3
        1 3
        2 3
    """

    def __init__(self, num_steps: int | None = None, timesteps: Callable[[], Tensor | None] | None = None,
                 t_max: float = 1000.0, bounds: tuple[float, float] | None = None) -> None:
        self.num_steps_given = num_steps
        self.timesteps = timesteps
        self.t_max = t_max
        self.bounds = bounds
        self.step = 0
        self.num_steps = num_steps
        self.current: float | None = None
        self.trajectory = 0
        self.first = 0  # the position in the schedule of the trajectory's first timestep

    def observe(self, timestep: Tensor | float | None) -> bool:
        """Updates the step from a call's timestep; returns True when a new trajectory starts."""
        if timestep is None:
            return False
        t = float(timestep.flatten()[0]) if isinstance(timestep, Tensor) else float(timestep)
        if t == self.current:
            return False
        new_trajectory = self.current is None or t > self.current
        schedule = self.timesteps() if self.timesteps is not None else None
        if schedule is not None and len(schedule) > 0:
            index = int((schedule - t).abs().argmin())
            if new_trajectory:
                self.first = index
            runs = schedule[self.first:]
            if self.bounds is not None:
                runs = runs[(runs >= self.bounds[0]) & (runs < self.bounds[1])]
            self.step = max(0, index - self.first)
            self.num_steps = max(1, len(runs))
        else:
            self.step = 0 if new_trajectory else self.step + 1
        self.current = t
        if new_trajectory:
            self.trajectory += 1
        return new_trajectory

    @property
    def progress(self) -> float:
        """0 at the first (noisiest) step, 1 at the last."""
        if self.num_steps is not None and self.num_steps > 1:
            return min(1.0, self.step / (self.num_steps - 1))
        if self.current is None:
            return 0.0
        return min(1.0, max(0.0, 1.0 - self.current / self.t_max))


Streams = tuple[Tensor | None, ...]
"""The token streams of one block call in the order of the block's output (``BlockSpec.streams``): the image
tokens, and e.g. the text tokens of a joint block; ``None`` where the block returns no tensor."""


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
    (``Decision.measure_change``; TeaCache, FirstBlockCache).

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
        Reads one number on the host (runs eagerly, in :meth:`MergeState.end_block`)."""
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


def _bytes(t: Tensor) -> int:
    return t.untyped_storage().nbytes()


def _same_shapes(a: Streams, b: Streams) -> bool:
    return len(a) == len(b) and all((x is None) == (y is None) and (x is None or x.shape == y.shape)
                                    for x, y in zip(a, b))


@dataclasses.dataclass
class BlockCall:
    """One block forward: what :meth:`MergeState.begin_block` prepared before it (from Python state, outside any
    compiled graph) and what its merge points produced (committed by :meth:`MergeState.end_block`).

    The merge points' hooks read and write only this object and tensors, never the step, the layer or the
    state's caches: under ``torch.compile`` a new step or another block with the same decision then
    reuses the compiled graph (docs/compile.md).
    """

    where: Where
    decision: Decision
    grid: Grid | None
    block_input: Tensor | None
    ctx: MergeContext | None = None  # the strategy's context, when the decision merges
    plan: MergePlan | None = None  # the cached plan (reused), or the one this call computed
    merged: Tensor | None = None  # [B or 1, N] bool: the plan's merged tokens, when streaks or the cache need them
    kept_destinations: Tensor | None = None  # [B, M] destinations kept under the decision's destinations_key
    streak: Tensor | None = None  # [B, N] merge streaks before this call (kept when a strategy uses them)
    computed: bool = False  # the plan was computed in this call (end_block caches it and tells the observers)
    new_streak: Tensor | None = None  # [B, N] streaks after this call's merge decision
    # point index (or reference_key(point)) -> the feature cache this call reads / what it stores (None: drop)
    # (module_key(point): (input shape, the module's whole output), for reused sublayers)
    cached_outputs: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    new_outputs: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    attention: Tensor | None = None  # [B, N] received attention a probe recorded in this call
    active: dict[int, MergePlan] = dataclasses.field(default_factory=dict)  # point index -> plan
    streams: Streams | None = None  # the block's input streams, when the decision uses the block cache
    image_stream: int = 0  # the index of the image tokens in streams
    reused: Streams | None = None  # the residual a reusing call adds to its input (kept, or forecast)
    block_outputs: Streams | None = None  # a storing call's output streams (its residual is taken in end_block)

    skipped: set[int] = dataclasses.field(default_factory=set)  # point indices whose call in progress reads no image tokens
    input_shapes: dict[int, torch.Size] = dataclasses.field(default_factory=dict)  # point -> image input, for a stored module output

    @property
    def records_attention(self) -> bool:
        """Whether the received-attention probes record in this call: its decision merges and its attention runs
        (not reused from the feature cache, ``Decision.reuse_outputs``)."""
        return self.decision.merges and "attn" not in self.decision.reuse_outputs

    # ------------------------------------------------------------------ the block cache
    def store_residual(self, outputs: Streams) -> None:
        """Hands the block's ``outputs`` to :meth:`MergeState.end_block`, which keeps ``outputs - streams`` (per
        stream; ``None`` where the block returned no tensor) as the residual of this layer and call index.

        Raises:
            RuntimeError: an output stream of a shape its input does not broadcast to, or a tensor returned for a stream
                the block had no input of: the block's residual is not defined.
        """
        assert self.streams is not None  # begin_block kept them for a storing decision
        for index, (x, y) in enumerate(zip(self.streams, outputs)):
            if y is not None and (x is None or not broadcasts_to(x.shape, y.shape)):
                raise RuntimeError(
                    f"tomerge: the {self.where.block_kind!r} block returned a {tuple(y.shape)} tensor as its output "
                    f"stream {index}, for an input of {None if x is None else tuple(x.shape)}: the block cache keeps "
                    "output minus input, which needs outputs of their inputs' shapes (BlockSpec.outputs)")
        self.block_outputs = tuple(outputs)

    # ------------------------------------------------------------------ the feature cache
    def store_output(self, point: int, output: Tensor) -> None:
        """Keeps ``output [B, N, C']`` as the cached output of the block's merge point number ``point`` (stored
        for this layer and call index when the block call ends, :meth:`MergeState.end_block`)."""
        self.new_outputs[point] = output.detach()
        self.new_outputs[reference_key(point)] = None  # a new cached output: "merged_change" starts again

    def store_module_output(self, point: int, output: Any) -> None:
        """Keeps the whole output of merge point ``point``'s module (a tensor or a tuple: a joint attention's text
        tokens included) with the shape of its image-token input, for the calls that reuse it
        (``Decision.reuse_outputs``; stored for this layer and call index when the block call ends)."""
        shape = self.input_shapes.pop(point, None)
        if shape is None:
            return
        detached = tuple(t.detach() if isinstance(t, Tensor) else t for t in output) \
            if isinstance(output, tuple) else output.detach()
        self.new_outputs[module_key(point)] = (shape, detached)

    def blend_cached(self, point: int, output: Tensor, plan: MergePlan) -> Tensor:
        """``output [B, N, C']`` (the unmerged output of the block's merge point number ``point``, merged with
        ``plan``) combined with the output this point stored last (``cached``), as the decision says:

        * ``cache_weight=w``: the tokens the plan counts as merged get ``w * output + (1 - w) * cached``;
        * ``cache_detail="slot_offset"``: every token gets ``output + cached - unmerge(merge(cached))``;
        * ``cache_detail="merged_change"``: ``cached`` (keeping ``output`` as the reference) on the first call
          after the store, ``cached + output - reference`` on the later ones.

        Unchanged without either, without a cached output of this point, or when the cached one has another
        shape (it is then dropped: it came from a call of another size)."""
        decision = self.decision
        cached = self.cached_outputs.get(point)
        if cached is None or (decision.cache_weight is None and decision.cache_detail is None):
            return output
        if cached.shape != output.shape:
            self.new_outputs.setdefault(point, None)
            return output
        cached = cached.to(output.dtype)
        if decision.cache_detail == "merged_change":
            reference = self.cached_outputs.get(reference_key(point))
            if reference is None:
                self.new_outputs[reference_key(point)] = output.detach()
                return cached
            return cached + (output - reference.to(output.dtype))  # [B, N, C']
        if decision.cache_detail == "slot_offset":
            detail = cached - decision.strategy.unmerge(plan.merge(cached), plan)  # [B, N, C'] offset from the slot mean
            return output + detail
        if self.merged is None:
            return output
        blended = torch.lerp(cached, output, decision.cache_weight)  # [B, N, C'] = w * output + (1 - w) * cached
        return torch.where(self.merged.unsqueeze(-1), blended, output)  # [B, N, C']


def module_key(point: int) -> tuple[str, int]:
    """The feature-cache key of merge point ``point``'s whole module output and input shape (``reuse_outputs``)."""
    return ("module", point)


def reference_key(point: int) -> tuple[str, int]:
    """The feature-cache key of merge point ``point``'s reference output (``cache_detail="merged_change"``)."""
    return ("reference", point)


@dataclasses.dataclass(frozen=True)
class Record:
    """One block call's decision, as recorded for tests, logs and figures."""

    trajectory: int
    step: int
    layer: int
    block_kind: str
    label: str
    ratio: float
    sublayers: tuple[str, ...]
    num_tokens: int
    num_removed: int
    reused: bool = False  # the block did not run: its input plus a kept residual


@dataclasses.dataclass
class CallCounts:
    """What the calls of one application did, counted eagerly as each ends (:meth:`MergeState.end_block`), whether
    or not :class:`Record` s are kept: ``handle.stats`` reads them, and the check of a handle that merged or reused
    nothing (:meth:`tomerge.attach.MergeHandle.check_something_happened`) reads what the schedule asked for.

    Every block call is exactly one of ``merged_calls`` (ran with tokens removed), ``reused_calls`` (skipped: its
    input plus a kept or forecast residual) and ``computed_calls`` (ran with every token)."""

    model_calls: int = 0  # calls of the hooked model (its forward hooks ran)
    block_calls: int = 0
    merged_calls: int = 0
    reused_calls: int = 0
    forecast_calls: int = 0  # of the reused calls, those whose residual was a Taylor forecast (forecast_order > 0)
    computed_calls: int = 0
    sublayer_reused_calls: int = 0  # calls that ran but returned a sublayer's stored output instead of running it (toca)
    reuse_missed_calls: int = 0  # reuses that found no kept residual of the input's shape: the block ran and stored
    tokens: int = 0  # tokens of the merged calls
    tokens_removed: int = 0
    # what the schedule asked for (the reasons of a handle that merged or reused nothing)
    grid_calls: int = 0  # block calls with a token grid (the schedule decides only those)
    merge_decisions: int = 0  # block calls whose decision merges at a ratio > 0
    reuse_decisions: int = 0  # block calls whose decision reuses the block or a sublayer (a missed reuse included)
    changes_measured: int = 0  # residual changes measured (adaptive caching)
    smallest_change: float = math.inf  # the smallest of them
    most_steps: int = 0  # the most distinct steps one trajectory reached

    def count(self, call: BlockCall) -> None:
        """Counts one ended block call."""
        decision, plan = call.decision, call.plan
        self.block_calls += 1
        self.grid_calls += call.grid is not None
        self.merge_decisions += decision.merges and decision.ratio > 0
        self.reuse_missed_calls += decision.label == REUSE_MISSED
        self.reuse_decisions += (decision.block_cache == "reuse" or bool(decision.reuse_outputs)
                                 or decision.label == REUSE_MISSED)
        if call.reused is not None:
            self.reused_calls += 1
            self.forecast_calls += decision.forecast_order > 0
        elif plan is not None and plan.num_removed > 0:
            self.merged_calls += 1
            self.tokens += plan.num_tokens
            self.tokens_removed += plan.num_removed
        else:
            self.computed_calls += 1
        if decision.reuse_outputs and any(isinstance(key, tuple) and key[0] == "module" for key in call.cached_outputs):
            self.sublayer_reused_calls += 1


class MergeState:
    """The state of one application (see the module docstring).

    Args:
        schedule: the schedule deciding every block call.
        num_layers: how many blocks the adapter hooked.
        seed: base seed of the per-(step, layer) generators.
        clock: the trajectory clock.
        record: keep a :class:`Record` per block call (``records``), up to ``max_records``.
        memory_budget: GiB the kept tensors (:meth:`kept_bytes`) may reach; over it, the first steps warn once with
            the estimate (:meth:`check_memory`). ``None``: on CUDA, the device memory free at that point; elsewhere
            no check.
    """

    def __init__(self, schedule: Schedule, num_layers: int, *, seed: int = 0,
                 clock: TrajectoryClock | None = None, record: bool = True, max_records: int = 100_000,
                 memory_budget: float | None = None) -> None:
        self.schedule = schedule
        self.num_layers = num_layers
        self.seed = seed
        self.clock = clock or TrajectoryClock()
        self.record = record
        self.max_records = max_records
        self.memory_budget = memory_budget
        self._memory_warned = False
        self.records: list[Record] = []
        self.counts = CallCounts()
        self._steps: set[int] = set()  # the distinct steps of the trajectory in progress
        self.call: BlockCall | None = None
        # Plans, destinations, streaks and cached outputs are kept per call index: the index of the model call
        # among the calls of the current step (split guidance: 0 = first branch, 1 = second; batched guidance:
        # always 0), so split guidance reuses and counts exactly as the batched call does for each sample.
        self.call_index = 0
        # (call index, scope of Decision.cache_key) -> (window, plan, [B or 1, N] merged): one plan per scope, the
        # latest window's (windows only grow along a trajectory, so an earlier window's plan is never asked again)
        self.plans: dict[tuple[int, Hashable], tuple[Hashable, MergePlan, Tensor | None]] = {}
        # (call index, scope of Decision.destinations_key) -> (window, N, [B, M] dst)
        self.destinations: dict[tuple[int, Hashable], tuple[Hashable, int, Tensor]] = {}
        # (call index, Decision.streak_key, N) -> [B, N] consecutive merges of each token
        self.streaks: dict[tuple[int, Hashable, int], Tensor] = {}
        # (call index, layer, point or reference_key(point)) -> [B, N, C'] feature cache
        self.outputs: dict[tuple[int, int, Hashable], Tensor] = {}
        # (layer, B, N) -> [B, N] received attention of the layer's latest call of that batch and length, oldest
        # first: a step whose model calls differ in batch (a doubled guidance batch, then single ones) keeps each
        # size's attention for the next step
        self.attention_by_size: dict[tuple[int, int, int], Tensor] = {}
        self.residuals: dict[tuple[int, int], KeptResidual] = {}  # (call index, layer) -> the block cache
        self.signals: dict[int, ChangeSignal] = {}  # call index -> the change signal of adaptive caching
        self.change: float | None = None  # the change measured in the model call in progress (Where.change)
        self.text_labels: Any = None  # what schedule.prepare_text_labels returned (e.g. SDTM's prompt categories)
        self._forked: dict[torch.device, torch.Generator] = {}
        # Called with (block call, new plan) whenever a plan is computed: merge maps, probes, logging.
        self.observers: list[Callable[[BlockCall, MergePlan], None]] = []
        self.needs: frozenset[str] = schedule.needs
        self.keep_streaks = any(s.uses_streak for s in schedule.strategies())

    # ------------------------------------------------------------------ model calls
    def begin_model_call(self, timestep: Tensor | float | None) -> None:
        previous = (self.clock.trajectory, self.clock.current)
        self.counts.model_calls += 1
        if self.clock.observe(timestep):
            for per_trajectory in (self.plans, self.destinations, self.streaks, self.attention_by_size,
                                   self.outputs, self.residuals, self.signals, self._steps):
                per_trajectory.clear()
        self._steps.add(self.clock.step)
        self.counts.most_steps = max(self.counts.most_steps, len(self._steps))
        same_step = timestep is not None and previous[1] is not None \
            and (self.clock.trajectory, self.clock.current) == previous
        self.call_index = self.call_index + 1 if same_step else 0
        self.change = None

    # ------------------------------------------------------------------ block calls
    def begin_block(self, layer: int, block_kind: str, grid: Grid | None,
                    block_input: Tensor | None, kind_index: int | None = None,
                    num_points: int = 0, streams: Streams | None = None, image_stream: int = 0) -> BlockCall:
        """Decides a block call and prepares everything its merge points read: the strategy's context, the
        cached plan or kept destinations, the streaks and the feature cache of its ``num_points`` points, and for
        the block cache its input ``streams`` (``streams[image_stream]`` the image tokens) and the residual a
        reuse adds (forecast here, eagerly, so that the step never enters a compiled graph). Runs eagerly (the
        hooks call it outside compiled graphs); ``block_input [B, N, C]``."""
        where = Where(step=self.clock.step, num_steps=self.clock.num_steps, progress=self.clock.progress,
                      layer=layer, num_layers=self.num_layers, block_kind=block_kind, kind_index=kind_index,
                      change=self.change)
        decision = self.schedule.decide(where) if grid is not None else SKIP
        if decision.merges:
            check_attention_runs_before_its_merge(
                decision.strategy, decision.sublayers, SCHEDULE_MERGES_AFTER_THE_ATTENTION,
                where=f" (chosen by schedule {self.schedule.name!r} at step {where.step}, layer {layer})")
        if decision.reset_streaks:
            for key in [k for k in self.streaks if k[0] == self.call_index]:
                del self.streaks[key]
        if decision.block_cache is not None:
            if streams is None:
                raise RuntimeError(f"tomerge: schedule {self.schedule.name!r} decided {decision.block_cache!r} for "
                                   "a block cache, but its caches_blocks is False: the hooks did not wrap the blocks")
            if decision.block_cache == "reuse":
                kept = self.residuals.get((self.call_index, layer))
                if kept is None or not kept.fits(streams):  # nothing to reuse: run the block and keep its residual
                    decision = dataclasses.replace(decision, block_cache="store", label=REUSE_MISSED)
        call = self.call = BlockCall(where, decision, grid, block_input)
        if decision.block_cache is not None:
            call.streams, call.image_stream = streams, image_stream
            if decision.block_cache == "reuse":
                call.reused = self.residuals[(self.call_index, layer)].forecast(where.step)
                return call
        if block_input is None:
            return call
        B, N = block_input.shape[:2]
        if decision.cache_weight is not None or decision.cache_detail is not None or decision.reuse_outputs:
            # it reads the feature cache
            for index in range(num_points):
                for key in (index, reference_key(index), module_key(index)):
                    cached = self.outputs.get((self.call_index, layer, key))
                    if cached is not None:
                        call.cached_outputs[key] = cached
        strategy = decision.strategy
        if strategy is None and decision.streak_key is not None and self.keep_streaks:
            # a call that selects no token: every token's streak of this key grows by 1 (ToCa's counter)
            streak = self._streak(B, N, block_input.device, decision.streak_key)
            self.streaks[(self.call_index, decision.streak_key, N)] = streak + 1
        if strategy is None or grid is None:
            return call
        if decision.cache_key is not None:
            scope, window = decision.cache_key
            cached = self.plans.get((self.call_index, scope))
            if cached is not None and cached[0] == window and _fits(cached[1].num_tokens, cached[1].dst, block_input):
                _, call.plan, call.merged = cached
                return call
        if decision.destinations_key is not None:
            scope, window = decision.destinations_key
            kept = self.destinations.get((self.call_index, scope))
            if kept is not None and kept[0] == window and _fits(kept[1], kept[2], block_input):
                call.kept_destinations = kept[2]
        if self.keep_streaks:
            call.streak = self._streak(B, N, block_input.device, decision.streak_key)
        ctx = MergeContext(
            grid=grid, ratio=decision.ratio, progress=where.progress, step=where.step,
            num_steps=where.num_steps, layer=layer, num_layers=self.num_layers, block_kind=block_kind,
            generator=self._generator(strategy, where, block_input.device) if strategy.uses_generator else None,
            received_attention=self._latest_attention(layer, B, N),
            streak=call.streak if strategy.uses_streak else None,
            removal=torch.empty(int(N * decision.ratio), 0, device=block_input.device),  # [r, 0]: r as a size
        )
        if strategy.uses_generator and ctx.tokens_to_remove(N) > 0 and call.kept_destinations is None:
            ctx = dataclasses.replace(ctx, draws=strategy.draw(ctx, B))  # drawn here, outside compiled graphs
        call.ctx = ctx
        return call

    def plan_for(self, call: BlockCall, tokens: Tensor) -> MergePlan:
        """The plan of this block call: the cached one, else computed once from ``tokens [B, N, C]`` (from the
        kept destinations when there are some) and shared by the call's merge points. Tensor work only: this
        runs inside compiled graphs."""
        if call.plan is not None:
            return call.plan
        strategy, ctx = call.decision.strategy, call.ctx
        assert strategy is not None and ctx is not None  # begin_block prepared a merging call
        if call.attention is not None:  # recorded by a probe earlier in this call (its attention ran unmerged)
            ctx = dataclasses.replace(ctx, received_attention=call.attention)
        if call.kept_destinations is None:
            plan = strategy.plan(tokens, ctx)
        else:
            plan = strategy.plan(tokens, ctx, destinations=call.kept_destinations)
        call.plan, call.computed = plan, True
        if self.keep_streaks or call.decision.cache_weight is not None:
            call.merged = strategy.merged_tokens(plan, ctx)  # [B or 1, N] bool
        if call.streak is not None and ctx.tokens_to_remove(plan.num_tokens) > 0:
            # One merge decision (a call asked to remove nothing counts nothing): every token the plan counts as
            # merged extends its streak by 1, every other token's streak drops to 0 (the authors'
            # last_independent: add 1 to all, zero the independent ones).
            call.new_streak = (call.streak + 1) * call.merged.expand_as(call.streak)  # [B, N]
        return plan

    def end_block(self) -> None:
        """Commits what the block call produced (cached plan, kept destinations, streaks, feature cache, block
        cache, received attention) and records its decision. Runs eagerly, after the block: every tensor kept is
        a copy made here (:func:`_copy`), or computed here, never one the (compiled) block call returned."""
        call, self.call = self.call, None
        if call is None:
            return
        layer = call.where.layer
        if call.computed:
            plan = call.plan
            assert plan is not None
            key, dst_key = call.decision.cache_key, call.decision.destinations_key
            if key is not None:
                scope, window = key
                self.plans[(self.call_index, scope)] = (window, plan.detached_copy(), _copy(call.merged))
            if dst_key is not None and call.kept_destinations is None and not plan.is_identity:
                scope, window = dst_key
                self.destinations[(self.call_index, scope)] = (window, plan.num_tokens, _copy(plan.dst))
            if call.new_streak is not None:
                self.streaks[(self.call_index, call.decision.streak_key, plan.num_tokens)] = _copy(call.new_streak)
            for observe in self.observers:
                observe(call, plan)
        for index, output in call.new_outputs.items():
            if output is None:
                self.outputs.pop((self.call_index, layer, index), None)
            else:
                self.outputs[(self.call_index, layer, index)] = _copy(output)
        if call.block_outputs is not None:
            self._keep_residual(call)
        if call.reused is not None and self.call_index in self.signals:
            self.signals[self.call_index].last_full = False
        if call.attention is not None:
            self.store_attention(layer, call.attention)
        self.counts.count(call)
        if self.record and len(self.records) < self.max_records:
            plan = call.plan
            self.records.append(Record(
                trajectory=self.clock.trajectory, step=call.where.step, layer=layer,
                block_kind=call.where.block_kind, label=call.decision.label, ratio=call.decision.ratio,
                sublayers=tuple(sorted(call.decision.sublayers)) if plan is not None else (),
                num_tokens=plan.num_tokens if plan is not None else 0,
                num_removed=plan.num_removed if plan is not None else 0,
                reused=call.reused is not None,
            ))

    # ------------------------------------------------------------------ the block cache
    def _keep_residual(self, call: BlockCall) -> None:
        """Stores a storing call's residual (with its Taylor terms) and measures its change when asked."""
        key, step = (self.call_index, call.where.layer), call.where.step
        assert call.streams is not None and call.block_outputs is not None
        order = call.decision.forecast_order
        residual = KeptResidual.residual(call.streams, call.block_outputs, order)
        kept = self.residuals.get(key)
        inputs = tuple(None if x is None else x.shape for x in call.streams)
        self.residuals[key] = (KeptResidual(step, [residual], order, inputs) if kept is None
                               else kept.updated(step, residual, order, inputs))
        rule = call.decision.measure_change
        if rule is not None:
            image = residual[call.image_stream]
            if image is None:
                raise RuntimeError(f"tomerge: the {call.where.block_kind!r} block returned no image tokens; the change "
                                   "of adaptive caching is measured on them")
            self.change = self.signals.setdefault(self.call_index, ChangeSignal()).measure(image, rule)
            self.counts.changes_measured += 1
            self.counts.smallest_change = min(self.counts.smallest_change, self.change)

    # ------------------------------------------------------------------ memory
    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor kept across model calls, with what keeps it: ``"plans"`` (cached plans and their merged
        tokens), ``"destinations"``, ``"streaks"``, ``"feature_cache"`` (stored sublayer outputs), ``"attention"``
        (received attention), ``"block_cache"`` (kept residuals and their Taylor terms), ``"change_signal"``."""
        for _, plan, merged in self.plans.values():
            yield from (("plans", t) for t in (*plan.tensors(), merged) if t is not None)
        for _, _, dst in self.destinations.values():
            yield "destinations", dst
        for streak in self.streaks.values():
            yield "streaks", streak
        for output in self.outputs.values():
            yield from (("feature_cache", t) for t in _leaves(output))
        for received in self.attention_by_size.values():
            yield "attention", received
        for kept in self.residuals.values():
            yield from (("block_cache", t) for term in kept.terms for t in term if t is not None)
        for signal in self.signals.values():
            yield from (("change_signal", t) for t in (signal.last, signal.reference) if t is not None)

    def kept_bytes(self, by_kind: bool = False) -> int | dict[str, int]:
        """The bytes of :meth:`kept_tensors`, each storage counted once (the first kind that keeps it); per kind
        with ``by_kind``."""
        seen: set[StorageWeakRef] = set()
        sizes: dict[str, int] = {}
        for kind, tensor in self.kept_tensors():
            storage = StorageWeakRef(tensor.untyped_storage())
            if storage not in seen:
                seen.add(storage)
                sizes[kind] = sizes.get(kind, 0) + _bytes(tensor)
        return sizes if by_kind else sum(sizes.values())

    def check_memory(self) -> None:
        """Warns once when the kept tensors, with every block cache's Taylor terms filled up, would exceed the budget
        (``memory_budget`` GiB; by default on CUDA the device memory still free). The hooks call it after each model
        call of the first two steps, when every call index has stored once (eagerly; on CUDA it asks the driver)."""
        if self._memory_warned:
            return
        sizes = self.kept_bytes(by_kind=True)
        kept = sum(sizes.values())
        growth = sum(r.capacity() for r in self.residuals.values()) - sizes.get("block_cache", 0)
        projected = kept + max(0, growth)
        tensors = [t for _, t in self.kept_tensors()]
        if self.memory_budget is not None:
            budget, what = self.memory_budget * 2**30, f"memory_budget={self.memory_budget:g} GiB"
        elif tensors and tensors[0].device.type == "cuda" and torch.cuda.is_available():
            free = torch.cuda.mem_get_info(tensors[0].device)[0]
            budget, what = kept + free, f"what is kept plus the {free / 2**30:.2f} GiB free on {tensors[0].device}"
        else:
            return
        if projected <= budget:
            return
        self._memory_warned = True
        parts = ", ".join(f"{kind} {size / 2**30:.2f}" for kind, size in sorted(sizes.items()))
        orders = {r.order for r in self.residuals.values()}
        warnings.warn(
            f"tomerge: schedule {self.schedule.name!r} will keep about {projected / 2**30:.2f} GiB across model calls "
            f"(now {kept / 2**30:.2f} GiB: {parts}"
            + (f"; the block cache grows to {max(orders) + 1} Taylor terms" if orders and max(orders) > 0 else "")
            + f"), more than {what}. Lower the Taylor order (forecast_order), cache fewer blocks, run guidance "
            "batched rather than as separate calls, use a smaller batch, or set memory_budget=... (GiB) where the "
            "memory is there", stacklevel=3)

    # ------------------------------------------------------------------ per-token statistics
    def store_attention(self, layer: int, received: Tensor) -> None:
        """Keeps ``received [B, N]`` as the layer's latest received attention of its size (moved to the end: the
        newest)."""
        key = (layer, *received.shape[:2])
        self.attention_by_size.pop(key, None)
        self.attention_by_size[key] = _copy(received)

    @property
    def attention(self) -> dict[int, Tensor]:
        """layer -> ``[B, N]`` the received attention of the layer's latest call, whatever its size."""
        return {layer: a for (layer, _, _), a in self.attention_by_size.items()}

    def _latest_attention(self, layer: int, batch: int, num_tokens: int) -> Tensor | None:
        """The received attention the layer recorded last in a call of ``batch`` samples of ``num_tokens`` tokens
        (``None`` if no call of that size recorded one in this trajectory)."""
        return self.attention_by_size.get((layer, batch, num_tokens))

    def _streak(self, batch: int, num_tokens: int, device: torch.device, key: Hashable | None) -> Tensor:
        s = self.streaks.get((self.call_index, key, num_tokens))
        if s is None or s.shape[0] != batch:
            s = torch.zeros(batch, num_tokens, device=device)
            self.streaks[(self.call_index, key, num_tokens)] = s
        return s

    # ------------------------------------------------------------------ randomness
    def _generator(self, strategy: Any, where: Where, device: torch.device) -> torch.Generator:
        """The strategy's :attr:`~tomerge.MergeStrategy.generator_policy`: ``"fork_global"`` (ToMeSD's): one
        generator forked from the global RNG at first use, advanced by each draw; ``"per_step_layer"``: one
        generator per (step, layer), so split and batched guidance see the same layout."""
        if strategy.generator_policy == "fork_global":
            gen = self._forked.get(device)
            if gen is None:
                gen = torch.Generator(device=device)
                gen.set_state(torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state())
                self._forked[device] = gen
            return gen
        gen = torch.Generator(device=device)
        gen.manual_seed((self.seed * 1_000_003 + where.step * 10_007 + where.layer) % (2**63))
        return gen


#: The end of :func:`~tomerge.schedule.check_attention_runs_before_its_merge`'s message for a schedule's decision.
SCHEDULE_MERGES_AFTER_THE_ATTENTION = (
    "make the schedule merge only sublayers that run after the attention with this strategy (e.g. the MLP alone, "
    "as sdtm's detail phase does with idm), or do not list 'received_attention' in the strategy's needs. A "
    "schedule's sublayers are known only from its decisions, so this is refused at the first block call that "
    "merges the attention with it, not by tomerge.apply")

REUSE_MISSED = "reuse_missed"  # the label of a reuse that found no kept residual (the block ran and stored one)


def _copy(kept: Any) -> Any:
    """A copy of a tensor (or the tensors of a tuple) that the state keeps across model calls, made eagerly: it
    aliases nothing computed in the block call (a CUDA graph's replay overwrites its outputs)."""
    if isinstance(kept, Tensor):
        return kept.detach().clone()
    if isinstance(kept, tuple) and not isinstance(kept, torch.Size):
        return tuple(_copy(t) for t in kept)
    return kept


def _leaves(kept: Any) -> Iterator[Tensor]:
    """The tensors of a feature-cache entry: a tensor, or ``(input shape, module output)`` with tuples inside."""
    if isinstance(kept, Tensor):
        yield kept
    elif isinstance(kept, tuple):
        for item in kept:
            yield from _leaves(item)


def _fits(num_tokens: int, dst: Tensor, tokens: Tensor) -> bool:
    """Whether a kept plan or kept destinations (``dst [B or 1, M]`` over ``num_tokens`` tokens) can serve the
    tokens ``tokens [B, N, C]``: same ``N`` and batch (or one shared row); a call of another size plans anew."""
    return num_tokens == tokens.shape[1] and dst.shape[0] in (1, tokens.shape[0])
