"""The one timer of the experiments: how a call is clocked, how baseline and merged alternate, and the
measured columns of a result row (FLOPs: :mod:`tomerge.experiments.measure.flops`).

Setups (the baseline, a merged model, ...) are entered in turn, round after round (:func:`alternating_rounds`), so
slow drifts of the machine hit every setup alike. The denoiser (the transformer or UNet) is observed with forward
hooks (:class:`DenoiserProbe`; CUDA events on a GPU), so the numbers separate what merging can save from what it
cannot (text encoders, VAE decoding, the sampler). Which command times with what, and the columns of a row:
docs/experiments.md, "Per run it records" and "Layout: which module owns what".
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from torch import nn
# torch is imported in the functions (it is loaded whenever they run), so importing this module is cheap.

__all__ = ["NOISY_SPREAD", "MEASURED_COLUMNS", "Timing", "DenoiserProbe", "median_and_spread", "clock_function",
           "time_once", "median_ms", "alternating_rounds", "time_baseline_and_merged", "time_setups", "speed_columns",
           "overhead_ratio"]

# A timing whose repeats disagree by more than this (max - min over the median) is flagged as noisy.
NOISY_SPREAD = 0.10

#: The columns of a result row that a timing measures (:func:`speed_columns`, and ``overhead_ratio``): they
#: differ between two runs of the same code, every other column of a row does not.
MEASURED_COLUMNS = frozenset({
    "time_base_s", "time_s", "speedup", "speedup_lo", "speedup_hi", "time_rounds_base_s", "time_rounds_s",
    "time_per_image_s", "time_per_image_base_s",
    "denoiser_time_base_s", "denoiser_time_s", "denoiser_speedup",
    "time_spread_base", "time_spread", "timing_spread", "timing_noisy",
    "peak_memory_base_mb", "peak_memory_mb", "overhead_ratio",
})

Setup = TypeVar("Setup", bound=Hashable)


# ------------------------------------------------------------------------------------ clocks
def _cuda_in_use() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _synchronize() -> None:
    import torch

    if _cuda_in_use():
        torch.cuda.synchronize()


def clock_function(clock: str) -> Callable[[], float]:
    """The CPU clock named ``clock``: ``"wall"`` (``time.perf_counter``) or ``"cpu"`` (``time.process_time``)."""
    if clock not in ("wall", "cpu"):
        raise ValueError(f"clock must be 'wall' or 'cpu', got {clock!r}")
    return time.process_time if clock == "cpu" else time.perf_counter


def time_once(fn: Callable[[], object], threads: int, clock: str = "wall") -> float:
    """Seconds of one call of ``fn``, after one untimed warm-up call (CUDA: two).

    CPU: with ``threads`` torch threads, wall-clock time (``time.perf_counter``) or with ``clock="cpu"``
    the process's CPU time (``time.process_time``: robust when other jobs share the cores; meaningful
    with one thread, where it is the work done). One warm-up suffices here: the setups alternate, and
    what a first call after a switch pays (plan caches, allocator growth) is paid by that call.
    CUDA: CUDA events around the call, after a synchronise (the GPU time of everything ``fn`` queues).
    """
    import torch

    if _cuda_in_use():
        fn()
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    now = clock_function(clock)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fn()
        begin = now()
        fn()
        return now() - begin
    finally:
        torch.set_num_threads(previous)


def median_ms(fn: Callable[[], object], min_run_time: float, clock: str = "wall") -> float:
    """Median time of ``fn`` in ms: ``torch.utils.benchmark`` blocks of calls over ``min_run_time`` seconds
    with all of torch's threads (``clock="cpu"``: process CPU time); on CUDA (once a CUDA tensor exists),
    the median of CUDA-event timings over ``min_run_time`` seconds.

    ``blocked_autorange``, not ``adaptive_autorange``: the adaptive loop runs until the spread is small, which on
    a busy machine it never is, and its stop check re-sorts every block so far (a sub-millisecond kernel on a
    loaded machine kept it going for minutes).
    """
    import torch

    if _cuda_in_use():
        return _cuda_events_ms(fn, min_run_time)
    timer = _torch_benchmark().Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads(),
                                     timer=clock_function(clock))
    return timer.blocked_autorange(min_run_time=min_run_time).median * 1e3


def _torch_benchmark():
    """``torch.utils.benchmark``, imported without the warning "No CUDA runtime is found, using
    CUDA_HOME=..." that importing it prints on a CPU machine with a CUDA folder: it imports
    ``torch.utils.cpp_extension`` (for C++ timing statements, never used here), whose import looks for
    CUDA and logs that warning."""
    import logging

    logger = logging.getLogger("torch.utils.cpp_extension")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        from torch.utils import benchmark
    finally:
        logger.setLevel(level)
    return benchmark


def _cuda_events_ms(fn: Callable[[], object], min_run_time: float, inner: int = 10) -> float:
    """Median over blocks of ``inner`` back-to-back calls, each block timed with CUDA events."""
    import torch

    for _ in range(3):
        fn()
    times: list[float] = []
    start_all = time.perf_counter()
    while len(times) < 5 or time.perf_counter() - start_all < min_run_time:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / inner)
    return statistics.median(times)


# ------------------------------------------------------------------------------------ what a call costs
class DenoiserProbe:
    """Forward hooks on the denoiser counting its calls and timing them (context manager).

    Example:
        >>> with DenoiserProbe(pipe.transformer) as probe:             # doctest: +SKIP
        ...     pipe(prompt="a cat")
        >>> probe.calls, probe.seconds()                               # doctest: +SKIP
    """

    def __init__(self, denoiser: nn.Module) -> None:
        self.denoiser = denoiser
        self.calls = 0
        self._cuda = next(denoiser.parameters()).is_cuda
        self._intervals: list[Any] = []
        self._handles: list[Any] = []

    def __enter__(self) -> DenoiserProbe:
        self._handles = [self.denoiser.register_forward_pre_hook(self._start),
                         self.denoiser.register_forward_hook(self._stop)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _mark(self) -> Any:
        if self._cuda:
            import torch

            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _start(self, module: nn.Module, args: tuple) -> None:
        self.calls += 1
        self._intervals.append([self._mark(), None])

    def _stop(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._intervals[-1][1] = self._mark()

    def seconds(self) -> float:
        """Total time inside the denoiser (synchronises CUDA first)."""
        if self._cuda:
            import torch

            torch.cuda.synchronize()
            return sum(a.elapsed_time(b) for a, b in self._intervals) / 1000.0
        return sum(b - a for a, b in self._intervals)


@dataclasses.dataclass
class Timing:
    """Repeated measurements of one configuration (seconds per call)."""

    wall: list[float] = dataclasses.field(default_factory=list)
    denoiser: list[float] = dataclasses.field(default_factory=list)
    peak_memory_mb: float | None = None

    @property
    def median(self) -> float:
        return statistics.median(self.wall)

    @property
    def denoiser_median(self) -> float:
        return statistics.median(self.denoiser)

    @property
    def spread(self) -> float | None:
        """``(max - min) / median`` of the wall-clock repeats (``None`` for a single repeat)."""
        return median_and_spread(self.wall)[1]


def median_and_spread(times: Sequence[float]) -> tuple[float, float | None]:
    """The median of timed repeats and their spread ``(max - min) / median`` (``None`` for a single repeat)."""
    median = statistics.median(times)
    return median, ((max(times) - min(times)) / median if len(times) > 1 else None)


@contextlib.contextmanager
def _peak_memory(timing: Timing) -> Iterator[None]:
    import torch

    on_cuda = _cuda_in_use()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    yield
    if on_cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
        timing.peak_memory_mb = max(timing.peak_memory_mb or 0.0, peak)


def _measure(call: Callable[[], Any], denoiser: nn.Module, timing: Timing, keep: bool) -> None:
    """One ``call()`` into ``timing``: its wall-clock and denoiser seconds when ``keep``; its peak CUDA memory
    always (warm-up rounds included)."""
    _synchronize()
    with _peak_memory(timing), DenoiserProbe(denoiser) as probe:
        start = time.perf_counter()
        call()
        _synchronize()
        wall = time.perf_counter() - start
    if keep:
        timing.wall.append(wall)
        timing.denoiser.append(probe.seconds())


# ------------------------------------------------------------------------------------ alternating rounds
def alternating_rounds(setups: Mapping[Setup, Callable[[], contextlib.AbstractContextManager]],
                       measure: Callable[[Setup, bool], None], warmup: int, repeats: int) -> None:
    """``warmup + repeats`` rounds; in each, every setup's context in turn (in ``setups``' order) with
    ``measure(setup, timed)`` inside, ``timed`` false in the first ``warmup`` rounds."""
    for round_index in range(warmup + repeats):
        for setup, enter in setups.items():
            with enter():
                measure(setup, round_index >= warmup)


def time_baseline_and_merged(call: Callable[[], Any], merging: Callable[[], contextlib.AbstractContextManager],
                             denoiser: nn.Module, warmup: int = 1, repeats: int = 3) -> tuple[Timing, Timing]:
    """Baseline and merged ``call()`` alternating in one process (:func:`alternating_rounds`: the baseline,
    then the call inside ``merging()``), the denoiser's time observed; returns ``(baseline, merged)``."""
    timings = {"baseline": Timing(), "merged": Timing()}
    alternating_rounds({"baseline": contextlib.nullcontext, "merged": merging},
                       lambda setup, timed: _measure(call, denoiser, timings[setup], keep=timed), warmup, repeats)
    return timings["baseline"], timings["merged"]


def time_setups(setups: Mapping[Setup, Callable[[], contextlib.AbstractContextManager]], fn: Callable[[], object],
                repeats: int, warmup: int, threads: int, clock: str = "wall",
                peaks: dict[Setup, float] | None = None) -> dict[Setup, tuple[float, float | None]]:
    """Median seconds of ``fn`` (:func:`time_once`) inside each setup's context, the setups alternating round
    after round (:func:`alternating_rounds`), with the spread of the repeats, ``(max - min) / median``
    (``None`` for one repeat). ``peaks``: on CUDA, filled with each setup's peak memory in MiB
    (``torch.cuda.max_memory_allocated`` over its timed rounds' calls, warm-ups included: weights, inputs,
    activations and what the setup keeps); left empty on CPU."""
    times: dict[Setup, list[float]] = {setup: [] for setup in setups}

    def measure(setup: Setup, timed: bool) -> None:
        if peaks is None or not timed:
            seconds = time_once(fn, threads, clock)
        else:
            timing = Timing(peak_memory_mb=peaks.get(setup))
            with _peak_memory(timing):
                seconds = time_once(fn, threads, clock)
            if timing.peak_memory_mb is not None:
                peaks[setup] = timing.peak_memory_mb
        if timed:
            times[setup].append(seconds)

    alternating_rounds(setups, measure, warmup, repeats)
    return {setup: median_and_spread(seconds) for setup, seconds in times.items()}


# ------------------------------------------------------------------------------------ a row's columns
def speed_columns(base: Timing, merged: Timing, items: int, repeats: int) -> dict[str, Any]:
    """The measured columns of a run's result row from its two timings of a call generating ``items`` items:
    medians, speed-ups with the speed-up's 95% interval over the paired rounds (``speedup_lo`` / ``speedup_hi``,
    :func:`~tomerge.experiments.measure.intervals.speedup_interval`; ``None`` for one round) and the rounds' times,
    per image, denoiser time, spreads (``timing_noisy`` above :data:`NOISY_SPREAD`), peak memory."""
    from .intervals import speedup_interval

    spread = None if base.spread is None else max(base.spread, merged.spread)
    interval = speedup_interval(base.wall, merged.wall)
    return {
        "time_base_s": base.median, "time_s": merged.median, "speedup": base.median / merged.median,
        "speedup_lo": None if interval is None else interval[0], "speedup_hi": None if interval is None else interval[1],
        "time_rounds_base_s": list(base.wall), "time_rounds_s": list(merged.wall),
        "time_per_image_s": merged.median / items, "time_per_image_base_s": base.median / items,
        "denoiser_time_base_s": base.denoiser_median, "denoiser_time_s": merged.denoiser_median,
        "denoiser_speedup": base.denoiser_median / merged.denoiser_median,
        "time_spread_base": base.spread, "time_spread": merged.spread, "timing_spread": spread,
        "timing_noisy": spread is not None and spread > NOISY_SPREAD, "timing_repeats": repeats,
        "peak_memory_base_mb": base.peak_memory_mb, "peak_memory_mb": merged.peak_memory_mb,
    }


def overhead_ratio(speedup: float, flop_speedup: float) -> float:
    """A row's ``overhead_ratio``: the measured speed-up over the FLOP-ideal one (1: merging costs nothing
    beyond its FLOPs; below 1: planning, gathers and scatters take part of what the removed FLOPs save).

    Example:
        >>> overhead_ratio(1.5, 2.0)
        0.75
    """
    return speedup / flop_speedup
