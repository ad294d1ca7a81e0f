"""bf16: merging and caching add no rounding error beyond the model's own.

Each method's bf16 trajectory on the bundled reference DiT is compared with its float32 trajectory, the bf16 run
planning nothing itself but taking the float32 run's plans (a bf16 token that rounds across a near tie would pick
another destination, and a different merge is not a rounding error); the yardstick is the unmerged model's own
bf16-vs-float32 gap. Slot means and the block cache's Taylor terms accumulate in float32 (``tomerge.plan.ACCUMULATE``);
the unit tests below check that exactly. Measured gaps: docs/compile.md, "bf16".
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from torch import Tensor

import tomerge
import tomerge.plan
from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.sources.reference_model import REFERENCE_CHECKPOINT
from tomerge.experiments.sources.sampling import sample
from tomerge.plan import MergePlan
from tomerge.block_cache import KeptResidual

STEPS = 8
#: Every registered method (and a composition) with options that make it merge or reuse on the reference DiT in
#: STEPS steps; first_block_cache's threshold lies 0.02 or more from every change it measures there (no flip).
METHODS: dict[str, dict[str, Any]] = {
    "tomesd": {"ratio": 0.5, "use_rand": False, "merge_mlp": True},
    "ssm": {"ratio": 0.5},
    "idm": {"ratio": 0.5},
    "facility_location": {"ratio": 0.5, "num_tiles": 16},
    "sdtm": {"ratio": 0.5},
    "sdtm_release": {"ratio": 0.5, "switch_step": 4},
    "sdtm_paper": {"ratio": 0.5},
    "toma": {"ratio": 0.5, "num_tiles": 16, "recompute_every": 2},
    "toma_release": {"ratio": 0.5, "num_tiles": 16, "skip_first": 1},
    "fresh_tokens": {"ratio": 0.5},
    "toca": {"interval": 3},
    "cached_detail": {"ratio": 0.5},
    "block_cache": {},
    "fora": {},
    "taylorseer": {"forecast_order": 2, "interval": 3},
    "first_block_cache": {"threshold": 0.2},
    "fora+ssm": {"merge": "ssm", "ratio": 0.5},
}
#: A method's bf16-vs-float32 RMSE over the unmerged model's: measured 0.73 to 1.49, the highest for the soft plans
#: of facility_location and toma, whose weights round to bf16 (docs/compile.md, "bf16").
YARDSTICK = 2.0


def draw(model: torch.nn.Module, method: str | None, plans: dict | None = None) -> tuple[Tensor, dict, dict]:
    """Four images of STEPS Euler steps (guidance 2) from fixed noise; with ``plans`` the strategies return those
    (keyed by model call and layer) instead of planning; returns the images, the plans made, the handle's stats."""
    noise = torch.randn(4, 1, 32, 32, generator=torch.Generator().manual_seed(0))
    noise = noise.to(next(model.parameters()).dtype)
    if method is None:
        return sample(model, torch.arange(4), num_steps=STEPS, cfg_scale=2.0, noise=noise).float(), {}, {}
    torch.manual_seed(0)
    made: dict = {}
    with tomerge.merging(model, method.split("+")[0], num_steps=STEPS, **METHODS[method]) as handle:
        calls = [0]
        handle._hooks.append(model.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1)))
        strategies = handle.schedule.strategies()
        if plans is None:
            handle.state.observers.append(lambda c, p: made.__setitem__((calls[0], c.where.layer), p.detached_copy()))
        else:
            for s in strategies:  # an instance attribute in front of the class's plan(); removed below
                object.__setattr__(s, "plan", lambda x, ctx, destinations=None: plans[(calls[0], ctx.layer)])
        try:
            images = sample(model, torch.arange(4), num_steps=STEPS, cfg_scale=2.0, noise=noise).float()
        finally:
            for s in strategies:
                s.__dict__.pop("plan", None)
        return images, made, handle.stats


def rmse(a: Tensor, b: Tensor) -> float:
    return float((a - b).pow(2).mean().sqrt())


@pytest.fixture(scope="module")
def models() -> dict[torch.dtype, torch.nn.Module]:
    return {dtype: load_dit(REFERENCE_CHECKPOINT).eval().to(dtype) for dtype in (torch.float32, torch.bfloat16)}


@pytest.fixture(scope="module")
def unmerged_gap(models) -> float:
    gap = rmse(draw(models[torch.float32], None)[0], draw(models[torch.bfloat16], None)[0])
    assert 1e-3 < gap < 3e-2  # bf16 rounds visibly, and stays an image of the same content
    return gap


def test_every_registered_method_is_compared():
    assert {e.name for e in entry_points(group="tomerge.strategies")} <= {name.split("+")[0] for name in METHODS}


@pytest.mark.parametrize("method", list(METHODS))
def test_a_bf16_trajectory_is_as_close_to_float32_as_the_unmerged_model(models, unmerged_gap, method):
    reference, plans, stats = draw(models[torch.float32], method)
    assert stats["merged_calls"] + stats["reused_calls"] > 0, stats
    images, _, _ = draw(models[torch.bfloat16], method, plans=plans)
    gap = rmse(images, reference)
    assert gap <= YARDSTICK * unmerged_gap, f"{method}: {gap:.5f} vs the unmerged model's {unmerged_gap:.5f}"


def test_a_bf16_slot_mean_is_the_float32_mean_rounded_once():
    """Five tokens per slot: the float32 sum scaled by the float32 1/5, rounded to bf16 once (a bf16 sum rounds at
    every addition and 1/5 itself rounds to 0.2002)."""
    x = torch.randn(2, 20, 64).to(torch.bfloat16)
    assign = torch.arange(20).remainder(4).expand(2, -1)  # slot t % 4: five tokens each
    plan = MergePlan.hard(assign, dst=torch.arange(4).expand(2, -1))
    expected = (x.float().view(2, 5, 4, 64).sum(1) * (1 / 5)).to(torch.bfloat16)  # [2, 4, 64]
    assert torch.equal(plan.merge(x), expected)


def forecast_of_bf16_residuals(order: int = 4) -> tuple[Tensor, Tensor]:
    """TaylorSeer's forecast at step 14 from bf16 block outputs stored at steps 0, 3, ..., 12 (a cubic plus noise,
    block input 0): tomerge's, and the same rule in float64 on the same stored values."""
    g = torch.Generator().manual_seed(0)
    noise = torch.randn(5, 1, 64, 8, generator=g)
    steps = [0, 3, 6, 9, 12]
    outputs = [(1 + 0.3 * t - 0.02 * t ** 2 + 1e-3 * t ** 3 + 0.05 * n).to(torch.bfloat16) for t, n in zip(steps, noise)]
    zero = torch.zeros(1, 64, 8, dtype=torch.bfloat16)
    kept = reference = None
    for t, y in zip(steps, outputs):
        r = KeptResidual.residual((zero,), (y,), order)
        kept = KeptResidual(t, [r], order) if kept is None else kept.updated(t, r, order)
        exact = (y.double(),)
        reference = KeptResidual(t, [exact], order) if reference is None else reference.updated(t, exact, order)
    assert len(kept.terms) == order + 1
    return kept.forecast(14)[0], reference.forecast(14)[0]


def test_taylor_terms_of_bf16_residuals_are_float32(monkeypatch):
    """The terms are float32 and their forecast is the float64 rule's to float32 rounding; kept in bf16 (what
    ``ACCUMULATE = bfloat16`` gives, as before), every division and sum rounds to 8 bits and the order-4 forecast
    is off by a percent."""
    forecast, exact = forecast_of_bf16_residuals()
    assert forecast.dtype == torch.float32
    error = float((forecast.double() - exact).abs().max() / exact.abs().max())
    assert error < 1e-5, error
    monkeypatch.setattr(tomerge.plan, "ACCUMULATE", torch.bfloat16)
    rounded, _ = forecast_of_bf16_residuals()
    assert rounded.dtype == torch.bfloat16
    assert float((rounded.double() - exact).abs().max() / exact.abs().max()) > 1e-3


if __name__ == "__main__":  # the table of docs/compile.md, "bf16": python3 tests/core/test_bf16.py
    models32, models16 = (load_dit(REFERENCE_CHECKPOINT).eval().to(d) for d in (torch.float32, torch.bfloat16))
    unmerged = rmse(draw(models32, None)[0], draw(models16, None)[0])
    print("| method | RMSE, same plans | over the unmerged model's | RMSE, own plans |\n|---|---:|---:|---:|")
    print(f"| unmerged | {unmerged:.4f} | 1 | {unmerged:.4f} |")
    for name in METHODS:
        reference, plans, _ = draw(models32, name)
        same = rmse(draw(models16, name, plans=plans)[0], reference)
        own = rmse(draw(models16, name)[0], reference)
        print(f"| `{name}` | {same:.4f} | {same / unmerged:.2f} | {own:.4f} |", flush=True)
