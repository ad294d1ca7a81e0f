"""The declared adapters of current image transformers, `flux2` (FLUX.2), `qwenimage` (Qwen-Image) and `sana`
(SANA), on random-weight diffusers models built from their released configurations, reduced.

Each model keeps its release's structure and per-head sizes (head dims, RoPE axes, patch sizes, MLP ratios,
input and text widths) with fewer heads and 1-2 blocks of each kind, so that a forward pass takes milliseconds
on one CPU thread. Checks: ratio 0 and ``remove()`` are bit-identical to the unpatched model; ratio 0.5 is
finite, of the right shape, and its blocks cost what the unpatched blocks cost on half the tokens; a
permutation "merge" (slots = all tokens, reordered per sample) gives the unpatched output, which holds only if
every slot carries its token's rotary position; a batch equals its samples alone (float64); grids with
leftover rows (editing calls with reference images: ``test_reference_images.py``). The helpers here are shared
with ``test_backbones_video.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.backbones._declared import DeclaredAdapter, DeclaredPoint
from tomerge.backbones._gather import BatchedComplexTable, gather_key_mask, gather_rope
from tomerge.experiments.measure.flops import FlopCounter


# ---------------------------------------------------------------------- families
@dataclasses.dataclass(frozen=True)
class Family:
    """A family under test: its adapter name, a model builder, an input builder and the model's block lists.

    ``inputs(model, batch, grid, seed, dtype)`` gives keyword inputs whose image tokens form ``grid``.
    """

    backbone: str
    build: Callable[[], nn.Module]
    inputs: Callable[..., dict]
    containers: tuple[str, ...]
    kinds: tuple[str, ...]  # block kinds in execution order
    grid: tuple[int, ...]  # the tests' grid
    half: tuple[int, ...]  # a grid of half as many tokens (the FLOP reference)
    odd: tuple[int, ...]  # a grid with leftover rows/columns for 2 x 2 cells
    rope: bool = True


def _seed(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def build_flux2() -> nn.Module:
    """FLUX.2-dev's config (patch 1, 128 input channels, head dim 128, RoPE axes (32, 32, 32, 32), theta 2000,
    MLP ratio 3, text width 15360, guidance embedding) with 2 heads instead of 48, 1 double + 1 single block
    instead of 8 + 48."""
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=1, attention_head_dim=128,
        num_attention_heads=2, joint_attention_dim=15360, timestep_guidance_channels=256, mlp_ratio=3.0,
        axes_dims_rope=(32, 32, 32, 32), rope_theta=2000, guidance_embeds=True).eval()


def _ids(*axes: int) -> Tensor:
    return torch.cartesian_prod(*[torch.arange(a) for a in axes])


def flux2_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                 text: int = 8) -> dict:
    g = _seed(seed)
    H, W = grid
    return dict(
        hidden_states=torch.randn(batch, H * W, 128, generator=g).to(dtype),  # packed latent [B, N, 128]
        encoder_hidden_states=torch.randn(batch, text, 15360, generator=g).to(dtype),
        timestep=torch.full((batch,), 0.5, dtype=dtype), guidance=torch.full((batch,), 4.0, dtype=dtype),
        img_ids=_ids(1, H, W, 1)[None].expand(batch, -1, -1),  # (t, h, w, l) as Flux2Pipeline builds them
        txt_ids=_ids(1, 1, 1, text)[None].expand(batch, -1, -1))


def build_qwenimage() -> nn.Module:
    """Qwen-Image's config (patch 2, 64 packed input channels, 16 out, head dim 128, RoPE axes (16, 56, 56),
    text width 3584) with 2 heads instead of 24, 2 blocks instead of 60."""
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=128, num_attention_heads=2,
        joint_attention_dim=3584, axes_dims_rope=(16, 56, 56)).eval()


def qwenimage_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                     text: int = 8) -> dict:
    g = _seed(seed)
    H, W = grid
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[1:, text - 3:] = 0  # padded prompts after the first: the text mask must keep working
    return dict(
        hidden_states=torch.randn(batch, H * W, 64, generator=g).to(dtype),
        encoder_hidden_states=torch.randn(batch, text, 3584, generator=g).to(dtype),
        encoder_hidden_states_mask=mask, timestep=torch.full((batch,), 0.5, dtype=dtype),
        img_shapes=[[(1, H, W)]] * batch)


def build_sana() -> nn.Module:
    """SANA 1600M's config (32 latent channels, patch 1, head dim 32, MLP ratio 2.5, Gemma-2 caption width 2304,
    cross-attention head dim 112 -> here 128, no attention bias) with 8 heads (width 256) instead of 70 (2240)
    and 2 cross-attention heads, 2 blocks instead of 20."""
    from diffusers import SanaTransformer2DModel

    torch.manual_seed(0)
    return SanaTransformer2DModel(
        in_channels=32, out_channels=32, num_attention_heads=8, attention_head_dim=32, num_layers=2,
        num_cross_attention_heads=2, cross_attention_head_dim=128, cross_attention_dim=256, caption_channels=2304,
        mlp_ratio=2.5, sample_size=32, patch_size=1).eval()


def sana_inputs(model: nn.Module, batch: int = 2, grid=(8, 8), seed: int = 1, dtype=torch.float32,
                text: int = 8) -> dict:
    g = _seed(seed)
    mask = torch.ones(batch, text)
    mask[1:, text - 2:] = 0
    return dict(hidden_states=torch.randn(batch, 32, *grid, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, text, 2304, generator=g).to(dtype),
                encoder_attention_mask=mask.to(dtype), timestep=torch.full((batch,), 500.0, dtype=dtype))


FAMILIES = {
    "flux2": Family("flux2", build_flux2, flux2_inputs, ("transformer_blocks", "single_transformer_blocks"),
                    ("double", "single"), (8, 8), (8, 4), (5, 7)),
    "qwenimage": Family("qwenimage", build_qwenimage, qwenimage_inputs, ("transformer_blocks",),
                        ("joint", "joint"), (8, 8), (8, 4), (7, 5)),
    "sana": Family("sana", build_sana, sana_inputs, ("transformer_blocks",), ("sana", "sana"), (8, 8), (8, 4),
                   (5, 7), rope=False),
}
ALL_SUBLAYERS = dict(merge_attn=True, merge_crossattn=True, merge_mlp=True)


# ---------------------------------------------------------------------- helpers (also used by the video tests)
def run(model: nn.Module, inputs: dict) -> Tensor:
    """The model's output; a list of per-sample outputs (Z-Image) is stacked."""
    with torch.no_grad():
        out = model(**inputs).sample
    return torch.stack(out) if isinstance(out, list) else out


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def flop_counts(model: nn.Module, inputs: dict, containers: tuple[str, ...]) -> tuple[int, int]:
    """``(whole model, blocks only)`` FLOPs of one call."""
    counter = FlopCounter()
    with counter:
        run(model, inputs)
    counts = counter.get_flop_counts()
    prefix = type(model).__name__
    blocks = sum(sum(counts.get(f"{prefix}.{c}.{i}", {}).values())
                 for c in containers for i in range(len(model.get_submodule(c))))
    return counter.get_total_flops(), blocks


def select(inputs: dict, i: int, shared: tuple[str, ...] = ()) -> dict:
    """Sample ``i`` of a batch of keyword inputs (lists of per-sample entries too; shared ids stay, and so do the
    inputs named in ``shared``, e.g. frame indices without a batch axis)."""
    return {k: v[i:i + 1] if k not in shared and (isinstance(v, list) or isinstance(v, Tensor) and v.dim() > 0)
            else v for k, v in inputs.items()}


def to_float64(inputs: dict) -> dict:
    """The inputs with their floating-point tensors (also inside lists: per-sample latents) in float64."""
    def convert(v):
        if isinstance(v, list):
            return [convert(item) for item in v]
        return v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
    return {k: convert(v) for k, v in inputs.items()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class Permute(tomerge.MergeStrategy):
    """Removes nothing: slot ``m`` of sample ``b`` is token ``perm_b[m]`` (another permutation per sample). The
    merged model equals the plain one only if every slot carries its token's position (RoPE gathered)."""

    name = "test_declared_permute"

    def select_destinations(self, x, ctx):
        g = torch.Generator().manual_seed(x.shape[1])
        return torch.stack([torch.randperm(x.shape[1], generator=g) for _ in range(x.shape[0])])  # [B, N]

    def merge_matrix(self, x, dst, ctx):
        return tomerge.MergePlan.hard(dst.argsort(dim=1), dst, backend="index")


def check_bit_identical(model: nn.Module, inputs: dict, strategy: str = "tomesd", **options) -> None:
    before = run(model, inputs)
    with tomerge.merging(model, strategy, ratio=0.0, **options):
        assert torch.equal(run(model, inputs), before)
    handle = tomerge.apply(model, strategy, ratio=0.5, **options)
    merged = run(model, inputs)
    assert handle.stats["tokens_removed"] > 0 and not torch.equal(merged, before)
    handle.remove()
    assert torch.equal(run(model, inputs), before)
    assert no_hooks_left(model) and "_tomerge_handle" not in model.__dict__


def check_flops(model: nn.Module, family: Family, label: str) -> float:
    """At ratio 0.5 (tomesd, 2 x 2 cells, every sublayer) every block runs on half the image tokens: its FLOPs
    are those of the unpatched block on a grid of half the tokens (plus tomesd's similarity matmul and, for
    SANA, the depthwise convolution that stays at full length: at most 5% more). Returns the whole model's
    FLOP ratio unmerged / merged."""
    inputs, half = family.inputs(model, grid=family.grid), family.inputs(model, grid=family.half)
    base_total, base_blocks = flop_counts(model, inputs, family.containers)
    _, half_blocks = flop_counts(model, half, family.containers)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        total, blocks = flop_counts(model, inputs, family.containers)
        records = handle.state.records
    N = math.prod(family.grid)
    assert records and all(r.num_tokens == N and r.num_removed == N // 2 for r in records)
    assert half_blocks <= blocks <= 1.05 * half_blocks, (blocks, half_blocks)
    assert total < base_total
    print(f"\nFLOPs {label:16s} ratio 0.5: blocks {base_blocks / blocks:.3f}x fewer ({base_blocks} -> {blocks}; "
          f"on half the tokens {half_blocks}), whole model {base_total / total:.3f}x ({base_total} -> {total})")
    return base_total / total


def check_permutation_is_exact(model: nn.Module, inputs: dict, shuffle: Callable[[dict, Tensor], dict] | None,
                               N: int, **options) -> None:
    """Merged with :class:`Permute` the model gives its plain output, up to the rounding of float32 sums taken in
    another order (1.6e-5 seen on one CPU; the control's positions off by a permutation are over 1e-3 away)."""
    before = run(model, inputs)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS, **options) as handle:
        out = run(model, inputs)
        assert handle.state.records and all(set(r.sublayers) >= {"attn", "mlp"} for r in handle.state.records)
    torch.testing.assert_close(out, before, rtol=1e-4, atol=5e-5)
    if shuffle is not None:  # control: positions matter, so a permutation without the RoPE gather is far off
        perm = torch.randperm(N, generator=_seed(3))
        assert (run(model, shuffle(inputs, perm)) - before).abs().max() > 1e-3


def check_inference_mode(model: nn.Module, inputs: dict) -> None:
    """Inference tensors (``torch.inference_mode``, what benchmarks and pipelines use) have no version counter:
    the adapters must not read one. The merged output equals the ``no_grad`` one."""
    with tomerge.merging(model, "ssm", ratio=0.5, round_windows=1, **ALL_SUBLAYERS):
        expected = run(model, inputs)
        with torch.inference_mode():
            out = run(model, inputs)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def check_batch_equals_samples(model: nn.Module, inputs: dict, select_sample: Callable[[dict, int], dict] = select,
                               **options) -> None:
    """float64: a batch and its samples alone give the same merged outputs (tomesd without randomness plans
    per sample from the same values). ``select_sample(inputs, i)``: sample ``i`` of the inputs (default
    :func:`select`: the batch is the first axis)."""
    model64, inputs64 = copy.deepcopy(model).double(), to_float64(inputs)
    outs = []
    for part in (inputs64, select_sample(inputs64, 0), select_sample(inputs64, 1)):
        with tomerge.merging(model64, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS, **options) as handle:
            outs.append(run(model64, part))
            assert handle.stats["tokens_removed"] > 0
    torch.testing.assert_close(outs[0], torch.cat(outs[1:]), rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    return {name: family.build() for name, family in FAMILIES.items()}


# ---------------------------------------------------------------------- every family
@pytest.mark.parametrize("name", FAMILIES)
def test_finds_the_transformer_and_its_blocks_in_order(models, name):
    family, model = FAMILIES[name], models[name]
    with tomerge.merging(types.SimpleNamespace(transformer=model), "tomesd", ratio=0.5) as handle:
        assert handle.model is model and handle.adapter.name == family.backbone
        assert isinstance(handle.adapter, DeclaredAdapter)
        specs = handle.adapter.blocks()
        assert [s.kind for s in specs] == list(family.kinds)
        assert [s.module for s in specs] == [b for c in family.containers for b in getattr(model, c)]
        assert [s.layer for s in specs] == list(range(len(specs)))


@pytest.mark.parametrize("strategy", ["tomesd", "ssm", "facility_location"])
@pytest.mark.parametrize("name", FAMILIES)
def test_ratio_zero_and_remove_are_bit_identical(models, name, strategy):
    model = models[name]
    options = {"tomesd": {"use_rand": False}, "facility_location": {"num_tiles": 4}}.get(strategy, {})
    check_bit_identical(model, FAMILIES[name].inputs(model), strategy, **options)


@pytest.mark.parametrize("strategy", ["tomesd", "ssm", "facility_location"])
@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_is_finite_and_of_the_right_shape(models, name, strategy):
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    options = {"facility_location": {"num_tiles": 4}, "ssm": {"round_windows": 1}}.get(strategy, {})
    with tomerge.merging(model, strategy, ratio=0.5, **options, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        records = handle.state.records
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert [r.block_kind for r in records] == list(family.kinds) and all(r.num_removed > 0 for r in records)


@pytest.mark.parametrize("name", FAMILIES)
def test_half_ratio_blocks_cost_what_half_the_tokens_cost(models, name):
    check_flops(models[name], FAMILIES[name], name)


def _shuffle_flux2(inputs: dict, perm: Tensor) -> dict:
    return dict(inputs, hidden_states=inputs["hidden_states"][:, perm])


def _shuffle_qwen(inputs: dict, perm: Tensor) -> dict:
    return dict(inputs, hidden_states=inputs["hidden_states"][:, perm])


@pytest.mark.parametrize("name", FAMILIES)
def test_permuted_slots_give_the_unpatched_output(models, name):
    """Exact only if RoPE rows follow their tokens (FLUX.2's text-first rows, Qwen's separate image table) and,
    for SANA, if the 1x1 convolutions' tokens are unmerged back onto the grid before the depthwise conv."""
    family, model = FAMILIES[name], models[name]
    shuffle = {"flux2": _shuffle_flux2, "qwenimage": _shuffle_qwen}.get(name)
    for grid in (family.grid, family.odd):
        check_permutation_is_exact(model, family.inputs(model, grid=grid, seed=4), shuffle, math.prod(grid))


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", FAMILIES)
def test_a_batch_equals_its_samples_alone(models, name):
    family, model = FAMILIES[name], models[name]
    check_batch_equals_samples(model, family.inputs(model, seed=5))


def check_odd_grid_merges(model: nn.Module, family: Family) -> None:
    """On the family's grid with leftover rows (and frames): every block merges all of its tokens' grid, and
    the output is finite, of the right shape, with no hook left."""
    inputs = family.inputs(model, grid=family.odd, seed=6)
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        out = run(model, inputs)
        assert handle.adapter.grid_size == family.odd
        assert all(r.num_tokens == math.prod(family.odd) and r.num_removed > 0 for r in handle.state.records)
    assert out.shape == before.shape and torch.isfinite(out).all()
    assert no_hooks_left(model)


@pytest.mark.parametrize("name", FAMILIES)
def test_grids_with_leftover_rows_merge(models, name):
    check_odd_grid_merges(models[name], FAMILIES[name])


# ---------------------------------------------------------------------- family specifics
def test_flux2_single_block_runs_its_parallel_attention_and_mlp_merged(models):
    """With attention and MLP merged, a FLUX.2 single block runs its whole parallel attention + MLP merged
    (``to_out`` is called inside the attention, on text + merged image tokens) and unmerges once, after
    ``to_out`` (the permutation test checks that this is exact)."""
    model = models["flux2"]
    inputs = flux2_inputs(model, seed=7)
    seen: list[int] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        block = model.single_transformer_blocks[0]
        hooks = [block.attn.to_out.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1])),
                 block.register_forward_hook(lambda m, args, kwargs, out: seen.append(out.shape[1]), with_kwargs=True)]
        try:
            out = run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == [8 + 32, 8 + 64]  # to_out on text + merged image tokens; the block returns the full sequence


def test_flux2_mlp_only_merges_to_out_and_leaves_the_attention_at_full_length(models):
    model = models["flux2"]
    inputs = flux2_inputs(model, seed=8)
    seen: list[int] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [m.register_forward_pre_hook(lambda m, args, kwargs: seen.append(  # after tomerge's hooks
            (kwargs.get("hidden_states", args[0] if args else None)).shape[1]), with_kwargs=True)
            for m in (model.single_transformer_blocks[0].attn, model.transformer_blocks[0].ff)]
        hooks.append(model.single_transformer_blocks[0].attn.to_out.register_forward_pre_hook(
            lambda m, args: seen.append(args[0].shape[1])))
        try:
            out = run(model, inputs)
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == [32, 8 + 64, 8 + 32]  # double ff merged; single attn full length; to_out merged


def test_flux2_timestep_in_the_unit_interval_gives_progress(models):
    model = models["flux2"]
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        run(model, flux2_inputs(model, grid=(4, 4)))
        inputs = flux2_inputs(model, grid=(4, 4))
        inputs["timestep"] = torch.full((2,), 0.25)
        run(model, inputs)
        assert handle.state.clock.step == 1 and handle.state.clock.progress == pytest.approx(0.75)


def test_sana_mlp_convolutions_run_on_merged_tokens(models):
    model = models["sana"]
    block = model.transformer_blocks[0]
    seen: dict[str, list] = {"inverted": [], "depth": [], "point": []}
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_mlp=True):
        hooks = [getattr(block.ff, f"conv_{k}").register_forward_pre_hook(  # after tomerge's hooks
            lambda m, args, k=k: seen[k].append(tuple(args[0].shape[2:]))) for k in seen]
        try:
            out = run(model, sana_inputs(model))
        finally:
            for h in hooks:
                h.remove()
    assert torch.isfinite(out).all()
    assert seen == {"inverted": [(32, 1)], "depth": [(8, 8)], "point": [(32, 1)]}


def test_sana_t_max_follows_timestep_scale():
    from diffusers import SanaTransformer2DModel

    from tomerge.backbones.sana import SanaAdapter

    model = SanaTransformer2DModel(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
                                   num_layers=1, num_cross_attention_heads=1, cross_attention_head_dim=16,
                                   cross_attention_dim=16, caption_channels=8, timestep_scale=0.5)
    assert SanaAdapter(model, None).t_max == 500.0


# ---------------------------------------------------------------------- the gathers
def test_gather_rope_layouts_match_hand_built_tables():
    dst = torch.tensor([[2, 0], [1, 1]])  # [B=2, M=2]
    rows = torch.arange(5.0)[:, None].expand(5, 3)  # 2 text rows, then N = 3 image rows
    c, _ = gather_rope((rows, rows), dst, 3, "rows")
    assert torch.equal(c.table[:, :, 0], torch.tensor([[0.0, 1, 4, 2], [0, 1, 3, 3]]))
    batched = torch.arange(6.0).view(2, 3, 1)  # [B, N, d]
    c, _ = gather_rope((batched, batched), dst, 3, "batched")
    assert torch.equal(c[..., 0], torch.tensor([[2.0, 0], [4, 4]]))
    shared, _ = gather_rope((batched[:1], batched[:1]), dst, 3, "batched")
    assert torch.equal(shared[..., 0], torch.tensor([[2.0, 0], [1, 1]]))
    image = torch.arange(3.0).to(torch.complex64)[:, None]  # [N, d/2]
    text = torch.zeros(4, 1, dtype=torch.complex64)
    gathered, kept = gather_rope((image, text), dst, 3, "qwen")
    assert isinstance(gathered, BatchedComplexTable) and kept is text
    assert torch.equal(gathered.unsqueeze(1)[:, :, 0, 0].real, torch.tensor([[2.0, 0], [1, 1]]))
    one, _ = gather_rope((image, text), dst[:1], 3, "qwen")
    assert torch.equal(one[:, 0].real, torch.tensor([2.0, 0]))
    with pytest.raises(TypeError, match="unsqueeze"):
        gathered.unsqueeze(0)


def test_gather_key_mask_keeps_text_and_follows_the_slots():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]).bool()[:, None, None]  # [B, 1, 1, 3 image + 2 text]
    out = gather_key_mask(mask, torch.tensor([[2, 1], [0, 0]]), 3, "last")
    assert out[:, 0, 0].tolist() == [[False, True, True, False], [False, False, True, True]]
    first = gather_key_mask(mask, torch.tensor([[0, 2]]), 3, "first")  # text first: columns 0-1 text
    assert first[:, 0, 0].tolist() == [[True, True, False, False], [False, True, True, True]]


def test_a_declared_point_refuses_a_mask_it_cannot_merge(models):
    model = models["flux2"]
    inputs = flux2_inputs(model, grid=(4, 4))
    inputs["joint_attention_kwargs"] = {"attention_mask": torch.ones(2, 1, 1, 8 + 16, dtype=torch.bool)}
    with tomerge.merging(model, "tomesd", ratio=0.5):
        with pytest.raises(ValueError, match="attention mask"):
            run(model, inputs)
    assert isinstance(DeclaredPoint, type)


# ---------------------------------------------------------------------- a pipeline from a local folder
def generate(pipe, family: str, seeds=(0, 1)) -> Tensor:
    """A 2-prompt, 2-step generation of a tiny pipeline of ``local_pipelines`` (images or video frames)."""
    import local_pipelines

    out = pipe(prompt=["a photo of a cat", "a red car in the city"], output_type="pt",
               generator=[torch.Generator().manual_seed(s) for s in seeds],
               **local_pipelines.CURRENT_CALL_DEFAULTS[family])
    return out.images if hasattr(out, "images") else out.frames


def load_tiny_pipeline(family: str):
    import local_pipelines
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(local_pipelines.pipeline_folder(family), local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")
def test_sana_pipeline_loaded_from_a_local_folder_merges_and_is_restored(monkeypatch):
    """SanaPipeline (Gemma-2 text encoder, DC-AE, DPM-Solver flow) saved and loaded offline: ``merging(pipe)``
    patches its transformer, the scheduler gives the step (batched guidance: one call per step), the images
    change and are bit-identical again afterwards."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pipe = load_tiny_pipeline("sana")
    assert type(pipe).__name__ == "SanaPipeline"
    before = generate(pipe, "sana")
    assert torch.equal(generate(pipe, "sana"), before)
    with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False) as handle:
        merged = generate(pipe, "sana")
        assert handle.model is pipe.transformer and handle.adapter.name == "sana"
        assert [r.step for r in handle.state.records] == [0, 0, 1, 1] and handle.state.clock.num_steps == 2
        assert all(r.num_tokens == 256 and r.num_removed == 128 for r in handle.state.records)
    assert merged.shape == before.shape == (2, 3, 32, 32) and torch.isfinite(merged).all()
    assert not torch.equal(merged, before)
    assert torch.equal(generate(pipe, "sana"), before)
