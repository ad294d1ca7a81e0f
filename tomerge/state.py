"""`MergeState`: everything one application of tomerge remembers between calls.

One object per :func:`tomerge.apply`, never module attributes: the trajectory clock (step index from
distinct timestep values), the block call in progress, cached plans and destinations, random generators, a record
of every decision, and one state per technique the schedule uses (:class:`~tomerge.technique.TechniqueState`: the
block cache, the feature cache, merge streaks, received attention, each in its own module), created at first use.

What is kept across calls is copied out of the block call by eager code (:meth:`MergeState.end_block`,
:meth:`MergeState.keep`), so it never aliases a tensor computed inside a compiled block, which CUDA graphs overwrite
at their next replay; it is bounded by the model, not by the step count (one plan per cache scope, each technique's
bound in its docstring; docs/compile.md, "CUDA graphs").
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Hashable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef

from .context import Grid, MergeContext
from .plan import MergePlan
from .probe import ReceivedAttention
from .schedule import SKIP, Decision, Schedule, Where, check_attention_runs_before_its_merge
from .streaks import StreakState, next_streak
from .technique import Streams, TechniqueState

T = TypeVar("T", bound=TechniqueState)


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


@dataclasses.dataclass
class BlockCall:
    """One block forward: what :meth:`MergeState.begin_block` prepared before it (from Python state, outside any
    compiled graph) and what its merge points produced (committed by :meth:`MergeState.end_block`).

    The merge points' hooks read and write only this object and tensors, never the step, the layer or the
    state's caches: under ``torch.compile`` a new step or another block with the same decision then
    reuses the compiled graph (docs/compile.md). A technique's per-call data is ``scratch[its state's class]``.
    """

    where: Where
    decision: Decision
    grid: Grid | None
    block_input: Tensor | None
    streams: Streams | None = None  # the block's input streams, when a technique wraps the block (wraps_blocks)
    image_stream: int = 0  # the index of the image tokens in streams
    ctx: MergeContext | None = None  # the strategy's context, when the decision merges
    plan: MergePlan | None = None  # the cached plan (reused), or the one this call computed
    merged: Tensor | None = None  # [B or 1, N] bool: the plan's merged tokens, when a technique reads them
    wants_merged: bool = False  # a technique reads merged (set in begin_block): a computed plan computes it
    kept_destinations: Tensor | None = None  # [B, M] destinations kept under the decision's destinations_key
    computed: bool = False  # the plan was computed in this call (end_block caches it and tells the observers)
    attention: Tensor | None = None  # [B, N] received attention a probe recorded in this call
    active: dict[int, MergePlan] = dataclasses.field(default_factory=dict)  # point index -> plan
    skipped: set[int] = dataclasses.field(default_factory=set)  # point indices whose call in progress reads no image tokens
    reused: Streams | None = None  # the block does not run: its output is its input plus this (the block cache's)
    scratch: dict[type[TechniqueState], Any] = dataclasses.field(default_factory=dict)  # technique -> per-call data

    @property
    def records_attention(self) -> bool:
        """Whether the received-attention probes record in this call: its decision merges and its attention runs
        (no technique returns its output: ``Decision.skipped``)."""
        return self.decision.merges and "attn" not in self.decision.skipped


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
    """What the calls of one application did, counted eagerly as each ends (:meth:`MergeState.end_block`, the
    techniques' counts in their ``end_block``), whether or not :class:`Record` s are kept: ``handle.stats`` reads
    them, and the check of a handle that merged or reused nothing
    (:meth:`tomerge.attach.MergeHandle.check_something_happened`) reads what the schedule asked for.

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
        if call.reused is not None:
            self.reused_calls += 1
        elif plan is not None and plan.num_removed > 0:
            self.merged_calls += 1
            self.tokens += plan.num_tokens
            self.tokens_removed += plan.num_removed
        else:
            self.computed_calls += 1


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
        # Plans, destinations and the techniques' caches are kept per call index: the index of the model call
        # among the calls of the current step (split guidance: 0 = first branch, 1 = second; batched guidance:
        # always 0), so split guidance reuses and counts exactly as the batched call does for each sample.
        self.call_index = 0
        # (call index, scope of Decision.cache_key) -> (window, plan, [B or 1, N] merged): one plan per scope, the
        # latest window's (windows only grow along a trajectory, so an earlier window's plan is never asked again)
        self.plans: dict[tuple[int, Hashable], tuple[Hashable, MergePlan, Tensor | None]] = {}
        # (call index, scope of Decision.destinations_key) -> (window, N, [B, M] dst)
        self.destinations: dict[tuple[int, Hashable], tuple[Hashable, int, Tensor]] = {}
        self.change: float | None = None  # what a block call of the model call in progress measured (Where.change)
        self._forked: dict[torch.device, torch.Generator] = {}
        # Called with (block call, new plan) whenever a plan is computed: merge maps, probes, logging.
        self.observers: list[Callable[[BlockCall, MergePlan], None]] = []
        self.needs: frozenset[str] = schedule.needs
        self.techniques: dict[type[TechniqueState], TechniqueState] = {}  # class -> its one state, in creation order
        if any(s.uses_streak for s in schedule.strategies()):
            self.technique(StreakState)
        if "received_attention" in self.needs:
            self.technique(ReceivedAttention)

    def technique(self, cls: type[T]) -> T:
        """The one state of technique ``cls`` in this application, created (``cls.create(self)``) at first use; its
        hooks run around every later block call."""
        found = self.techniques.get(cls)
        if found is None:
            found = self.techniques[cls] = cls.create(self)
        return found  # type: ignore[return-value]

    @property
    def attention(self) -> dict[int, Tensor]:
        """layer -> ``[B, N]`` the received attention of the layer's latest call, whatever its size."""
        return self.technique(ReceivedAttention).by_layer()

    @staticmethod
    def keep(kept: Any) -> Any:
        """A copy of a tensor (or the tensors of a tuple) to keep across model calls (:func:`_copy`)."""
        return _copy(kept)

    # ------------------------------------------------------------------ model calls
    def begin_model_call(self, timestep: Tensor | float | None) -> None:
        previous = (self.clock.trajectory, self.clock.current)
        self.counts.model_calls += 1
        if self.clock.observe(timestep):
            for per_trajectory in (self.plans, self.destinations, self._steps):
                per_trajectory.clear()
            for technique in self.techniques.values():
                technique.reset()
        self._steps.add(self.clock.step)
        self.counts.most_steps = max(self.counts.most_steps, len(self._steps))
        same_step = timestep is not None and previous[1] is not None \
            and (self.clock.trajectory, self.clock.current) == previous
        self.call_index = self.call_index + 1 if same_step else 0
        self.change = None

    # ------------------------------------------------------------------ block calls
    def begin_block(self, layer: int, block_kind: str, grid: Grid | None,
                    block_input: Tensor | None, kind_index: int | None = None,
                    streams: Streams | None = None, image_stream: int = 0) -> BlockCall:
        """Decides a block call and prepares everything its merge points read: what the techniques hand it
        (:meth:`TechniqueState.begin_block <tomerge.technique.TechniqueState.begin_block>`: e.g. the residual a
        block-cache reuse adds, given the block's input ``streams``, ``streams[image_stream]`` the image tokens), then,
        when it merges, the strategy's context and the cached plan or kept destinations. Runs eagerly (the hooks
        call it outside compiled graphs); ``block_input [B, N, C]``."""
        where = Where(step=self.clock.step, num_steps=self.clock.num_steps, progress=self.clock.progress,
                      layer=layer, num_layers=self.num_layers, block_kind=block_kind, kind_index=kind_index,
                      change=self.change)
        decision = self.schedule.decide(where) if grid is not None else SKIP
        if decision.merges:
            check_attention_runs_before_its_merge(
                decision.strategy, decision.sublayers, SCHEDULE_MERGES_AFTER_THE_ATTENTION,
                where=f" (chosen by schedule {self.schedule.name!r} at step {where.step}, layer {layer})")
        call = BlockCall(where, decision, grid, block_input, streams=streams, image_stream=image_stream)
        for options in decision.techniques:
            self.technique(options.State)
        for technique in list(self.techniques.values()):
            technique.begin_block(call, self)
        self.call = call
        decision, strategy = call.decision, call.decision.strategy
        if call.reused is not None or block_input is None or strategy is None or grid is None:
            return call
        B, N = block_input.shape[:2]
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
        streaks = self.techniques.get(StreakState)
        streak = streaks.current(call, self) if streaks is not None and streaks.keep else None
        attention = self.techniques.get(ReceivedAttention)
        ctx = MergeContext(
            grid=grid, ratio=decision.ratio, progress=where.progress, step=where.step,
            num_steps=where.num_steps, layer=layer, num_layers=self.num_layers, block_kind=block_kind,
            generator=self._generator(strategy, where, block_input.device) if strategy.uses_generator else None,
            received_attention=attention.latest(layer, B, N) if attention is not None else None,
            streak=streak if strategy.uses_streak else None,
            removal=torch.empty(int(N * decision.ratio), 0, device=block_input.device),  # [r, 0]: r as a size
        )
        if strategy.uses_generator and ctx.tokens_to_remove(N) > 0 and call.kept_destinations is None:
            ctx = dataclasses.replace(ctx, draws=strategy.draw(ctx, B))  # drawn here, outside compiled graphs
        call.ctx = ctx
        return call

    def plan_for(self, call: BlockCall, tokens: Tensor) -> MergePlan:
        """The plan of this block call: the cached one, else computed once from ``tokens [B, N, C]`` (from the
        kept destinations when there are some) and shared by the call's merge points; the call's merge streaks
        follow it (:func:`~tomerge.streaks.next_streak`). Tensor work only: this runs inside compiled graphs."""
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
        if call.wants_merged:
            call.merged = strategy.merged_tokens(plan, ctx)  # [B or 1, N] bool
        counted = call.scratch.get(StreakState)
        if counted is not None and ctx.tokens_to_remove(plan.num_tokens) > 0:
            # one merge decision (a call asked to remove nothing counts nothing)
            counted.after = next_streak(counted.before, call.merged)  # [B, N]
        return plan

    def end_block(self) -> None:
        """Commits what the block call produced (cached plan, kept destinations, and each technique's:
        :meth:`TechniqueState.end_block <tomerge.technique.TechniqueState.end_block>`) and records its decision.
        Runs eagerly, after the block: every tensor kept is a copy made here (:meth:`keep`), or computed here, never
        one the (compiled) block call returned."""
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
            for observe in self.observers:
                observe(call, plan)
        for technique in list(self.techniques.values()):
            technique.end_block(call, self)
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

    # ------------------------------------------------------------------ memory
    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor kept across model calls, with what keeps it: ``"plans"`` (cached plans and their merged
        tokens), ``"destinations"``, and each technique's kinds (``"streaks"``, ``"feature_cache"``, ``"attention"``,
        ``"block_cache"``, ``"change_signal"``: :meth:`TechniqueState.kept_tensors
        <tomerge.technique.TechniqueState.kept_tensors>`)."""
        for _, plan, merged in self.plans.values():
            yield from (("plans", t) for t in (*plan.tensors(), merged) if t is not None)
        for _, _, dst in self.destinations.values():
            yield "destinations", dst
        for technique in self.techniques.values():
            yield from technique.kept_tensors()

    def kept_bytes(self, by_kind: bool = False) -> int | dict[str, int]:
        """The bytes of :meth:`kept_tensors`, each storage counted once (the first kind that keeps it); per kind
        with ``by_kind``."""
        seen: set[StorageWeakRef] = set()
        sizes: dict[str, int] = {}
        for kind, tensor in self.kept_tensors():
            storage = StorageWeakRef(tensor.untyped_storage())
            if storage not in seen:
                seen.add(storage)
                sizes[kind] = sizes.get(kind, 0) + tensor.untyped_storage().nbytes()
        return sizes if by_kind else sum(sizes.values())

    def check_memory(self) -> None:
        """Warns once when the kept tensors, with every technique's grown to its :meth:`TechniqueState.capacity
        <tomerge.technique.TechniqueState.capacity>` (the block cache's Taylor terms filled up), would exceed the
        budget (``memory_budget`` GiB; by default on CUDA the device memory still free). The hooks call it after each
        model call of the first two steps, when every call index has stored once (eagerly; on CUDA it asks the
        driver)."""
        if self._memory_warned:
            return
        sizes = self.kept_bytes(by_kind=True)
        kept = sum(sizes.values())
        growth, notes = 0, []
        for technique in self.techniques.values():
            capacity = technique.capacity()
            if capacity is not None:
                growth += capacity[0] - sizes.get(technique.kind, 0)
                notes += [capacity[1]] if capacity[1] else []
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
        warnings.warn(
            f"tomerge: schedule {self.schedule.name!r} will keep about {projected / 2**30:.2f} GiB across model calls "
            f"(now {kept / 2**30:.2f} GiB: {parts}" + "".join(f"; {note}" for note in notes)
            + f"), more than {what}. Lower the Taylor order (forecast_order), cache fewer blocks, run guidance "
            "batched rather than as separate calls, use a smaller batch, or set memory_budget=... (GiB) where the "
            "memory is there", stacklevel=3)

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


def _copy(kept: Any) -> Any:
    """A copy of a tensor (or the tensors of a tuple) that the state keeps across model calls, made eagerly: it
    aliases nothing computed in the block call (a CUDA graph's replay overwrites its outputs)."""
    if isinstance(kept, Tensor):
        return kept.detach().clone()
    if isinstance(kept, tuple) and not isinstance(kept, torch.Size):
        return tuple(_copy(t) for t in kept)
    return kept


def _fits(num_tokens: int, dst: Tensor, tokens: Tensor) -> bool:
    """Whether a kept plan or kept destinations (``dst [B or 1, M]`` over ``num_tokens`` tokens) can serve the
    tokens ``tokens [B, N, C]``: same ``N`` and batch (or one shared row); a call of another size plans anew."""
    return num_tokens == tokens.shape[1] and dst.shape[0] in (1, tokens.shape[0])
