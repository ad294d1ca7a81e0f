"""Speed benchmarks: end-to-end model forwards (``--e2e``) and merge kernels (``--kernels``).

    tomerge bench --e2e --widths sd3 pixart flux unet --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2
    tomerge bench --e2e --quick                   # tiny models in seconds (smoke test)
    tomerge bench --kernels                       # N = 1024, 4096; C = 1536; B = 2; ratio 0.25, 0.5
    tomerge bench --config my_sd3.yaml --set model.pipeline=/models/sd3 --set repeats=5   # a real pipeline
    python -m tomerge.experiments.bench.kernels --kernels --tokens 1024 --ratios 0.5 --out runs/kernels.csv

End-to-end mode (:mod:`tomerge.experiments.bench.e2e`): random-weight diffusers models at SD3-Medium,
PixArt/DiT-XL and Flux widths with reduced depth, baseline and every strategy/schedule alternating in
one process; measured speed-up, FLOP-ideal speed-up (:mod:`tomerge.experiments.measure.flops`) and their ratio; on a
UNet, the ``tomesd`` package's own patch against tomerge's ``tomesd`` at the same ratio.

Config mode (``--config``): the generation call of a config's model (the bundled reference DiT or a
diffusers pipeline folder, see docs/experiments.md) on its timing batch, for every run of its grid,
timed as ``tomerge ablate`` times it (alternating, median and spread, denoiser time and FLOPs).

Kernel mode: plan + merge + unmerge of every strategy against the ``tomesd`` package's own functions,
on bare tensors. Each strategy's hard plans run with both backends (``index`` gather/scatter,
``dense`` batched matmul); soft plans (facility location) are dense by construction. Times are medians
of ``torch.utils.benchmark`` blocked runs, with as many threads as torch uses here.

On CUDA every timing synchronises (``torch.utils.benchmark`` does); ``--dtype bf16`` runs in bfloat16.
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import tomerge

from .allocator import keep_freed_memory
from .e2e import COMPILE_MODES, TOMESD_PACKAGE, WIDTHS, check_sizes, e2e_benchmark
from .e2e import markdown_table as e2e_table
from .e2e import pivot_table
from ..measure.columns import format_markdown_table
from ..errors import UsageError, user_input
from ..sources.models import DTYPE_NAMES, torch_dtype
from ..measure.timing import median_ms, overhead_ratio

if TYPE_CHECKING:
    import torch
# torch is imported in the functions that time things, so that `tomerge bench --help` loads without it.


@dataclass(frozen=True)
class KernelRow:
    """One timed configuration; times in milliseconds."""

    method: str
    backend: str
    tokens: int
    ratio: float
    removed: int
    plan_ms: float
    merge_unmerge_ms: float

    @property
    def total_ms(self) -> float:
        return self.plan_ms + self.merge_unmerge_ms


def _tomesd_row(x: torch.Tensor, grid: tuple[int, int], ratio: float, min_run_time: float,
                clock: str = "wall") -> KernelRow:
    from tomesd.merge import bipartite_soft_matching_random2d

    H, W = grid
    r = int(x.shape[1] * ratio)

    def plan():
        return bipartite_soft_matching_random2d(x, W, H, 2, 2, r, no_rand=True)

    merge, unmerge = plan()
    y = merge(x)
    return KernelRow("tomesd package", "index", x.shape[1], ratio, x.shape[1] - y.shape[1],
                     median_ms(plan, min_run_time, clock), median_ms(lambda: unmerge(merge(x)), min_run_time, clock))


def _strategy_rows(name: str, x: torch.Tensor, grid: tuple[int, int], ratio: float,
                   backends: Sequence[str], min_run_time: float, clock: str = "wall") -> list[KernelRow]:
    from tomerge.contract import make_context

    strategy = tomerge.get_strategy(name, **({"use_rand": False} if name == "tomesd" else {}))
    ctx = make_context(x, grid, ratio)
    plan = strategy.plan(x, ctx)
    plan_ms = median_ms(lambda: strategy.plan(x, ctx), min_run_time, clock)
    rows = []
    for backend in (["dense"] if plan.is_soft else backends):
        p = plan.with_backend(backend)
        rows.append(KernelRow(name, backend, x.shape[1], ratio, p.num_removed, plan_ms,
                              median_ms(lambda: p.unmerge(p.merge(x)), min_run_time, clock)))
    return rows


def kernel_benchmark(tokens: Sequence[int] = (1024, 4096), ratios: Sequence[float] = (0.25, 0.5),
                     channels: int = 1536, batch: int = 2, strategies: Sequence[str] | None = None,
                     backends: Sequence[str] = ("index", "dense"), min_run_time: float = 0.5,
                     progress: bool = True, device: str = "cpu", dtype: torch.dtype | None = None,
                     clock: str = "wall") -> list[KernelRow]:
    """Times plan and merge + unmerge for every strategy and the tomesd package.

    Args:
        tokens: image token counts ``N`` (square grids, ``sqrt(N)`` must be an integer).
        ratios: merge ratios.
        channels, batch: ``C`` and ``B`` of the token tensor.
        strategies: names (default: every registered :class:`MergeStrategy`).
        backends: backends for hard plans.
        min_run_time: seconds of measurement per timing.
        progress: show a progress bar.
        device, dtype: where the token tensor lives (``dtype`` default: float32).
        clock: ``"wall"`` or ``"cpu"`` (process CPU time) for CPU timings; CUDA uses CUDA events.

    Returns:
        One :class:`KernelRow` per (method, backend, N, ratio).
    """
    import torch
    from tqdm import tqdm

    from tomerge.strategy import MergeStrategy

    dtype = torch.float32 if dtype is None else dtype
    names = strategies or [n for n in tomerge.list_strategies()
                           if issubclass(tomerge.registry.strategy_class(n), MergeStrategy)]
    configs = [(n, r) for n in tokens for r in ratios]
    rows: list[KernelRow] = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for N, ratio in tqdm(configs, desc="kernels", disable=not progress):
            side = math.isqrt(N)
            if side * side != N:
                raise UsageError(f"--tokens must be squares, got {N}")
            grid = (side, side)
            x = torch.randn(batch, N, channels, device=device).to(dtype)
            rows.append(_tomesd_row(x, grid, ratio, min_run_time, clock))
            for name in names:
                rows.extend(_strategy_rows(name, x, grid, ratio, backends, min_run_time, clock))
    return rows


def markdown_table(rows: Sequence[KernelRow]) -> str:
    titles = ["N", "ratio", "method", "backend", "removed", "plan ms", "merge+unmerge ms", "total ms"]
    cells = [[str(r.tokens), str(r.ratio), r.method, r.backend, str(r.removed), f"{r.plan_ms:.2f}",
              f"{r.merge_unmerge_ms:.2f}", f"{r.total_ms:.2f}"] for r in rows]
    return format_markdown_table(titles, cells, [True, True, False, False, True, True, True, True])


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
    parser.add_argument("--strategies", nargs="+", default=None,
                        choices=[*tomerge.list_strategies(), TOMESD_PACKAGE],
                        help="methods (default: every strategy; --e2e: every strategy and schedule)")
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


def model_benchmark(config_path: Path, overrides: Sequence[str], plugins: Sequence[str] = ()) -> list[dict]:
    """Speed rows of every run of a config's grid on its model: the timing batch's generation call,
    baseline and merged alternating (``warmup``, ``repeats``), denoiser time and FLOPs, spread."""
    from ..runs.ablation import match_flop_speedups, measure, speed_row
    from ..config.load import load_config

    with user_input():
        config = load_config(config_path, list(overrides), plugins=list(plugins))
    source = config.model.load()
    items = config.items()[: config.timing_batch]
    source.check_items(items)
    flops_base = measure(source, config, items, None, map_steps=False)["flops"]
    rows = []
    for run in match_flop_speedups(source, config, config.runs(), items[:1]):
        flops = measure(source, config, items, run, map_steps=False)["flops"]
        row = {"run": run.run_id, "ratio": run.ratio, **speed_row(source, config, items, run),
               "flops_base": flops_base, "flops": flops, "flop_speedup": flops_base / flops}
        row["overhead_ratio"] = overhead_ratio(row["speedup"], row["flop_speedup"])
        rows.append(row)
    return rows


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
    command = f"python -m tomerge.experiments.bench.kernels {' '.join(argv)}" if argv is not None else \
        f"tomerge {' '.join(sys.argv[1:])}"
    if args.config is not None:
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
        table = markdown_table(rows)
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
            device=args.device, sdpa=args.sdpa, clock=args.clock, compile_mode=args.compile_mode, frames=args.frames)
        models = "quick (tiny) models" if quick else "full widths"
        compiled = "eager" if args.compile_mode is None else f"torch.compile (inductor, mode {args.compile_mode})"
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
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.bench.kernels", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    return run(args)


if __name__ == "__main__":
    from tomerge.experiments.errors import module_main

    module_main("bench", main)
