"""scripts/one_call_flops.py: one denoiser call's counted FLOPs under a strategy, planning included."""

from __future__ import annotations

import re
import runpy
import sys

import pytest

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "one_call_flops.py"


def flop_ideal(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *args: str) -> tuple[float, float]:
    """(unmerged GFLOP, FLOP-ideal speed-up) as the script prints them."""
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    runpy.run_path(str(SCRIPT), run_name="__main__")
    out = capsys.readouterr().out
    unmerged = float(re.search(r"unmerged ([\d.]+) GFLOP", out).group(1))
    return unmerged, float(re.search(r"FLOP-ideal ([\d.]+)x", out).group(1))


def test_one_global_tile_pays_for_its_selection(capsys, monkeypatch):
    """Facility location's greedy selection compares every candidate with every token of its tile: one tile of
    all 256 tokens costs 16x the similarities of 16 tiles of 16, so at the same ratio it saves fewer FLOPs."""
    unmerged, tiled = flop_ideal(capsys, monkeypatch, "facility_location", "ratio=0.5", "num_tiles=16")
    same_unmerged, global_ = flop_ideal(capsys, monkeypatch, "facility_location", "ratio=0.5", "num_tiles=1")
    assert unmerged == same_unmerged
    assert tiled > 1.0
    assert global_ < tiled - 0.3


def test_options_are_checked(capsys, monkeypatch):
    with pytest.raises(ValueError, match="ratio"):
        flop_ideal(capsys, monkeypatch, "tomesd", "ratio=1.5")


def test_a_sampling_count_of_a_constant_strategy_is_its_one_call_count(capsys, monkeypatch):
    """``--steps``: every call of a fixed-ratio strategy costs the same, so a 3-step sampling's FLOP-ideal is one
    call's; a schedule whose calls differ (``toca``'s fresh and cached steps) is counted over them; --steps 0 is
    refused."""
    one = flop_ideal(capsys, monkeypatch, "tomesd", "ratio=0.5", "use_rand=false")
    assert flop_ideal(capsys, monkeypatch, "--steps", "3", "tomesd", "ratio=0.5", "use_rand=false")[1] == one[1] > 1
    _, sampled = flop_ideal(capsys, monkeypatch, "--steps", "3", "toca")
    assert 1 < sampled
    with pytest.raises(SystemExit):
        flop_ideal(capsys, monkeypatch, "--steps", "0", "toca")
