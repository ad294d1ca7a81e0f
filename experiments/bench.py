"""Speed benchmarks. Kernel mode: plan + merge + unmerge of every strategy against the `tomesd`
package's own functions, on bare tensors, as median wall-clock times.

    tomerge bench --kernels                       # N = 1024, 4096; C = 1536; B = 2; ratio 0.25, 0.5
    python -m tomerge.experiments.bench --kernels --tokens 1024 --ratios 0.5 --out runs/kernels.csv

Each strategy's hard plans run with both backends (``index`` gather/scatter, ``dense`` batched
matmul); soft plans (facility location) are dense by construction. Times are medians of
``torch.utils.benchmark`` adaptive runs, with as many threads as torch uses here.
"""

from __future__ import annotations

import argparse
import csv
import math
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch.utils import benchmark

import tomerge
from tomerge.contract import make_context
from tomerge.strategy import MergeStrategy


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


def median_ms(fn: Callable[[], object], min_run_time: float) -> float:
    """Median time of ``fn`` in ms (adaptive repeats, all of torch's threads)."""
    timer = benchmark.Timer(stmt="fn()", globals={"fn": fn}, num_threads=torch.get_num_threads())
    return timer.adaptive_autorange(min_run_time=min_run_time).median * 1e3


def _tomesd_row(x: torch.Tensor, grid: tuple[int, int], ratio: float, min_run_time: float) -> KernelRow:
    from tomesd.merge import bipartite_soft_matching_random2d

    H, W = grid
    r = int(x.shape[1] * ratio)

    def plan():
        return bipartite_soft_matching_random2d(x, W, H, 2, 2, r, no_rand=True)

    merge, unmerge = plan()
    y = merge(x)
    return KernelRow("tomesd package", "index", x.shape[1], ratio, x.shape[1] - y.shape[1],
                     median_ms(plan, min_run_time), median_ms(lambda: unmerge(merge(x)), min_run_time))


def _strategy_rows(name: str, x: torch.Tensor, grid: tuple[int, int], ratio: float,
                   backends: Sequence[str], min_run_time: float) -> list[KernelRow]:
    strategy = tomerge.get_strategy(name, **({"use_rand": False} if name == "tomesd" else {}))
    ctx = make_context(x, grid, ratio)
    plan = strategy.plan(x, ctx)
    plan_ms = median_ms(lambda: strategy.plan(x, ctx), min_run_time)
    rows = []
    for backend in (["dense"] if plan.is_soft else backends):
        p = plan.with_backend(backend)
        rows.append(KernelRow(name, backend, x.shape[1], ratio, p.num_removed, plan_ms,
                              median_ms(lambda: p.unmerge(p.merge(x)), min_run_time)))
    return rows


def kernel_benchmark(tokens: Sequence[int] = (1024, 4096), ratios: Sequence[float] = (0.25, 0.5),
                     channels: int = 1536, batch: int = 2, strategies: Sequence[str] | None = None,
                     backends: Sequence[str] = ("index", "dense"), min_run_time: float = 0.5,
                     progress: bool = True) -> list[KernelRow]:
    """Times plan and merge + unmerge for every strategy and the tomesd package.

    Args:
        tokens: image token counts ``N`` (square grids, ``sqrt(N)`` must be an integer).
        ratios: merge ratios.
        channels, batch: ``C`` and ``B`` of the token tensor.
        strategies: names (default: every registered :class:`MergeStrategy`).
        backends: backends for hard plans.
        min_run_time: seconds of measurement per timing.
        progress: show a progress bar.

    Returns:
        One :class:`KernelRow` per (method, backend, N, ratio).
    """
    from tqdm import tqdm

    names = strategies or [n for n in tomerge.list_strategies()
                           if issubclass(tomerge.registry.strategy_class(n), MergeStrategy)]
    configs = [(n, r) for n in tokens for r in ratios]
    rows: list[KernelRow] = []
    torch.manual_seed(0)
    with torch.inference_mode():
        for N, ratio in tqdm(configs, desc="kernels", disable=not progress):
            side = math.isqrt(N)
            if side * side != N:
                raise ValueError(f"--tokens must be squares, got {N}")
            grid = (side, side)
            x = torch.randn(batch, N, channels)
            rows.append(_tomesd_row(x, grid, ratio, min_run_time))
            for name in names:
                rows.extend(_strategy_rows(name, x, grid, ratio, backends, min_run_time))
    return rows


def markdown_table(rows: Sequence[KernelRow]) -> str:
    lines = ["| N | ratio | method | backend | removed | plan ms | merge+unmerge ms | total ms |",
             "|---:|---:|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.tokens} | {r.ratio} | {r.method} | {r.backend} | {r.removed} | {r.plan_ms:.2f} | "
                     f"{r.merge_unmerge_ms:.2f} | {r.total_ms:.2f} |")
    return "\n".join(lines)


def machine_line() -> str:
    return (f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
            f"torch {torch.__version__}, python {platform.python_version()}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kernels", action="store_true", help="time plan + merge + unmerge on bare tensors")
    parser.add_argument("--tokens", type=int, nargs="+", default=[1024, 4096], help="image token counts N")
    parser.add_argument("--ratios", type=float, nargs="+", default=[0.25, 0.5])
    parser.add_argument("--channels", type=int, default=1536)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--strategies", nargs="+", default=None, choices=tomerge.list_strategies())
    parser.add_argument("--min-run-time", type=float, default=0.5, help="seconds measured per timing")
    parser.add_argument("--out", type=Path, default=None, help="write the rows as CSV here")


def run(args: argparse.Namespace) -> int:
    if not args.kernels:
        print("tomerge bench: choose a mode, e.g. --kernels", file=sys.stderr)
        return 2
    rows = kernel_benchmark(args.tokens, args.ratios, args.channels, args.batch, args.strategies,
                            min_run_time=args.min_run_time)
    print(f"\nKernel benchmark, B={args.batch}, C={args.channels} ({machine_line()})\n")
    print(markdown_table(rows))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        with args.out.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=[*asdict(rows[0]), "total_ms"])
            writer.writeheader()
            writer.writerows({**asdict(r), "total_ms": r.total_ms} for r in rows)
        print(f"\nwrote {args.out}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
