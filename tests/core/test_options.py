"""The option checks of ``tomerge.options``, shared by every strategy and schedule."""

from __future__ import annotations

import doctest
import math

import pytest

from tomerge import options
from tomerge.context import check_ratio
from tomerge.options import (check_bool, check_choice, check_int, check_number, check_ratio_option,
                             check_sublayers)
from tomerge.strategies.facility_location import FacilityLocation
from tomerge.strategies.idm import IDM
from tomerge.strategies.sdtm import SDTM
from tomerge.strategies.ssm import SSM
from tomerge.strategies.toma import ToMA
from tomerge.strategies.tomesd import ToMeSD


# ---------------------------------------------------------------------------------------- check_int
@pytest.mark.parametrize("value", [True, False, 2.0, 2.5, "2", None, [2]])
def test_check_int_rejects_non_ints_bools_included(value):
    with pytest.raises(ValueError, match=r"^ssm: window must be an int >= 0, got "):
        check_int(value, "window", "ssm", low=0)


def test_check_int_bounds_are_inclusive():
    assert check_int(2, "window", "ssm", low=2) == 2
    assert check_int(5, "window", "ssm", low=2, high=5) == 5
    assert check_int(-7, "offset", "x") == -7  # no bound
    with pytest.raises(ValueError, match=r"^ssm: window must be an int >= 2, got 1$"):
        check_int(1, "window", "ssm", low=2)
    with pytest.raises(ValueError, match=r"^ssm: window must be an int in \[2, 5\], got 6$"):
        check_int(6, "window", "ssm", low=2, high=5)
    with pytest.raises(ValueError, match=r"^x: n must be an int <= 3, got 4$"):
        check_int(4, "n", "x", high=3)


def test_check_int_optional_and_note():
    assert check_int(None, "group_size", "toma", low=1, optional=True) is None
    with pytest.raises(ValueError, match=r"^toma: group_size must be an int >= 1 or None, got 0$"):
        check_int(0, "group_size", "toma", low=1, optional=True)
    with pytest.raises(ValueError, match=r"^idm: round_tokens must be an int >= 1 or None \(1 disables rounding\), "
                                         r"got True$"):
        check_int(True, "round_tokens", "idm", low=1, optional=True, note="1 disables rounding")


# ---------------------------------------------------------------------------------------- check_number
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, True, "0.5", None, [0.5]])
def test_check_number_rejects_non_finite_bools_and_non_numbers(value):
    with pytest.raises(ValueError, match=r"^ssm: alpha_s must be a finite number >= 0, got "):
        check_number(value, "alpha_s", "ssm", low=0)


def test_check_number_bounds_are_inclusive_unless_low_open():
    assert check_number(0, "switch", "sdtm", low=0, high=1) == 0.0
    assert check_number(1, "switch", "sdtm", low=0, high=1) == 1.0
    assert isinstance(check_number(1, "switch", "sdtm", low=0, high=1), float)
    assert check_number(-1e300, "bias", "x") == -1e300  # no bound
    with pytest.raises(ValueError, match=r"^sdtm: switch must be a finite number in \[0, 1\], got 1.5$"):
        check_number(1.5, "switch", "sdtm", low=0, high=1)
    with pytest.raises(ValueError, match=r"^sdtm: switch must be a finite number in \[0, 1\], got -0.1$"):
        check_number(-0.1, "switch", "sdtm", low=0, high=1)
    with pytest.raises(ValueError, match=r"^x: w must be a finite number <= 2, got 3$"):
        check_number(3, "w", "x", high=2)
    assert check_number(1e-9, "temperature", "facility_location", low=0, low_open=True) == 1e-9
    with pytest.raises(ValueError, match=r"^facility_location: temperature must be a finite number > 0, got 0.0$"):
        check_number(0.0, "temperature", "facility_location", low=0, low_open=True)
    with pytest.raises(ValueError, match=r"^x: w must be a finite number in \(0, 1\], got 0$"):
        check_number(0, "w", "x", low=0, high=1, low_open=True)


def test_check_number_optional_and_note():
    assert check_number(None, "cache_weight", "sdtm", low=0, high=1, optional=True) is None
    with pytest.raises(ValueError, match=r"^sdtm: cache_weight must be a finite number in \[0, 1\] or None, got nan$"):
        check_number(math.nan, "cache_weight", "sdtm", low=0, high=1, optional=True)
    with pytest.raises(ValueError, match=r"^ssm: alpha_s must be a finite number >= 0 \(0 disables the prior\), "):
        check_number(-1, "alpha_s", "ssm", low=0, note="0 disables the prior")


# ---------------------------------------------------------------------------------------- choices, bools
def test_check_choice():
    choices = ("transpose", "pinv")
    assert check_choice("pinv", "unmerge_matrix", "facility_location", choices) == "pinv"
    for value in ("inverse", None, 1, ["pinv"]):
        with pytest.raises(ValueError, match=r"^facility_location: unmerge_matrix must be one of "
                                             r"\('transpose', 'pinv'\), got "):
            check_choice(value, "unmerge_matrix", "facility_location", choices)
    with pytest.raises(ValueError, match=r"\(paper or release\), got 'x'$"):
        check_choice("x", "variant", "idm", ("a", "b"), note="paper or release")


def test_check_bool_accepts_only_true_and_false():
    assert check_bool(True, "local", "idm") is True and check_bool(False, "local", "idm") is False
    for value in (0, 1, "yes", None, 1.0):
        with pytest.raises(ValueError, match=r"^idm: local must be True or False, got "):
            check_bool(value, "local", "idm")


# ---------------------------------------------------------------------------------------- sublayers
def test_check_sublayers_normalises_to_a_sorted_tuple():
    assert check_sublayers(["mlp", "attn", "mlp"], "sublayers", "toma") == ("attn", "mlp")
    assert check_sublayers({"crossattn"}, "sublayers", "toma") == ("crossattn",)
    assert check_sublayers(("attn", "crossattn", "mlp"), "sublayers", "toma") == ("attn", "crossattn", "mlp")


@pytest.mark.parametrize("value", ["attn", (), ("ff",), ("attn", "x"), 3, None])
def test_check_sublayers_rejects(value):
    with pytest.raises(ValueError, match=r"^sdtm: detail_sublayers must be a non-empty tuple of sublayer names "
                                         r"from \('attn', 'crossattn', 'mlp'\) \(move the switch\), got "):
        check_sublayers(value, "detail_sublayers", "sdtm", note="move the switch")


def test_check_sublayers_leaves_unhashable_entries_to_set():
    with pytest.raises(TypeError):  # as before the move: toma turns it into its kind_sublayers message
        check_sublayers([["attn"]], "sublayers", "toma")


# ---------------------------------------------------------------------------------------- ratio
def test_check_ratio_option_is_check_ratio_with_the_owner():
    assert check_ratio_option(0, "toma") == check_ratio(0) == 0.0
    for value in (1.0, -0.1, math.nan, True, "0.5"):
        with pytest.raises(ValueError) as plain:
            check_ratio(value)
        with pytest.raises(ValueError, match=r"^toma: ratio ") as owned:
            check_ratio_option(value, "toma")
        assert str(owned.value) == f"toma: {plain.value}"


# ---------------------------------------------------------------------------------------- the users
@pytest.mark.parametrize("cls, kwargs, match", [
    (SSM, dict(window=True), "^ssm: window"),
    (IDM, dict(local=1), "^idm: local"),
    (FacilityLocation, dict(num_tiles=0), "^facility_location: num_tiles"),
    (ToMeSD, dict(sx=0), "^tomesd: sx"),
    (ToMeSD, dict(sy=2.0), "^tomesd: sy"),
    (ToMeSD, dict(sx=1, sy=1), "^tomesd: sx and sy"),
    (ToMeSD, dict(rng="global"), "^tomesd: rng"),
    (SDTM, dict(switch=math.nan), "^sdtm: switch"),
    (SDTM, dict(ratio=1.0), "^sdtm: ratio"),
    (ToMA, dict(ratio=1.0), "^toma: ratio"),
    (ToMA, dict(num_tiles=0), "^facility_location: num_tiles"),  # forwarded: the strategy that owns it
])
def test_strategies_and_schedules_name_themselves_and_the_option(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_doctests_of_the_module_pass():
    result = doctest.testmod(options, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_the_module_is_core_only():
    """``tomerge.options`` imports no strategy and no backbone (plugins use it without loading the built-ins)."""
    import subprocess
    import sys
    code = ("import sys, tomerge.options; "
            "print(sorted(m for m in sys.modules if m.startswith(('tomerge.strategies', 'tomerge.backbones'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
