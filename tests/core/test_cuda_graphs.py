"""Safe under CUDA graphs: nothing tomerge keeps across calls aliases a tensor computed inside a block call.

:class:`cuda_graphs.ReplayOverwrite` fills every tensor a block's ``forward`` made with NaN (integers with -1) when
CUDA graphs would reuse its memory: at the next model call, or (stricter) at the next block call but for that
call's inputs. Every method then gives the eager images bit for bit over a multi-step trajectory with guidance
pairs, because the state copies what it keeps in its eager ``end_block`` (docs/compile.md, "CUDA graphs").
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import Any

import pytest
import torch
from torch import Tensor

import tomerge
import tomerge.state
from helpers.cuda_graphs import ReplayOverwrite
from helpers.compiled import build, call, inputs

STEPS = 8
#: Every registered method and a composition of merging inside step caching, with options that make each one
#: merge, reuse or forecast on the tiny DiT (8 x 8 tokens, 4 blocks) within STEPS steps.
METHODS: dict[str, dict[str, Any]] = {
    "tomesd": {"ratio": 0.5},
    "ssm": {"ratio": 0.5, "round_windows": 1},
    "idm": {"ratio": 0.5},
    "facility_location": {"ratio": 0.5, "num_tiles": 4},
    "sdtm": {"ratio": 0.5},
    "sdtm_release": {"ratio": 0.5, "switch_step": 3},
    "sdtm_paper": {"ratio": 0.5},
    "toma": {"ratio": 0.5, "num_tiles": 4, "recompute_every": 3, "destinations_every": 6},
    "toma_release": {"ratio": 0.5, "num_tiles": 4, "skip_first": 1, "merge_every": 2},
    "fresh_tokens": {"ratio": 0.5},
    "toca": {"interval": 3},
    "cached_detail": {"ratio": 0.5},
    "block_cache": {},
    "fora": {"interval": 3},
    "taylorseer": {},
    "first_block_cache": {"threshold": 1e9},
    "fora+tomesd": {"interval": 2, "merge": "tomesd", "ratio": 0.5, "merge_options": {"merge_mlp": True}},
    "cached_detail+slot_offset": {"ratio": 0.5, "detail": "slot_offset", "merge": "ssm",
                                  "merge_options": {"round_windows": 1}},
}


def test_every_registered_method_is_covered():
    assert {e.name for e in entry_points(group="tomerge.strategies")} <= {name.split("+")[0] for name in METHODS}


def run(model: torch.nn.Module, method: str, scope: str | None) -> tuple[list[Tensor], dict, ReplayOverwrite | None]:
    """The outputs of a STEPS-step trajectory with a guidance pair per step, eager or under the emulation."""
    options = dict(METHODS[method])
    torch.manual_seed(0)  # tomesd's generator forks the global RNG at its first draw
    with tomerge.merging(model, method.split("+")[0], num_steps=STEPS, seed=3, **options) as handle:
        emulation = None if scope is None else ReplayOverwrite(scope).attach(handle)
        try:
            outs = [call(model, inputs("native_dit", 0.95 - 0.9 * s / STEPS)) for s in range(STEPS)]
        finally:
            if emulation is not None:
                emulation.remove()
        stats = handle.stats
    return outs, stats, emulation


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return build("native_dit", depth=4)


@pytest.mark.parametrize("scope", ["model", "block"])
@pytest.mark.parametrize("method", list(METHODS))
def test_images_are_bit_identical_when_cuda_graphs_overwrite_what_blocks_computed(model, method, scope):
    eager, stats, _ = run(model, method, None)
    replayed, _, emulation = run(model, method, scope)
    assert stats["merged_calls"] + stats["reused_calls"] > 0, stats  # the method did something
    assert emulation.recorded > 0  # the emulation saw the block calls' tensors
    for step, (a, b) in enumerate(zip(eager, replayed)):
        assert torch.equal(a, b), f"{method}: step {step} differs (max {float((a - b).abs().nan_to_num(1e9).max()):.3g})"


@pytest.mark.parametrize("method", ["toca", "sdtm", "cached_detail"])
def test_the_emulation_catches_a_kept_tensor_that_aliases_a_block_output(model, method, monkeypatch):
    """Without the state's copies (what it kept before) the kept feature caches, streaks and plans are overwritten
    and the images change: the emulation is not vacuous."""
    monkeypatch.setattr(tomerge.state, "_copy", lambda kept: kept)
    eager, _, _ = run(model, method, None)
    replayed, _, _ = run(model, method, "model")
    assert not all(torch.equal(a, b) for a, b in zip(eager, replayed))
