"""The 95% intervals of result rows (measure.intervals) and the Gram-matrix FD they resample: known answers."""

import math

import numpy as np
import pytest

from tomerge.experiments.measure.features import ResampledFrechet, frechet_distance
from tomerge.experiments.measure.intervals import bootstrap_interval, compare, jackknife_interval, mean_interval, \
    quality_intervals, speedup_interval

T_975 = {2: 4.302652729911275, 4: 2.7764451051977987}  # Student's t 0.975 quantiles, degrees of freedom 2 and 4


def _features(n: int, d: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


@pytest.mark.parametrize("n, d", [(12, 40), (30, 8)])  # fewer and more samples than dimensions
def test_resampled_frechet_equals_the_frechet_distance_of_the_resample(n, d):
    x, y, ref = _features(n, d, 0), _features(n, d, 1) * 0.5 + 0.2, _features(3 * n, d, 2)
    paired, fixed = ResampledFrechet(x, y, paired=True), ResampledFrechet(x, ref, paired=False)
    for idx in (np.arange(n), np.random.default_rng(3).integers(0, n, n), np.array([0, 0, 1, 2])):
        assert paired.distance(idx) == pytest.approx(frechet_distance(x[idx], y[idx]), rel=1e-9, abs=1e-9)
        assert fixed.distance(idx) == pytest.approx(frechet_distance(x[idx], ref), rel=1e-9, abs=1e-9)


def test_a_constant_difference_gives_a_zero_width_interval():
    assert mean_interval([2.5] * 7) == (2.5, 2.5)
    c = compare("psnr", np.array([30.0, 28.0, 35.0, 31.0]), np.array([29.5, 27.5, 34.5, 30.5]))
    assert (c.difference, c.lo, c.hi, c.differ) == (0.5, 0.5, 0.5, True)
    # y = x + shift: every resample has equal covariances, so its FD is |shift|^2 = 4 * 0.5^2 = 1
    x = _features(20, 4, 0)
    fd = ResampledFrechet(x + 0.5, x, paired=True)
    lo, hi = bootstrap_interval(fd.distance, 20)
    assert lo == pytest.approx(1.0, abs=1e-9) and hi == pytest.approx(1.0, abs=1e-9)
    # two runs shifted by 0.5 and 0.25 in every dimension: their FD difference is 1 - 0.25 everywhere
    c = compare("fd_effnetlite0", fd_a=fd, fd_b=ResampledFrechet(x + 0.25, x, paired=True))
    assert c.lo == pytest.approx(0.75, abs=1e-9) and c.hi == pytest.approx(0.75, abs=1e-9) and c.differ


def test_the_mean_interval_of_a_large_normal_sample_is_the_normal_one():
    v = np.random.default_rng(0).normal(10.0, 2.0, size=4000)
    half = 1.959963984540054 * v.std(ddof=1) / math.sqrt(v.size)  # z 0.975 * standard error
    lo, hi = mean_interval(v)
    assert lo == pytest.approx(v.mean() - half, abs=0.1 * half) and hi == pytest.approx(v.mean() + half, abs=0.1 * half)


def test_the_jackknife_interval_of_a_mean_is_the_normal_one_exactly():
    """For the mean the jackknife standard error is s / sqrt(n) exactly, so the interval is mean -+ z s / sqrt(n)."""
    v = np.array([3.0, 1.0, 4.0, 1.5, 5.0, 9.0, 2.0, 6.0])
    s, n = math.sqrt(sum((x - v.mean()) ** 2 for x in v) / (len(v) - 1)), len(v)
    half = 1.959963984540054 * s / math.sqrt(n)
    lo, hi = jackknife_interval(lambda idx: float(v[idx].mean()), n)
    assert lo == pytest.approx(v.mean() - half, rel=1e-12) and hi == pytest.approx(v.mean() + half, rel=1e-12)


def test_fd_intervals_do_not_drift_with_repeated_images():
    """Against a fixed reference set, resampling with repeats raises FD systematically (a resample's covariance has
    lower rank): every bootstrap draw lies above the estimate; the jackknife interval of quality_intervals is centred
    on the estimate."""
    x, ref = _features(20, 30, 0), _features(200, 30, 1) + 0.3
    fd = ResampledFrechet(x, ref, paired=False)
    value = fd.distance(np.arange(20))
    draws = [fd.distance(np.random.default_rng(k).integers(0, 20, 20)) for k in range(200)]
    assert min(draws) > value  # what makes a bootstrap of FD unusable
    out = quality_intervals({"psnr": np.full(20, 30.0)}, {"fd_effnetlite0_ref": fd})
    assert out["fd_effnetlite0_ref_lo"] < value < out["fd_effnetlite0_ref_hi"]
    assert out["fd_effnetlite0_ref_hi"] - value == pytest.approx(value - out["fd_effnetlite0_ref_lo"])


def test_an_interval_that_straddles_zero_is_not_a_difference():
    a = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    b = np.array([2.0, 1.0, 4.0, 3.0, 6.0, 5.0])  # differences +-1, mean 0
    c = compare("ssim", a, b)
    assert c.difference == 0.0 and c.lo < 0 < c.hi and not c.differ


def test_the_speedup_interval_is_students_t_on_the_paired_log_ratios():
    base, merged = [2.0, 2.2, 1.8], [1.0, 1.0, 1.0]  # ratios 2.0, 2.2, 1.8 by round
    logs = [math.log(2.0), math.log(2.2), math.log(1.8)]
    m = sum(logs) / 3
    sd = math.sqrt(sum((v - m) ** 2 for v in logs) / 2)
    half = T_975[2] * sd / math.sqrt(3)
    lo, hi = speedup_interval(base, merged)
    assert lo == pytest.approx(math.exp(m - half), rel=1e-9) and hi == pytest.approx(math.exp(m + half), rel=1e-9)
    assert speedup_interval([3.0, 6.0], [1.5, 3.0]) == (2.0, 2.0)  # the same ratio every round
    assert speedup_interval([3.0], [1.5]) is None  # one round: no interval
    with pytest.raises(ValueError, match="rounds"):
        speedup_interval([1.0, 2.0], [1.0])


def test_video_intervals_resample_whole_videos():
    """Three videos of two frames: the per-video values are resampled, and the FD resamples both frames of a
    drawn video together (frames of one video never apart: a frame-level resample differs)."""
    x = _features(6, 3, 0)
    fd = ResampledFrechet(x + 1.0, x, paired=True)  # constant shift: FD 3 whatever is drawn
    groups = [np.array([0, 1]), np.array([2, 3]), np.array([4, 5])]
    out = quality_intervals({"psnr": np.array([30.0, 30.0, 30.0])}, {"fd_effnetlite0": fd}, groups)
    assert out["psnr_lo"] == out["psnr_hi"] == 30.0
    assert out["fd_effnetlite0_lo"] == pytest.approx(3.0) and out["fd_effnetlite0_hi"] == pytest.approx(3.0)
    with pytest.raises(ValueError, match="at least 2"):
        mean_interval([1.0])


def test_two_images_give_no_fd_interval_instead_of_nan():
    """Leaving one of two images out leaves one feature row, whose covariance is undefined: no FD interval (the
    value stands alone) and no FD comparison, where the jackknife gave NaN. Two videos of two frames keep one."""
    x = _features(2, 3, 0)
    fd = ResampledFrechet(x + 1.0, x, paired=True)
    out = quality_intervals({"psnr": np.array([30.0, 31.0])}, {"fd_effnetlite0": fd})
    assert "psnr_lo" in out and "fd_effnetlite0_lo" not in out and "fd_effnetlite0_hi" not in out
    with pytest.raises(ValueError, match="at least 3 items, got 2"):
        compare("fd_effnetlite0", fd_a=fd, fd_b=fd)
    videos = ResampledFrechet(_features(4, 3, 1) + 1.0, _features(4, 3, 1), paired=True)
    out = quality_intervals({"psnr": np.array([30.0, 31.0])}, {"fd_effnetlite0": videos},
                            [np.array([0, 1]), np.array([2, 3])])
    assert out["fd_effnetlite0_lo"] == pytest.approx(3.0) and out["fd_effnetlite0_hi"] == pytest.approx(3.0)
