"""Where a merged forward's time goes, eager and compiled: the profile table of docs/benchmarks.md ("Compiled:
where the time goes").

For the baseline and each method, on its own copy of a bench model (``tomerge.experiments.bench_e2e.build``),
one forward is profiled (``torch.profiler``, CPU) after warm-up calls, eager and compiled with inductor
(``skip_nnmodule_hook_guards=False``, as ``tomerge bench --e2e --compile`` does). The self time of every
profiled op is put in one of these classes:

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

    python scripts/profile_compiled.py --width sd3 --tokens 4096 --depth 2 --threads 2 \\
        --methods tomesd ssm idm facility_location
    python scripts/profile_compiled.py --quick --tokens 256      # a tiny check of the script itself
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
import torch._dynamo
import torch._inductor.config
from torch.profiler import ProfilerActivity, profile

from tomerge.experiments.bench_e2e import build, count_flops, merged

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


def profiled_forward(call) -> dict[str, float]:
    """Milliseconds per class of one ``call()``, and its wall time (``total``), after one profiled call that is
    thrown away (the profiler's own first-call cost)."""
    with profile(activities=[ProfilerActivity.CPU]):
        call()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        begin = time.perf_counter()
        call()
        wall = (time.perf_counter() - begin) * 1e3
    ms = dict.fromkeys(CLASSES, 0.0)
    # leaf ops only: an op's self time excludes its children; record_function scopes and compiled-region
    # markers carry no work of their own beyond Python, which lands in "other" through the wall time
    for event in prof.key_averages():
        kind = classify(event.key)
        if kind == "other":
            continue
        ms[kind] += event.self_cpu_time_total / 1e3
    ms["other"] = max(0.0, wall - sum(ms.values()))
    ms["total"] = wall
    return ms


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", default="sd3")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="tiny widths (checks the script)")
    parser.add_argument("--methods", nargs="+", default=["tomesd", "ssm", "idm", "facility_location"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch._inductor.config.cpp.enable_kernel_profile = True
    bench = build(args.width, args.tokens, args.depth, args.batch, quick=args.quick)
    raw = bench.model
    methods = [None, *args.methods]
    flops = {}
    rows = []
    for method in methods:
        with torch.no_grad(), merged(bench, method, args.ratio):
            flops[method] = count_flops(bench.call)
        for compiled in (False, True):
            torch._dynamo.reset()
            bench.model = copy.deepcopy(raw)
            with contextlib.ExitStack() as stack, torch.no_grad():
                stack.enter_context(torch._dynamo.config.patch(skip_nnmodule_hook_guards=False))
                stack.enter_context(merged(bench, method, args.ratio))
                if compiled:
                    bench.model = torch.compile(bench.model)
                for _ in range(args.warmup):
                    bench.call()
                rows.append((method, compiled, profiled_forward(bench.call)))
            bench.model = raw
            print(f"# done: {method or 'baseline'} {'compiled' if compiled else 'eager'}", flush=True)
    base = {compiled: ms for method, compiled, ms in rows if method is None}
    print(f"\n{args.width}, N = {args.tokens}, depth {args.depth}, batch {args.batch}, ratio {args.ratio}, "
          f"{args.threads} threads, torch {torch.__version__}; ms of one forward by class\n")
    print("| method | mode | total | " + " | ".join(CLASSES) + " | measured / FLOP-ideal |")
    print("|---|---|---:|" + "---:|" * len(CLASSES) + "---|")
    for method, compiled, ms in rows:
        ideal = flops[None] / flops[method]
        measured = base[compiled]["total"] / ms["total"]
        cells = " | ".join(f"{ms[c]:.0f}" for c in CLASSES)
        ratio = "-" if method is None else f"{measured:.2f} / {ideal:.2f} ({measured / ideal:.0%})"
        print(f"| {method or 'baseline'} | {'compiled' if compiled else 'eager'} | {ms['total']:.0f} | {cells} | {ratio} |")


if __name__ == "__main__":
    main()
