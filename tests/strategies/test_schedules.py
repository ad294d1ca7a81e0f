"""The composite schedules ``sdtm`` and ``toma``: pure ``decide()`` rules over a synthetic trajectory,
then the recorded decisions and plan reuse on the tiny UNet."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import tomerge
from tomerge.schedule import Where
from tomerge.strategies.facility_location import FacilityLocation
from tomerge.strategies.idm import IDM
from tomerge.strategies.sdtm import SDTM
from tomerge.strategies.ssm import SSM
from tomerge.strategies.toma import ToMA
from tomerge.streaks import StreakState
from helpers.models import tiny_unet, unet_inputs

STEPS, LAYERS = 50, 8
# Protected and skipped steps merge nothing on purpose: that must not warn.
QUIET = pytest.mark.filterwarnings("error:tomerge. no block of this")


def where(step: int, layer: int, num_steps: int = STEPS, num_layers: int = LAYERS, kind: str = "joint") -> Where:
    return Where(step=step, num_steps=num_steps, progress=step / (num_steps - 1), layer=layer,
                 num_layers=num_layers, block_kind=kind)


def trajectory(num_steps: int = STEPS, num_layers: int = LAYERS):
    return [where(s, l, num_steps, num_layers) for s in range(num_steps) for l in range(num_layers)]


# ====================================================================== sdtm: decide()
@pytest.mark.parametrize("switch, first_detail", [(0.4, 20), (0.7, 35), (0.0, 1), (1.0, None)])
def test_sdtm_switches_from_ssm_to_idm_at_the_configured_progress(switch, first_detail):
    s = SDTM(ratio=0.3, deviation=0.2, switch=switch)
    detail_steps = set()
    for w in trajectory():
        d = s.decide(w)
        if w.progress <= switch:
            assert (d.label, d.strategy, d.sublayers) == ("structure", s.ssm, frozenset({"attn", "mlp"}))
            assert isinstance(d.strategy, SSM)
        else:
            assert (d.label, d.strategy, d.sublayers) == ("detail", s.idm, frozenset({"mlp"}))
            assert isinstance(d.strategy, IDM)
            detail_steps.add(w.step)
        assert d.cache_key is None and d.merges
    assert min(detail_steps, default=None) == first_detail
    assert s.strategies() == (s.ssm, s.idm)


def test_sdtm_switch_step_is_the_authors_inclusive_absolute_rule_and_overrides_switch():
    s = SDTM(switch=0.9, switch_step=20)
    labels = {w.step: s.decide(w).label for w in trajectory()}
    assert [t for t in range(STEPS) if labels[t] == "structure"] == list(range(21))  # step <= 20
    assert labels[21] == "detail"


@pytest.mark.parametrize("curve", ["cosine", "linear"])
def test_sdtm_ratio_follows_the_curve(curve):
    ratio, dev = 0.3, 0.2
    s = SDTM(ratio=ratio, deviation=dev, curve=curve)
    for w in trajectory():
        p = w.step / (STEPS - 1)
        expected = (ratio - dev) + 2 * dev * math.cos(p * math.pi / 2) if curve == "cosine" else (ratio + dev) - 2 * dev * p
        assert s.decide(w).ratio == pytest.approx(expected, abs=1e-12)
    first, last = s.decide(where(0, 3)).ratio, s.decide(where(STEPS - 1, 3)).ratio
    assert first == pytest.approx(0.5) and last == pytest.approx(0.1)
    middle = s.decide(Where(step=5, num_steps=11, progress=0.5, layer=0, num_layers=1)).ratio
    assert middle == pytest.approx(0.1 + 0.4 * math.cos(math.pi / 4) if curve == "cosine" else 0.3)


def test_sdtm_constant_curve_and_plain_sdtm_keep_the_ratio():
    for s in (SDTM(ratio=0.4, curve="constant"), SDTM(ratio=0.4)):
        assert {s.decide(w).ratio for w in trajectory()} == {0.4}


def test_sdtm_ratio_is_clamped():
    s = SDTM(ratio=0.5, deviation=0.495)  # peak 0.995 is valid input, scheduled at most 0.99
    assert s.decide(where(0, 0)).ratio == 0.99
    assert SDTM(ratio=0.2, deviation=0.2, curve="linear").ratio_at(1.5) == 0.0  # never negative


@pytest.mark.parametrize("curve", ["cosine", "linear"])
def test_sdtm_accepts_a_curve_below_zero_and_clips_the_ratio_at_zero(curve):
    # The SDTM paper's ratio=0.3, deviation=0.4 run: the curve ends at -0.1. The authors' code computes the
    # negative ratio and returns unmerged when int(N * r) <= 0 (TR_SDTM.py compute_ratio, compute_merge), so
    # those steps merge nothing: the ratio is clipped at 0.
    ratio, dev = 0.3, 0.4
    s = SDTM(ratio=ratio, deviation=dev, curve=curve)
    negative = []
    for t in range(STEPS):
        p = t / (STEPS - 1)
        raw = (ratio - dev) + 2 * dev * math.cos(p * math.pi / 2) if curve == "cosine" else (ratio + dev) - 2 * dev * p
        assert s.ratio_at(p) == pytest.approx(max(raw, 0.0), abs=1e-12)
        if raw < 0:
            negative.append(t)
            assert s.ratio_at(p) == 0.0 and int(4096 * raw) <= 0  # the authors' reduce_num <= 0: no merge
    # Cosine: -0.1 + 0.8 cos(pi p / 2) < 0 where cos(pi p / 2) < 1/8, p > 0.9202: steps 46..49 of 50.
    # Linear: 0.7 - 0.8 p < 0 where p > 0.875: steps 43..49 (42/49 = 0.857 gives 0.014).
    assert negative == (list(range(46, 50)) if curve == "cosine" else list(range(43, 50)))
    assert s.ratio_at(0.0) == pytest.approx(0.7)
    for w in trajectory():
        d = s.decide(w)
        assert d.label in ("structure", "detail") and (d.ratio == 0.0) == (w.step in negative)


def test_sdtm_protected_steps_and_layers_run_unmerged():
    s = SDTM(ratio=0.3, deviation=0.2, protect_every=3, protect_layers=[5, 0])
    assert s.protect_layers == (0, 5)
    for w in trajectory():
        d = s.decide(w)
        if w.step % 3 == 0 or w.layer in (0, 5):
            assert d.label == "protected" and d.strategy is None and not d.merges and d.ratio == 0.0
        else:
            assert d.label in ("structure", "detail") and d.merges and d.ratio > 0
    every = SDTM(protect_layers_every=3)  # authors' rule: layer % 3 == 0 and the last layer
    protected = {w.layer for w in trajectory() if every.decide(w).label == "protected"}
    assert protected == {0, 3, 6, 7}
    with pytest.raises(ValueError, match="protect_layers"):
        SDTM(protect_layers=(8,)).decide(where(0, 0))


def test_sdtm_forwards_strategy_options_and_builds_them_once():
    s = SDTM(window=3, alpha_s=0.1, round_windows=1, alpha_d=0.2, idm_variant="streak", idm_local=True,
             structure_sublayers=["mlp", "attn", "crossattn"], detail_sublayers=("crossattn", "mlp"))
    assert (s.ssm.window, s.ssm.alpha_s, s.ssm.round_windows) == (3, 0.1, 1)
    assert (s.idm.window, s.idm.alpha_d, s.idm.variant, s.idm.local) == (3, 0.2, "streak", True)
    assert s.idm.round_tokens == 16 and SDTM().idm.round_tokens == 1  # the variants' defaults
    assert SDTM(idm_variant="streak", idm_round_tokens=1).idm.round_tokens == 1
    assert SDTM().idm.plan_input == "block_input" and SDTM(idm_plan_from="sublayer").idm.plan_input == "sublayer"
    assert s.idm.needs == frozenset() and SDTM().idm.needs == {"received_attention"}
    assert s.decide(where(0, 0)).sublayers == {"attn", "crossattn", "mlp"}
    assert s.decide(where(49, 0)).sublayers == {"crossattn", "mlp"}
    assert all(s.decide(w).strategy in (s.ssm, s.idm) for w in trajectory())  # the same two objects


@pytest.mark.parametrize("options, match", [
    (dict(ratio=1.0), "ratio"),
    (dict(ratio=0.8, deviation=0.2), r"ratio \+ deviation .* must be < 1"),
    (dict(ratio=0.5, deviation=0.6), r"ratio \+ deviation .* must be < 1"),
    (dict(deviation=-0.1), "deviation"),
    (dict(switch=1.5), "switch"),
    (dict(switch_step=-1), "switch_step"),
    (dict(switch_step=True), "switch_step"),
    (dict(curve="cos"), "curve"),
    (dict(curve="constant", deviation=0.1), "deviation=0"),
    (dict(protect_every=0), "protect_every"),
    (dict(protect_layers=(1, -2)), "protect_layers"),
    (dict(protect_layers=3), "protect_layers"),
    (dict(protect_layers_every=0), "protect_layers_every"),
    (dict(structure_sublayers=()), "structure_sublayers"),
    (dict(detail_sublayers=("ff",)), "detail_sublayers"),
    (dict(window=1), "ssm: window"),
    (dict(idm_variant="maps"), "idm: variant"),
    (dict(alpha_d=-1.0), "idm: alpha_d"),
    (dict(idm_round_tokens=0), "idm: round_tokens"),
    (dict(idm_plan_from="norm1"), "idm: plan_from"),
])
def test_sdtm_rejects_invalid_options(options, match):
    with pytest.raises(ValueError, match=match):
        SDTM(**options)


def test_sdtm_config_is_flat_and_replaceable():
    s = tomerge.get_strategy("sdtm", ratio=0.3, deviation=0.2, switch_step=20)
    config = s.to_dict()
    assert config["schedule"] == "sdtm" and config["deviation"] == 0.2 and config["switch_step"] == 20
    assert not any(k.startswith("_") for k in config)
    r = dataclasses.replace(s, window=4)
    assert r.ssm.window == 4 and r.idm.window == 4 and s.ssm.window == 2
    with pytest.raises(TypeError, match="valid options"):
        tomerge.get_strategy("sdtm", devation=0.2)


# ====================================================================== toma: decide()
@dataclasses.dataclass(frozen=True)
class KindWhere(Where):
    """A Where with the per-kind block position the core may provide (``kind_index``)."""

    kind_index: int | None = None


def flux_like(num_steps: int = STEPS, double: int = 4, single: int = 6) -> list[KindWhere]:
    out = []
    for s in range(num_steps):
        for layer in range(double + single):
            kind, index = ("joint", layer) if layer < double else ("single", layer - double)
            out.append(KindWhere(step=s, num_steps=num_steps, progress=s / (num_steps - 1), layer=layer,
                                 num_layers=double + single, block_kind=kind, kind_index=index))
    return out


def test_toma_skips_the_first_blocks_of_each_kind():
    s = ToMA(skip_first=2)
    skipped = {(w.block_kind, w.layer) for w in flux_like() if s.decide(w).label == "skip_block"}
    assert skipped == {("joint", 0), ("joint", 1), ("single", 4), ("single", 5)}
    plain = {w.layer for w in trajectory() if s.decide(w).label == "skip_block"}  # no kind_index: layer
    assert plain == {0, 1}
    for w in trajectory():
        d = s.decide(w)
        assert d.merges == (w.layer >= 2) and (d.strategy is s.facility or d.strategy is None)


def test_toma_merges_only_every_m_steps():
    s = ToMA(merge_every=3)
    for w in trajectory():
        d = s.decide(w)
        if w.step % 3 == 0:
            assert d.label == "merge" and d.strategy is s.facility and d.ratio == 0.5
            assert d.sublayers == {"attn", "mlp"}
        else:
            assert d.label == "skip_step" and d.strategy is None and not d.merges


def test_toma_cache_keys_change_exactly_every_d_steps():
    s = ToMA(recompute_every=4, group_size=1)
    for layer in range(LAYERS):
        keys = [s.decide(where(t, layer)).cache_key for t in range(STEPS)]
        changes = [t for t in range(1, STEPS) if keys[t] != keys[t - 1]]
        assert changes == list(range(4, STEPS, 4))
    assert len({s.decide(w).cache_key for w in trajectory()}) == LAYERS * math.ceil(STEPS / 4)


def test_toma_shares_keys_within_groups_of_consecutive_blocks_of_one_kind():
    s = ToMA(skip_first=1, group_size=2, recompute_every=5)
    for w in flux_like(num_steps=10):
        d = s.decide(w)
        if w.kind_index < 1:
            assert d.cache_key is None
            continue
        assert d.cache_key == (("toma", w.block_kind, (w.kind_index - 1) // 2), w.step // 5)
    step0 = {w.layer: s.decide(w).cache_key for w in flux_like(num_steps=10) if w.step == 0}
    assert step0[0] is None and step0[4] is None  # kind_index 0 of each kind is skipped
    assert step0[1] == step0[2] != step0[3]  # joint blocks 1..3: groups (1, 2), (3)
    assert step0[5] == step0[6] != step0[7] == step0[8] != step0[9]  # single blocks 5..9 (indices 1..5)
    assert step0[1] != step0[5]  # group 0 of each kind: groups never span kinds


@pytest.mark.parametrize("options, match", [
    (dict(ratio=1.0), "ratio"), (dict(skip_first=-1), "skip_first"), (dict(merge_every=0), "merge_every"),
    (dict(recompute_every=0), "recompute_every"), (dict(group_size=0), "group_size"),
    (dict(sublayers=("attn", "x")), "sublayers"), (dict(locality="rows"), "locality"),
    (dict(num_tiles=0), "num_tiles"), (dict(unmerge_matrix="inverse"), "unmerge_matrix"),
])
def test_toma_rejects_invalid_options(options, match):
    with pytest.raises(ValueError, match=match):
        ToMA(**options)


def test_toma_forwards_facility_options_and_config():
    s = tomerge.get_strategy("toma", num_tiles=256, temperature=0.01, shared_destinations=True, skip_first=5)
    assert (s.facility.num_tiles, s.facility.temperature, s.facility.shared_destinations) == (256, 0.01, True)
    assert s.strategies() == (s.facility,)
    config = s.to_dict()
    assert config["schedule"] == "toma" and config["skip_first"] == 5 and config["num_tiles"] == 256
    assert not any(k.startswith("_") for k in config)


# ====================================================================== on the tiny UNet
TIMESTEPS = [900 - 100 * i for i in range(10)]  # 10 calls, one per step, decreasing timesteps


@pytest.fixture(scope="module")
def unet():
    return tiny_unet()


@pytest.fixture(scope="module")
def baseline(unet):
    return run(unet)


def run(unet) -> list[torch.Tensor]:
    sample, _, text = unet_inputs()
    with torch.no_grad():
        return [unet(sample, torch.tensor(t), text).sample for t in TIMESTEPS]


def ssm_removed(num_tokens: int, ratio: float, round_windows: int = 16) -> int:
    """SSM's count from the spec: floor(r / 3) 2x2 windows, rounded down to 16 unless that gives 0."""
    n_win = int(num_tokens * ratio) // 3
    rounded = n_win - n_win % round_windows
    return 3 * (rounded if rounded > 0 else n_win)


def test_sdtm_on_the_unet_records_the_scheduled_decisions(unet, baseline):
    handle = tomerge.apply(unet, "sdtm", ratio=0.3, deviation=0.2, num_steps=10, adapter={"max_downsample": 2})
    try:
        merged = run(unet)
        records = handle.state.records
        num_layers = handle.state.num_layers
        assert len(records) == 10 * num_layers and {r.step for r in records} == set(range(10))
        for r in records:
            p = r.step / 9
            expected = handle.schedule.decide(Where(r.step, 10, p, r.layer, num_layers, r.block_kind))
            ratio = 0.1 + 0.4 * math.cos(p * math.pi / 2)
            assert (r.label, r.ratio) == (expected.label, expected.ratio) and r.ratio == pytest.approx(ratio)
            assert r.num_tokens in (64, 256)
            if p <= 0.4:  # steps 0..3: SSM on attention and MLP
                assert r.label == "structure" and r.sublayers == ("attn", "mlp")
                assert r.num_removed == ssm_removed(r.num_tokens, r.ratio)
            else:  # steps 4..9: IDM on the MLP, r = int(N * ratio) sources merged
                assert r.label == "detail" and r.sublayers == ("mlp",)
                assert r.num_removed == int(r.num_tokens * r.ratio)
        assert [r.label for r in records if r.layer == 0] == ["structure"] * 4 + ["detail"] * 6
        assert any(not torch.equal(a, b) for a, b in zip(merged, baseline))
    finally:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(run(unet), baseline))  # remove(): bit-identical


def test_sdtm_streak_variant_on_the_unet_removes_the_releases_multiple_of_16(unet):
    # The release's detail phase removes min(3N/4, r) // 16 * 16 tokens (TR_SDTM.py, FIDM lines 376-378).
    with tomerge.merging(unet, "sdtm", ratio=0.3, deviation=0.2, idm_variant="streak", num_steps=10,
                         adapter={"max_downsample": 2}) as handle:
        run(unet)
        detail = [r for r in handle.state.records if r.label == "detail"]
        assert detail and {r.num_tokens for r in detail} == {64, 256}
        for r in detail:
            full = int(r.num_tokens * r.ratio)
            rounded = min(3 * r.num_tokens // 4, full) // 16 * 16
            assert r.num_removed == (rounded if rounded > 0 else full)
        assert any(r.num_removed != int(r.num_tokens * r.ratio) for r in detail)


@QUIET
def test_sdtm_on_the_unet_protects_steps_and_layers(unet):
    with tomerge.merging(unet, "sdtm", ratio=0.3, protect_every=3, protect_layers=(1,), num_steps=10,
                         adapter={"max_downsample": 2}) as handle:
        run(unet)
        for r in handle.state.records:
            if r.step % 3 == 0 or r.layer == 1:
                assert (r.label, r.num_removed, r.sublayers) == ("protected", 0, ())
            else:
                assert r.label in ("structure", "detail") and r.num_removed > 0


def test_sdtm_with_ratio_zero_is_bit_identical(unet, baseline):
    with tomerge.merging(unet, "sdtm", ratio=0.0, num_steps=10, adapter={"max_downsample": 2}) as handle:
        assert all(torch.equal(a, b) for a, b in zip(run(unet), baseline))
        assert handle.stats["tokens_removed"] == 0 and {r.label for r in handle.state.records} == {"structure", "detail"}


@QUIET
def test_sdtm_below_zero_merges_nothing_on_the_clipped_steps_and_leaves_the_streaks(unet):
    # ratio=0.3, deviation=0.4, linear, 10 steps: r_t = 0.7 - 0.8 t / 9, negative at t = 8 (-0.011) and
    # t = 9 (-0.1); t = 7 gives 0.078 (int(64 * 0.078) = 4 > 0 tokens: it merges).
    sample, _, text = unet_inputs()
    with tomerge.merging(unet, "sdtm", ratio=0.3, deviation=0.4, curve="linear", switch=0.4, num_steps=10,
                         adapter={"max_downsample": 2}) as handle, torch.no_grad():
        for step, t in enumerate(TIMESTEPS):
            unet(sample, torch.tensor(t), text)
            if step == 7:
                after_7 = {k: v.clone() for k, v in handle.state.technique(StreakState).streaks.items()}
        assert after_7 and all(after_7[k].max() > 0 for k in after_7)
        assert after_7.keys() == handle.state.technique(StreakState).streaks.keys()
        assert all(torch.equal(after_7[k], v)
                   for k, v in handle.state.technique(StreakState).streaks.items())  # 8, 9 count nothing
        records = handle.state.records
        for r in records:
            expected = max(0.7 - 0.8 * r.step / 9, 0.0)
            assert r.ratio == pytest.approx(expected, abs=1e-12)
            if r.step >= 8:
                assert (r.label, r.ratio, r.num_removed) == ("detail", 0.0, 0)
            else:
                assert r.num_removed > 0
        assert {r.step for r in records if r.num_removed == 0} == {8, 9}


@pytest.fixture
def plan_calls(monkeypatch):
    calls: list[tuple[int, int]] = []  # (step, layer) of every computed facility-location plan
    original = FacilityLocation.plan

    def counting(self, x, ctx):
        calls.append((ctx.step, ctx.layer))
        return original(self, x, ctx)

    monkeypatch.setattr(FacilityLocation, "plan", counting)
    return calls


@QUIET
@pytest.mark.parametrize("group_size, merge_every, recompute_every", [(1, 1, 1), (2, 2, 5), (1, 3, 3), (2, 2, 4)])
def test_toma_on_the_unet_reuses_plans_as_configured(unet, plan_calls, group_size, merge_every, recompute_every):
    skip = 1  # execution order: down 16x16 | down 8x8, mid 8x8 | up 8x8, 8x8 | up 16x16, 16x16
    with tomerge.merging(unet, "toma", ratio=0.5, num_tiles=4, skip_first=skip, group_size=group_size,
                         merge_every=merge_every, recompute_every=recompute_every, num_steps=10,
                         adapter={"max_downsample": 2}) as handle:
        run(unet)
        num_layers = handle.state.num_layers
    layers = range(skip, num_layers)
    keys = {((layer - skip) // group_size, step // recompute_every)
            for step in range(10) if step % merge_every == 0 for layer in layers}
    assert len(plan_calls) == len(keys)  # one plan per (group, window), every other call reuses it
    if (group_size, merge_every, recompute_every) == (1, 1, 1):
        assert len(plan_calls) == 10 * len(layers)
    records = handle.state.records
    sizes = {r.layer: r.num_tokens for r in records if r.num_tokens}
    for r in records:
        if r.layer < skip:
            assert (r.label, r.num_removed) == ("skip_block", 0)
        elif r.step % merge_every:
            assert (r.label, r.num_removed) == ("skip_step", 0)
        else:
            assert r.label == "merge" and r.num_removed == r.num_tokens // 2
    # the tiny UNet's groups hold blocks of one resolution, so a shared plan always fits
    for layer in layers:
        first = skip + (layer - skip) // group_size * group_size
        assert sizes[layer] == sizes[first]


def test_toma_with_ratio_zero_and_after_remove_is_bit_identical(unet, baseline):
    with tomerge.merging(unet, "toma", ratio=0.0, num_steps=10, adapter={"max_downsample": 2}):
        assert all(torch.equal(a, b) for a, b in zip(run(unet), baseline))
    handle = tomerge.apply(unet, "toma", ratio=0.5, num_tiles=4, num_steps=10, adapter={"max_downsample": 2})
    assert any(not torch.equal(a, b) for a, b in zip(run(unet), baseline))
    handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(run(unet), baseline))


# ====================================================================== toma: reuse options, presets
def test_toma_shares_one_plan_per_block_kind_by_default():
    """The authors' FluxScheduler keeps one plan per block type, computed at its first merged block: the default
    ``group_size=None`` gives every merged block of a kind one key (so ``toma`` is not ``facility_location``)."""
    s = ToMA(skip_first=1, recompute_every=2)
    for w in flux_like(num_steps=6):
        d = s.decide(w)
        assert d.cache_key == (None if w.kind_index < 1 else (("toma", w.block_kind, 0), w.step // 2))


def test_toma_destination_keys_change_every_d_steps_and_d_is_a_multiple_of_e():
    s = ToMA(recompute_every=2, destinations_every=6)
    keys = [s.decide(where(t, 3)) for t in range(STEPS)]
    assert [t for t in range(1, STEPS) if keys[t].destinations_key != keys[t - 1].destinations_key] \
        == list(range(6, STEPS, 6))
    assert [t for t in range(1, STEPS) if keys[t].cache_key != keys[t - 1].cache_key] == list(range(2, STEPS, 2))
    assert ToMA().decide(where(0, 0)).destinations_key is None
    with pytest.raises(ValueError, match="multiple of recompute_every"):
        ToMA(recompute_every=2, destinations_every=3)


def test_toma_kept_destinations_recompute_only_the_merge_matrices(monkeypatch):
    """Within a window of ``destinations_every`` steps a new plan reuses the first plan's destinations with
    merge weights from the current tokens: it is ``plan(x_now, destinations=first.dst)``."""
    from tomerge.state import MergeState

    selected: list[int] = []  # one entry per greedy selection (the fused plan and select_destinations run it)
    original = FacilityLocation._greedy
    monkeypatch.setattr(FacilityLocation, "_greedy", lambda self, *a: selected.append(len(selected)) or original(self, *a))
    schedule = ToMA(ratio=0.5, num_tiles=4, recompute_every=1, destinations_every=2, group_size=None,
                    mask_selected=True)
    state = MergeState(schedule, num_layers=1)
    g = torch.Generator().manual_seed(0)
    plans, tokens = [], []
    for step in range(4):
        x = torch.randn(2, 64, 8, generator=g, dtype=torch.float64)
        state.begin_model_call(float(900 - 100 * step))
        call = state.begin_block(0, "block", (8, 8), x)
        plans.append(state.plan_for(call, x))
        tokens.append(x)
        state.end_block()
    assert len(selected) == 2  # destinations chosen at steps 0 and 2 only
    for step in (1, 3):
        kept, plan = plans[step - 1], plans[step]
        assert torch.equal(plan.dst, kept.dst)
        ctx = tomerge.MergeContext(grid=(8, 8), ratio=0.5, step=step)
        direct = schedule.facility.plan(tokens[step], ctx, destinations=kept.dst)
        assert torch.equal(plan.merge_weights, direct.merge_weights)
        assert not torch.equal(plan.merge_weights, kept.merge_weights)  # weights follow the new tokens
    assert not torch.equal(plans[2].dst, plans[1].dst)  # a new window selects anew


def test_toma_kind_sublayers_override_the_sublayers_of_one_block_kind():
    s = ToMA(kind_sublayers=(("joint", ("attn",)),))
    for w in flux_like(num_steps=2):
        assert s.decide(w).sublayers == ({"attn"} if w.block_kind == "joint" else {"attn", "mlp"})
    with pytest.raises(ValueError, match="kind_sublayers"):
        ToMA(kind_sublayers=(("joint", ("x",)),))


def test_presets_hold_the_authors_released_settings():
    """Values read from the authors' code: SDTM ``sample.py`` argparse defaults (ratio 0.3, deviation 0.2,
    switch step 20, mcw 0.1, protect steps every 3, layers -1) with ``TR_SDTM.py`` (FIDM, a_p never read, window
    score over all K * K pairs);
    ToMA ``run_flux.py`` / ``config/*.yaml`` / ``FluxScheduler`` (ratio 0.5, 256 tiles, merge steps
    ``range(0, 35, 3)``, recompute every step, the first 5 blocks of each type unmerged, one plan per type)."""
    release = tomerge.get_strategy("sdtm_release")
    assert (release.ratio, release.deviation, release.switch_step, release.curve) == (0.3, 0.2, 20, "cosine")
    assert (release.protect_every, release.protect_layers_every, release.cache_weight) == (3, None, 0.1)
    assert (release.idm_variant, release.idm.round_tokens, release.ssm.round_windows) == ("streak", 16, 16)
    assert (release.window, release.alpha_s, release.alpha_d, release.prompt_reweight) == (2, 0.05, 0.05, None)
    assert release.ssm.include_self and not SDTM().ssm.include_self  # TR_SDTM.py's window score: diagonal included
    assert release.to_dict()["schedule"] == "sdtm_release"
    paper = tomerge.get_strategy("sdtm_paper", ratio=0.4)  # presets take overrides
    assert (paper.ratio, paper.deviation, paper.idm_variant, paper.cache_weight, paper.protect_every) \
        == (0.4, 0.2, "attention", None, None)
    toma = tomerge.get_strategy("toma_release")
    assert (toma.ratio, toma.num_tiles, toma.skip_first, toma.merge_every, toma.recompute_every) == (0.5, 256, 5, 3, 1)
    assert (toma.group_size, toma.shared_destinations, toma.mask_selected) == (None, True, False)
    assert toma.decide(KindWhere(0, 35, 0.0, 7, 57, "double", 7)).sublayers == {"attn"}
    assert toma.decide(KindWhere(0, 35, 0.0, 30, 57, "single", 11)).sublayers == {"attn", "mlp"}


def test_sdtm_detail_first_swaps_the_phases_at_the_same_switch():
    first, swapped = SDTM(switch=0.4), SDTM(switch=0.4, order="detail_first")
    for w in trajectory():
        a, b = first.decide(w), swapped.decide(w)
        assert (a.label, b.label) in (("structure", "detail"), ("detail", "structure"))
        assert a.ratio == b.ratio and (b.strategy is swapped.ssm) == (b.label == "structure")
    with pytest.raises(ValueError, match="order"):
        SDTM(order="reversed")


def test_constant_merges_only_inside_its_progress_window(unet):
    from tomerge.schedule import Constant

    s = Constant(strategy=SSM(), ratio=0.5, merge_from=0.5, merge_until=0.8)
    for w in trajectory():
        d = s.decide(w)
        assert d.merges == (0.5 <= w.progress <= 0.8) and (d.label == "skip_step") != d.merges
    with tomerge.merging(unet, "ssm", ratio=0.5, merge_until=0.4, num_steps=10, adapter={"max_downsample": 2}) as handle:
        run(unet)
        merged_steps = {r.step for r in handle.state.records if r.num_removed}
    assert merged_steps == {0, 1, 2, 3}  # progress s / 9 <= 0.4
    for options in (dict(merge_from=1.5), dict(merge_from=0.6, merge_until=0.5), dict(merge_until=True)):
        with pytest.raises(ValueError, match="merge_"):
            Constant(strategy=SSM(), ratio=0.5, **options)
