"""The kernel benchmark (``tomerge bench --kernels``): plan + merge + unmerge of every strategy against the
``tomesd`` package's own functions, on bare tensors. Each strategy's hard plans run with both backends (``index``
gather/scatter, the default on every device; ``dense`` batched one-hot matmuls); soft plans (facility location)
are dense by construction. Times are medians of ``torch.utils.benchmark`` blocked runs, with as many threads as
torch uses here (CUDA: events). FLOPs of plan + merge + unmerge per image (``merge_gflops``, counted by
:mod:`tomerge.experiments.measure.flops` on one call: on bare tensors all of it is merging's own).

    tomerge bench --kernels                       # N = 1024, 4096; C = 1536; B = 2; ratio 0.25, 0.5
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import tomerge

from ..errors import UsageError
from ..measure.columns import format_markdown_table
from ..measure.timing import median_ms
from .e2e import method_spec
from .e2e import TOMESD_PACKAGE

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
    merge_gflops: float = 0.0  # plan + merge + unmerge, GFLOP per image (per sample of the batch)

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

    def everything():
        merge, unmerge = plan()
        return unmerge(merge(x))

    merge, unmerge = plan()
    y = merge(x)
    return KernelRow(TOMESD_PACKAGE, "index", x.shape[1], ratio, x.shape[1] - y.shape[1],
                     median_ms(plan, min_run_time, clock), median_ms(lambda: unmerge(merge(x)), min_run_time, clock),
                     _gflops_per_image(everything, x.shape[0]))


def _gflops_per_image(fn, batch: int) -> float:
    from ..measure.flops import count_flops

    return count_flops(fn) / batch / 1e9


def _strategy_rows(name: str, x: torch.Tensor, grid: tuple[int, int], ratio: float,
                   backends: Sequence[str], min_run_time: float, clock: str = "wall") -> list[KernelRow]:
    from tomerge.contract import make_context

    strategy_name, options = method_spec(name)
    strategy = tomerge.get_strategy(strategy_name, **({"use_rand": False} if strategy_name == "tomesd" else {}),
                                    **options)
    ctx = make_context(x, grid, ratio)
    plan = strategy.plan(x, ctx)
    plan_ms = median_ms(lambda: strategy.plan(x, ctx), min_run_time, clock)
    rows = []
    for backend in (["dense"] if plan.is_soft else backends):
        p = plan.with_backend(backend)
        rows.append(KernelRow(name, backend, x.shape[1], ratio, p.num_removed, plan_ms,
                              median_ms(lambda: p.unmerge(p.merge(x)), min_run_time, clock),
                              _gflops_per_image(lambda: (strategy.plan(x, ctx), p.unmerge(p.merge(x))), x.shape[0])))
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
    schedules = [n for n in names if not issubclass(tomerge.registry.strategy_class(method_spec(n)[0]), MergeStrategy)]
    if schedules:
        raise UsageError(f"--kernels plans bare tensors with merging strategies; {schedules} are schedules "
                         "(time them with --e2e)")
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
    from ..measure.columns import COLUMNS

    titles = ["N", "ratio", "method", "backend", "removed", "plan ms", "merge+unmerge ms", "total ms",
              COLUMNS["merge_gflops"].table_title]
    cells = [[str(r.tokens), str(r.ratio), r.method, r.backend, str(r.removed), f"{r.plan_ms:.2f}",
              f"{r.merge_unmerge_ms:.2f}", f"{r.total_ms:.2f}", f"{r.merge_gflops:.3g}"] for r in rows]
    return format_markdown_table(titles, cells, [True, True, False, False, True, True, True, True, True])
