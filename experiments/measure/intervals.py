"""The uncertainty of every measured number: 95% intervals of a run's quality metrics and speed-up, and the
paired comparison of two runs of one folder (``tomerge compare``).

A per-image metric gets a bootstrap interval of its mean (:func:`quality_intervals`), a Frechet distance the
jackknife's (:func:`jackknife_interval`: a bootstrap resample repeats images, which moves FD itself), the measured
speed-up Student's t on the paired log ratios of the timing rounds (:func:`speedup_interval`); :func:`compare` does
the same for the difference of two runs over the same seeds. Resampling is seeded, so a row is reproducible. The
row keys are ``<metric>_lo`` / ``<metric>_hi`` (:func:`interval_keys`). The method and why: docs/experiments.md,
"Intervals".
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from .features import ResampledFrechet

__all__ = ["CONFIDENCE", "RESAMPLES", "SEED", "PER_IMAGE", "FD_METRICS", "interval_keys", "row_interval", "video_groups",
           "bootstrap_interval", "jackknife_interval", "fd_resamplable", "mean_interval", "quality_intervals",
           "speedup_interval", "Comparison", "compare"]

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0
#: Metrics with one value per item, each paired with the baseline image of the same seed.
PER_IMAGE = ("psnr", "ssim", "feat_cos_dist", "dino_dist", "clip_score")
#: Set-level metrics with a resampled interval: FD vs the baseline (pairs) and vs the real reference images.
FD_METRICS = ("fd_effnetlite0", "fd_effnetlite0_ref")


def interval_keys(metric: str) -> tuple[str, str]:
    """The row keys of a metric's interval.

    Example:
        >>> interval_keys("psnr")
        ('psnr_lo', 'psnr_hi')
    """
    return f"{metric}_lo", f"{metric}_hi"


def row_interval(row: Mapping[str, Any], key: str) -> tuple[float, float] | None:
    """A result row's 95% interval of ``key`` (``<key>_lo``, ``<key>_hi``), or ``None`` when it has none (one timing
    round, FID, a row written before intervals were recorded): what tables and figures show.

    Example:
        >>> row_interval({"speedup": 2.0, "speedup_lo": 1.8, "speedup_hi": 2.3}, "speedup")
        (1.8, 2.3)
        >>> row_interval({"speedup": 2.0}, "speedup") is None
        True
    """
    lo, hi = (row.get(k) for k in interval_keys(key))
    finite = all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in (lo, hi))
    return (float(lo), float(hi)) if finite else None


def video_groups(videos: int, frames_per_video: int | float | None) -> list[np.ndarray] | None:
    """The feature rows of each video (``[i * T, (i + 1) * T)``: frames in video-major order), what the intervals
    resample whole; ``None`` for images (one row per item).

    Example:
        >>> [g.tolist() for g in video_groups(2, 3)]
        [[0, 1, 2], [3, 4, 5]]
    """
    if not frames_per_video:
        return None
    t = int(frames_per_video)
    return [np.arange(i * t, (i + 1) * t) for i in range(videos)]


def bootstrap_interval(statistic: Callable[[np.ndarray], float], units: int) -> tuple[float, float]:
    """The :data:`CONFIDENCE` BCa bootstrap interval of ``statistic(idx)``, a number computed from the units
    ``idx`` (indices into ``range(units)``, drawn with replacement). Where BCa is undefined (most resamples tie
    with the estimate, e.g. a PSNR of 100 dB on most images) the percentile interval: ``(v, v)`` when every
    resample gives ``v``.

    Example:
        >>> bootstrap_interval(lambda idx: 2.0, 10)
        (2.0, 2.0)
    """
    if units < 2:
        raise ValueError(f"an interval needs at least 2 items, got {units}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # scipy's DegenerateDataWarning for a constant statistic: handled below
        from scipy import stats

        res = stats.bootstrap((np.arange(units),), statistic, vectorized=False,
                              n_resamples=RESAMPLES, confidence_level=CONFIDENCE, method="BCa",
                              random_state=np.random.default_rng(SEED))
    lo, hi = float(res.confidence_interval.low), float(res.confidence_interval.high)
    if math.isfinite(lo) and math.isfinite(hi):
        return lo, hi
    values = res.bootstrap_distribution  # BCa undefined: most resamples tie with the estimate
    tail = (1 - CONFIDENCE) / 2
    return float(np.quantile(values, tail)), float(np.quantile(values, 1 - tail))


def jackknife_interval(statistic: Callable[[np.ndarray], float], units: int) -> tuple[float, float]:
    """The :data:`CONFIDENCE` normal interval ``s +- z * se`` of ``statistic(idx)`` over the units
    ``range(units)``, with ``se`` the jackknife standard error (leave one unit out:
    ``sqrt((n - 1) / n * sum((s_i - mean s_i)^2))``). For set-level metrics (FD), whose bootstrap resamples repeat
    images and so shift the statistic itself (FD's small-sample bias): leaving one out repeats nothing.

    Example:
        >>> lo, hi = jackknife_interval(lambda idx: float(np.mean(np.array([1.0, 2.0, 3.0, 4.0])[idx])), 4)
        >>> round(lo, 4), round(hi, 4)    # the mean's: 2.5 -+ 1.96 * s / sqrt(n), s = 1.291
        (1.2348, 3.7652)
    """
    if units < 2:
        raise ValueError(f"an interval needs at least 2 items, got {units}")
    from scipy import stats

    everything = np.arange(units)
    leave_out = np.array([statistic(np.delete(everything, i)) for i in range(units)])  # [n]
    se = math.sqrt((units - 1) / units * float(((leave_out - leave_out.mean()) ** 2).sum()))
    value, z = statistic(everything), float(stats.norm.ppf(1 - (1 - CONFIDENCE) / 2))
    return value - z * se, value + z * se


def mean_interval(values: Sequence[float] | np.ndarray) -> tuple[float, float]:
    """The interval of the mean of per-item values.

    Example:
        >>> mean_interval([1.5, 1.5, 1.5])
        (1.5, 1.5)
    """
    v = np.asarray(values, dtype=np.float64)
    return bootstrap_interval(lambda idx: float(v[idx].mean()), v.size)


def fd_resamplable(units: int, groups: Sequence[np.ndarray] | None = None) -> bool:
    """Whether FD's leave-one-out interval exists: every subset must keep at least 2 feature rows (2 images
    leave 1, whose covariance is undefined)."""
    rows = [len(g) for g in groups] if groups is not None else [1] * units
    return units >= 2 and sum(rows) - max(rows) >= 2


def _frames(groups: Sequence[np.ndarray] | None, idx: np.ndarray) -> np.ndarray:
    """The feature rows of the units ``idx``: the units themselves, or every frame of each video."""
    return idx if groups is None else np.concatenate([groups[i] for i in idx])


def quality_intervals(per_item: Mapping[str, np.ndarray], fd: Mapping[str, ResampledFrechet],
                      groups: Sequence[np.ndarray] | None = None) -> dict[str, float]:
    """``<metric>_lo`` / ``<metric>_hi`` of a run's quality metrics.

    Args:
        per_item: per-item values (videos: each video's mean over its frames) of the :data:`PER_IMAGE` metrics.
        fd: the run's :class:`~tomerge.experiments.measure.features.ResampledFrechet` per FD metric (no interval
            where :func:`fd_resamplable` is false: the value stands alone, as FID's does).
        groups: videos: the feature rows (frames) of each video; ``None``: one row per item.
    """
    out: dict[str, float] = {}
    for key, values in per_item.items():
        out.update(zip(interval_keys(key), mean_interval(values)))
    units = len(groups) if groups is not None else next(iter(per_item.values())).size
    for key, resampled in fd.items() if fd_resamplable(units, groups) else ():
        out.update(zip(interval_keys(key), jackknife_interval(lambda idx: resampled.distance(_frames(groups, idx)),
                                                              units)))
    return out


def speedup_interval(base: Sequence[float], merged: Sequence[float]) -> tuple[float, float] | None:
    """The interval of the speed-up from paired timing rounds (``base[r] / merged[r]``); ``None`` with fewer than
    two rounds.

    Example:
        >>> speedup_interval([2.0, 4.0], [1.0, 2.0])
        (2.0, 2.0)
        >>> speedup_interval([2.0], [1.0]) is None
        True
    """
    if len(base) != len(merged):
        raise ValueError(f"{len(base)} baseline rounds against {len(merged)} merged rounds")
    if len(base) < 2:
        return None
    logs = np.log(np.asarray(base, dtype=np.float64) / np.asarray(merged, dtype=np.float64))
    if np.ptp(logs) == 0:
        return float(np.exp(logs[0])), float(np.exp(logs[0]))
    from scipy import stats

    ci = stats.ttest_1samp(logs, 0.0).confidence_interval(CONFIDENCE)
    return float(np.exp(ci.low)), float(np.exp(ci.high))


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A metric of run ``a`` minus the same metric of run ``b``, over the same items, with its interval."""

    metric: str
    a: float
    b: float
    lo: float
    hi: float

    @property
    def difference(self) -> float:
        return self.a - self.b

    @property
    def differ(self) -> bool:
        """The interval of the difference excludes 0."""
        return self.lo > 0 or self.hi < 0


def compare(metric: str, per_item_a: np.ndarray | None = None, per_item_b: np.ndarray | None = None,
            fd_a: ResampledFrechet | None = None, fd_b: ResampledFrechet | None = None,
            groups: Sequence[np.ndarray] | None = None) -> Comparison:
    """Run ``a`` against run ``b`` on ``metric``: per-item values (paired by item) or, for an FD metric, the two
    runs' :class:`~tomerge.experiments.measure.features.ResampledFrechet` (each run against the baseline or the
    reference), resampled with the same items.

    Example:
        >>> c = compare("psnr", np.array([30.0, 31.0, 29.0]), np.array([29.0, 30.0, 28.0]))
        >>> c.difference, (c.lo, c.hi), c.differ
        (1.0, (1.0, 1.0), True)
    """
    if per_item_a is not None and per_item_b is not None:
        a, b = np.asarray(per_item_a, dtype=np.float64), np.asarray(per_item_b, dtype=np.float64)
        if a.shape != b.shape:
            raise ValueError(f"{metric}: {a.size} items against {b.size}")
        d = a - b
        lo, hi = mean_interval(d)
        return Comparison(metric, float(a.mean()), float(b.mean()), lo, hi)
    if fd_a is None or fd_b is None:
        raise ValueError(f"{metric}: give both runs' per-item values or both runs' FD resamplers")
    units = len(groups) if groups is not None else fd_a.g_xx.shape[0]
    if not fd_resamplable(units, groups):
        raise ValueError(f"{metric}: FD's leave-one-out interval needs at least 3 items, got {units}")
    everything = np.arange(units)
    lo, hi = jackknife_interval(lambda idx: fd_a.distance(_frames(groups, idx)) - fd_b.distance(_frames(groups, idx)),
                                units)
    return Comparison(metric, fd_a.distance(_frames(groups, everything)), fd_b.distance(_frames(groups, everything)),
                      lo, hi)
