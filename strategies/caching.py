"""Caching schedules: block calls skipped by reusing (or forecasting) their residual from an earlier step,
composed with any merging strategy or schedule on the block calls that run (docs/schedules.md, "Caching").

A caching schedule decides, for every block call, whether the block runs or is skipped. A block call that runs
takes the decision of the inner merging schedule (``merge``: a registered strategy or schedule, or ``None`` to
run the block unmerged) and keeps the block's residual, output minus input per token stream, for its layer and
call index (``Decision.block_cache``: :class:`~tomerge.block_cache.BlockCaching` ``"store"``). A skipped call runs
none of the block's sublayers and returns its input plus the kept residual (``"reuse"``), or, with
``forecast_order=k``, plus the residual's Taylor forecast of order ``k`` from the finite differences of the last
stores (TaylorSeer). The block cache's state does the caching (:class:`tomerge.block_cache.BlockCacheState`, with
the wrapped block ``forward`` of :mod:`tomerge.attach`), so the FLOP counter sees a skipped block cost nothing and
every block that runs cost what it costs.

* ``block_cache`` (:class:`BlockCache`): step-level reuse: every block runs on the first ``warmup`` steps and then
  every ``interval`` steps, counted from the last warmup step (``count="up"``) or from the last step down
  (``count="down"``); the steps in between reuse. Presets: ``fora`` (:class:`FORA`, counted down as FORA's code
  counts), ``taylorseer`` (:class:`TaylorSeer`).
* ``first_block_cache`` (:class:`FirstBlockCache`): adaptive: the first block always runs and measures the
  relative L1 change of its residual (``Where.change``); the other blocks reuse while the change is below
  ``threshold``; in TeaCache's mode (``accumulate``) the last step runs in full.

Each preset's docstring names the authors' file and line it follows.

References:
    * FORA: P. Selvaraju, T. Ding, T. Chen, I. Zharkov, L. Liang, "FORA: Fast-Forward Caching in Diffusion
      Transformer Acceleration", arXiv:2407.01425 (code: https://github.com/prathebaselva/FORA).
    * TaylorSeer: "From Reusing to Forecasting: Accelerating Diffusion Models with TaylorSeers",
      arXiv:2503.06923 (code: https://github.com/Shenyi-Z/TaylorSeer).
    * FirstBlockCache: ParaAttention (https://github.com/chengzeyi/ParaAttention, ``para_attn.first_block_cache``).
    * TeaCache: F. Liu et al., "Timestep Embedding Tells: It's Time to Cache for Video Diffusion Model",
      arXiv:2411.19108 (code: https://github.com/ali-vilab/TeaCache).

Deviations from the authors' code (all documented in docs/schedules.md): the cache holds the block's residual,
so a reused residual carries the gates of the step it was computed at, where FORA and TaylorSeer cache the
attention and MLP outputs and gate them with the current step's gates; TaylorSeer forecasts those sublayer
outputs, here the block residual. FirstBlockCache reuses one residual of all the later blocks together; here
every later block reuses its own, whose sum is that residual. TeaCache measures the first block's modulated input
(rescaled per model) and skips the first block too; here the first block's residual is measured and it always runs.

Example:
    >>> from tomerge.schedule import Where
    >>> s = BlockCache(interval=3)
    >>> [s.decide(Where(step=t, num_steps=8, progress=t / 7, layer=0, num_layers=2)).block_cache.mode for t in range(5)]
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
        return dataclasses.replace(decision, block_cache=BlockCaching("store", self.forecast_order))

    def reused(self) -> Decision:
        """The decision of a skipped block call: its input plus the kept (or forecast) residual."""
        return Decision(strategy=None, label=FORECAST if self.forecast_order else REUSE,
                        block_cache=BlockCaching("reuse", self.forecast_order))

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
    """Step-level reuse of every block's residual, FORA-style (see the module docstring).

    Every block runs on the steps ``t < warmup`` and, with ``count="up"``, on ``t = warmup - 1 + k * interval``;
    with ``count="down"`` on the steps whose index counted from the last step down, ``S - 1 - t``, is a multiple
    of ``interval`` (FORA's rule, so the last step always runs; it needs the step count ``S``). On the others every
    block is skipped and returns its input plus its kept residual (forecast with ``forecast_order``).
    ``interval=1`` runs every block on every step: the model's own output, bit for bit (with ``merge=None``).

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
    """``fora``: FORA's static caching as its code runs it (https://github.com/prathebaselva/FORA at ``acde628``,
    ``src/models.py`` lines 139-143: ``step == numstep - 1 or step % cache_threshold == 0``, with ``step`` counting
    down, ``src/diffusion/gaussian_diffusion.py`` lines 517 and 551): the first step and every step whose countdown
    index is a multiple of 3 (its README's "caching frequency 3"), so the last step too; 20 steps: 0, 1, 4, 7, 10,
    13, 16, 19. Deviations (docs/schedules.md): the residual is cached, not the attention and MLP outputs gated
    anew; the rule runs at the sampler's step count (the README's runs 250 DDPM steps)."""

    name: ClassVar[str] = "fora"

    interval: int = 3
    count: str = "down"


@dataclasses.dataclass(frozen=True, kw_only=True)
class TaylorSeer(BlockCache):
    """``taylorseer``: TaylorSeer on DiT as its authors recommend (https://github.com/Shenyi-Z/TaylorSeer at
    ``288776d``: ``TaylorSeer-DiT.md`` line 25, ``interval=4, max_order=4``, 50 DDIM steps;
    ``TaylorSeer-DiT/cache_functions/cache_init.py`` line 21, ``first_enhance = 2``; ``cal_type.py`` lines 6-17: the
    first 2 steps full, then a full step after every ``interval - 1`` forecast ones): every block runs on steps 0,
    1, 5, 9, ...; the steps in between forecast each residual with its Taylor expansion of order 4 in steps. (Their
    FLUX code uses ``interval=6, max_order=1``, ``first_enhance = 3``.) Deviation (docs/schedules.md): the block's
    residual is forecast, not the attention and MLP outputs gated anew."""

    name: ClassVar[str] = "taylorseer"

    interval: int = 4
    warmup: int = 2
    forecast_order: int = 4


# ---------------------------------------------------------------------- adaptive: the first block decides
@dataclasses.dataclass(frozen=True, kw_only=True)
class FirstBlockCache(CachingSchedule):
    """Adaptive reuse: the first block decides, from how much its residual changed (FirstBlockCache, TeaCache).

    The first hooked block runs on every model call and measures the relative L1 change ``mean|r - ref| /
    mean|ref|`` of its residual ``r`` over the whole call (every sample: one decision for the batch). With
    ``accumulate=False`` (FirstBlockCache's rule) ``ref`` is its residual in the last model call that ran every
    block; with ``accumulate=True`` (TeaCache's rule) the change is the sum of the changes from call to call since
    that one. The later blocks are skipped (input plus kept residual) when the change is below ``threshold`` and
    the step is past ``warmup``; otherwise they run (with ``merge``). ``threshold=0`` runs every block: the
    model's own output, bit for bit (with ``merge=None``).

    The authors' code: ``accumulate=False`` follows ParaAttention (``src/para_attn/first_block_cache/utils.py`` at
    ``4de137c``: lines 270-286, the change from the reference, no step forced; lines 362-375, the reference replaced
    only by a call that runs every block); ``accumulate=True`` follows TeaCache, which also runs the last step in
    full (``TeaCache4FLUX/teacache_flux.py`` lines 109-111 at ``7c10efc``: ``if self.cnt == 0 or self.cnt ==
    self.num_steps-1: should_calc = True``), so it needs the step count. Deviations (docs/schedules.md): every later
    block reuses its own residual, where ParaAttention reuses one of them all; TeaCache measures the first block's
    modulated input, rescaled by a polynomial fitted per model, and skips the first block too.

    The default threshold is ParaAttention's for FLUX.1 (``doc/fastest_flux.md``: ``residual_diff_threshold=0.08``,
    "the default value for FLUX models"; 0.06 for HunyuanVideo). TeaCache's thresholds (FLUX: 0.25, 0.4, 0.6, 0.8)
    apply to its own signal and do not carry over.

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
            return dataclasses.replace(self.computed(where),
                                       block_cache=BlockCaching("store", self.forecast_order, measure))
        if where.step < self.warmup or where.change is None or not where.change < self.threshold:
            return self.computed(where)
        if self.accumulate:
            if not where.num_steps:
                raise ValueError(f"{self.name}: accumulate=True runs the last step in full, as TeaCache does, so it "
                                 "needs the step count: on a bare model pass num_steps= to tomerge.apply")
            if where.step == where.num_steps - 1:
                return self.computed(where)
        return self.reused()
