"""Every registered merging strategy and schedule on every registered backbone (``tomerge.list_strategies()``, the
caching schedules aside: tests/strategies/test_caching.py, x ``helpers.cases.CASES``: the declared adapters' rows
named after their backbone and the hand-written adapters' tiny models).

One sample (batches are the family contract's subject). A schedule runs ``STEPS`` model calls at decreasing
timesteps (``num_steps=STEPS``), so that those that change over the trajectory (``sdtm*``: structure then
detail; ``toma*``: plans reused between steps) go through their phases; a strategy, which decides every call
alike, one. At ratio 0 every call is bit-identical to the unpatched model and runs every block; at ratio 0.5 every
call is finite and of the right shape, tokens are removed, the clock counts the calls as steps, and after
``remove()`` the model is bit-identical again with no hook left. ``idm``, the ``sdtm`` schedules and
``fresh_tokens`` need received attention: every backbone here records it.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.experiments.sources.coverage import caches_blocks
from tomerge.schedule import Schedule
from helpers import no_hooks_left
from helpers.cases import CASES, STEPS, run, trajectory

# Mochi's RoPE runs under torch.autocast(float32), which diffusers calls on the CPU too.
pytestmark = pytest.mark.filterwarnings("ignore:In CPU autocast, but the target dtype is not supported")

#: The merging strategies and schedules; the caching schedules have their own contract (test_caching.py).
STRATEGIES = [name for name in tomerge.list_strategies() if not caches_blocks(name)]
#: Options a strategy needs on the tests' small grids (8 x 8 tokens and less).
STRATEGY_OPTIONS = {"facility_location": {"num_tiles": 4}, "toma": {"num_tiles": 4}, "ssm": {"round_windows": 1},
                    "toma_release": {"num_tiles": 4, "skip_first": 0},  # the release skips 5 blocks of each kind
                    "sdtm_release": {"switch_step": 1}}  # the release's detail phase starts after step 20


def zero_ratio_options(strategy: str) -> dict:
    """A schedule with a ratio curve merges nothing only with its deviation 0 too (the ``sdtm`` presets' ratio is
    the middle of their curve, ``deviation`` (0.2) above it early and below it late)."""
    fields = {f.name for f in dataclasses.fields(tomerge.registry.strategy_class(strategy))}
    return {"deviation": 0.0} if "deviation" in fields else {}


def needs_probe(strategy: str) -> bool:
    """The strategy (or one of the schedule's strategies) ranks tokens by received attention."""
    built = tomerge.get_strategy(strategy)
    parts = built.strategies() if isinstance(built, Schedule) else (built,)
    return any("received_attention" in part.needs for part in parts)


def test_the_strategies_include_those_that_need_received_attention():
    """idm's attention variant and the schedules built on it need received attention (sdtm_release runs idm's
    streak variant), and so does fresh_tokens (ToCa's score): every backbone of CASES records it."""
    assert {s for s in STRATEGIES if needs_probe(s)} == {"idm", "sdtm", "sdtm_paper", "fresh_tokens"}


@pytest.fixture(scope="module")
def unpatched() -> dict[str, tuple[nn.Module, list[dict], list[Tensor]]]:
    """Per backbone, built on first use: the model, a trajectory's inputs and the unpatched outputs."""
    return {}


def _backbone(unpatched: dict, name: str) -> tuple[nn.Module, list[dict], list[Tensor]]:
    if name not in unpatched:
        case = CASES[name]
        model = case.build()
        calls = trajectory(case, model)
        unpatched[name] = (model, calls, run(case, model, calls))
    return unpatched[name]


@pytest.mark.parametrize("name, strategy", [(name, strategy) for name in CASES for strategy in STRATEGIES])
def test_every_strategy_runs_on_every_backbone(unpatched, name, strategy):
    case = CASES[name]
    model, trajectory_calls, trajectory_before = _backbone(unpatched, name)
    schedule = issubclass(tomerge.registry.strategy_class(strategy), tomerge.Schedule)
    steps = STEPS if schedule else 1  # a strategy decides every call alike: one call shows it
    calls, before = trajectory_calls[:steps], trajectory_before[:steps]
    options = {**STRATEGY_OPTIONS.get(strategy, {}), **case.options, "num_steps": STEPS}
    with tomerge.merging(model, strategy, ratio=0.0, **options, **zero_ratio_options(strategy)) as handle:
        unmerged = run(case, model, calls)
        assert case.blocks is None or handle.stats["block_calls"] == steps * case.blocks
    assert all(torch.equal(a, b) for a, b in zip(unmerged, before))
    handle = tomerge.apply(model, strategy, ratio=0.5, **options)
    try:
        merged = run(case, model, calls)
        removed = handle.stats["tokens_removed"]
        labels = {r.label for r in handle.state.records if r.num_removed > 0}
        assert handle.state.clock.step == steps - 1
    finally:
        handle.remove()
    assert all(m.shape == b.shape and torch.isfinite(m).all() for m, b in zip(merged, before))
    assert removed > 0 and not all(torch.equal(m, b) for m, b in zip(merged, before))
    if strategy.startswith("sdtm"):
        assert {"structure", "detail"} <= labels  # both phases merged (the detail phase: idm, received attention)
    assert all(torch.equal(a, b) for a, b in zip(run(case, model, calls), before))  # remove() restored the model
    assert no_hooks_left(model)
