"""experiments/speed.py: denoiser FLOPs summed over every call, call counts, spreads and noisy flags."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tomerge.experiments.speed import NOISY_SPREAD, Timing, count_denoiser_flops, time_alternating


def test_flops_of_every_denoiser_call_are_summed_and_nothing_outside_is_counted():
    denoiser = torch.nn.Linear(8, 4, bias=False)
    outside = torch.nn.Linear(8, 16, bias=False)

    def call():
        for rows in (1, 3, 5):  # three denoiser calls of different sizes
            denoiser(outside(torch.randn(rows, 8))[:, :8])

    flops, calls = count_denoiser_flops(denoiser, call)
    assert calls == 3
    assert flops == sum(2 * rows * 8 * 4 for rows in (1, 3, 5))  # 2 M K N per matmul, `outside` excluded
    assert not denoiser._forward_hooks and not denoiser._forward_pre_hooks  # hooks removed


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
