"""A declared adapter's family under test (:class:`Family`: its model builder, its inputs, its blocks and what its
contract needs to know about it) and the checks of the family contract, which tests/backbones/test_family_contract.py
runs over every row of ``helpers.families.FAMILIES``.

Each family's model keeps its release's structure and per-head sizes (head dims, RoPE axes, patch sizes, MLP
ratios, input and text widths) with fewer heads and 1-2 blocks of each kind, so that a forward pass takes
milliseconds on one CPU thread (the builders of ``helpers.image_families`` and ``helpers.video_families`` say how
each is reduced).
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

import tomerge
from tomerge.experiments.measure.flops import FlopCounter

from helpers import no_hooks_left, seeded
from helpers.probes import attentions_of

#: Every sublayer merged.
ALL_SUBLAYERS = dict(merge_attn=True, merge_crossattn=True, merge_mlp=True)


# ---------------------------------------------------------------------- inputs
def select(inputs: dict, i: int, shared: tuple[str, ...] = ()) -> dict:
    """Sample ``i`` of a batch of keyword inputs (lists of per-sample entries too; shared ids stay, and so do the
    inputs named in ``shared``, e.g. frame indices without a batch axis)."""
    return {k: v[i:i + 1] if k not in shared and (isinstance(v, list) or isinstance(v, Tensor) and v.dim() > 0)
            else v for k, v in inputs.items()}


def sharing(*keys: str) -> Callable[[dict, int], dict]:
    """:func:`select` for inputs whose ``keys`` are shared by the samples (position ids ``[N, 3]``, frame indices
    without a batch axis): kept whole."""
    def pick(inputs: dict, i: int) -> dict:
        return select(inputs, i, keys)
    return pick


def to_float64(inputs: dict) -> dict:
    """The inputs with their floating-point tensors (also inside lists: per-sample latents) in float64."""
    def convert(v):
        if isinstance(v, list):
            return [convert(item) for item in v]
        return v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
    return {k: convert(v) for k, v in inputs.items()}


def grid_ids(*axes: int) -> Tensor:
    """Raster-ordered position ids ``[prod(axes), len(axes)]`` (int64)."""
    return torch.cartesian_prod(*[torch.arange(a) for a in axes])


def text_mask(batch: int, text: int, padded: int = 3) -> Tensor:
    """``[B, T]`` bool: the first prompt fills the text, the others are ``padded`` tokens shorter (padding masked)."""
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1:, text - padded:] = False
    return mask


def shuffle_tokens(inputs: dict, perm: Tensor) -> dict:
    """The inputs with the packed image tokens of ``hidden_states [B, N, C]`` in the order ``perm``."""
    return dict(inputs, hidden_states=inputs["hidden_states"][:, perm])


# ---------------------------------------------------------------------- a family
@dataclasses.dataclass(frozen=True)
class JointProbe:
    """Where a family's joint-attention probe is checked against the model's own SDPA call
    (``helpers.probes.check_probe_matches_the_model``): the attention module ``path`` of every block of
    ``containers`` (dotted paths, in layer order), the text before or after the image tokens, whether the inputs mask
    padded text, and ``kinds``: the indices of the adapter's block kinds the check keeps (all if ``None``; FLUX.3: its
    single blocks, the mode blocks' self-attention probe has its own test)."""

    containers: tuple[str, ...]
    path: str = "attn"
    text_first: bool = True
    masked: bool = False
    kinds: tuple[int, ...] | None = None

    def attentions(self, model: nn.Module) -> dict[int, nn.Module]:
        """``{layer: attention module}`` of the blocks, in layer order."""
        return attentions_of(*self.containers, path=self.path)(model)


@dataclasses.dataclass(frozen=True)
class Family:
    """A family under test: its adapter's name, a model builder, an input builder, the model's block lists, and
    what the contract checks need to know about it.

    ``inputs(model, batch=2, grid=..., seed=1, dtype=torch.float32, ...)`` gives keyword inputs of one call whose
    image tokens form ``grid``. A row named after its backbone is the backbone's configuration in the tests that run
    every strategy on every backbone; other rows are variants (another release's configuration) of the same adapter.
    """

    backbone: str
    build: Callable[[], nn.Module]
    inputs: Callable[..., dict]
    containers: tuple[str, ...]  # the block lists (dotted paths), in execution order
    kinds: tuple[str, ...]  # block kinds in execution order
    grid: tuple[int, ...]  # the tests' grid
    half: tuple[int, ...]  # a grid of half as many tokens (the FLOP reference)
    odd: tuple[int, ...]  # a grid with leftover rows/columns (and frames) for 2 x 2 cells
    #: The positions are rotary: a permutation of the slots without the RoPE gather changes the output.
    rope: bool = True
    #: Permutes the image tokens of the inputs (``(inputs, perm) -> inputs``): another control of the permutation.
    shuffle: Callable[[dict, Tensor], dict] | None = None
    #: Ratio 0 and ``remove()`` give the unpatched output bit for bit with each of these strategies.
    strategies: tuple[str, ...] = ("tomesd",)
    #: At ratio 0.5 each of these merges every block on the tests' grid, finite and of the right shape.
    half_strategies: tuple[str, ...] = ("ssm",)
    #: Sample ``i`` of a batch of the family's inputs.
    select: Callable[[dict, int], dict] = select
    #: A batch against its samples alone (float64): ``"exact"`` (to 1e-9), ``"as_unpatched"`` (no further apart than
    #: the unpatched model's, which computes in float32 inside), or why they are not compared.
    batch: str = "exact"
    #: Submodules of the blocks (dotted, below a block) that run on every token whatever is merged: they cost what
    #: they cost unmerged; ``full_length_per_token``: that cost is per token (twice that on the half grid).
    full_length: tuple[str, ...] = ()
    full_length_per_token: bool = False
    #: The joint-attention probe checked against the model's attention (tests/backbones/test_probes.py).
    joint: JointProbe | None = None
    #: The keyword of the call's timestep, and whether the model's time rises over a run (from the noise to the
    #: image: Z-Image's ``t``, Lumina 2's ``1 - t / 1000``, Mochi's inverted sigmas).
    time_key: str = "timestep"
    rising: bool = False


# ---------------------------------------------------------------------- running a model
def run(model: nn.Module, inputs: dict) -> Tensor:
    """The model's output; a list of per-sample outputs (Z-Image) is stacked."""
    with torch.no_grad():
        out = model(**inputs).sample
    return torch.stack(out) if isinstance(out, list) else out


def run_hooked(model: nn.Module, inputs: dict, hooks: list) -> Tensor:
    """:func:`run`, then removes ``hooks`` (the test's recorders), whether the call raises or not."""
    try:
        return run(model, inputs)
    finally:
        for hook in hooks:
            hook.remove()


def flop_counts(model: nn.Module, inputs: dict, containers: tuple[str, ...],
                parts: tuple[str, ...] = ()) -> tuple[int, int, int]:
    """``(whole model, blocks, the blocks' submodules parts)`` FLOPs of one call."""
    counter = FlopCounter()
    with counter:
        run(model, inputs)
    counts = counter.get_flop_counts()
    prefix = type(model).__name__
    blocks = [f"{prefix}.{c}.{i}" for c in containers for i in range(len(model.get_submodule(c)))]
    in_blocks = sum(sum(counts.get(block, {}).values()) for block in blocks)
    in_parts = sum(sum(counts.get(f"{block}.{part}", {}).values()) for block in blocks for part in parts)
    return counter.get_total_flops(), in_blocks, in_parts


@dataclasses.dataclass(frozen=True, kw_only=True)
class Permute(tomerge.MergeStrategy):
    """Removes nothing: slot ``m`` of sample ``b`` is token ``perm_b[m]`` (another permutation per sample). The
    merged model equals the plain one only if every slot carries its token's position (RoPE gathered)."""

    name = "test_permute"

    def select_destinations(self, x, ctx):
        g = torch.Generator().manual_seed(x.shape[1])
        return torch.stack([torch.randperm(x.shape[1], generator=g) for _ in range(x.shape[0])])  # [B, N]

    def merge_matrix(self, x, dst, ctx):
        return tomerge.MergePlan.hard(dst.argsort(dim=1), dst, backend="index")  # assign[b, dst[b, m]] = m


def without_rope(adapter: type) -> tuple:
    """The adapter's kinds with no RoPE gather: the control of the permutation test."""
    return tuple(dataclasses.replace(k, sites=tuple(dataclasses.replace(s, rope=None) for s in k.sites))
                 for k in adapter.kinds)


# ---------------------------------------------------------------------- the contract's checks
def check_bit_identical(model: nn.Module, inputs: dict, strategy: str = "tomesd", **options) -> None:
    """Ratio 0 and ``remove()`` give the unpatched output bit for bit, ratio 0.5 another one; no hook is left."""
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
    SANA, the depthwise convolution that stays at full length: at most 5% more). The blocks' submodules of
    ``family.full_length`` cost what they cost unmerged (twice what they cost on the half grid where the cost is per
    token), the rest of the blocks what half the tokens cost. Returns the whole model's FLOP ratio unmerged /
    merged."""
    inputs, half = family.inputs(model, grid=family.grid), family.inputs(model, grid=family.half)
    base_total, base_blocks, base_full = flop_counts(model, inputs, family.containers, family.full_length)
    _, half_blocks, half_full = flop_counts(model, half, family.containers, family.full_length)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        total, blocks, merged_full = flop_counts(model, inputs, family.containers, family.full_length)
        records = handle.state.records
    N = math.prod(family.grid)
    assert records and all(r.num_tokens == N and r.num_removed == N // 2 for r in records)
    if family.full_length:
        assert merged_full == base_full > half_full > 0, (merged_full, base_full, half_full)
        assert base_full == 2 * half_full or not family.full_length_per_token, (base_full, half_full)
    rest, half_rest = blocks - merged_full, half_blocks - half_full
    assert half_rest <= rest <= 1.05 * half_rest, (rest, half_rest)
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
        perm = torch.randperm(N, generator=seeded(3))
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


def check_batch_as_close_as_unpatched(model: nn.Module, inputs: dict,
                                      select_sample: Callable[[dict, int], dict] = select) -> None:
    """float64, for a model that computes in float32 inside (Hunyuan-DiT's FP32LayerNorms and FP32SiLU): its batch
    and its samples alone differ by ~1e-7 unmerged already; merged they differ no more than 10 times that (another
    plan in the batch than alone would differ by ~1e-2)."""
    model64, inputs64 = copy.deepcopy(model).double(), to_float64(inputs)

    def batch_minus_samples() -> float:
        alone = torch.cat([run(model64, select_sample(inputs64, i)) for i in range(2)])
        return float((run(model64, inputs64) - alone).abs().max())

    unmerged = batch_minus_samples()
    with tomerge.merging(model64, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged = batch_minus_samples()
        assert handle.stats["tokens_removed"] > 0
    assert unmerged < 1e-5 and merged <= 10 * unmerged, (merged, unmerged)


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
