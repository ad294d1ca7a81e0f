"""``torch.compile`` of a model with merging applied: compiled once for a whole trajectory, no graph break
inside a block, no host read in the hot path, and the eager result (docs/compile.md).

The hooks split the work: the model's and the blocks' hooks make every per-step decision in Python and run
eagerly (``torch.compiler.disable``), the merge points' hooks do the tensor work inside the compiled block
graphs and read only the block call prepared for them. The counts come from dynamo's own counters: the
compiled frames of a counting backend (``CompileCounterWithBackend``) and ``counters["graph_break"]``.

The default run traces with dynamo and AOTAutograd (``aot_eager``: the captured graphs run the same aten
ops, so float64 outputs match eager to rounding); inductor runs (C++ code generation with gcc, a minute
or more per compile on a loaded 2-core machine) are marked slow.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch._dynamo.testing
import torch._dynamo.utils
from torch import Tensor

import tomerge
from helpers.compiled import (OPTIONS, SCHEDULES, STRATEGIES, FailOnHostRead, build, call,
                              compiled_against_eager, inputs, times, trajectory)

# Compiled block graphs a trajectory may add after its first step: 0 at a fixed ratio; a schedule adds one per
# kind of block call it switches to (protected -> merged, structure -> detail) and one when its ratio curve
# changes the merged count (dynamo then makes the count a dynamic size: one graph for every later count).
EXTRA_GRAPHS = {"toma": 0, "toma_release": 1, "sdtm": 1, "sdtm_release": 2, "sdtm_paper": 2}


@pytest.mark.parametrize("strategy", STRATEGIES + SCHEDULES)
def test_whole_model_compiles_once_for_the_trajectory(strategy):
    """``torch.compile(model)``: every block call runs one compiled block graph (shared by the blocks), the
    model's other modules their own; a fixed ratio compiles nothing after the first step, a schedule at most
    ``EXTRA_GRAPHS`` more, whatever the trajectory's length (dynamo's recompile limit is 8)."""
    frames = compiled_against_eager("native_dit", strategy)
    assert frames[-1] - frames[0] <= EXTRA_GRAPHS.get(strategy, 0), frames
    assert frames[-1] == frames[len(frames) // 2], frames  # nothing compiled in the trajectory's second half


@pytest.mark.parametrize("strategy", ["tomesd", "ssm", "sdtm_release"])
def test_regional_compilation_compiles_one_block_graph(strategy):
    """Each block compiled on its own (``nn.Module.compile``, what diffusers' ``compile_repeated_blocks``
    does): the blocks share one compiled graph per kind of block call."""
    frames = compiled_against_eager("native_dit", strategy, regional=True)
    assert frames[0] == 1 and frames[-1] <= 1 + EXTRA_GRAPHS.get(strategy, 0), frames


def test_deeper_model_compiles_no_more():
    """Twelve blocks compile as many graphs as two: per-block facts (the layer, its plan) never enter a graph."""
    counts = []
    for depth in (2, 12):
        model = build("native_dit", depth)
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        counts.append(trajectory(model, "native_dit", "ssm", counter)[1][-1])
    assert counts[0] == counts[1], counts


def test_toma_with_kept_destinations_compiles_once_more():
    """ToMA's separate refresh intervals: a call that recomputes only the merge matrices from kept destinations
    is one more kind of call (facility location's checks of the kept destinations, host reads, are skipped
    inside compiled graphs)."""
    frames = compiled_against_eager("native_dit", "toma", options={"num_tiles": 4, "destinations_every": 2})
    assert frames[-1] - frames[0] <= 1 and frames[-1] == frames[len(frames) // 2], frames


def test_diffusers_dit_compiles_once():
    frames = compiled_against_eager("dit", "facility_location")
    assert frames[-1] == frames[0], frames


@pytest.mark.parametrize("strategy", STRATEGIES + SCHEDULES)
def test_no_host_read_after_the_step_starts(strategy):
    """The only host read of a model call is the trajectory clock's read of the timestep, before the first
    block (``TrajectoryClock.observe``); the hooks, plans, merges and unmerges read none, so a step can be
    captured in a CUDA graph (``mode="reduce-overhead"``)."""
    model = build("native_dit")
    with tomerge.merging(model, strategy, ratio=0.5, num_steps=4, **OPTIONS.get(strategy, {})) as handle:
        mode = FailOnHostRead(allowed=("observe",))
        with mode:
            for t in times(4):
                call(model, inputs("native_dit", t))
        assert handle.stats["tokens_removed"] > 0
    assert mode.allowed_reads == 4  # the mode saw the clock's read of every call: it was active


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["tomesd", "ssm", "sdtm_release"])
def test_inductor_compiled_trajectory_matches_eager(strategy):
    """The default backend (inductor, C++ on CPU). The strategies select in float32 (``x.float()``), where
    inductor's fused kernels may round differently from eager, hence the tolerance."""
    model = build("native_dit")
    eager, _, _ = trajectory(model, "native_dit", strategy)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled, frames, _ = trajectory(model, "native_dit", strategy, counter)
    assert frames[-1] - frames[0] <= EXTRA_GRAPHS.get(strategy, 0), frames
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_compiled_benchmark_times_every_method_compiled():
    """``tomerge bench --e2e --compile`` times each method on its own compiled copy of the model, applied before
    compiling (``bench_e2e.time_compiled``): each copy's compiled calls give that method's eager merged output,
    and the bench's model is the untouched eager module afterwards. ``aot_eager`` here; the CLI uses inductor."""
    import contextlib

    from tomerge.experiments.bench import e2e as bench_e2e
    from tomerge.experiments.bench.models import build

    bench = build("dit", 64, depth=1, batch=2, quick=True)
    raw = bench.model
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # DiT's init zeroes the blocks' modulation: random weights make merging visible
        for p in raw.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    hooks_before = [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in raw.modules()]
    methods = ("ssm", "idm")  # deterministic plans that remove tokens on this 8 x 8 grid
    with torch.inference_mode():
        expected = {None: bench.call()}
        for method in methods:
            with tomerge.merging(raw, method, ratio=0.5):
                expected[method] = bench.call()
    handles: dict[str | None, Any] = {}
    outputs: dict[int, Tensor] = {}
    original_merged = bench_e2e.merged

    @contextlib.contextmanager
    def merged(b, method, ratio, num_steps=None):  # the bench's context, keeping each method's handle
        with original_merged(b, method, ratio, num_steps):
            handles[method] = b.model.__dict__.get("_tomerge_handle")
            yield

    def call():  # the timed function, keeping the last output of each compiled copy
        out = bench.call()
        outputs[id(getattr(bench.model, "_orig_mod", bench.model))] = out
        return out

    bench_e2e.merged = merged
    try:
        with torch.inference_mode():
            secs = bench_e2e.time_compiled(bench, [None, *methods], 0.5, call, repeats=2, warmup=1, threads=1,
                                           num_steps=None, clock="cpu", mode="default", backend="aot_eager")
    finally:
        bench_e2e.merged = original_merged
    assert set(secs) == {None, *methods} and all(t > 0 for t, _ in secs.values())
    assert handles[None] is None
    torch.testing.assert_close(outputs[id(raw)], expected[None], rtol=1e-5, atol=1e-5)
    for method in methods:
        copy = handles[method].model
        assert copy is not raw
        assert not torch.allclose(expected[method], expected[None])  # merging changes the output here
        torch.testing.assert_close(outputs[id(copy)], expected[method], rtol=1e-5, atol=1e-5)
    assert bench.model is raw
    assert [(dict(m._forward_pre_hooks), dict(m._forward_hooks)) for m in raw.modules()] == hooks_before


def test_apply_refuses_blocks_compiled_before_it():
    """Dynamo does not guard on module hooks by default: blocks compiled before apply() would keep their
    unmerged graphs while the eager hooks count merges, so apply() refuses and says to apply first."""
    model = build("native_dit")
    model.blocks[0].compile(backend="aot_eager")
    try:
        with pytest.raises(RuntimeError, match="Apply first, then compile"):
            tomerge.apply(model, "ssm", ratio=0.5)
        assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):  # hooks guarded: a changed hook recompiles
            tomerge.apply(model, "ssm", ratio=0.5).remove()
    finally:
        model.blocks[0]._compiled_call_impl = None
        torch._dynamo.reset()
