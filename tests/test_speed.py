"""experiments/speed.py: spreads, noisy flags and alternating timing."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tomerge.experiments.speed import NOISY_SPREAD, Timing, time_alternating


def test_timing_spread_and_noisy_flag():
    t = Timing(wall=[1.0, 1.2, 1.1], denoiser=[0.5, 0.6, 0.55])
    assert t.median == 1.1 and t.spread == pytest.approx(0.2 / 1.1) and t.denoiser_median == 0.55
    assert Timing(wall=[2.0]).spread is None
    assert 0.2 / 1.1 > NOISY_SPREAD > 0.05


def test_time_alternating_runs_baseline_and_merged_in_turn():
    order = []
    denoiser = torch.nn.Linear(2, 2)

    @contextlib.contextmanager
    def merging():
        order.append("enter")
        yield
        order.append("exit")

    base, merged = time_alternating(lambda: order.append("call") or denoiser(torch.ones(1, 2)), merging, denoiser,
                                    warmup=1, repeats=2)
    assert order == ["call", "enter", "call", "exit"] * 3
    assert len(base.wall) == len(merged.wall) == 2 and len(base.denoiser) == 2  # the warm-up round is dropped
    assert all(0 < d <= w for d, w in zip(base.denoiser, base.wall))
