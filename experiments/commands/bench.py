"""Speed benchmarks: model forwards (``--e2e``), merge kernels (``--kernels``), a config's call (``--config``).

    tomerge bench --e2e --widths sd3 pixart flux unet --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2
    tomerge bench --e2e --quick                   # tiny models in seconds (smoke test)
    tomerge bench --kernels                       # N = 1024, 4096; C = 1536; B = 2; ratio 0.25, 0.5
    tomerge bench --config my_sd3.yaml --set model.pipeline=/models/sd3 --set repeats=5   # a real pipeline
    python -m tomerge.experiments.commands.bench --kernels --tokens 1024 --ratios 0.5 --out runs/kernels.csv

Each mode times the baseline and every strategy or schedule alternating in one process and reports measured and
FLOP-ideal speed-ups; a method may carry options (``--strategies fora:merge=tomesd``). What each mode measures
and how: docs/benchmarks.md, "What is measured".
"""

from __future__ import annotations

import argparse
import csv
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import tomerge

from ..bench.allocator import keep_freed_memory
from ..bench.e2e import COMPILE_MODES, TOMESD_PACKAGE, e2e_benchmark
from ..bench.e2e import markdown_table as e2e_table
from ..bench.e2e import pivot_table
from ..bench.kernels import kernel_benchmark
from ..bench.kernels import markdown_table as kernel_table
from ..bench.models import WIDTHS, check_sizes
from ..errors import UsageError, module_main, user_input
from ..sources.models import DTYPE_NAMES, torch_dtype

__all__ = ["add_arguments", "run", "main"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    mode = parser.add_argument_group("mode (one of)")
    mode.add_argument("--e2e", action="store_true", help="time model forwards: baseline vs strategies vs tomesd")
    mode.add_argument("--kernels", action="store_true", help="time plan + merge + unmerge on bare tensors")
    mode.add_argument("--config", type=Path, default=None,
                      help="time the generation calls of a config's model (the reference DiT or a pipeline folder) "
                           "for every run of its grid, as tomerge ablate does, without images or quality metrics")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="--config: override a config entry (dotted keys, YAML values; repeatable)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None,
                        help="image token counts N, perfect squares (default 1024 4096; --quick: 256); video widths: "
                             "N = T * H * W of the patchified latent, e.g. 32760 for 81 frames at 480 x 832 (see --frames)")
    parser.add_argument("--ratios", type=float, nargs="+", default=None,
                        help="merge ratios (default: --e2e 0.5, --kernels 0.25 0.5)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=None, type=_method, metavar="METHOD",
                        help="methods: registered strategies and schedules (tomerge.list_strategies()) or 'tomesd "
                             "package'; --e2e: with options as NAME:KEY=VALUE[:KEY=VALUE], e.g. fora:merge=tomesd "
                             "(default: every strategy; --e2e: every strategy and schedule)")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as CSV here (and a .md beside it)")
    parser.add_argument("--device", default=None, help="(default: cuda when available, else cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_NAMES), default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="CPU timings: wall-clock, or process CPU time (robust on a shared machine; use with "
                             "--threads 1). CUDA always uses CUDA events")
    parser.add_argument("--no-keep-freed-memory", dest="keep_freed_memory", action="store_false",
                        help="CPU: leave glibc's malloc as it is (by default freed large blocks are kept for reuse "
                             "instead of being unmapped and page-faulted in again; see experiments/bench/allocator.py)")
    kernels = parser.add_argument_group("--kernels")
    kernels.add_argument("--channels", type=int, default=1536)
    kernels.add_argument("--min-run-time", type=float, default=0.5, help="seconds measured per timing")
    e2e = parser.add_argument_group("--e2e")
    e2e.add_argument("--widths", nargs="+", choices=WIDTHS, default=None,
                     help="model families/widths (default sd3 pixart flux unet)")
    e2e.add_argument("--depth", type=int, default=None, help="blocks per model; Flux: of each kind (default 2)")
    e2e.add_argument("--steps", type=int, default=0, help="also time an Euler sampling loop of this many steps")
    e2e.add_argument("--repeats", type=int, default=None, help="timed alternating rounds (default 3)")
    e2e.add_argument("--warmup", type=int, default=0,
                     help="untimed alternating rounds (each timing already follows a warm-up call)")
    e2e.add_argument("--text-tokens", type=int, default=None, help="override the widths' text lengths")
    e2e.add_argument("--frames", type=int, default=None,
                     help="video widths (wan, wan14b, hunyuan_video): frames T of the token grid, dividing each N; "
                          "H x W is the factor pair of N / T closest to 832:480 (default T: the largest divisor of N "
                          "not above 21, Wan's 81 frames)")
    e2e.add_argument("--quick", action="store_true", help="tiny models, N=256, depth 1, 2 repeats (seconds)")
    e2e.add_argument("--sdpa", choices=["default", "flash", "efficient", "cudnn", "math"], default="default",
                     help="restrict scaled_dot_product_attention to one backend (GPU: flash)")
    e2e.add_argument("--compile", dest="compile_mode", nargs="?", const="default", default=None,
                     choices=COMPILE_MODES, metavar="MODE",
                     help="time baseline and methods compiled with inductor (torch.compile mode, default 'default'; "
                          "GPU: reduce-overhead for CUDA graphs)")
    e2e.add_argument("--compile-backend", default="inductor", choices=["inductor", "aot_eager", "eager"],
                     help="--compile: torch.compile's backend; aot_eager or eager ignore the mode (a CPU smoke test "
                          "of the compiled path in seconds)")


def _method(text: str) -> str:
    from ..bench.e2e import check_method

    try:
        return check_method(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from err


def machine_line() -> str:
    import torch

    proc = platform.processor() or platform.machine()
    if torch.cuda.is_available():
        proc = f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    return f"{proc}, {torch.get_num_threads()} threads, torch {torch.__version__}, python {platform.python_version()}"


def clock_line(args: argparse.Namespace, kept_freed_memory: bool = False) -> str:
    if args.device.startswith("cuda"):
        return "CUDA events"
    clock = "process CPU time" if args.clock == "cpu" else "wall-clock"
    return f"{clock}, {'freed memory kept (mallopt)' if kept_freed_memory else 'default malloc'}"


def write_rows(path: Path, rows: Sequence[dict], table: str, header: str) -> None:
    """CSV of the rows at ``path`` and the Markdown table at ``path.with_suffix('.md')``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    path.with_suffix(".md").write_text(f"{header}\n\n{table}\n")
    print(f"\nwrote {path} and {path.with_suffix('.md')}")


def run(args: argparse.Namespace) -> int:
    if args.e2e + args.kernels + (args.config is not None) != 1:
        raise UsageError("choose one mode, --e2e, --kernels or --config FILE")
    import torch

    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.threads:
        torch.set_num_threads(args.threads)
    kept = not args.device.startswith("cuda") and args.keep_freed_memory and keep_freed_memory()
    argv = getattr(args, "argv", None)  # set by main(); the `tomerge` console script passes sys.argv
    command = f"python -m tomerge.experiments.commands.bench {' '.join(argv)}" if argv is not None else \
        f"tomerge {' '.join(sys.argv[1:])}"
    if args.config is not None:
        from ..bench.grid import model_benchmark
        from ..runs.records import markdown_table as run_table

        dicts = rows = model_benchmark(args.config, args.overrides, getattr(args, "plugins", None) or ())
        header = f"Generation-call benchmark of {args.config} ({machine_line()})"
        table = run_table(rows)
    elif args.kernels:
        if TOMESD_PACKAGE in (args.strategies or []):
            raise UsageError("the tomesd package is always in --kernels; name tomerge strategies")
        rows = kernel_benchmark(args.tokens or [1024, 4096], args.ratios or [0.25, 0.5], args.channels, args.batch,
                                args.strategies, min_run_time=args.min_run_time, device=args.device,
                                dtype=torch_dtype(args.dtype), clock=args.clock)
        header = (f"Kernel benchmark, B={args.batch}, C={args.channels}, {args.dtype}, {clock_line(args, kept)} "
                  f"({machine_line()})")
        table = kernel_table(rows)
        dicts = [{**asdict(r), "total_ms": r.total_ms} for r in rows]
    else:
        quick = args.quick
        with user_input():
            check_sizes(args.widths or ["sd3", "pixart", "flux", "unet"], args.tokens or [256], args.frames)
        rows = e2e_benchmark(
            widths=args.widths or ["sd3", "pixart", "flux", "unet"], tokens=args.tokens or ([256] if quick else
                                                                                             [1024, 4096]),
            ratios=args.ratios or [0.5], depth=args.depth or (1 if quick else 2), batch=args.batch,
            methods=args.strategies, steps=args.steps, repeats=args.repeats or (2 if quick else 3),
            warmup=args.warmup, quick=quick, text_tokens=args.text_tokens, dtype=torch_dtype(args.dtype),
            device=args.device, sdpa=args.sdpa, clock=args.clock, compile_mode=args.compile_mode, frames=args.frames,
            compile_backend=args.compile_backend)
        models = "quick (tiny) models" if quick else "full widths"
        compiled = ("eager" if args.compile_mode is None else
                    f"torch.compile (inductor, mode {args.compile_mode}), whole model"
                    if args.compile_backend == "inductor" else
                    f"torch.compile (backend {args.compile_backend}), whole model")
        header = (f"End-to-end benchmark, B={args.batch}, {args.dtype}, SDPA {args.sdpa}, {models}, {compiled}, "
                  f"{clock_line(args, kept)} ({machine_line()})")
        table = (f"{e2e_table(rows)}\n\nSpeed-up / FLOP-ideal speed-up (efficiency) per method:\n\n"
                 f"{pivot_table(rows)}")
        dicts = [r.as_dict() for r in rows]
    print(f"\n{header}\n\n{table}")
    print(f"\ncommand: {command}")
    if args.out is not None and rows:
        write_rows(args.out, dicts, table, f"{header}\n\ncommand: `{command}`")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.commands.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    module_main("bench", main)
