"""The timers of the experiments are in :mod:`tomerge.experiments.timing`; importing this module fails
with an ``ImportError`` that names each name's spelling there."""

raise ImportError(
    "tomerge.experiments.speed is tomerge.experiments.timing: NOISY_SPREAD, Timing, DenoiserProbe and "
    "median_and_spread keep their names, time_alternating(call, merging, denoiser, warmup, repeats) is "
    "time_baseline_and_merged", name=__name__)
