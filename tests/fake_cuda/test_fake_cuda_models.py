"""Every strategy and schedule on SD3-Medium, FLUX.1-dev, SDXL and Wan 2.1 14B at their real sizes, bf16 on fake
``cuda`` tensors (the GPU's stand-in, :mod:`helpers.fake_cuda`): no device, dtype or shape error; host reads only where
docs/compile.md says, at most one per model call from each place, none inside a block call; merging and reuse
happen; and the bytes tomerge keeps stay under a stated bound and stop growing once the caches are full.

The sweep runs the short models: the real configs (widths, heads, token counts, text lengths, batch, every block
kind) with fewer blocks (``ModelSpec.short``), so that every method on every model fits in about two minutes on 2
CPU cores. The full-depth models run the composition ``fora+toma`` here and every method with ``-m slow``; the
50-step memory table of the full-depth models is ``scripts/kept_memory.py``'s. The suite's one stand-in beyond the
fake tensors: ``MergeState._generator`` hands out CPU generators (``harness.cpu_generators``), because a CUDA
generator needs a driver.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from helpers import fake_cuda as harness
from helpers.fake_cuda import METHODS, MODELS, BlockGeometry, ModelSpec, Read, Trajectory

pytestmark = pytest.mark.fake_cuda

STEPS = 5
# taylorseer stores on steps 0, 1, 5, 9, 13, 17: its 5 Taylor terms are all there after step 13
LONG = {"taylorseer": 18}
FULL_AFTER = {"taylorseer": 13}  # the step after which no cache grows (default: STEPS // 2)

MERGES = {"tomesd", "ssm", "idm", "facility_location", "toma", "toma_release", "sdtm", "sdtm_release", "sdtm_paper",
          "cached_detail", "fresh_tokens", "toca", "fora+toma", "toma(group_size=1)"}
REUSES = {"block_cache", "fora", "taylorseer", "first_block_cache", "fora+toma"}
# A label of the block calls that show the method's reuse path ran (besides merged and reused counts).
LABELS = {"taylorseer": "forecast", "toca": "toca", "cached_detail": "full", "sdtm_release": "protected",
          "sdtm": "detail", "sdtm_paper": "detail"}
# What each method may keep across model calls (MergeState.kept_tensors' kinds).
TOKEN_STATE = {"streaks", "attention", "destinations"}
KEEPS = {
    "tomesd": set(), "facility_location": set(), "ssm": TOKEN_STATE, "idm": TOKEN_STATE, "sdtm": TOKEN_STATE,
    "sdtm_paper": TOKEN_STATE, "fresh_tokens": TOKEN_STATE, "toma": TOKEN_STATE | {"plans"},
    "toma_release": TOKEN_STATE | {"plans"}, "toma(group_size=1)": TOKEN_STATE | {"plans"},
    "sdtm_release": TOKEN_STATE | {"feature_cache"}, "toca": TOKEN_STATE | {"feature_cache"},
    "cached_detail": TOKEN_STATE | {"plans", "feature_cache"},
    "block_cache": {"block_cache"}, "fora": {"block_cache"}, "taylorseer": {"block_cache"},
    "first_block_cache": {"block_cache", "change_signal"}, "fora+toma": TOKEN_STATE | {"plans", "block_cache"},
}
FORECAST_ORDER = {"taylorseer": 4}
TOMA_TILES = 64  # toma's num_tiles (its default)


def steps_of(method: str) -> int:
    return LONG.get(method, STEPS)


# ---------------------------------------------------------------------- shared builds and runs
class Runs:
    """The models (built once per module) and their trajectories (run once, read by several tests)."""

    def __init__(self, short: bool) -> None:
        self.short = short
        self.models: dict[str, Any] = {}
        self.geometries: dict[str, list[BlockGeometry]] = {}
        self.trajectories: dict[tuple[str, str], Trajectory] = {}

    def model(self, name: str) -> Any:
        if name not in self.models:
            self.models[name] = harness.build(name, short=self.short)
        return self.models[name]

    def geometry(self, name: str) -> list[BlockGeometry]:
        if name not in self.geometries:
            mode, model = self.model(name)
            self.geometries[name] = harness.geometry(MODELS[name], model, mode)
        return self.geometries[name]

    def trajectory(self, name: str, method: str, steps: int | None = None) -> Trajectory:
        key = (name, method)
        if key not in self.trajectories:
            mode, model = self.model(name)
            self.trajectories[key] = harness.run(MODELS[name], model, mode, method, steps or steps_of(method),
                                                 harness.method_options(method, self.short))
        return self.trajectories[key]


@pytest.fixture(scope="module")
def short() -> Runs:
    return Runs(short=True)


@pytest.fixture(scope="module")
def full() -> Runs:
    return Runs(short=False)


# ---------------------------------------------------------------------- the checks
def check_ran(t: Trajectory, spec: ModelSpec, steps: int) -> None:
    """No error; every call's output has the latent's shape, on cuda, in bf16."""
    if t.error is not None:
        raise AssertionError(f"{type(t.error).__name__}: {t.error}") from t.error
    assert len(t.outputs) == steps * spec.calls_per_step
    latent = (spec.batch, spec.tokens, spec.latent[2] * 4) if spec.name == "flux" else (spec.batch, *spec.latent)
    for out in t.outputs:
        assert (tuple(out.shape), out.device.type, out.dtype) == (latent, "cuda", torch.bfloat16)


PLACES = {
    "clock": lambda r: r.within("TrajectoryClock.observe"),
    "criterion": lambda r: r.within("relative_l1") or r.within("ChangeSignal.measure"),
    "adapter": lambda r: r.within("on_model_call"),
}


def place(read: Read) -> str | None:
    found = [name for name, test in PLACES.items() if test(read)]
    return found[0] if found else None


def check_reads(t: Trajectory, spec: ModelSpec, method: str) -> None:
    """Host reads (docs/compile.md, "CUDA graphs"): none inside a block call; the trajectory clock reads each model
    call's timestep once; first_block_cache's criterion reads its change at most once per call (and in every call
    after the first step); the FLUX adapter copies ``img_ids`` to the host once for the whole trajectory (the same
    tensor every call); nothing else."""
    assert not t.violations, t.violations
    assert not [r for r in t.reads if r.in_block], [r for r in t.reads if r.in_block]
    assert not [r for r in t.reads if place(r) is None], [r for r in t.reads if place(r) is None]
    per_place = {name: {} for name in PLACES}
    for read in t.reads:
        counts = per_place[place(read)]
        counts[read.call] = counts.get(read.call, 0) + 1
    assert per_place["clock"] == {call: 1 for call in range(t.calls)}
    assert all(r.known for r in t.reads if place(r) in ("clock", "adapter"))  # they read inputs, nothing computed
    criterion = per_place["criterion"]
    if harness.method_name(method) == "first_block_cache":
        assert max(criterion.values()) == 1 and set(range(spec.calls_per_step, t.calls)) <= set(criterion)
    else:
        assert not criterion
    assert sum(per_place["adapter"].values()) == (1 if spec.name == "flux" else 0), per_place["adapter"]


def check_work(t: Trajectory, method: str) -> None:
    """``handle.stats`` and the recorded labels show that the method merged / reused where it does."""
    stats = t.stats
    if method in MERGES:
        assert stats["merged_calls"] > 0 and stats["tokens_removed"] > 0, stats
    else:
        assert stats["merged_calls"] == 0, stats
    if method in REUSES:
        assert stats["reused_calls"] > 0, stats
    else:
        assert stats["reused_calls"] == 0, stats
    if method in LABELS:
        assert t.labels.get(LABELS[method], 0) > 0, t.labels


def toma_soft_plan_bytes(spec: ModelSpec, tokens: int) -> int:
    """The two weight tensors of a tiled soft plan (``[B, T, d, s]`` and ``[B, T, s, d]``, fp32, ``d <= s``) over a
    grid of ``tokens`` tokens: ``2 * B * T * s^2 * 4`` with tiles of ``t x t``, ``t = round(sqrt(H W / 64))``,
    ``T`` tiles per frame padded to whole tiles."""
    frames = spec.latent[1] if spec.name == "wan" else 1
    H = W = int(math.isqrt(tokens // frames))
    if spec.name == "wan":  # 30 x 52 per frame
        H, W = spec.latent[2] // 2, spec.latent[3] // 2
    t = max(1, round(math.sqrt(H * W / TOMA_TILES)))
    tiles = frames * math.ceil(H / t) * math.ceil(W / t)
    return 2 * spec.batch * tiles * t ** 4 * 4


def kept_bounds(spec: ModelSpec, blocks: list[BlockGeometry], method: str) -> dict[str, int]:
    """Upper bounds of the bytes per kind (``calls``: model calls per step, each call index keeps its own; ``B, N``:
    batch and image tokens of a merged block; only the blocks at the merged resolution count for merging state):

    * token state (streaks, received attention, kept destinations): ``calls * L * B * N * 8`` each (fp32 or int64);
    * plans: ``calls * L * (B * N * (8 + 8 + 1) + soft)``: destinations and assignment (int64), the merged mask
      (bool), and for toma's tiled soft plans their two weight tensors (:func:`toma_soft_plan_bytes`);
    * feature cache: ``calls * sum over merge points of 2 * (numel of the point's whole output) * 2``: each point's
      output and a reference, bf16;
    * block cache: ``calls * sum over blocks of (order + 1) * (numel of the streams a block replaces) * 4``: the
      residual and its Taylor terms, fp32 at most;
    * change signal: ``calls * 2 * (numel of the first block's image stream) * 4``: the last and the reference
      residual.
    """
    calls, B, N = spec.calls_per_step, spec.batch, spec.tokens
    merged = [b for b in blocks if b.tokens == N]
    L = len(merged)
    soft = toma_soft_plan_bytes(spec, N) if "toma" in method else 0
    token = calls * L * B * N * 8
    return {
        "streaks": token, "attention": token, "destinations": token,
        "plans": calls * L * (B * N * 17 + soft),
        "feature_cache": calls * sum(2 * n * 2 for b in merged for n in b.point_numels),
        "block_cache": calls * sum((FORECAST_ORDER.get(method, 0) + 1) * b.stream_numel * 4 for b in blocks),
        "change_signal": calls * 2 * blocks[0].image_numel * 4,
    }


def check_kept(t: Trajectory, spec: ModelSpec, blocks: list[BlockGeometry], method: str) -> None:
    """The kinds kept are the method's; each under its bound (:func:`kept_bounds`); after the step from which the
    caches are full, no step keeps more than the most kept up to it (no growth with the number of steps)."""
    bounds = kept_bounds(spec, blocks, method)
    for step, kinds in enumerate(t.kept_by_kind):
        assert set(kinds) <= KEEPS[method], (step, kinds)
        over = {k: (v, bounds[k]) for k, v in kinds.items() if v > bounds[k]}
        assert not over, (step, over)
    full = FULL_AFTER.get(method, len(t.kept_bytes) // 2)
    assert max(t.kept_bytes[full + 1:]) <= max(t.kept_bytes[:full + 1]), t.kept_bytes
    if KEEPS[method] - TOKEN_STATE:  # a method keeping caches has kept something
        assert max(t.kept_bytes) > 0


# ---------------------------------------------------------------------- the sweep (short models)
SWEEP = [(name, method) for name in MODELS for method in METHODS]
IDS = [f"{name}-{method}" for name, method in SWEEP]


@pytest.mark.parametrize("name,method", SWEEP, ids=IDS)
def test_runs_on_fake_cuda_in_bf16(short, name, method):
    check_ran(short.trajectory(name, method), MODELS[name], steps_of(method))


@pytest.mark.parametrize("name,method", SWEEP, ids=IDS)
def test_host_reads_only_where_documented(short, name, method):
    t = short.trajectory(name, method)
    assert t.error is None, t.error
    check_reads(t, MODELS[name], method)


@pytest.mark.parametrize("name,method", SWEEP, ids=IDS)
def test_merges_and_reuses(short, name, method):
    t = short.trajectory(name, method)
    assert t.error is None, t.error
    check_work(t, method)


@pytest.mark.parametrize("name,method", SWEEP, ids=IDS)
def test_kept_bytes_are_bounded_and_do_not_grow(short, name, method):
    t = short.trajectory(name, method)
    assert t.error is None, t.error
    check_kept(t, MODELS[name], short.geometry(name), method)


# ---------------------------------------------------------------------- full depth
def check_all(runs: Runs, name: str, method: str, steps: int) -> None:
    t = runs.trajectory(name, method, steps)
    spec = MODELS[name]
    check_ran(t, spec, steps)
    check_reads(t, spec, method)
    check_work(t, method)
    check_kept(t, spec, runs.geometry(name), method)


@pytest.mark.parametrize("name", list(MODELS))
def test_full_depth_composition(full, name):
    """The real depth (SD3-Medium 24 blocks, FLUX.1-dev 19 + 38, SDXL 70 of which 10 at 64 x 64, Wan 2.1 40): a
    caching schedule around ToMA, 4 steps (stores on 0 and 3, reuses on 1 and 2)."""
    check_all(full, name, "fora+toma", 4)


@pytest.mark.slow
@pytest.mark.parametrize("name,method", SWEEP, ids=IDS)
def test_full_depth_every_method(full, name, method):
    check_all(full, name, method, steps_of(method))


def test_the_short_models_keep_every_block_kind(short, full):
    """The sweep's short models have the full models' module classes (block kinds), widths and token counts, and
    fewer blocks."""
    for name in MODELS:
        models = (short.model(name)[1], full.model(name)[1])
        kinds = [{type(m).__name__ for m in model.modules()} for model in models]
        assert kinds[0] == kinds[1], name
        count = [sum(p.numel() for p in model.parameters()) for model in models]
        assert count[0] < count[1] / 2, (name, count)
        geometry = short.geometry(name)
        assert any(b.tokens == MODELS[name].tokens for b in geometry), name
