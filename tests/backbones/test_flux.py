"""The `flux` adapter (backbones/flux.py, hand-written) on a tiny random-weight FluxTransformer2DModel (double and
single blocks: ``helpers.models.tiny_flux``)."""

from __future__ import annotations

import copy
import types

import pytest
import torch

import tomerge
from tomerge.backbones._gather import BatchedRotaryTable, gather_rotary
from tomerge.backbones._grid import grid_from_ids
from tomerge.backbones.flux import CallLengths, DoubleAttentionPoint, FluxAdapter
from tomerge.experiments.measure.flops import count_flops
from helpers import no_hooks_left
from helpers.family import Permute
from helpers.models import flux_inputs, image_ids, tiny_flux


STRATEGIES = {"tomesd": {}, "ssm": {}, "idm": {}, "facility_location": {"num_tiles": 4}}


def forward(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def flops(model, inputs: dict) -> int:
    """FLOPs of one forward."""
    return count_flops(lambda: forward(model, inputs))


@pytest.fixture(scope="module")
def flux():
    return tiny_flux()


@pytest.fixture(scope="module")
def baseline(flux):
    inputs = flux_inputs()
    return inputs, forward(flux, inputs), flops(flux, inputs)


# ---------------------------------------------------------------------- attaching
def test_finds_the_transformer_of_a_pipeline_and_lists_double_then_single_blocks(flux):
    pipe = types.SimpleNamespace(transformer=flux)
    with tomerge.merging(pipe, "tomesd", ratio=0.5) as handle:
        assert handle.model is flux and isinstance(handle.adapter, FluxAdapter)
        specs = handle.adapter.blocks()
        assert [s.kind for s in specs] == ["double", "double", "single", "single"]
        assert [s.module for s in specs] == [*flux.transformer_blocks, *flux.single_transformer_blocks]
        single = specs[2]
        assert [(p.sublayer, p.module) for p in single.points] == [
            ("attn", single.module.proj_mlp), ("attn", single.module.attn), ("mlp", single.module.proj_out)]
    assert no_hooks_left(flux)


@pytest.mark.parametrize("name", STRATEGIES)
def test_ratio_zero_and_remove_are_bit_identical(flux, baseline, name):
    inputs, before, _ = baseline
    with tomerge.merging(flux, name, ratio=0.0, **STRATEGIES[name]):
        assert torch.equal(forward(flux, inputs), before)
    handle = tomerge.apply(flux, name, ratio=0.5, **STRATEGIES[name])
    assert not torch.equal(forward(flux, inputs), before)
    handle.remove()
    assert torch.equal(forward(flux, inputs), before)
    assert no_hooks_left(flux) and "_tomerge_handle" not in flux.__dict__


@pytest.mark.parametrize("name", STRATEGIES)
def test_half_ratio_is_finite_and_saves_flops(flux, baseline, name):
    inputs, before, base_flops = baseline
    with tomerge.merging(flux, name, ratio=0.5, **STRATEGIES[name]) as handle:
        out = forward(flux, inputs)
        merged_flops = flops(flux, inputs)
        records = handle.state.records[:4]
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == ["double", "double", "single", "single"]
    assert all(r.num_tokens == 64 and r.num_removed >= 24 for r in records)  # ssm rounds windows: 30 of 32
    assert merged_flops < base_flops
    print(f"\nflux {name}: FLOPs baseline/merged = {base_flops / merged_flops:.3f} ({base_flops} / {merged_flops})")


def test_merged_rows_carry_their_destinations_rotary_positions(flux, baseline):
    inputs, before, _ = baseline
    with tomerge.merging(flux, Permute(), ratio=0.5) as handle:
        out = forward(flux, inputs)
        assert all(set(r.sublayers) == {"attn", "mlp"} for r in handle.state.records)
    torch.testing.assert_close(out, before, rtol=1e-5, atol=1e-5)
    # Control: positions matter in this model, so a permutation without the gather would be far off.
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(3))
    shuffled = dict(inputs, hidden_states=inputs["hidden_states"][:, perm])
    assert (forward(flux, shuffled)[:, perm.argsort()] - before).abs().max() > 1e-2


def test_gather_rotary_matches_a_hand_built_table():
    T, N, d = 3, 5, 4
    cos = torch.arange((T + N) * d, dtype=torch.float32).view(T + N, d)  # row r holds r*d .. r*d + d-1
    sin = -cos
    dst = torch.tensor([[4, 0, 2], [1, 1, 3]])  # [B=2, M=3]
    c, s = gather_rotary((cos, sin), dst, T)
    assert isinstance(c, BatchedRotaryTable)
    expected = torch.empty(2, T + 3, d)
    for b in range(2):
        for i in range(T):
            expected[b, i] = cos[i]
        for m in range(3):
            expected[b, T + m] = cos[T + int(dst[b, m])]
    assert torch.equal(c.table, expected) and torch.equal(s.table, -expected)
    shared_c, _ = gather_rotary((cos, sin), dst[:1], T)  # one row of destinations: a plain table
    assert isinstance(shared_c, torch.Tensor) and torch.equal(shared_c, expected[0])


def test_batched_table_through_diffusers_apply_rotary_emb_equals_per_sample_tables():
    from diffusers.models.embeddings import apply_rotary_emb

    g = torch.Generator().manual_seed(0)
    cos, sin = torch.randn(2, 6, 8, generator=g), torch.randn(2, 6, 8, generator=g)  # [B, S, d]
    x = torch.randn(2, 6, 3, 8, generator=g)  # [B, S, heads, d]
    batched = apply_rotary_emb(x, (BatchedRotaryTable(cos), BatchedRotaryTable(sin)), sequence_dim=1)
    for b in range(2):
        alone = apply_rotary_emb(x[b:b + 1], (cos[b], sin[b]), sequence_dim=1)
        assert torch.equal(batched[b:b + 1], alone)
    with pytest.raises(TypeError, match="apply_rotary_emb"):
        BatchedRotaryTable(cos)[0]
    with pytest.raises(AttributeError, match="apply_rotary_emb"):
        BatchedRotaryTable(cos).unsqueeze(0)


# ---------------------------------------------------------------------- batches, shapes, dtypes
@pytest.mark.tie_sensitive
def test_a_batch_of_two_equals_its_samples_alone(flux):
    """float64: in float32 the batch size changes the kernels' rounding (~1e-6), which can flip tomesd's
    argsort between near-tied similarities; in float64 the strategy (selecting in float32) sees the same values."""
    model = copy.deepcopy(flux).double()
    inputs = flux_inputs(batch=2, seed=5, dtype=torch.float64)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_mlp=True) as handle:
        both = forward(model, inputs)
        assert handle.stats["tokens_removed"] > 0
        for b in range(2):
            alone = dict(inputs, **{k: inputs[k][b:b + 1] for k in
                                    ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep")})
            torch.testing.assert_close(forward(model, alone), both[b:b + 1], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("grid", [(4, 6), (6, 4), (5, 7)])
def test_non_square_latents_use_the_grid_of_the_ids(flux, grid):
    inputs = flux_inputs(grid=grid)
    before = forward(flux, inputs)
    with tomerge.merging(flux, "ssm", ratio=0.5, round_windows=1) as handle:
        out = forward(flux, inputs)
        assert handle.adapter.grid_size == grid
        assert all(r.num_removed > 0 for r in handle.state.records)
    assert out.shape == before.shape and torch.isfinite(out).all()
    with tomerge.merging(flux, Permute(), ratio=0.5):
        torch.testing.assert_close(forward(flux, inputs), before, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("text", [1, 13])
def test_text_length_comes_from_the_call(flux, text):
    inputs = flux_inputs(text=text, seed=7)
    before = forward(flux, inputs)
    with tomerge.merging(flux, Permute(), ratio=0.5):  # a wrong text/image split would not be exact
        torch.testing.assert_close(forward(flux, inputs), before, rtol=1e-5, atol=1e-5)
    with tomerge.merging(flux, "facility_location", ratio=0.5, num_tiles=4) as handle:
        assert torch.isfinite(forward(flux, inputs)).all()
        assert handle.stats["tokens_removed"] > 0


@pytest.mark.parametrize("name", STRATEGIES)
def test_bf16_runs(flux, name):
    model = copy.deepcopy(flux).to(torch.bfloat16)
    inputs = flux_inputs(dtype=torch.bfloat16)
    with tomerge.merging(model, name, ratio=0.5, **STRATEGIES[name]) as handle:
        out = forward(model, inputs)
        assert handle.stats["tokens_removed"] > 0
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()


# ---------------------------------------------------------------------- received attention, clock, ids
def test_idm_records_text_to_image_attention_in_every_block(flux):
    inputs = flux_inputs()
    with tomerge.merging(flux, "idm", ratio=0.5) as handle:
        forward(flux, inputs)
        attention = handle.state.attention
        assert sorted(attention) == [0, 1, 2, 3]
        for a in attention.values():
            assert a.shape == (2, 64) and torch.allclose(a.sum(-1), torch.ones(2))
            assert not torch.allclose(a, torch.full_like(a, 1 / 64))  # not uniform: real q/k
        assert all(r.sublayers == ("mlp",) and r.num_removed == 32 for r in handle.state.records)


def test_timestep_in_unit_interval_gives_progress(flux):
    with tomerge.merging(flux, "tomesd", ratio=0.5) as handle:
        forward(flux, flux_inputs(t=1.0))
        forward(flux, flux_inputs(t=0.25))
        assert handle.state.clock.step == 1
        assert handle.state.clock.progress == pytest.approx(0.75)


def test_ids_that_are_not_one_raster_grid_are_not_merged(flux):
    inputs = flux_inputs(grid=(4, 4))
    inputs["img_ids"] = image_ids(4, 4)[torch.randperm(16, generator=torch.Generator().manual_seed(0))]
    with tomerge.merging(flux, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning) as caught:
            forward(flux, inputs)
        assert any("raster" in str(w.message) for w in caught)
        assert handle.stats["tokens_removed"] == 0


def test_grid_from_ids():
    assert grid_from_ids(image_ids(3, 5)) == (3, 5)
    assert grid_from_ids(image_ids(3, 5) + torch.tensor([0.0, 2.0, 7.0])) == (3, 5)  # offsets are fine
    assert grid_from_ids(image_ids(3, 5)[None]) == (3, 5)  # deprecated 3D ids
    assert grid_from_ids(image_ids(12, 9).bfloat16()) == (12, 9)  # pipelines pass ids in the model dtype
    assert grid_from_ids(torch.cat([image_ids(2, 2), image_ids(2, 2)])) is None  # two grids (split_ids: one target)
    assert grid_from_ids(image_ids(3, 5) * 0.5) is None


def test_ip_adapter_outputs_unmerge_both_image_parts():
    point = DoubleAttentionPoint("attn", torch.nn.Identity())
    image, text, ip = torch.randn(2, 3, 4), torch.randn(2, 5, 4), torch.randn(2, 3, 6)
    joined = point.get_output((image, text, ip))  # [B, M, 4 + 6]
    assert torch.equal(joined, torch.cat([image, ip], -1))
    out = point.set_output((image, text, ip), torch.cat([image, ip], -1).repeat(1, 2, 1))  # "unmerged" to 6 rows
    assert out[0].shape == (2, 6, 4) and out[1] is text and out[2].shape == (2, 6, 6)
    assert point.set_output((image, text), image)[1] is text


def test_single_stream_points_reject_a_wrong_text_image_split(flux):
    from tomerge.backbones.flux import SingleStreamPoint

    point = SingleStreamPoint("mlp", flux.single_transformer_blocks[0].proj_out, arg="input",
                              lengths=CallLengths(text=3, image=10))
    with pytest.raises(RuntimeError, match="T=3 text and N=10"):
        point.get_input((torch.randn(1, 12, 4),), {})


def test_a_model_loaded_from_a_local_folder_merges_like_the_original(flux, baseline, tmp_path):
    from diffusers import FluxTransformer2DModel

    inputs, before, _ = baseline
    flux.save_pretrained(tmp_path)
    loaded = FluxTransformer2DModel.from_pretrained(tmp_path).eval()
    assert torch.equal(forward(loaded, inputs), before)
    with tomerge.merging(flux, "ssm", ratio=0.5) as a, tomerge.merging(loaded, "ssm", ratio=0.5) as b:
        torch.testing.assert_close(forward(loaded, inputs), forward(flux, inputs), rtol=0, atol=0)
        assert b.stats["tokens_removed"] == a.stats["tokens_removed"] > 0


# ---------------------------------------------------------------------- single-stream blocks stay merged
def _count_plan_calls(monkeypatch) -> dict[str, list[tuple[int, ...]]]:
    """Records the shapes every MergePlan.merge / unmerge call sees."""
    calls: dict[str, list[tuple[int, ...]]] = {"merge": [], "unmerge": []}
    for name in calls:
        original = getattr(tomerge.MergePlan, name)

        def wrapped(self, x, *a, _name=name, _original=original, **k):
            calls[_name].append(tuple(x.shape))
            return _original(self, x, *a, **k)
        monkeypatch.setattr(tomerge.MergePlan, name, wrapped)
    return calls


def test_single_stream_block_merges_once_and_unmerges_once(flux, baseline, monkeypatch):
    """With attention and MLP merged, a single-stream block merges its normalised tokens once (shared by
    proj_mlp and attn) and unmerges only proj_out's output: the [B, N, 4C] MLP activation never leaves
    the merged length."""
    inputs, _, _ = baseline
    with tomerge.merging(flux, "ssm", ratio=0.5) as handle:
        calls = _count_plan_calls(monkeypatch)
        forward(flux, inputs)
    assert handle.stats["tokens_removed"] > 0
    C = 32  # model width; proj_mlp's output is 4C and proj_out's input 5C
    # 2 double blocks x (attn, ff) + 2 single blocks x 1, each way, all at width C
    assert [shape[-1] for shape in calls["merge"]] == [C] * 6
    assert [shape[-1] for shape in calls["unmerge"]] == [C] * 6


@pytest.mark.parametrize("strategy", ["ssm", "tomesd"])
def test_single_stream_merged_branch_equals_unmerge_then_merge_for_hard_plans(flux, baseline, strategy, monkeypatch):
    """For a hard plan, unmerging proj_mlp's output and merging proj_out's input again is the identity (a slot
    is copied to its tokens and averaged back), so keeping the branch merged changes cost, not results."""
    from tomerge.backbones.flux import SingleStreamPoint

    inputs, _, _ = baseline
    options = {"use_rand": False} if strategy == "tomesd" else {}
    sublayers = {"merge_attn": True, "merge_mlp": True} if strategy == "tomesd" else {}
    with tomerge.merging(flux, strategy, ratio=0.5, **options, **sublayers):
        fused = forward(flux, inputs)
    monkeypatch.setattr(SingleStreamPoint, "keeps_merged", lambda self, sublayers: False)
    with tomerge.merging(flux, strategy, ratio=0.5, **options, **sublayers):
        round_trip = forward(flux, inputs)
    torch.testing.assert_close(fused, round_trip, rtol=1e-4, atol=1e-5)
