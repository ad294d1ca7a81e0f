"""Speed of a generation call: wall-clock, denoiser time, peak memory, and their spread (FLOPs:
:mod:`tomerge.experiments.flops`).

The denoiser (the transformer or UNet; the whole model for the reference DiT) is observed with
forward hooks, so the numbers separate what merging can save (the denoiser) from what it cannot
(text encoders, VAE decoding, the sampler). On CUDA every interval is measured with CUDA events and
read after a synchronisation at the end of the call; on CPU with ``time.perf_counter``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn
# torch is imported in the functions (it is loaded whenever they run), so importing this module is cheap.

__all__ = ["NOISY_SPREAD", "Timing", "DenoiserProbe", "median_and_spread", "time_alternating"]

# A timing whose repeats disagree by more than this (max - min over the median) is flagged as noisy.
NOISY_SPREAD = 0.10


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


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

    on_cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    yield
    if on_cuda:
        peak = torch.cuda.max_memory_allocated() / 2**20
        timing.peak_memory_mb = max(timing.peak_memory_mb or 0.0, peak)


def _measure(call: Callable[[], Any], denoiser: nn.Module, timing: Timing, keep: bool) -> None:
    _synchronize()
    with _peak_memory(timing), DenoiserProbe(denoiser) as probe:
        start = time.perf_counter()
        call()
        _synchronize()
        wall = time.perf_counter() - start
    if keep:
        timing.wall.append(wall)
        timing.denoiser.append(probe.seconds())


def time_alternating(call: Callable[[], Any], merging: Callable[[], contextlib.AbstractContextManager],
                     denoiser: nn.Module, warmup: int = 1, repeats: int = 3) -> tuple[Timing, Timing]:
    """Baseline and merged ``call()`` alternating in one process (so drifts hit both alike), ``warmup``
    rounds dropped; returns ``(baseline, merged)`` timings."""
    base, merged = Timing(), Timing()
    for i in range(warmup + repeats):
        _measure(call, denoiser, base, keep=i >= warmup)
        with merging():
            _measure(call, denoiser, merged, keep=i >= warmup)
    return base, merged
