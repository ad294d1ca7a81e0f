"""`apply`, `remove`, `merging`: attaching a strategy or schedule to a model with forward hooks.

Every hook handle is kept by the :class:`MergeHandle`; ``remove()`` deletes them all, so the model
is exactly as before (bit-identical outputs). The hooks are generic; the backbone adapter tells them
where the blocks, merge points and token grids are.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .adapter import BackboneAdapter, BlockSpec, MergePoint
from .context import check_ratio
from .follow import FollowedHooks
from .recipe import Recipe
from .registry import backbone_class, build, list_backbones, strategy_class
from .schedule import Constant, Schedule
from .state import MergeState, TrajectoryClock
from .strategy import RECORDED_NEEDS, MergeStrategy
from .technique import TECHNIQUES, TechniqueState
from .text_bias import TextLabels, bias_text_keys

_HANDLE_ATTR = "_tomerge_handle"
_CONSTANT_OPTIONS = ("merge_attn", "merge_crossattn", "merge_mlp", "merge_from", "merge_until")  # Constant's options
_STATE_OPTIONS = ("seed", "num_steps", "text_labels", "memory_budget")


def recorded_needs(adapter: type[BackboneAdapter], kinds: Iterable[str]) -> frozenset[str]:
    """What ``adapter`` records (a subset of :data:`~tomerge.strategy.RECORDED_NEEDS`) in a model whose blocks
    are of ``kinds``: received attention when its probe covers every one of them (:meth:`BackboneAdapter.probed_kinds`),
    else nothing. The one rule of :func:`apply` (which refuses a strategy needing more) and of the coverage
    table (``tomerge backbones``)."""
    kinds = frozenset(kinds)
    return RECORDED_NEEDS if kinds and kinds <= adapter.probed_kinds() else frozenset()


def unrecorded_reason(adapter: type[BackboneAdapter], kinds: Iterable[str]) -> str | None:
    """Why ``adapter`` records no received attention in a model whose blocks are of ``kinds`` (the block kinds
    without a probe), or ``None`` where it does (:func:`recorded_needs`)."""
    kinds = list(dict.fromkeys(kinds))
    if recorded_needs(adapter, kinds):
        return None
    unprobed = [kind for kind in kinds if kind not in adapter.probed_kinds()] or kinds
    return (f"backbone {adapter.name!r} cannot record received attention in its {', '.join(map(repr, unprobed))} "
            "blocks (no probe is declared for their attention: docs/backbones/adding-a-family.md)")


def block_cache_refusal(adapter: type[BackboneAdapter], kinds: Iterable[str]) -> str | None:
    """Why the block cache (schedules that skip whole block calls, :attr:`Schedule.caches_blocks`) cannot run on a
    model of ``adapter`` whose blocks are of ``kinds`` (:meth:`BackboneAdapter.uncached_kinds`), or ``None``. The
    one rule of :func:`apply` (which refuses such a schedule there) and of the coverage table (``tomerge
    backbones``)."""
    uncached = adapter.uncached_kinds()
    refused = [kind for kind in dict.fromkeys(kinds) if kind in uncached]
    if not refused:
        return None
    return f"backbone {adapter.name!r} cannot skip its {refused[0]!r} blocks: {uncached[refused[0]]}"


def refusal(adapter: type[BackboneAdapter], kinds: Iterable[str], schedule: Schedule) -> str | None:
    """Why :func:`apply` refuses ``schedule`` on a model of ``adapter`` whose blocks are of ``kinds`` (what it needs
    is not recorded there, :func:`unrecorded_reason`; it skips whole blocks that cannot be skipped,
    :func:`block_cache_refusal`), or ``None`` where it runs. The coverage table's rule per cell."""
    kinds = list(kinds)
    if schedule.needs - recorded_needs(adapter, kinds):
        return unrecorded_reason(adapter, kinds)
    if schedule.caches_blocks:
        return block_cache_refusal(adapter, kinds)
    return None


class MergeHandle:
    """One application of tomerge to a model: its adapter, schedule, state and hooks.

    Attributes:
        model: the patched module (the transformer/UNet, also when a pipeline was given).
        schedule: the schedule deciding every block call.
        state: the :class:`~tomerge.state.MergeState` (``state.records`` has every decision).
        experts: the handles of every model :func:`apply` attached to, this one first: ``(handle,)``, or for a
            two-expert pipeline (Wan 2.2 A14B) ``(transformer's, transformer_2's)``, each with its own state, step
            clock and stats; ``remove()`` removes them all.
    """

    experts: tuple[MergeHandle, ...] = ()

    def __init__(self, model: nn.Module, adapter: BackboneAdapter, schedule: Schedule, state: MergeState) -> None:
        self.model, self.adapter, self.schedule, self.state = model, adapter, schedule, state
        self._hooks: list[Any] = []
        self._blocks: list[BlockSpec] = []
        self._text_hooks = False  # text-key bias hooks installed (on the first set_text_labels)
        self._blocks_with_grid = 0  # blocks of the current model call the adapter could merge
        self._blocks_called = 0  # blocks of the current model call
        self._warned_nothing = False  # the warning of a handle that merged or reused nothing was given

    # ------------------------------------------------------------------ public
    @property
    def stats(self) -> dict[str, Any]:
        """What the calls since :func:`apply` did (counted as they end, also with ``state.record`` off):

        * ``model_calls``: calls of the hooked model; ``block_calls``: calls of its hooked blocks, each exactly one
          of ``merged_calls`` (ran with tokens removed), ``reused_calls`` (skipped: its input plus a kept residual,
          block caching) and ``computed_calls`` (ran with every token);
        * ``forecast_calls``: of the reused calls, those whose residual was a Taylor forecast (``taylorseer``);
        * ``sublayer_reused_calls``: calls that ran but returned a sublayer's stored output instead of running it
          (token-wise caching, ``toca``); ``reuse_missed_calls``: reuses that found no kept residual of the input's
          shape, so the block ran (and stored one);
        * ``tokens``, ``tokens_removed``: the tokens of the merged calls and how many of them were removed;
        * ``step``, ``num_steps``: the step clock now.

        A handle that saw block calls but merged or reused nothing warns once, naming why
        (:meth:`check_something_happened`)."""
        counts = self.state.counts
        return {
            "model_calls": counts.model_calls,
            "block_calls": counts.block_calls,
            "merged_calls": counts.merged_calls,
            "reused_calls": counts.reused_calls,
            "computed_calls": counts.computed_calls,
            "forecast_calls": counts.forecast_calls,
            "sublayer_reused_calls": counts.sublayer_reused_calls,
            "reuse_missed_calls": counts.reuse_missed_calls,
            "tokens": counts.tokens,
            "tokens_removed": counts.tokens_removed,
            "step": self.state.clock.step,
            "num_steps": self.state.clock.num_steps,
        }

    def check_something_happened(self) -> None:
        """Warns once (one line: the reason and what to do) when the handle saw calls but its schedule, which merges
        at a ratio > 0 or caches, merged or reused nothing in any of them. The hooks call it when the clock reaches
        the last step of a trajectory, when a new trajectory starts and at :meth:`remove` (the context's exit), so a
        cache that reuses only late in a trajectory is judged on the whole of it; a model call none of whose blocks
        has a token grid warns at once (:meth:`_model_post`)."""
        if self._warned_nothing:
            return
        reason = self._nothing_reason()
        if reason is not None:
            self._warn_nothing(reason)

    def _warn_nothing(self, reason: str) -> None:
        self._warned_nothing = True
        what = (f"strategy {self.schedule.strategy.name!r}" if isinstance(self.schedule, Constant)
                else f"schedule {self.schedule.name!r}")
        warnings.warn(f"tomerge: {what} on this {type(self.model).__name__} {reason}", stacklevel=3)

    def _nothing_reason(self) -> str | None:
        """Why the handle merged (at a ratio > 0) or reused nothing, with what to do; ``None`` when it did what its
        schedule asks for, or saw no call at all."""
        counts, schedule = self.state.counts, self.schedule
        wants_merge = _merges_at_a_ratio(schedule) and counts.merged_calls == 0
        wants_reuse = _caches(schedule) and counts.reused_calls == 0 and counts.sublayer_reused_calls == 0
        if not (wants_merge or wants_reuse) or counts.model_calls + counts.block_calls == 0:
            return None
        what = " or ".join(w for w, wanted in (("merged", wants_merge), ("reused", wants_reuse)) if wanted)
        done = f"{what} nothing in {counts.block_calls} block calls"
        if counts.block_calls == 0:
            return (f"{done}: the model ran {counts.model_calls} times but none of its {len(self._blocks)} hooked "
                    "blocks did (the pipeline or a graph compiled before apply bypassed them); apply to the module the "
                    "pipeline runs (e.g. transformer_2 too), and compile after apply")
        if counts.model_calls == 0:
            return (f"{done}: a pipeline bypassed the hooked module: its blocks ran outside a call of it "
                    "(model.forward(...) called directly, or a pipeline that runs the blocks itself), so neither the "
                    "token grid nor the step was read; call the model itself, model(...)")
        if counts.grid_calls == 0:
            return (f"{done}: no block with a token grid: none is mergeable with the {self.adapter.name!r} adapter's "
                    f"options {self.adapter.options} at these input sizes; change the adapter's options (e.g. "
                    "max_downsample) or the input size")
        if wants_merge and counts.merge_decisions == 0:
            return (f"{done}: the schedule decided no merge in any block call of the {counts.most_steps} steps "
                    f"seen; check its step options (merge_from/merge_until, refresh_every, warmup) against the step "
                    "count")
        if wants_merge:
            return (f"{done}: the strategy removed no token in the {counts.merge_decisions} block calls it was asked "
                    "to merge (too few tokens for the ratio); raise the ratio or use a larger input")
        if counts.reuse_missed_calls and counts.reuse_missed_calls == counts.reuse_decisions:
            return (f"{done}: each of its {counts.reuse_missed_calls} reuses found no kept residual of its input's "
                    "shape (the batch or size changed between steps); keep them fixed along a trajectory")
        if counts.changes_measured and counts.reuse_decisions == 0:
            threshold = getattr(schedule, "threshold", None)
            return (f"{done}: the threshold was never crossed: the first block's residual changed by at least "
                    f"{counts.smallest_change:.3g} per step, not below threshold={threshold}; raise the threshold")
        if counts.most_steps <= 1 and counts.model_calls > 1:
            return (f"{done}: all {counts.model_calls} model calls were at one step (their timestep never changed, "
                    "and the step clock counts a step per new timestep); pass the model the scheduler's timestep")
        return (f"{done}: the step count leaves no reuse step: no step of the {counts.most_steps} seen (of "
                f"num_steps={self.state.clock.num_steps}) was one its warmup and interval reuse; run more steps or "
                "lower the warmup or interval")

    def remove(self) -> None:
        """Removes every hook; the model computes exactly what it did before :func:`apply`. Warns when the handle
        saw calls but merged or reused nothing (:meth:`check_something_happened`)."""
        if self._hooks:
            self.check_something_happened()
        try:
            for hook in self._hooks:
                hook.remove()
        finally:
            self._hooks.clear()
            if self.model.__dict__.get(_HANDLE_ATTR) is self:
                del self.model.__dict__[_HANDLE_ATTR]

    def set_text_labels(self, labels: Any) -> None:
        """Sets the text-token labels the schedule's text-key bias reads (:meth:`Schedule.text_key_bias`);
        ``None`` turns the bias off. For ``sdtm`` (prompt reweighting): one label list per prompt
        (``"structure"``, ``"detail"``, ``"none"`` for every text token the model attends to, e.g. from
        :class:`tomerge.strategies.sdtm_prompts.WordListCategorizer`; classifier-free guidance: the negative
        prompts' rows first; one row applies to every sample).

        Raises:
            TypeError: the schedule takes no labels (e.g. ``sdtm`` built with ``prompt_reweight=None``).
            ValueError: invalid labels, or a model without text tokens in its attention.

        Example:
            >>> handle = tomerge.apply(pipe, "sdtm", ratio=0.3)                    # doctest: +SKIP
            >>> handle.set_text_labels([negative_labels, labels])                  # doctest: +SKIP
        """
        if labels is None:
            self.state.technique(TextLabels).labels = None
            return
        if not self._hooks:
            raise RuntimeError("this tomerge handle was removed; apply again")
        prepared = self.schedule.prepare_text_labels(labels)
        if not self._text_hooks:
            hooks: list[Any] = []
            for block in self._blocks:
                for point in block.points:
                    keys = self.adapter.text_keys(block, point)
                    if keys is not None:
                        hooks += bias_text_keys(keys, self._text_bias)
            if not hooks:
                raise ValueError(f"the {self.adapter.name!r} backbone has no text tokens in its attention: a text-key "
                                 "bias (e.g. SDTM's prompt reweighting) needs a joint text-image attention whose text keys the adapter "
                                 "declares (sd3, flux, flux2, qwenimage, hunyuan_video, hunyuan_video15)")
            self._hooks.extend(hooks)
            self._text_hooks = True
        self.state.technique(TextLabels).labels = prepared

    def _text_bias(self, batch: int, text_len: int, device: Any) -> Any:
        """The ``[B, T]`` text-key bias of the block call in progress, or ``None``."""
        labels, call = self.state.technique(TextLabels).labels, self.state.call
        if labels is None or call is None:
            return None
        return self.schedule.text_key_bias(call.where, labels, batch, text_len, device)

    # ------------------------------------------------------------------ hooks
    def _attach(self, blocks: list[BlockSpec]) -> None:
        self._blocks = blocks
        if self.schedule.caches_blocks:
            reason = block_cache_refusal(type(self.adapter), (block.kind for block in blocks))
            if reason is not None:
                raise NotImplementedError(
                    f"schedule {self.schedule.name!r} skips whole block calls (block cache): {reason}; use a merging "
                    "strategy, or a caching schedule that skips no whole block (toca)")
        add = self._hooks.append
        self._block_wrappers = [technique for technique in TECHNIQUES if technique.wraps_blocks(self.schedule)]
        point_wrappers = {technique: technique.wrapped_sublayers(self.schedule) for technique in TECHNIQUES}
        self._follower = FollowedHooks(self.model)
        add(self._follower)
        add(self.model.register_forward_pre_hook(torch.compiler.disable(self._model_pre), with_kwargs=True))
        add(self.model.register_forward_hook(torch.compiler.disable(self._model_post)))
        kind_counts: dict[str, int] = {}
        for block in blocks:
            kind_index = kind_counts.get(block.kind, 0)
            kind_counts[block.kind] = kind_index + 1
            for technique in self._block_wrappers:
                add(_ForwardPatch(block.module, self._wrapped_block(technique, block, block.module.forward)))
            add(block.module.register_forward_pre_hook(self._block_pre(block, kind_index), with_kwargs=True))
            add(block.module.register_forward_hook(self._block_post(block), always_call=True))
            for index, point in enumerate(block.points):
                wrappers = [t for t, sublayers in point_wrappers.items() if point.sublayer in sublayers]
                for technique in wrappers:
                    add(_ForwardPatch(point.module, self._wrapped_point(technique, point, index, point.module.forward)))
                patched = bool(wrappers)
                # a merge point replaced after apply (peft's LoRA layers) takes its hooks along (tomerge/follow.py)
                self._follower.add(point.module, self._point_pre(point, index), self._point_post(point, index),
                                   fixed=patched)
        self._record_needs(blocks)

    def _record_needs(self, blocks: list[BlockSpec]) -> None:
        """Installs the recorders of what the schedule's strategies need (:attr:`MergeStrategy.needs`): received
        attention through the adapter's probe on every block's ``"attn"`` points. A need no adapter records, or one
        :func:`recorded_needs` says this adapter does not record in these blocks, raises here, naming the
        strategies."""
        strategies = self.schedule.strategies()
        for need in sorted(self.state.needs):
            users = sorted({s.name for s in strategies if need in s.needs})
            if need not in RECORDED_NEEDS:
                raise ValueError(f"strategy {', '.join(map(repr, users))} needs {need!r}, which no backbone adapter "
                                 f"records (they record: {', '.join(sorted(RECORDED_NEEDS))})")
        if "received_attention" not in self.state.needs:
            return
        users = ", ".join(sorted({repr(s.name) for s in strategies if "received_attention" in s.needs}))
        reason = unrecorded_reason(type(self.adapter), (block.kind for block in blocks))
        if reason is not None:
            raise NotImplementedError(f"strategy {users} needs received attention: {reason}; use a strategy that "
                                      "needs none, e.g. idm(variant='streak') or ssm")
        for block in blocks:
            hooks: list[Any] = []
            try:
                for point in block.points:
                    if point.sublayer == "attn":
                        hooks += self.adapter.probe(block, point, self.state)
            except NotImplementedError as err:
                raise NotImplementedError(f"strategy {users} needs received attention: {err}") from err
            finally:
                self._hooks.extend(hooks)
            if not hooks:
                raise RuntimeError(
                    f"tomerge: backbone {self.adapter.name!r} declares a probe for its {block.kind!r} blocks "
                    "(probed_kinds()) but installed none in this block")

    # The model's and the blocks' hooks do the Python bookkeeping (the step, the decision, the caches) and run
    # eagerly, outside compiled graphs (torch.compiler.disable); the merge points' hooks do the tensor work and
    # read only the block call they were handed, so compiled graphs are reused across steps and blocks
    # (docs/compile.md).
    def _model_pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._follower.follow()
        trajectory = self.state.clock.trajectory
        self.state.begin_model_call(self.adapter.on_model_call(args, kwargs))
        if trajectory and self.state.clock.trajectory != trajectory:  # the previous trajectory ended
            self.check_something_happened()
        self._blocks_with_grid = self._blocks_called = 0

    def _model_post(self, module: nn.Module, args: tuple, output: Any) -> None:
        clock = self.state.clock
        if clock.step <= 1:
            self.state.check_memory()
        if self._warned_nothing:
            return
        if self._blocks_called and self._blocks_with_grid == 0 and (_merges_at_a_ratio(self.schedule)
                                                                    or _caches(self.schedule)):
            # known now: this call ran every block in full
            self._warned_nothing = True
            warnings.warn(
                f"tomerge: no block of this {type(self.model).__name__} call was merged or reused: no block with a "
                f"token grid: none is mergeable with the {self.adapter.name!r} adapter's options "
                f"{self.adapter.options} at this input size; change the adapter's options (e.g. max_downsample) or "
                "the input size", stacklevel=2)
        elif clock.num_steps is not None and clock.step >= clock.num_steps - 1:  # the last step of a trajectory
            self.check_something_happened()

    def _block_pre(self, block: BlockSpec, kind_index: int):
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = block.block_input(args, kwargs)
            grid = self.adapter.grid(block, x.shape[1])
            caching = bool(self._block_wrappers)
            call = self.state.begin_block(block.layer, block.kind, grid, x, kind_index=kind_index,
                                          streams=block.streams(args, kwargs) if caching else None,
                                          image_stream=block.image_stream if caching else 0)
            self._blocks_with_grid += grid is not None
            self._blocks_called += 1
            for point in block.points:
                point.enter_block(call.decision.merges and point.sublayer in call.decision.sublayers)
        return hook

    def _block_post(self, block: BlockSpec):
        @torch.compiler.disable
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            try:
                for point in block.points:
                    point.exit_block()
            finally:
                self.state.end_block()
        return hook

    def _wrapped_block(self, technique: type[TechniqueState], block: BlockSpec, forward: Any):
        """The block's ``forward`` run through ``technique.block_forward`` (inside compiled graphs)."""
        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            call = self.state.call
            if call is None:
                return forward(*args, **kwargs)
            return technique.block_forward(call, block, forward, args, kwargs)
        return wrapped

    def _wrapped_point(self, technique: type[TechniqueState], point: MergePoint, index: int, forward: Any):
        """The merge point's ``forward`` run through ``technique.point_forward`` (inside compiled graphs)."""
        @functools.wraps(forward)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            call = self.state.call
            if call is None:
                return forward(*args, **kwargs)
            return technique.point_forward(call, point, index, forward, args, kwargs)
        return wrapped

    def _point_pre(self, point: MergePoint, index: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict):
            call = self.state.call
            if call is None:
                return None
            if not point.reads_tokens(args, kwargs):  # a shared submodule's call on other tokens: runs as it is
                call.skipped.add(index)
                return None
            for technique in call.scratch:
                technique.point_input(call, point, index, args, kwargs)
            if point.sublayer not in call.decision.sublayers or call.decision.strategy is None:
                return None
            x = point.get_input(args, kwargs)
            plan_input = call.block_input if call.decision.strategy.plan_input == "block_input" else x
            plan = self.state.plan_for(call, plan_input)
            if plan.is_identity:
                return None
            call.active[index] = plan
            return point.merge_input(args, kwargs, x, plan)
        return hook

    def _point_post(self, point: MergePoint, index: int):
        def hook(module: nn.Module, args: tuple, output: Any):
            call = self.state.call
            if call is None:
                return None
            if index in call.skipped:
                call.skipped.discard(index)
                return None
            decision = call.decision
            plan = call.active.pop(index, None)
            if plan is None:  # ran at full length
                for technique in call.scratch:
                    technique.point_ran(call, point, index, output)
                return None
            if point.keeps_merged(decision.sublayers):
                return None  # a later point of the block consumes the merged output and unmerges
            y = decision.strategy.unmerge(point.get_output(output), plan)  # [B, M, C'] -> [B, N, C']
            for technique in call.scratch:
                y = technique.point_unmerged(call, point, index, y, plan)
            return point.set_output(output, y)
        return hook


# ---------------------------------------------------------------------- public functions
def apply(target: Any, strategy: str | MergeStrategy | Schedule | Recipe = "tomesd", *, ratio: float | None = None,
          backbone: str | None = None, adapter: Mapping[str, Any] | None = None, seed: int | None = None,
          num_steps: int | None = None, text_labels: Any = None, memory_budget: float | None = None,
          **options: Any) -> MergeHandle:
    """Attaches token merging to a diffusers pipeline, a diffusers model or a native DiT.

    Args:
        target: the pipeline or model.
        strategy: what to run: a :class:`MergeStrategy` or a :class:`Schedule` (e.g.
            ``FORA(merge=ToMeSD(ratio=0.5))``), a registered name as a shorthand, or a
            :class:`~tomerge.recipe.Recipe` (``tomerge tune``'s, with its ratio and options).
        ratio: fraction of tokens removed (for a strategy: required unless the instance has one).
        backbone: adapter name; found from the model's classes when ``None``.
        adapter: the adapter's options (e.g. ``{"max_downsample": 2}`` for the ``unet`` adapter).
        seed: the seed of the per-(step, layer) generators (``None``: 0, or a Recipe's own).
        num_steps: the step count, where the pipeline's scheduler does not tell it.
        text_labels: labels of the text tokens (:meth:`MergeHandle.set_text_labels`).
        memory_budget: GiB the kept caches may reach before a warning
            (:meth:`~tomerge.state.MergeState.check_memory`).
        **options: with a name, the options of that strategy or schedule (and, for a strategy,
            :class:`~tomerge.schedule.Constant`'s ``merge_attn`` ... ``merge_until``); with an object, only
            ``merge_attn`` ... ``merge_until``. Unknown names raise.

    Returns:
        A :class:`MergeHandle`; ``handle.remove()`` or :func:`remove` undoes everything. A two-expert pipeline
        (Wan 2.2 A14B: ``transformer`` and ``transformer_2`` switched at ``boundary_ratio``) has both merged, each
        with its own state and step clock over the steps it runs (``handle.experts``; docs/backbones/wan.md).

    Raises:
        RuntimeError: diffusers' own cache is enabled on the model (``enable_cache``); one enabled after ``apply``
            raises at the model's next call.

    Example:
        >>> handle = tomerge.apply(pipe, "tomesd", ratio=0.5)      # doctest: +SKIP
        >>> image = pipe("a photo of a cat").images[0]            # doctest: +SKIP
        >>> tomerge.remove(pipe)                                   # doctest: +SKIP
    """
    state = {"seed": seed, "num_steps": num_steps, "text_labels": text_labels, "memory_budget": memory_budget}
    if isinstance(strategy, Recipe):
        if ratio is not None or options or adapter is not None:
            raise TypeError("a Recipe carries its ratio and options: pass it without ratio=, adapter= or options")
        given = {k for k, v in state.items() if v is not None}
        twice = sorted(given & strategy.options.keys())
        if twice:
            raise TypeError(f"the Recipe sets {twice} among its options: pass them in one place")
        return apply(target, strategy.strategy, ratio=strategy.ratio, backbone=backbone,
                     **{**state, **apply_arguments(strategy.options)})
    adapter_cls, model = _find_backbone(target, backbone)
    misplaced = sorted(options.keys() & {f.name for f in dataclasses.fields(adapter_cls.Options)})
    if misplaced:
        raise TypeError(f"{misplaced} are options of the {adapter_cls.name!r} adapter: pass adapter={{...}}")
    adapter_opts = dict(adapter or {})
    state_opts = {**state, "seed": 0 if seed is None else seed}
    schedule = make_schedule(strategy, ratio, options)
    scheduler = getattr(target, "scheduler", None) if target is not model else None
    experts = _experts(target, model, adapter_cls, scheduler)
    handles: list[MergeHandle] = []
    try:
        for expert, boundary in experts:
            handles.append(_apply_model(expert, adapter_cls, adapter_opts, schedule, state_opts, scheduler, boundary))
    except BaseException:
        for handle in handles:
            handle.remove()
        raise
    handle = handles[0]
    for one in handles:
        one.experts = tuple(handles)
    handle._hooks.extend(_Removes(other) for other in handles[1:])  # handle.remove() removes the other experts too
    return handle


def _apply_model(model: nn.Module, adapter_cls: type[BackboneAdapter], adapter_opts: dict[str, Any],
                 schedule: Schedule, state_opts: dict[str, Any], scheduler: Any,
                 boundary: tuple[str, float] | None) -> MergeHandle:
    """Attaches ``schedule`` to one model (a pipeline's transformer, or one expert of two, ``boundary``: see
    :func:`_experts`); its own adapter, state and step clock."""
    if _HANDLE_ATTR in model.__dict__:
        raise RuntimeError(
            f"tomerge is already applied to this {type(model).__name__}; call tomerge.remove() first")
    _refuse_diffusers_cache(model, "is enabled on")
    adapter = adapter_cls(model, build(adapter_cls.Options, adapter_opts, what=f"backbone {adapter_cls.name!r}"))
    adapter.check()
    blocks = adapter.blocks()
    _check_not_compiled(model, blocks)
    if not blocks:
        raise ValueError(
            f"no block of {type(model).__name__} matched the {adapter_cls.name!r} adapter, which looks for "
            f"{', '.join(adapter_cls.block_names)}; pass backbone=... for another model family "
            f"(registered: {', '.join(list_backbones())})")

    bounds = None
    if boundary is not None:  # the scheduler's boundary timestep in the units of the model's calls
        side, value = boundary
        converted = adapter.scheduler_timesteps(torch.tensor([value], dtype=torch.float64))
        value = float(converted[0]) if converted is not None else value
        bounds = (value, math.inf) if side == "high" else (-math.inf, value)
    clock = TrajectoryClock(
        num_steps=state_opts.get("num_steps"),
        timesteps=_scheduler_timesteps(scheduler, adapter) if scheduler is not None else None,
        t_max=adapter.t_max,
        bounds=bounds,
    )
    state = MergeState(schedule, num_layers=len(blocks), seed=state_opts.get("seed", 0), clock=clock,
                       memory_budget=state_opts.get("memory_budget"))
    handle = MergeHandle(model, adapter, schedule, state)
    try:
        handle._hooks.append(model.register_forward_pre_hook(_refuse_diffusers_cache_at_call))
        handle._attach(blocks)
        if state_opts.get("text_labels") is not None:
            handle.set_text_labels(state_opts["text_labels"])
    except BaseException:
        handle.remove()
        raise
    model.__dict__[_HANDLE_ATTR] = handle
    return handle


def _experts(target: Any, model: nn.Module, adapter_cls: type[BackboneAdapter],
             scheduler: Any) -> list[tuple[nn.Module, tuple[str, float] | None]]:
    """The models :func:`apply` attaches to, each with the side of the boundary timestep it runs: ``[(model,
    None)]``, or for a two-expert pipeline (Wan 2.2 A14B: ``transformer`` runs the timesteps ``t >= boundary_ratio
    * num_train_timesteps``, ``transformer_2`` the others) ``[(transformer, ("high", b)), (transformer_2, ("low",
    b))]``. A ``transformer_2`` without a ``boundary_ratio`` never runs (diffusers' WanPipeline) and is left alone."""
    second = getattr(target, "transformer_2", None) if target is not model else None
    config = getattr(target, "config", None) or {}
    ratio = config.get("boundary_ratio") if hasattr(config, "get") else None
    if not isinstance(second, nn.Module) or ratio is None or getattr(target, "transformer", None) is not model:
        return [(model, None)]
    if adapter_cls.find_model(second) is not second:
        raise ValueError(f"the pipeline's transformer_2 ({type(second).__name__}) is not a model of the "
                         f"{adapter_cls.name!r} adapter of its transformer ({type(model).__name__}); apply to each "
                         "transformer separately")
    train_steps = getattr(getattr(scheduler, "config", None), "num_train_timesteps", None) or 1000
    boundary = float(ratio) * float(train_steps)
    return [(model, ("high", boundary)), (second, ("low", boundary))]


class _Removes:
    """A hook handle of the primary :class:`MergeHandle` that removes another expert's handle."""

    def __init__(self, handle: MergeHandle) -> None:
        self.handle = handle

    def remove(self) -> None:
        self.handle.remove()


def _refuse_diffusers_cache(model: nn.Module, how: str) -> None:
    """Raises when diffusers' own cache (``model.enable_cache(FirstBlockCacheConfig(...))`` and the like) is enabled
    on ``model``: its hooks skip blocks and replay block or attention outputs behind tomerge's hooks."""
    config = getattr(model, "_cache_config", None)
    if config is not None:
        raise RuntimeError(
            f"tomerge: diffusers' {type(config).__name__} cache {how} this {type(model).__name__} (enable_cache): "
            "its hooks skip blocks and replay outputs behind tomerge's, so the two do not compose; call its "
            "disable_cache() and use tomerge's caching instead (fora, taylorseer, first_block_cache; merge=... to "
            "merge too)")


@torch.compiler.disable
def _refuse_diffusers_cache_at_call(module: nn.Module, args: tuple) -> None:
    _refuse_diffusers_cache(module, "was enabled after tomerge.apply on")


def check_options(strategy: str, *, ratio: float | None = None, backbones: Sequence[str] | None = None,
                  **options: Any) -> Schedule:
    """Raises what :func:`apply` would raise for this strategy, ratio and options, without a model:
    unknown names, unknown options and invalid values (a config's whole grid can be checked before any
    work). Adapter options are accepted if one of ``backbones`` (default: every registered one) has them.
    Returns the schedule :func:`apply` would run (e.g. its :attr:`~tomerge.schedule.Schedule.needs`).

    Example:
        >>> tomerge.check_options("tomesd", ratio=0.5, use_rnd=False)      # doctest: +SKIP
        TypeError: unknown option(s) ['use_rnd'] for strategy 'tomesd'; valid options: [...]
    """
    names = list(backbones) if backbones is not None else list_backbones()
    adapter_fields = _adapter_fields(names)
    if len(names) == 1:  # one family: its option values are checked too
        cls = backbone_class(names[0])
        build(cls.Options, {k: v for k, v in options.items() if k in adapter_fields}, what=f"backbone {cls.name!r}")
    rest = {k: v for k, v in options.items() if k not in adapter_fields and k not in _STATE_OPTIONS}
    return make_schedule(strategy, ratio, rest, also_valid={*adapter_fields, *_STATE_OPTIONS})


def apply_arguments(options: Mapping[str, Any], backbones: Sequence[str] | None = None) -> dict[str, Any]:
    """The keyword arguments of :func:`apply` for a config's flat ``options`` (a grid entry's, which
    :func:`check_options` validates): the adapter options of ``backbones`` (default: every registered one) go
    into ``adapter=``, the state options stay keywords, the rest are the strategy's or schedule's."""
    adapter_fields = _adapter_fields(backbones)
    adapter = {k: v for k, v in options.items() if k in adapter_fields}
    rest = {k: v for k, v in options.items() if k not in adapter_fields}
    return {**rest, "adapter": adapter} if adapter else rest


def option_names(strategy: str, backbones: Sequence[str] | None = None) -> list[str]:
    """Every option name :func:`check_options` (and :func:`apply`) accepts with the registered ``strategy``:
    its own (a strategy's or schedule's fields), ``apply()``'s and the adapter options of ``backbones``
    (default: every registered one). A config check names the unknown ones all at once with it.

    Example:
        >>> "use_rand" in tomerge.attach.option_names("tomesd")      # doctest: +SKIP
        True
    """
    valid = {*_STATE_OPTIONS, *_adapter_fields(backbones)}
    cls = strategy_class(strategy)
    valid |= {f.name for f in dataclasses.fields(cls) if f.init}
    if not issubclass(cls, Schedule):
        valid |= set(_CONSTANT_OPTIONS)
    return sorted(valid)


def _adapter_fields(backbones: Sequence[str] | None) -> set[str]:
    """The option names of the adapters ``backbones`` (default: every registered one), together."""
    names = list(backbones) if backbones is not None else list_backbones()
    return {f.name for name in names for f in dataclasses.fields(backbone_class(name).Options)}


def remove(target: Any) -> None:
    """Undoes :func:`apply` on a model or pipeline; raises if nothing was applied."""
    for module in _candidate_modules(target):
        handle = module.__dict__.get(_HANDLE_ATTR)
        if handle is not None:
            handle.remove()
            return
    raise ValueError(f"tomerge is not applied to this {type(target).__name__}")


@contextlib.contextmanager
def merging(target: Any, strategy: str | MergeStrategy | Schedule = "tomesd", **kwargs: Any) -> Iterator[MergeHandle]:
    """Context manager form of :func:`apply`; removes on exit, also after an exception.

    Example:
        >>> with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False):   # doctest: +SKIP
        ...     image = pipe("a cat").images[0]
    """
    handle = apply(target, strategy, **kwargs)
    try:
        yield handle
    finally:
        handle.remove()


# ---------------------------------------------------------------------- helpers
def _merges_at_a_ratio(schedule: Schedule) -> bool:
    """Whether the schedule merges: it has a strategy, its ``ratio`` (where it has one) is not 0, and it reuses no
    sublayer output (token-wise caching, ``toca``, whose strategy picks the tokens a cached step recomputes: that
    is its caching, judged by :func:`_caches`)."""
    return bool(schedule.strategies()) and getattr(schedule, "ratio", None) != 0 and not schedule.reused_sublayers


def _caches(schedule: Schedule) -> bool:
    """Whether the schedule reuses block calls (``caches_blocks``) or sublayer outputs (``reused_sublayers``)."""
    return schedule.caches_blocks or bool(schedule.reused_sublayers)


class _ForwardPatch:
    """A block's ``forward`` replaced by a wrapper (an instance attribute, as diffusers' hooks do); ``remove()``
    puts back what was there, so the module is exactly as before."""

    _ABSENT = object()  # the module had no instance-level forward (its class's is used)

    def __init__(self, module: nn.Module, wrapper: Any) -> None:
        self.module, self.wrapper = module, wrapper
        self.previous = module.__dict__.get("forward", self._ABSENT)
        module.forward = wrapper

    def remove(self) -> None:
        if self.module.__dict__.get("forward") is not self.wrapper:
            # Another library wrapped the forward after tomerge: removing ours would remove theirs. Ours stays inside
            # theirs and passes every call through (no block call of this handle is ever in progress again).
            warnings.warn(f"tomerge: the forward of {type(self.module).__name__} was wrapped again after tomerge's; "
                          "tomerge's wrapper stays inside it and passes calls through", stacklevel=3)
            return
        if self.previous is self._ABSENT:
            del self.module.forward
        else:
            self.module.forward = self.previous


def _scheduler_timesteps(scheduler: Any, adapter: BackboneAdapter):
    """The pipeline scheduler's current timesteps in the units of the adapter's call timesteps
    (:meth:`BackboneAdapter.scheduler_timesteps`), float32 on the host: copied from the device once per timestep
    tensor the scheduler sets (pipelines set a new one per run), not at every call."""
    copied: dict[str, Any] = {}

    def timesteps():
        t = getattr(scheduler, "timesteps", None)
        if t is None:
            return None
        if copied.get("source") is not t or copied.get("version") != t._version:
            converted = adapter.scheduler_timesteps(t)
            copied.update(source=t, version=t._version, host=None if converted is None else converted.float().cpu())
        return copied["host"]
    return timesteps


def make_schedule(strategy: str | MergeStrategy | Schedule, ratio: float | None, options: dict[str, Any],
                  also_valid: set[str] = frozenset()) -> Schedule:
    """The schedule :func:`apply` runs for ``strategy`` (a registered name, a strategy or a schedule) at ``ratio``
    with ``options`` (a strategy's options and :class:`~tomerge.schedule.Constant`'s; a schedule's own), raising
    what ``apply`` raises; ``also_valid`` are named as valid in the error on an unknown option (a config's
    adapter and state options). ``options`` is consumed."""
    if isinstance(strategy, str):
        cls = strategy_class(strategy)
        if issubclass(cls, Schedule):
            if ratio is not None:
                options["ratio"] = ratio
            return build(cls, options, what=f"schedule {strategy!r}")
        flags = {k: options.pop(k) for k in _CONSTANT_OPTIONS if k in options}
        instance = build(cls, options, what=f"strategy {strategy!r}",
                         also_valid={*_CONSTANT_OPTIONS, *also_valid})
        return _constant(instance, ratio, flags)
    if isinstance(strategy, Schedule):
        if options or ratio is not None:
            raise TypeError(f"options {sorted(options) + (['ratio'] if ratio is not None else [])} go into the "
                            "Schedule when you build it, not into apply()")
        return strategy
    if isinstance(strategy, MergeStrategy):
        flags = {k: options.pop(k) for k in _CONSTANT_OPTIONS if k in options}
        if options:
            raise TypeError(f"options {sorted(options)} go into the strategy when you build it, not into apply(); "
                            f"apply() takes ratio, {', '.join(_CONSTANT_OPTIONS)} beside it, adapter options as "
                            f"adapter={{...}} and the state's ({', '.join(_STATE_OPTIONS)}) as keywords")
        return _constant(strategy, ratio, flags)
    raise TypeError(f"strategy must be a name, a MergeStrategy or a Schedule, got {type(strategy).__name__}")


def _constant(strategy: MergeStrategy, ratio: float | None, flags: dict[str, bool]) -> Constant:
    ratio = strategy.ratio if ratio is None else ratio
    if ratio is None:
        raise TypeError(f"apply() needs ratio=... for strategy {strategy.name!r}")
    return Constant(strategy=strategy, ratio=check_ratio(ratio), **flags)


def _check_not_compiled(model: nn.Module, blocks: list[BlockSpec]) -> None:
    """Raises when the model or a block was compiled in place (``nn.Module.compile``, diffusers'
    ``compile_repeated_blocks``): dynamo does not guard on module hooks by default
    (``torch._dynamo.config.skip_nnmodule_hook_guards``), so the compiled graphs would keep running without the
    merge hooks while the eager bookkeeping still counted merges."""
    if not torch._dynamo.config.skip_nnmodule_hook_guards:
        return  # dynamo guards on hooks: the compiled blocks recompile with the merge hooks
    compiled = [m for m in (model, *(b.module for b in blocks)) if getattr(m, "_compiled_call_impl", None) is not None]
    if compiled:
        raise RuntimeError(
            f"{type(compiled[0]).__name__} was compiled before tomerge.apply: its compiled graphs would not run the "
            "merge hooks (dynamo does not guard on module hooks by default). Apply first, then compile; or set "
            "torch._dynamo.config.skip_nnmodule_hook_guards = False, so that changed hooks recompile "
            "(docs/compile.md)")


def _candidate_modules(target: Any) -> list[nn.Module]:
    found = [target] if isinstance(target, nn.Module) else []
    for attr in ("transformer", "unet", "model"):
        sub = getattr(target, attr, None)
        if isinstance(sub, nn.Module):
            found.append(sub)
    return found


def _find_backbone(target: Any, backbone: str | None) -> tuple[type[BackboneAdapter], nn.Module]:
    names = [backbone] if backbone is not None else list_backbones()
    for name in names:
        cls = backbone_class(name)
        model = cls.find_model(target)
        if model is not None:
            return cls, model
    if backbone is not None:
        raise ValueError(f"backbone {backbone!r} found no model in {type(target).__name__}")
    raise ValueError(
        f"no registered backbone ({', '.join(names)}) recognises {type(target).__name__}; pass backbone=...")
