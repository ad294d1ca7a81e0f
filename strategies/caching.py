"""Caching schedules: block calls skipped by reusing (or forecasting) their residual from an earlier step,
composed with any merging strategy or schedule on the block calls that run.

``block_cache`` (:class:`BlockCache`; presets ``fora`` and ``taylorseer``) decides by the step, ``first_block_cache``
(:class:`FirstBlockCache`) by how much the first block's residual changed; the block cache's state
(:mod:`tomerge.block_cache`) does the caching. The rules, the papers and the authors' code they follow, and the
deviations: docs/schedules.md, "Caching".

Example:
    >>> from tomerge.schedule import Where
    >>> s = BlockCache(interval=3)
    >>> [s.decide(Where(step=t, num_steps=8, progress=t / 7, layer=0, num_layers=2)).technique(BlockCaching).mode
    ...  for t in range(5)]
    ['store', 'reuse', 'reuse', 'store', 'reuse']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from tomerge.block_cache import BlockCaching
from tomerge.options import check_bool, check_int, check_number
from tomerge.schedule import Decision, Schedule, Where
from tomerge.strategy import MergeStrategy

COMPUTE, REUSE, FORECAST = "compute", "reuse", "forecast"  # labels: an unmerged block that runs, a skipped one
COUNTS = ("up", "down")  # BlockCache.count: the full steps counted from the first steps or from the last one


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachingSchedule(Schedule):
    """What every caching schedule shares: the inner merging schedule, the warm-up steps and the forecast.

    Args:
        merge: the merging strategy or schedule of the block calls that run: a registered name, a
            :class:`~tomerge.MergeStrategy` or a :class:`~tomerge.Schedule` (not a caching one); ``None``: they
            run unmerged (caching only).
        merge_options: options of ``merge`` when it is a name (a strategy's options and ``merge_attn`` ...
            ``merge_until``, or a schedule's), as ``tomerge.apply`` takes them.
        ratio: the ratio of ``merge``; ``None``: its own default. Without ``merge`` only ``None`` or 0.
        warmup: the first ``warmup`` steps run every block (at least 1: step 0 has nothing to reuse).
        forecast_order: the order of the Taylor forecast of a reused residual (TaylorSeer); 0 reuses it as kept.
    """

    merge: str | MergeStrategy | Schedule | None = None
    merge_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    ratio: float | None = None
    warmup: int = 1
    forecast_order: int = 0

    _inner: Schedule | None = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        what = self.name
        check_int(self.warmup, "warmup", what, low=1, note="step 0 has no residual to reuse")
        check_int(self.forecast_order, "forecast_order", what, low=0)
        if not isinstance(self.merge_options, Mapping):
            raise ValueError(f"{what}: merge_options must be a mapping of option names to values, "
                             f"got {self.merge_options!r}")
        object.__setattr__(self, "_inner", _inner_schedule(self.merge, self.ratio, dict(self.merge_options), what))

    @property
    def inner(self) -> Schedule | None:
        """The merging schedule of the block calls that run (built once), or ``None``."""
        return self._inner

    @property
    def caches_blocks(self) -> bool:
        return True

    def computed(self, where: Where) -> Decision:
        """The decision of a block call that runs: the inner schedule's (unmerged without one), keeping the
        block's residual."""
        decision = self._inner.decide(where) if self._inner is not None else Decision(strategy=None, label=COMPUTE)
        return decision.using(BlockCaching("store", self.forecast_order))

    def reused(self) -> Decision:
        """The decision of a skipped block call: its input plus the kept (or forecast) residual."""
        return Decision(strategy=None, label=FORECAST if self.forecast_order else REUSE,
                        techniques=(BlockCaching("reuse", self.forecast_order),))

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return self._inner.strategies() if self._inner is not None else ()

    # ------------------------------------------------------------------ the inner schedule's text-key bias
    def prepare_text_labels(self, labels: Any) -> Any:
        if self._inner is None:
            return super().prepare_text_labels(labels)
        return self._inner.prepare_text_labels(labels)

    def text_key_bias(self, where: Where, labels: Any, batch: int, text_len: int,
                      device: torch.device) -> Tensor | None:
        if self._inner is None:
            return None
        return self._inner.text_key_bias(where, labels, batch, text_len, device)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (the built inner schedule is derived, not logged)."""
        out = {k: v for k, v in super().to_dict().items() if not k.startswith("_")}
        out["merge_options"] = dict(self.merge_options)
        return out


def _inner_schedule(merge: Any, ratio: float | None, options: dict[str, Any], what: str) -> Schedule | None:
    """The schedule of ``merge`` at ``ratio`` with ``options``, as ``tomerge.apply`` builds it."""
    from tomerge.attach import make_schedule  # attach imports the registry that loads this module

    if merge is None:
        if ratio not in (None, 0, 0.0) or options:
            given = [name for name, value in (("ratio", ratio), ("merge_options", options)) if value]
            raise ValueError(f"{what}: {' and '.join(given)} set the merging strategy, but merge is None "
                             "(caching only); name one, e.g. merge='tomesd'")
        return None
    if not isinstance(merge, (str, MergeStrategy, Schedule)):
        raise ValueError(f"{what}: merge must be a strategy or schedule name, a MergeStrategy or a Schedule, "
                         f"got {merge!r}")
    try:
        inner = make_schedule(merge, None if isinstance(merge, Schedule) else ratio, options)
    except (KeyError, TypeError, ValueError) as err:  # KeyError: an unknown name (its message is its one argument)
        message = err.args[0] if isinstance(err, KeyError) and err.args else err
        raise ValueError(f"{what}: merge={merge if isinstance(merge, str) else type(merge).__name__!r}: {message}") \
            from err
    if inner.caches_blocks:
        raise ValueError(f"{what}: merge={inner.name!r} is itself a caching schedule; merge names a merging "
                         "strategy or schedule")
    if isinstance(merge, Schedule) and ratio is not None:
        raise ValueError(f"{what}: ratio goes into the Schedule given as merge when you build it")
    return inner


# ---------------------------------------------------------------------- step-level reuse
@dataclasses.dataclass(frozen=True, kw_only=True)
class BlockCache(CachingSchedule):
    """Step-level reuse of every block's residual, FORA-style (docs/schedules.md, "block_cache").

    Args:
        interval: the steps from one full step to the next (FORA's ``N``, TaylorSeer's ``interval``).
        count: ``"up"``: the full steps are counted from the last warm-up step (TaylorSeer); ``"down"``: from the
            last step (FORA).
        merge, merge_options, ratio, warmup, forecast_order: see :class:`CachingSchedule`.

    Example:
        >>> [BlockCache(interval=4, warmup=2).is_full(t, 7) for t in range(7)]
        [True, True, False, False, False, True, False]
        >>> [BlockCache(interval=3, count="down").is_full(t, 7) for t in range(7)]
        [True, False, False, True, False, False, True]
    """

    name: ClassVar[str] = "block_cache"

    interval: int = 3
    count: str = "up"

    def __post_init__(self) -> None:
        check_int(self.interval, "interval", self.name, low=1)
        if self.count not in COUNTS:
            raise ValueError(f"{self.name}: count must be one of {COUNTS}, got {self.count!r}")
        super().__post_init__()

    def is_full(self, step: int, num_steps: int | None) -> bool:
        """Whether every block runs on ``step`` (0: the first denoising step) of ``num_steps``."""
        if step < self.warmup:
            return True
        if self.count == "up":
            return (step - (self.warmup - 1)) % self.interval == 0
        if not num_steps:
            raise ValueError(f"{self.name}: count='down' counts the steps from the last one, so it needs the step "
                             "count: on a bare model pass num_steps= to tomerge.apply")
        return (num_steps - 1 - step) % self.interval == 0

    def decide(self, where: Where) -> Decision:
        """The inner schedule's decision, storing the residual, on full steps; a reuse on the others."""
        return self.computed(where) if self.is_full(where.step, where.num_steps) else self.reused()


@dataclasses.dataclass(frozen=True, kw_only=True)
class FORA(BlockCache):
    """``fora``: FORA's static caching as its code runs it (prathebaselva/FORA at ``acde628``): the first step and every
    step whose countdown index is a multiple of 3; the code cited and the deviations: docs/schedules.md, "Presets"."""

    name: ClassVar[str] = "fora"

    interval: int = 3
    count: str = "down"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaylorSeer(BlockCache):
    """``taylorseer``: TaylorSeer on DiT as its authors recommend (Shenyi-Z/TaylorSeer at ``288776d``): every block
    runs on steps 0, 1, 5, 9, ..., the others forecast with order 4; the code cited: docs/schedules.md, "Presets"."""

    name: ClassVar[str] = "taylorseer"

    interval: int = 4
    warmup: int = 2
    forecast_order: int = 4


# ---------------------------------------------------------------------- adaptive: the first block decides
@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstBlockCache(CachingSchedule):
    """Adaptive reuse: the first block decides, from how much its residual changed (FirstBlockCache, TeaCache).

    One decision per model call, for the whole batch; ``threshold=0`` runs every block. The rules, the authors' code
    they follow and the deviations: docs/schedules.md, "first_block_cache".

    Args:
        threshold: the largest change at which the later blocks are still skipped (exclusive), ``>= 0``.
        accumulate: TeaCache's accumulated change instead of FirstBlockCache's change from the last full call.
        merge, merge_options, ratio, warmup, forecast_order: see :class:`CachingSchedule`.
    """

    name: ClassVar[str] = "first_block_cache"

    threshold: float = 0.08
    accumulate: bool = False

    def __post_init__(self) -> None:
        check_number(self.threshold, "threshold", self.name, low=0)
        check_bool(self.accumulate, "accumulate", self.name)
        super().__post_init__()

    def decide(self, where: Where) -> Decision:
        """The first block: runs and measures; a later one: a reuse while ``where.change < threshold``, except on
        the last step with ``accumulate`` (TeaCache computes it)."""
        if where.layer == 0:
            measure = "accumulated" if self.accumulate else "since_full"
            return self.computed(where).using(BlockCaching("store", self.forecast_order, measure))
        if where.step < self.warmup or where.change is None or not where.change < self.threshold:
            return self.computed(where)
        if self.accumulate:
            if not where.num_steps:
                raise ValueError(f"{self.name}: accumulate=True runs the last step in full, as TeaCache does, so it "
                                 "needs the step count: on a bare model pass num_steps= to tomerge.apply")
            if where.step == where.num_steps - 1:
                return self.computed(where)
        return self.reused()
