"""Bounded memory: what a handle keeps across calls (``MergeState.kept_bytes``) does not grow with the steps, has
the size its formula says, warns over a budget, and planning refuses tiles whose similarities would not fit.

At real sizes the same is measured on fake CUDA tensors (``tests/fake_cuda``, ``scripts/kept_memory.py``).
"""

from __future__ import annotations

import warnings

import pytest
import torch

import tomerge
from helpers.compiled import build, call, inputs
from tomerge.strategies.facility_location import FacilityLocation

STEPS = 32
METHODS = {
    "toma": {"ratio": 0.5, "num_tiles": 4},
    "toma(group_size=1)": {"ratio": 0.5, "num_tiles": 4, "group_size": 1},
    "toma(destinations_every=4)": {"ratio": 0.5, "num_tiles": 4, "recompute_every": 2, "destinations_every": 4},
    "cached_detail": {"ratio": 0.5},
    "sdtm": {"ratio": 0.5},
    "idm": {"ratio": 0.5},
    "toca": {},
    "fora": {},
    "taylorseer": {},
    "first_block_cache": {"threshold": 1e9},
}


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("native_dit", depth=4)


def kept_per_step(model, method: str, steps: int = STEPS, **extra) -> tuple[list[int], dict]:
    with tomerge.merging(model, method.split("(")[0], num_steps=steps, **METHODS[method], **extra) as handle:
        kept = []
        for s in range(steps):
            call(model, inputs("native_dit", 0.95 - 0.9 * s / steps))
            kept.append(handle.state.kept_bytes())
        return kept, handle.state.kept_bytes(by_kind=True)


@pytest.mark.parametrize("method", list(METHODS))
def test_what_a_handle_keeps_does_not_grow_with_the_steps(model, method):
    kept, _ = kept_per_step(model, method)
    assert max(kept) > 0, kept  # the method keeps something (plans, caches, streaks or attention)
    assert max(kept[STEPS // 2:]) <= max(kept[:STEPS // 2]), kept


def test_toma_keeps_one_plan_per_block_of_its_own_size(model):
    """``toma(group_size=1)`` on 8 x 8 tokens in 4 tiles of 4 x 4 (s = 16), ratio 0.5: d = 8 destinations per tile,
    M = 32 slots, guidance pairs (B = 2). A plan holds W [B, T, d, s] and U [B, T, s, d] in float32, dst [B, M] and
    the tile layout [T, s] as int64: 2 * 2*4*8*16*4 + 2*32*8 + 4*16*8 = 9,216 bytes; one per block (4)."""
    _, by_kind = kept_per_step(model, "toma(group_size=1)")
    assert by_kind == {"plans": 4 * 9_216}


def test_the_block_cache_keeps_one_residual_per_block_and_taylorseer_its_terms_in_float32(model):
    """One [B, N, C] residual per block (B = 2, N = 64, C = 32): FORA keeps it in the model's dtype (float64
    here), TaylorSeer (order 4) keeps 5 terms in float64 too (float32 at least: a half-precision model's terms
    would be float32)."""
    residual = 2 * 64 * 32 * 8
    assert kept_per_step(model, "fora")[1] == {"block_cache": 4 * residual}
    assert kept_per_step(model, "taylorseer")[1] == {"block_cache": 4 * 5 * residual}


def test_caches_over_the_memory_budget_warn_once_with_the_estimate(model):
    with pytest.warns(UserWarning, match=r"taylorseer.*about 0\.00 GiB.*5 Taylor terms.*forecast_order") as seen:
        kept_per_step(model, "taylorseer", steps=4, memory_budget=1e-6)
    assert sum("memory_budget" in str(w.message) for w in seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kept_per_step(model, "taylorseer", steps=4, memory_budget=1.0)


def test_a_global_tile_at_video_size_is_refused_with_its_cost():
    x = torch.zeros(1, 128 * 128, 4)
    with pytest.raises(ValueError, match=r"tiles of 16384 tokens.*1\.00 GiB per sample.*max_tile_tokens"):
        FacilityLocation(num_tiles=1).plan(x, tomerge.MergeContext(grid=(128, 128), ratio=0.5))
    plan = FacilityLocation(num_tiles=1, max_tile_tokens=64).plan(torch.randn(1, 64, 4),
                                                                 tomerge.MergeContext(grid=(8, 8), ratio=0.5))
    assert plan.num_removed == 32
