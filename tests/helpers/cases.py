"""One trajectory's calls of every backbone: the declared adapters' rows named after their backbone
(``helpers.families.BACKBONE_ROWS``) and the hand-written adapters' tiny models (``helpers.models``), one sample a
call. tests/backbones/test_every_strategy_on_every_backbone.py runs every merging strategy and schedule on them,
tests/strategies/test_caching.py the caching schedules.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from helpers.families import BACKBONE_ROWS, FAMILIES
from helpers.family import Family
from helpers.models import (flux_inputs, make_inputs, native_dit_inputs, tiny_dit, tiny_flux, tiny_native_dit,
                            tiny_pixart, tiny_sd3, tiny_unet, unet_inputs)

STEPS = 3


def sample(out) -> Tensor:
    """A call's output tensor: ``.sample`` (a list of per-sample outputs, Z-Image's, stacked)."""
    return torch.stack(out.sample) if isinstance(out.sample, list) else out.sample


@dataclasses.dataclass(frozen=True)
class Case:
    """A backbone's tiny model, one call's keyword inputs, the timestep's keyword (``rising``: the model is called
    with its time rising over a run, from the noise to the image: Z-Image's time, Lumina 2's ``1 - t / 1000``,
    Mochi's inverted sigmas), the output tensor of a call, the adapter options the backbone needs here, and its
    blocks per call where a Family row knows them."""

    build: Callable[[], nn.Module]
    inputs: Callable[[nn.Module], dict]
    time_key: str = "timestep"
    output: Callable[[object], Tensor] = sample
    options: dict = dataclasses.field(default_factory=dict)
    rising: bool = False
    blocks: int | None = None


def family_case(family: Family) -> Case:
    return Case(family.build, lambda model: family.inputs(model, batch=1), time_key=family.time_key,
                rising=family.rising, blocks=len(family.kinds))


def _unet_inputs(model: nn.Module) -> dict:
    latent, t, text = unet_inputs(batch=1)
    return dict(sample=latent, timestep=t, encoder_hidden_states=text)


CASES = {
    **{name: family_case(FAMILIES[name]) for name in BACKBONE_ROWS},
    "flux": Case(tiny_flux, lambda model: flux_inputs(batch=1)),
    **{name: Case(build, lambda model, name=name: make_inputs(name, batch=1))
       for name, build in (("sd3", tiny_sd3), ("pixart", tiny_pixart), ("dit", tiny_dit))},
    "unet": Case(tiny_unet, _unet_inputs, options={"adapter": {"max_downsample": 2}}),
    "native_dit": Case(tiny_native_dit, lambda model: native_dit_inputs(), time_key="t", output=lambda out: out),
}


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
