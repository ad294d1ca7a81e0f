"""Every registered merging strategy and schedule on every supported family (``tomerge.list_strategies()``, the
caching schedules aside: tests/test_caching.py, x the tiny random-weight models of the family tests).

One sample (batches are the family tests' subject). A schedule runs ``STEPS`` model calls at decreasing
timesteps (``num_steps=STEPS``), so that those that change over the trajectory (``sdtm*``: structure then
detail; ``toma*``: plans reused between steps) go through their phases; a strategy, which decides every call
alike, one. At ratio 0 every call is bit-identical to the unpatched model; at ratio 0.5 every call is finite and
of the right shape, tokens are removed, and after ``remove()`` the model is bit-identical again. ``idm`` and the
``sdtm`` schedules need received attention: every family here declares a probe.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from models import tiny_unet, unet_inputs
from test_backbone_flux import flux_inputs, tiny_flux
from test_backbones_current import FAMILIES as IMAGE_FAMILIES
from test_backbones_diffusers import make_inputs, tiny_dit, tiny_pixart, tiny_sd3
from test_backbones_image_flux_like import FAMILIES as FLUX_LIKE_FAMILIES
from test_backbones_image_other import FAMILIES as OTHER_IMAGE_FAMILIES
from test_backbones_video import FAMILIES as VIDEO_FAMILIES
from test_backbones_video_more import ADAPTER_FAMILIES as MORE_VIDEO_ADAPTERS, FAMILIES as MORE_VIDEO_FAMILIES

STEPS = 3
#: Options a strategy needs on the tests' small grids (8 x 8 tokens and less).
STRATEGY_OPTIONS = {"facility_location": {"num_tiles": 4}, "toma": {"num_tiles": 4}, "ssm": {"round_windows": 1},
                    "toma_release": {"num_tiles": 4, "skip_first": 0},  # the release skips 5 blocks of each kind
                    "sdtm_release": {"switch_step": 1}}  # the release's detail phase starts after step 20
#: ``ratio`` is the middle of the ``sdtm`` presets' ratio curve, ``deviation`` (0.2) above it early and below it
#: late: a run that removes nothing has ratio 0 and deviation 0.
RATIO_ZERO_OPTIONS = {"sdtm_paper": {"deviation": 0.0}, "sdtm_release": {"deviation": 0.0}}


@dataclasses.dataclass(frozen=True)
class Case:
    """A family: its tiny model, one call's keyword inputs, the timestep's keyword (``rising``: the model is
    called with its time rising over a run, from the noise to the image: Z-Image's time, Lumina 2's
    ``1 - t / 1000``, Mochi's inverted sigmas), the output tensor of a call and the adapter options the family
    needs here."""

    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], dict]
    time_key: str = "timestep"
    output: Callable[[object], Tensor] = lambda out: out.sample
    options: dict = dataclasses.field(default_factory=dict)
    rising: bool = False


def _native_dit() -> nn.Module:
    from tomerge.backbones.timm_dit import DiT, DiTConfig

    model = DiT(DiTConfig(input_size=8, patch_size=1, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=10, learn_sigma=False))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # non-zero weights everywhere (the DiT init zeroes the adaLN and output layers)
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model.eval()


def _native_dit_inputs(model: nn.Module) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(x=torch.randn(1, 1, 8, 8, generator=g), t=torch.full((1,), 0.5), y=torch.tensor([3]))


def _unet_inputs(model: nn.Module) -> dict:
    sample, t, text = unet_inputs(batch=1)
    return dict(sample=sample, timestep=t, encoder_hidden_states=text)


#: Z-Image's call: its model time ``t`` rises to the image, its output is a list of per-sample latents.
Z_IMAGE = dict(time_key="t", rising=True, output=lambda out: torch.stack(out.sample))

CASES = {
    **{name: Case(family.build, lambda model, family=family: family.inputs(model, batch=1))
       for name, family in IMAGE_FAMILIES.items()},
    **{name: Case(family.build, lambda model, family=family: family.inputs(model, batch=1))
       for name, family in VIDEO_FAMILIES.items() if name != "wan_i2v"},  # wan_i2v: the adapter and blocks of wan
    **{name: Case(family.build, lambda model, family=family: family.inputs(model, batch=1),
                  **(Z_IMAGE if name == "z_image" else {}))
       for name, family in FLUX_LIKE_FAMILIES.items()},
    **{name: Case(MORE_VIDEO_FAMILIES[name].build,
                  lambda model, family=MORE_VIDEO_FAMILIES[name]: family.inputs(model, batch=1), rising=name == "mochi")
       for name in MORE_VIDEO_ADAPTERS},  # one configuration per adapter
    "flux": Case(tiny_flux, lambda model: flux_inputs(batch=1)),
    **{name: Case(build, lambda model, name=name: make_inputs(name, batch=1))
       for name, build in (("sd3", tiny_sd3), ("pixart", tiny_pixart), ("dit", tiny_dit))},
    **{name: Case(family.build, lambda model, family=family: family.inputs(model, batch=1))
       for name, family in OTHER_IMAGE_FAMILIES.items() if name not in ("hidream", "lumina2")},
    "hidream": Case(OTHER_IMAGE_FAMILIES["hidream"].build,
                    lambda model: OTHER_IMAGE_FAMILIES["hidream"].inputs(model, batch=1), time_key="timesteps"),
    "lumina2": Case(OTHER_IMAGE_FAMILIES["lumina2"].build,
                    lambda model: OTHER_IMAGE_FAMILIES["lumina2"].inputs(model, batch=1), rising=True),
    "unet": Case(tiny_unet, _unet_inputs, options={"adapter": {"max_downsample": 2}}),
    "native_dit": Case(_native_dit, _native_dit_inputs, time_key="t", output=lambda out: out),
}


@pytest.fixture(scope="module")
def unpatched() -> dict[str, tuple[nn.Module, list[dict], list[Tensor]]]:
    """Per family, built on first use: the model, a trajectory's inputs and the unpatched outputs."""
    return {}


def _family(unpatched: dict, name: str) -> tuple[nn.Module, list[dict], list[Tensor]]:
    if name not in unpatched:
        case = CASES[name]
        model = case.build()
        calls = trajectory(case, model)
        unpatched[name] = (model, calls, run(case, model, calls))
    return unpatched[name]


def trajectory(case: Case, model: nn.Module) -> list[dict]:
    """``STEPS`` calls' inputs, the timestep falling from the tests' value to a quarter of it (integer
    timesteps stay integers; ``case.rising``: the same values rising)."""
    inputs = case.inputs(model)
    t = inputs[case.time_key]
    scaled = [t * (STEPS - s) // STEPS if not t.is_floating_point() else t * (STEPS - s) / STEPS
              for s in range(STEPS)]
    return [{**inputs, case.time_key: ts} for ts in (scaled[::-1] if case.rising else scaled)]


def run(case: Case, model: nn.Module, calls: list[dict]) -> list[Tensor]:
    with torch.no_grad():
        return [case.output(model(**inputs)) for inputs in calls]


from tomerge.experiments.sources.coverage import caches_blocks  # noqa: E402  (caching schedules: tests/test_caching.py)


@pytest.mark.parametrize("name, strategy", [(name, strategy) for name in CASES for strategy in tomerge.list_strategies()
                                            if not caches_blocks(strategy)])
def test_every_strategy_runs_on_every_family(unpatched, name, strategy):
    case = CASES[name]
    model, trajectory_calls, trajectory_before = _family(unpatched, name)
    schedule = issubclass(tomerge.registry.strategy_class(strategy), tomerge.Schedule)
    steps = STEPS if schedule else 1  # a strategy decides every call alike: one call shows it
    calls, before = trajectory_calls[:steps], trajectory_before[:steps]
    options = {**STRATEGY_OPTIONS.get(strategy, {}), **case.options, "num_steps": STEPS}
    with tomerge.merging(model, strategy, ratio=0.0, **options, **RATIO_ZERO_OPTIONS.get(strategy, {})):
        unmerged = run(case, model, calls)
    assert all(torch.equal(a, b) for a, b in zip(unmerged, before))
    handle = tomerge.apply(model, strategy, ratio=0.5, **options)
    try:
        merged = run(case, model, calls)
        removed = handle.stats["tokens_removed"]
        labels = {r.label for r in handle.state.records if r.num_removed > 0}
    finally:
        handle.remove()
    assert all(m.shape == b.shape and torch.isfinite(m).all() for m, b in zip(merged, before))
    assert removed > 0 and not all(torch.equal(m, b) for m, b in zip(merged, before))
    if strategy.startswith("sdtm"):
        assert {"structure", "detail"} <= labels  # both phases merged (the detail phase: idm, received attention)
    assert torch.equal(run(case, model, calls[:1])[0], before[0])  # remove() restored the model
