"""experiments/measure/timing.py: spreads, noisy flags, alternating rounds, a row's measured columns; the
spellings of the modules it replaces."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tomerge.experiments.measure.timing import NOISY_SPREAD, MEASURED_COLUMNS, Timing, speed_columns, \
    time_baseline_and_merged, time_setups


def test_timing_spread_and_noisy_flag():
    t = Timing(wall=[1.0, 1.2, 1.1], denoiser=[0.5, 0.6, 0.55])
    assert t.median == 1.1 and t.spread == pytest.approx(0.2 / 1.1) and t.denoiser_median == 0.55
    assert Timing(wall=[2.0]).spread is None
    assert 0.2 / 1.1 > NOISY_SPREAD > 0.05


def test_baseline_and_merged_run_in_turn():
    order = []
    denoiser = torch.nn.Linear(2, 2)

    @contextlib.contextmanager
    def merging():
        order.append("enter")
        yield
        order.append("exit")

    base, merged = time_baseline_and_merged(lambda: order.append("call") or denoiser(torch.ones(1, 2)), merging,
                                            denoiser, warmup=1, repeats=2)
    assert order == ["call", "enter", "call", "exit"] * 3
    assert len(base.wall) == len(merged.wall) == 2 and len(base.denoiser) == 2  # the warm-up round is dropped
    assert all(0 < d <= w for d, w in zip(base.denoiser, base.wall))


def test_setups_alternate_round_after_round_and_the_warmup_rounds_are_dropped():
    order = []

    def setup(name):
        @contextlib.contextmanager
        def entered():
            order.append(name)
            yield

        return entered

    seconds = time_setups({None: setup("base"), "ssm": setup("ssm")}, lambda: None, repeats=3, warmup=2, threads=1)
    assert order == ["base", "ssm"] * 5
    assert set(seconds) == {None, "ssm"} and all(spread is not None for _, spread in seconds.values())


def test_speed_columns_are_the_measured_columns_of_a_row():
    base = Timing(wall=[2.0, 2.4, 2.1], denoiser=[1.0, 1.1, 1.05])
    merged = Timing(wall=[1.0, 1.0, 1.0], denoiser=[0.5, 0.5, 0.5])
    row = speed_columns(base, merged, items=4, repeats=3)
    assert row["speedup"] == pytest.approx(2.1) and row["time_per_image_s"] == 0.25
    assert row["timing_noisy"] and row["timing_spread"] == pytest.approx(0.4 / 2.1)
    assert set(row) - {"timing_repeats"} | {"overhead_ratio"} == MEASURED_COLUMNS
