"""The hand-written adapters of diffusers' DiT-style transformers, `sd3`, `pixart` and `dit` (backbones/sd3.py,
pixart.py, dit.py), on tiny random-weight models (``helpers.models``, no download).

Every backbone x every strategy: ratio 0 and remove() are bit-identical to the unpatched model;
ratio 0.5 is finite, of the right shape and cheaper in FLOPs; a batch equals its samples run alone;
non-square latents and bf16 work. Then what is particular to each family: SD3.5 dual attention and
the text-to-image probe, PixArt's cross-attention queries, merging with feed-forward chunking (also on
the UNet), pipelines, save/load round trips. The `unet` adapter's default level: test_unet.py.
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.backbones.dit import DiTAdapter
from tomerge.backbones.pixart import PixArtAdapter
from tomerge.backbones.sd3 import SD3Adapter
from tomerge.experiments.measure.flops import count_flops
from helpers import no_hooks_left
from helpers.models import SIZE, make_inputs, tiny_dit, tiny_pixart, tiny_sd3


STRATEGIES = ["tomesd", "ssm", "idm", "facility_location"]
BACKBONES = ["sd3", "pixart", "dit"]
OPTIONS = {"tomesd": {"use_rand": False}}  # deterministic and per-sample


# ---------------------------------------------------------------------- inputs and calls
def select(inputs: dict, i: int) -> dict:
    """Sample ``i`` of a batch of inputs."""
    return {k: v[i:i + 1] if isinstance(v, Tensor) else v for k, v in inputs.items()}


def pair(inputs: dict, i: int) -> dict:
    """A batch of two copies of sample ``i``."""
    return {k: v[i:i + 1].expand(2, *v.shape[1:]).clone() if isinstance(v, Tensor) else v for k, v in inputs.items()}


def to_dtype(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if isinstance(v, Tensor) and v.is_floating_point() and k != "timestep" else v
            for k, v in inputs.items()}


BUILDERS: dict[str, Callable[[], nn.Module]] = {"sd3": tiny_sd3, "pixart": tiny_pixart, "dit": tiny_dit}
ADAPTERS = {"sd3": SD3Adapter, "pixart": PixArtAdapter, "dit": DiTAdapter}


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: build() for name, build in BUILDERS.items()}


def run(model: nn.Module, inputs: dict) -> Tensor:
    with torch.no_grad():
        return model(**inputs).sample


def apply(model: nn.Module, strategy: str, ratio: float, **options) -> tomerge.MergeHandle:
    """``tomerge.apply`` with the test's per-strategy defaults (tomesd without randomness)."""
    return tomerge.apply(model, strategy, ratio=ratio, **{**OPTIONS.get(strategy, {}), **options})


def merging(model: nn.Module, strategy: str, ratio: float, **options):
    """``tomerge.merging`` with the test's per-strategy defaults."""
    return tomerge.merging(model, strategy, ratio=ratio, **{**OPTIONS.get(strategy, {}), **options})


def flops(model: nn.Module, inputs: dict) -> int:
    """FLOPs of one call."""
    return count_flops(lambda: run(model, inputs))


def token_counts(module: nn.Module) -> tuple[list[int], Callable[[], None]]:
    """Records the token count of every call of ``module`` (first input); returns the list and a remover."""
    seen: list[int] = []

    def hook(mod: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.append((kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]).shape[1])

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    return seen, handle.remove


# ---------------------------------------------------------------------- every backbone x every strategy
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_ratio_zero_and_remove_are_bit_identical(models, backbone, strategy):
    model, inputs = models[backbone], make_inputs(backbone)
    before = run(model, inputs)
    with merging(model, strategy, 0.0):
        assert torch.equal(run(model, inputs), before)
    handle = apply(model, strategy, 0.5)
    merged = run(model, inputs)
    assert handle.stats["tokens_removed"] > 0 and not torch.equal(merged, before)
    handle.remove()
    assert torch.equal(run(model, inputs), before)
    assert no_hooks_left(model) and "_tomerge_handle" not in model.__dict__


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_half_ratio_is_finite_right_shape_and_cheaper(models, backbone, strategy):
    model, inputs = models[backbone], make_inputs(backbone)
    base = flops(model, inputs)
    with merging(model, strategy, 0.5) as handle:
        out = run(model, inputs)
        merged = flops(model, inputs)
        records = [r for r in handle.state.records if r.num_removed > 0]
    assert out.shape == run(model, inputs).shape and torch.isfinite(out).all()
    assert {r.layer for r in records} == {0, 1}  # both blocks merged, the context_pre_only one of SD3 too
    assert all(r.num_tokens == SIZE[0] * SIZE[1] for r in records)
    assert merged < base
    print(f"\nFLOPs {backbone:6s} {strategy:17s} baseline/merged = {base / merged:.3f} ({base} / {merged})")


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_batch_equals_samples_alone(models, backbone, strategy):
    model, inputs = models[backbone], make_inputs(backbone)
    assert not tomerge.get_strategy(strategy, **OPTIONS.get(strategy, {})).uses_generator  # no draw shared by the batch
    outs = []
    for part in (inputs, pair(inputs, 0), pair(inputs, 1)):
        with merging(model, strategy, 0.5):  # fresh state each time (streaks are per application)
            outs.append(run(model, part))
    batch, twice_a, twice_b = outs
    # Same kernel shapes: a sample's result does not depend on the other sample, to the bit.
    assert torch.equal(batch, torch.cat([twice_a[:1], twice_b[1:]]))
    # Run alone (batch 1), float32 kernels round differently (~1e-6), and the strategies' argmaxes, sorts and
    # greedy picks flip between near-tied candidates of these tiny random models, whose normalised tokens
    # are dominated by the shared adaLN shift (facility location: 1e-6 input noise changes ~4% of outputs
    # by up to 6e-3). In float64 the batch size changes the tokens far below float32's resolution, so the
    # strategies (which select in float32) see the same values and make the same choices.
    model64, inputs64 = copy.deepcopy(model).double(), to_dtype(inputs, torch.float64)
    outs = []
    for part in (inputs64, select(inputs64, 0), select(inputs64, 1)):
        with merging(model64, strategy, 0.5) as handle:
            outs.append(run(model64, part))
            assert handle.stats["tokens_removed"] > 0
    batch, alone_a, alone_b = outs
    torch.testing.assert_close(batch, torch.cat([alone_a, alone_b]), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_non_square_latents(models, backbone, strategy):
    model = models[backbone]
    # diffusers' DiT unpatchifies with height = width = sqrt(N) (square latents only), so it gets a grid
    # whose token count is a square: 8 x 32 = 256; its output is then square but the merge grid is not.
    size = (8, 32) if backbone == "dit" else (12, 20)
    inputs = make_inputs(backbone, size=size)
    before = run(model, inputs)
    with merging(model, strategy, 0.5) as handle:
        out = run(model, inputs)
        spec = handle.adapter.blocks()[0]
        assert handle.adapter.grid(spec, size[0] * size[1]) == size
        assert handle.adapter.grid(spec, size[0] * size[1] - 1) is None  # never a wrong grid
        assert handle.stats["tokens_removed"] > 0
    assert out.shape == before.shape and torch.isfinite(out).all()
    if backbone != "dit":
        assert out.shape[-2:] == size


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("backbone", BACKBONES)
def test_bf16_runs_on_cpu(models, backbone, strategy):
    model = copy.deepcopy(models[backbone]).to(torch.bfloat16)
    inputs = to_dtype(make_inputs(backbone), torch.bfloat16)
    before = run(model, inputs)
    with merging(model, strategy, 0.0):
        assert torch.equal(run(model, inputs), before)
    with merging(model, strategy, 0.5) as handle:
        out = run(model, inputs)
        assert handle.stats["tokens_removed"] > 0
    assert out.dtype == torch.bfloat16 and out.shape == before.shape and torch.isfinite(out).all()


# ---------------------------------------------------------------------- finding the model
@pytest.mark.parametrize("backbone", BACKBONES)
def test_finds_the_model_in_a_pipeline_and_picks_the_right_adapter(models, backbone):
    model = models[backbone]
    pipe = types.SimpleNamespace(transformer=model)
    for other, cls in ADAPTERS.items():
        assert (cls.find_model(pipe) is model) == (other == backbone)
        assert (cls.find_model(model) is model) == (other == backbone)
    with tomerge.merging(pipe, "ssm", ratio=0.5) as handle:
        assert handle.model is model and type(handle.adapter) is ADAPTERS[backbone]
        assert [b.module for b in handle.adapter.blocks()] == list(model.transformer_blocks)


@pytest.mark.parametrize("backbone", BACKBONES)
def test_save_pretrained_round_trip_merges_the_same(models, backbone, tmp_path):
    model, inputs = models[backbone], make_inputs(backbone)
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    outs = []
    for m in (model, loaded):
        with tomerge.merging(m, "ssm", ratio=0.5):
            outs.append(run(m, inputs))
    assert torch.equal(outs[0], outs[1])


# ---------------------------------------------------------------------- IDM's received attention
@pytest.mark.parametrize("backbone", BACKBONES)
def test_idm_records_received_attention_and_merges_only_the_mlp(models, backbone):
    model, inputs = models[backbone], make_inputs(backbone)
    N = SIZE[0] * SIZE[1]
    with merging(model, "idm", 0.5) as handle:
        run(model, inputs)
        attention = handle.state.attention
        assert sorted(attention) == [0, 1]
        for a in attention.values():
            assert a.shape == (2, N) and (a >= 0).all()
            torch.testing.assert_close(a.sum(-1), torch.ones(2))
        merged = [r for r in handle.state.records if r.num_removed]
        assert merged and all(r.sublayers == ("mlp",) for r in merged)


def joint_reference(attn: nn.Module, image: Tensor, text: Tensor) -> Tensor:
    """Text-to-image attention of a joint ``Attention``, computed explicitly from its modules: ``[B, N]``."""
    B, N, _ = image.shape
    h = attn.heads

    def heads(t: Tensor, norm: nn.Module | None) -> Tensor:
        t = t.view(B, t.shape[1], h, -1).transpose(1, 2)  # [B, h, L, d]
        return norm(t) if norm is not None else t

    k = torch.cat([heads(attn.to_k(image), attn.norm_k), heads(attn.add_k_proj(text), attn.norm_added_k)], 2)
    q = heads(attn.add_q_proj(text), attn.norm_added_q)  # [B, h, T, d]
    p = (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1)  # [B, h, T, N + T]
    a = p.mean(dim=(1, 2))[:, :N]  # [B, N]
    return a / a.sum(-1, keepdim=True)


@pytest.mark.parametrize("qk_norm", [None, "rms_norm"])
def test_sd3_probe_is_the_text_to_image_attention(qk_norm):
    model, inputs = tiny_sd3(dual=False, qk_norm=qk_norm), make_inputs("sd3")
    seen: list[tuple[Tensor, Tensor]] = []
    hook = model.transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, a, kw: seen.append((kw["hidden_states"], kw["encoder_hidden_states"])), with_kwargs=True)
    with merging(model, "idm", 0.5) as handle:
        run(model, inputs)
        recorded = handle.state.attention[0]
    hook.remove()
    with torch.no_grad():
        expected = joint_reference(model.transformer_blocks[0].attn, *seen[0])
    torch.testing.assert_close(recorded, expected, rtol=1e-4, atol=1e-7)
    assert not torch.allclose(recorded, torch.full_like(recorded, 1 / recorded.shape[1]))  # not uniform


@pytest.mark.tie_sensitive
def test_sd3_probe_with_fused_projections_matches_unfused():
    # diffusers' fuse_qkv_projections puts the fused joint processor on every attention, which breaks
    # SD3.5's attn2 and skips q/k norms: only plain SD3 can be fused. float64: the fused projection rounds
    # differently, which in float32 can flip idm's sort and argmax between near-tied tokens of block 1.
    model, inputs = tiny_sd3(dual=False, qk_norm=None).double(), to_dtype(make_inputs("sd3"), torch.float64)
    with merging(model, "idm", 0.5) as handle:
        plain_out = run(model, inputs)
        plain = {k: v.clone() for k, v in handle.state.attention.items()}
    model.fuse_qkv_projections()
    with merging(model, "idm", 0.5) as handle:
        fused_out = run(model, inputs)
        fused = handle.state.attention
        assert sorted(fused) == sorted(plain) == [0, 1]
        for layer in plain:
            torch.testing.assert_close(fused[layer], plain[layer], rtol=1e-4, atol=1e-7)
    torch.testing.assert_close(fused_out, plain_out, rtol=1e-9, atol=1e-9)


# ---------------------------------------------------------------------- SD3 particulars
@pytest.mark.parametrize("merge_attn2", [True, False])
def test_sd3_dual_attention_is_merged_or_left_full_length_never_disabled(models, merge_attn2):
    model, inputs = models["sd3"], make_inputs("sd3")
    block = model.transformer_blocks[0]
    assert block.use_dual_attention and block.attn2 is not None
    assert model.transformer_blocks[-1].context_pre_only
    N = SIZE[0] * SIZE[1]
    with merging(model, "ssm", 0.5, adapter={"merge_attn2": merge_attn2}) as handle:
        attn_tokens, remove_a = token_counts(block.attn)  # registered after the merge hooks: sees merged input
        attn2_tokens, remove_b = token_counts(block.attn2)
        out = run(model, inputs)
        removed = next(r.num_removed for r in handle.state.records if r.layer == 0)
    remove_a(), remove_b()
    assert removed > 0 and block.use_dual_attention
    assert attn_tokens == [N - removed]
    assert attn2_tokens == [N - removed if merge_attn2 else N]
    assert torch.isfinite(out).all()


def test_sd3_merge_attn2_changes_the_output_and_is_validated(models):
    model, inputs = models["sd3"], make_inputs("sd3")
    outs = []
    for flag in (True, False):
        with merging(model, "ssm", 0.5, adapter={"merge_attn2": flag}):
            outs.append(run(model, inputs))
    assert not torch.equal(*outs)
    with pytest.raises(ValueError, match="merge_attn2"):
        apply(model, "ssm", 0.5, adapter={"merge_attn2": "yes"})
    with pytest.raises(TypeError, match="valid options"):
        apply(model, "ssm", 0.5, merge_atn2=False)
    assert no_hooks_left(model)


def test_sd3_steps_come_from_timesteps_cfg_and_skip_layer_calls_share_a_step(models):
    model = models["sd3"]
    with merging(model, "ssm", 0.5) as handle:
        for t in (900.0, 900.0, 900.0, 600.0, 600.0):  # cond, uncond, skip-layer guidance; next step
            inputs = make_inputs("sd3", batch=1)
            inputs["timestep"] = torch.tensor([t])
            run(model, inputs)
        assert sorted({r.step for r in handle.state.records}) == [0, 1]
        assert sum(r.step == 0 for r in handle.state.records) == 3 * 2  # three calls x two blocks


def test_sd3_plain_model_without_dual_attention_or_qk_norm(models):
    model, inputs = tiny_sd3(dual=False, qk_norm=None), make_inputs("sd3")
    with merging(model, "tomesd", 0.5) as handle:
        assert all(len(b.points) == 2 for b in handle.adapter.blocks())  # attn and ff
        out = run(model, inputs)
        assert handle.stats["merged_calls"] == 2
    assert torch.isfinite(out).all()


# ---------------------------------------------------------------------- PixArt particulars
def test_pixart_cross_attention_queries_are_merged_only_when_asked(models):
    model, inputs = models["pixart"], make_inputs("pixart")
    inputs["encoder_attention_mask"] = torch.tensor([[1] * 5 + [0] * 2, [1] * 7])  # padded text, as the pipeline
    block = model.transformer_blocks[0]
    N = SIZE[0] * SIZE[1]
    outs = []
    for flag in (None, True):
        with merging(model, "tomesd", 0.5, **({} if flag is None else {"merge_crossattn": flag})) as handle:
            attn1, remove_a = token_counts(block.attn1)  # registered after the merge hooks: sees merged input
            attn2, remove_b = token_counts(block.attn2)
            outs.append(run(model, inputs))
            records = [r for r in handle.state.records if r.layer == 0]
        remove_a(), remove_b()
        M = N - records[0].num_removed
        assert attn1 == [M] and M < N
        assert attn2 == ([M] if flag else [N])
        assert records[0].sublayers == (("attn", "crossattn") if flag else ("attn",))
    assert not torch.equal(*outs) and all(torch.isfinite(o).all() for o in outs)


def test_pixart_self_attention_mask_raises(models):
    model, inputs = models["pixart"], make_inputs("pixart")
    inputs["attention_mask"] = torch.ones(2, SIZE[0] * SIZE[1])
    with merging(model, "ssm", 0.5):
        with pytest.raises(ValueError, match="attention_mask"):
            run(model, inputs)
    assert no_hooks_left(model)


# ---------------------------------------------------------------------- feed-forward chunking
CHUNKING_BACKBONES = [*BACKBONES, "unet"]
CHUNKINGS = [(1, 0), (1, 1)]  # (chunk size, dim): per sample; per token, diffusers' enable_forward_chunking default


def chunking_case(backbone: str) -> tuple[nn.Module, dict, dict]:
    """A tiny model of ``backbone``, keyword inputs and the adapter options that merge every block of it."""
    if backbone == "unet":
        from helpers.models import tiny_unet, unet_inputs

        sample, timestep, text = unet_inputs()
        return tiny_unet(), dict(sample=sample, timestep=timestep, encoder_hidden_states=text), {"max_downsample": 2}
    return BUILDERS[backbone](), make_inputs(backbone), {}


def chunked_blocks(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "set_chunk_feed_forward")]


def set_chunking(model: nn.Module, chunking: tuple[int, int] | None) -> None:
    """Feed-forward chunking on every block, as ``model.enable_forward_chunking(size, dim)`` (``None``: off)."""
    for block in chunked_blocks(model):
        block.set_chunk_feed_forward(*(chunking or (None, 0)))


def chunking_left_as_set(model: nn.Module, chunking: tuple[int, int]) -> bool:
    """Every block has ``chunking`` again and no feed-forward kept an instance ``forward``."""
    blocks = chunked_blocks(model)
    feed_forwards = [getattr(b, name) for b in blocks for name in ("ff", "ff_context") if getattr(b, name, None)]
    return (all((b._chunk_size, b._chunk_dim) == chunking for b in blocks)
            and not any("forward" in ff.__dict__ for ff in feed_forwards))


def linear_calls(module: nn.Module) -> tuple[list[int], Callable[[], None]]:
    """Records the token count of every call of the feed-forward's first projection (one per chunk)."""
    first = next(m for m in module.modules() if isinstance(m, nn.Linear))
    seen: list[int] = []
    handle = first.register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[1]))
    return seen, handle.remove


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=["dim0", "dim1"])
@pytest.mark.parametrize("strategy", ["ssm", "idm"])  # the plan made before ff (at attn) and at ff itself
@pytest.mark.parametrize("backbone", CHUNKING_BACKBONES)
def test_feed_forward_chunking_merges_as_without_chunking(backbone, strategy, chunking):
    model, inputs, options = chunking_case(backbone)
    model, inputs = model.double(), to_dtype(inputs, torch.float64)
    block = chunked_blocks(model)[0]
    with merging(model, strategy, 0.5, adapter=options) as handle:
        expected = run(model, inputs)
        removed = handle.stats["tokens_removed"]
        set_chunking(model, chunking)  # enabled after apply()
        after_apply = run(model, inputs)
        assert chunking_left_as_set(model, chunking) and handle.stats["tokens_removed"] == 2 * removed > 0
    with merging(model, strategy, 0.5, adapter=options) as handle:  # enabled before apply()
        ff_tokens, remove_a = token_counts(block.ff)  # registered after the merge hooks: sees merged input
        chunk_tokens, remove_b = linear_calls(block.ff)
        before_apply = run(model, inputs)
        remove_a(), remove_b()
        N = next(r.num_tokens for r in handle.state.records if r.layer == 0)
        M = N - next(r.num_removed for r in handle.state.records if r.layer == 0)
    for out in (after_apply, before_apply):
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    assert chunking_left_as_set(model, chunking) and no_hooks_left(model)
    assert ff_tokens == [M] and M < N  # the merge point saw the whole merged sequence, once
    size, dim = chunking
    B = inputs["hidden_states" if "hidden_states" in inputs else "sample"].shape[0]
    assert chunk_tokens == ([M] * (B // size) if dim == 0 else [size] * (M // size))  # ... and ff ran it in chunks


@pytest.mark.parametrize("chunking", CHUNKINGS, ids=["dim0", "dim1"])
@pytest.mark.parametrize("backbone", CHUNKING_BACKBONES)
def test_feed_forward_chunking_ratio_zero_and_remove_are_bit_identical(backbone, chunking):
    model, inputs, options = chunking_case(backbone)
    set_chunking(model, chunking)
    before = run(model, inputs)
    with merging(model, "ssm", 0.0, adapter=options):
        assert torch.equal(run(model, inputs), before)  # the identity plan's ff ran in diffusers' chunks
        assert chunking_left_as_set(model, chunking)
    handle = apply(model, "ssm", 0.5, adapter=options)
    merged = run(model, inputs)
    assert handle.stats["tokens_removed"] > 0 and not torch.equal(merged, before)
    assert chunking_left_as_set(model, chunking)
    handle.remove()
    assert torch.equal(run(model, inputs), before)
    assert chunking_left_as_set(model, chunking) and no_hooks_left(model)


@pytest.mark.parametrize("backbone", CHUNKING_BACKBONES)
def test_feed_forward_chunking_is_untouched_where_the_mlp_is_not_merged(backbone):
    model, inputs, options = chunking_case(backbone)
    set_chunking(model, (1, 0))
    ff = chunked_blocks(model)[0].ff
    with merging(model, "tomesd", 0.5, adapter=options) as handle:  # attention only
        ff_tokens, remove = token_counts(ff)
        run(model, inputs)
        remove()
        assert handle.stats["tokens_removed"] > 0
    N = next(iter(ff_tokens))
    assert ff_tokens == [N, N]  # diffusers called ff once per sample, at full length
    assert chunking_left_as_set(model, (1, 0))


def test_feed_forward_chunking_is_restored_when_the_block_raises():
    model, inputs = tiny_pixart(), make_inputs("pixart")
    set_chunking(model, (1, 1))
    block = model.transformer_blocks[0]

    def fail(module: nn.Module, args: tuple) -> None:
        assert block._chunk_size is None and "forward" in block.ff.__dict__  # suspended while the block runs
        raise RuntimeError("attn2 failed")

    with merging(model, "ssm", 0.5):
        hook = block.attn2.register_forward_pre_hook(fail)  # after attn1, before ff
        with pytest.raises(RuntimeError, match="attn2 failed"):
            run(model, inputs)
        hook.remove()
        assert chunking_left_as_set(model, (1, 1))
        assert torch.isfinite(run(model, inputs)).all()  # the next call is unaffected
    assert no_hooks_left(model)


def test_feed_forward_chunking_under_torch_compile():
    """dynamo + AOTAutograd (as tests/core/test_compile.py): the suspension runs eagerly, the merged, chunked
    feed-forward is traced, and the result is the eager one."""
    model, inputs = tiny_dit().double(), to_dtype(make_inputs("dit"), torch.float64)
    set_chunking(model, (1, 1))
    with merging(model, "ssm", 0.5, round_windows=1):
        eager = run(model, inputs)
    torch._dynamo.reset()
    try:
        with merging(model, "ssm", 0.5, round_windows=1) as handle:
            compiled = run(torch.compile(model, backend="aot_eager"), inputs)
            assert handle.stats["tokens_removed"] > 0
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(compiled, eager, rtol=1e-9, atol=1e-9)
    assert chunking_left_as_set(model, (1, 1)) and no_hooks_left(model)




