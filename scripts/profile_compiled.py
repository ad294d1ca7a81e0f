"""Where a merged forward's time goes, eager and compiled: the SD3 table of docs/benchmarks.md ("Compiled
(CPU)").

For the baseline and each method, on its own copy of a bench model (``tomerge.experiments.bench.models.build``),
eager and compiled with inductor (``skip_nnmodule_hook_guards=False``, as ``tomerge bench --e2e --compile``
does), forwards are profiled (``torch.profiler``, CPU) after warm-up calls, ``--rounds`` of them, the models
alternating round after round. Every (op, input shapes) keeps its least self time over the rounds (see
:func:`least_disturbed`; with one round, that forward's), and the self times are put in one of these classes:

* ``matmul``: GEMMs and attention kernels (``aten::mm``/``addmm``/``bmm``/``baddbmm``, the SDPA kernels,
  oneDNN's linear): the work FLOPs count.
* ``fused``: inductor's generated kernels (``cpp_fused_*``, profiled with ``cpp.enable_kernel_profile``): the
  element-wise work compilation fused.
* ``element-wise``: ATen element-wise and normalisation ops run as such (adds, muls, norms, activations,
  copies, concatenations): in the eager runs, the work compilation could fuse.
* ``merge``: gathers, scatters, index and sort ops (the plans' and the merge/unmerge data movement).
* ``graphs``: calling compiled graphs: dynamo's guard checks (``TorchDynamo Cache Lookup``), the compiled
  regions' and AOT wrappers' own time.
* ``other``: the rest, including Python between ops (the forward's wall time minus the classified self times).

On CPU it first lets malloc keep freed blocks, as ``tomerge bench`` does (``experiments/bench/allocator.py``;
``--no-keep-freed-memory`` turns it off): otherwise every full-length activation is page-faulted in anew, and
that cost, a larger share of a merged forward than of the baseline, shows up in the gathers and element-wise ops.

    python scripts/profile_compiled.py --width sd3 --tokens 4096 --depth 2 --threads 2 --rounds 3 \\
        --methods tomesd ssm idm facility_location
    python scripts/profile_compiled.py --quick --tokens 256      # a tiny check of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch
import torch._dynamo
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from tomerge.experiments.bench.allocator import keep_freed_memory
from tomerge.experiments.bench.e2e import merged
from tomerge.experiments.bench.models import build
from tomerge.experiments.measure.flops import count_flops

MATMUL = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_dot_product_flash_attention_for_cpu",
          "aten::_scaled_dot_product_attention_math", "mkldnn::_linear_pointwise", "aten::mkldnn_rnn_layer",
          "mkl::_mkl_linear", "aten::_mkl_linear", "aten::linear", "aten::_slow_conv2d_forward",
          "aten::mkldnn_convolution", "aten::convolution", "aten::_convolution")
GRAPHS = ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "## Call CompiledFxGraph", "Pregraph bytecode",
          "AOTDispatcher", "CompiledFunction")
MERGE = ("gather", "scatter", "index", "sort", "topk", "argmax", "max", "take_along_dim", "nonzero", "masked",
         "cumsum", "arange", "where", "eq", "lt", "gt", "repeat_interleave", "unique")
ELEMENTWISE = ("add", "sub", "mul", "div", "layer_norm", "native_layer_norm", "gelu", "silu", "copy", "cat",
               "clone", "contiguous", "softmax", "exp", "sum", "mean", "norm", "sqrt", "rsqrt", "pow", "tanh",
               "addcmul", "fill", "zero", "empty_like", "to", "_to_copy", "chunk", "split", "stack", "neg", "relu",
               "baddbmm_")
CLASSES = ("matmul", "fused", "element-wise", "merge", "graphs", "other")


def classify(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if "cpp_fused" in name:
        return "fused"
    if name.startswith(GRAPHS):
        return "graphs"
    op = name.split("::")[-1].rstrip("_")
    if any(op == m or op.startswith(m + "_") or op.endswith("_" + m) for m in MERGE) or op.startswith("index"):
        return "merge"
    if any(op == e or op.startswith(e) for e in ELEMENTWISE):
        return "element-wise"
    return "other"


OpTimes = dict[tuple[str, str], float]  # (op name, input shapes) -> self ms in one forward


def profiled_forward(call) -> tuple[float, OpTimes]:
    """Wall ms of one profiled ``call()`` and the self ms of every (op, input shapes) in it."""
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        begin = time.perf_counter()
        call()
        wall = (time.perf_counter() - begin) * 1e3
    return wall, {(e.key, str(e.input_shapes)): e.self_cpu_time_total / 1e3
                  for e in prof.key_averages(group_by_input_shape=True)}


def by_class(wall: float, ops: OpTimes) -> dict[str, float]:
    """Milliseconds per class; ``other`` is the wall time the classified self times leave (Python between ops);
    record_function scopes and compiled-region markers carry no work of their own beyond Python."""
    ms = dict.fromkeys(CLASSES, 0.0)
    for (name, _), t in ops.items():
        kind = classify(name)
        if kind != "other":
            ms[kind] += t
    ms["other"] = max(0.0, wall - sum(ms.values()))
    ms["total"] = sum(ms[c] for c in CLASSES)
    return ms


def least_disturbed(forwards: list[tuple[float, OpTimes]]) -> dict[str, float]:
    """Per class, the profile with every op's time at its minimum over the rounds (and ``other`` at its least).

    On a machine whose neighbours slow calls down at random (the same op on the same shapes took 5-10% longer in
    one forward than in another here), a slowdown only adds time, and different forwards are hit in different ops,
    so the sum of per-op minima estimates the undisturbed forward far more steadily than any one forward's wall
    time. It is biased low alike for the baseline and the merged models."""
    keys = set().union(*(ops for _, ops in forwards))
    best = {k: min(ops[k] for _, ops in forwards if k in ops) for k in keys}
    ms = by_class(0.0, best)
    ms["other"] = min(by_class(wall, ops)["other"] for wall, ops in forwards)
    ms["total"] = sum(ms[c] for c in CLASSES)
    return ms


def label(method: str | None, compiled: bool) -> str:
    return f"{method or 'baseline'} {'compiled' if compiled else 'eager'}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", default="sd3")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=1,
                        help="profiled forwards per model, alternating round after round (per-op minima over them)")
    parser.add_argument("--modes", nargs="+", choices=["eager", "compiled"], default=["eager", "compiled"])
    parser.add_argument("--quick", action="store_true", help="tiny widths (checks the script)")
    parser.add_argument("--methods", nargs="+", default=["tomesd", "ssm", "idm", "facility_location"])
    parser.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                        help="leave glibc's malloc as it is (every large activation page-faulted in anew)")
    args = parser.parse_args()
    kept = args.keep_freed_memory and keep_freed_memory()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True
    bench = build(args.width, args.tokens, args.depth, args.batch, quick=args.quick)
    raw = bench.model
    methods = [None, *args.methods]
    runs = [(method, mode == "compiled") for method in methods for mode in args.modes]
    flops = {}
    for method in methods:
        with torch.no_grad(), merged(bench, method, args.ratio):
            flops[method] = count_flops(bench.call)
    forwards: dict[tuple[str | None, bool], list[tuple[float, OpTimes]]] = {run: [] for run in runs}
    runners = {}
    torch._dynamo.reset()
    with contextlib.ExitStack() as stack, torch.no_grad():
        # every model is its own copy, applied once; dynamo guards on hooks (else a merged copy could run the
        # baseline's graphs) and may keep every copy's graphs
        stack.enter_context(torch._dynamo.config.patch(skip_nnmodule_hook_guards=False,
                                                       recompile_limit=max(8, 8 * len(runs))))
        for method, compiled in runs:
            bench.model = copy.deepcopy(raw)
            stack.enter_context(merged(bench, method, args.ratio))
            runners[method, compiled] = bench.model = torch.compile(bench.model) if compiled else bench.model
            for _ in range(args.warmup + 1):  # + 1: the profiler's own first-call cost
                with profile(activities=[ProfilerActivity.CPU]):
                    bench.call()
            print(f"# ready: {label(method, compiled)}", flush=True)
        for run in runs:  # one untimed round: a compiled model may recompile once after the others compiled
            bench.model = runners[run]
            bench.call()
        for round_ in range(args.rounds):
            for run in runs:
                bench.model = runners[run]
                forwards[run].append(profiled_forward(bench.call))
            walls = ", ".join(f"{label(*run)} {forwards[run][-1][0]:.0f} ms" for run in runs)
            print(f"# round {round_ + 1} of {args.rounds}: {walls}", flush=True)
    bench.model = raw
    rows = [(method, compiled, least_disturbed(forwards[method, compiled]),
             statistics.median(wall for wall, _ in forwards[method, compiled])) for method, compiled in runs]
    base = {compiled: (ms, wall) for method, compiled, ms, wall in rows if method is None}
    print(f"\n{args.width}, N = {args.tokens}, depth {args.depth}, batch {args.batch}, ratio {args.ratio}, "
          f"{args.threads} threads, torch {torch.__version__}, {args.rounds} round(s), "
          f"{'freed memory kept (mallopt)' if kept else 'default malloc'}; ms of one forward by class, "
          "every op at its least over the rounds\n")
    print("| method | mode | total | " + " | ".join(CLASSES) + " | measured / FLOP-ideal | median wall ms | "
          "from median walls |")
    print("|---|---|---:|" + "---:|" * len(CLASSES) + "---|---:|---|")
    for method, compiled, ms, wall in rows:
        ideal = flops[None] / flops[method]
        base_ms, base_wall = base[compiled]
        cells = " | ".join(f"{ms[c]:.0f}" for c in CLASSES)
        least = "-" if method is None else f"{base_ms['total'] / ms['total']:.2f} / {ideal:.2f} " \
                                           f"({base_ms['total'] / ms['total'] / ideal:.0%})"
        median = "-" if method is None else f"{base_wall / wall:.2f} ({base_wall / wall / ideal:.0%})"
        print(f"| {method or 'baseline'} | {'compiled' if compiled else 'eager'} | {ms['total']:.0f} | {cells} | "
              f"{least} | {wall:.0f} | {median} |")


if __name__ == "__main__":
    main()
