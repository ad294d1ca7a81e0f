"""End-to-end speed benchmark (``tomerge bench --e2e``): random-weight diffusers models at the widths that matter,
the unmerged baseline against every registered strategy and schedule (and the ``tomesd`` package on a UNet),
timed alternating in one process, with measured and FLOP-ideal speed-ups.

    tomerge bench --e2e --quick                                  # tiny models, seconds (what the tests run)
    tomerge bench --e2e --widths sd3 pixart flux --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2

What is timed and counted, and the columns: docs/benchmarks.md, "What is measured"; the models, their widths and
inputs: :mod:`tomerge.experiments.bench.models`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tomerge

from ..measure.columns import format_markdown_table
from ..measure.timing import NOISY_SPREAD, time_setups
from .models import VIDEO_WIDTHS, Bench, build, check_sizes

if TYPE_CHECKING:
    import torch
# torch and diffusers are imported in the functions that time models: `tomerge bench --help` and the
# constants below load without them.

TOMESD_PACKAGE = "tomesd package"


@dataclasses.dataclass(frozen=True)
class E2ERow:
    """One (model, N, ratio, method) result; times in milliseconds, FLOPs in GFLOP."""

    model: str
    width: int
    heads: int
    depth: int
    tokens: int
    text_tokens: int
    batch: int
    mode: str  # "forward" or "loop<K>"
    ratio: float
    method: str
    base_ms: float
    merged_ms: float
    base_gflop: float
    merged_gflop: float
    base_spread: float | None = None  # (max - min) / median of the timed repeats
    merged_spread: float | None = None
    merge_gflops: float = 0.0  # planning + merging + unmerging, GFLOP per image (a part of merged_gflop / batch)
    peak_memory_base_mb: float | None = None  # CUDA: max_memory_allocated over the timed calls (None on CPU)
    peak_memory_mb: float | None = None

    @property
    def spread(self) -> float | None:
        """The larger of the two timings' spreads (``None`` with a single repeat)."""
        spreads = [s for s in (self.base_spread, self.merged_spread) if s is not None]
        return max(spreads) if spreads else None

    @property
    def noisy(self) -> bool:
        """The repeats disagree by more than :data:`~tomerge.experiments.measure.timing.NOISY_SPREAD` (10%)."""
        return self.spread is not None and self.spread > NOISY_SPREAD

    @property
    def speedup(self) -> float:
        return self.base_ms / self.merged_ms

    @property
    def ideal(self) -> float:
        return self.base_gflop / self.merged_gflop

    @property
    def efficiency(self) -> float:
        return self.speedup / self.ideal

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "speedup": round(self.speedup, 4), "ideal": round(self.ideal, 4),
                "efficiency": round(self.efficiency, 4)}


# ---------------------------------------------------------------------- merging, FLOPs, time
def method_spec(method: str) -> tuple[str, dict[str, Any]]:
    """``"NAME"`` or ``"NAME:KEY=VALUE[:KEY=VALUE...]"`` (YAML values) -> the registered name and its options.

    Example:
        >>> method_spec("fora:merge=tomesd:interval=2")
        ('fora', {'merge': 'tomesd', 'interval': 2})
    """
    from ..config.load import parse_override

    name, *pairs = method.split(":")
    options = dict(parse_override(pair) for pair in pairs)
    return name, options


def check_method(method: str) -> str:
    """``method`` if :func:`method_spec` reads it and ``tomerge.apply`` would accept its name and options (the
    ``tomesd`` package too), else a ``ValueError`` in one line."""
    if method == TOMESD_PACKAGE:
        return method
    name, options = method_spec(method)
    if name not in tomerge.list_strategies():
        raise ValueError(f"unknown method {name!r}; choose from {[*tomerge.list_strategies(), TOMESD_PACKAGE]}, "
                         "optionally with options as NAME:KEY=VALUE (e.g. fora:merge=tomesd)")
    from tomerge.attach import check_options

    try:
        check_options(name, ratio=None if options.get("merge") is None and _caches(name) else 0.5, **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{method}: {str(err).splitlines()[0]}") from err
    return method


def _caches(name: str) -> bool:
    from tomerge.experiments.sources.coverage import caches_blocks

    return caches_blocks(name)


@contextlib.contextmanager
def merged(bench: Bench, method: str | None, ratio: float, num_steps: int | None = None):
    """The model with ``method`` applied (``None``: baseline; ``"tomesd package"``: ``tomesd.apply_patch``;
    ``NAME:KEY=VALUE``: with options, :func:`method_spec`)."""
    if method is None:
        yield
    elif method == TOMESD_PACKAGE:
        import tomesd

        tomesd.apply_patch(bench.model, ratio=ratio)
        try:
            yield
        finally:
            tomesd.remove_patch(bench.model)
    else:
        name, options = method_spec(method)
        kw = {"num_steps": num_steps} if num_steps else {}
        from tomerge.attach import apply_arguments

        arguments = apply_arguments({**options, **kw})
        with tomerge.merging(bench.model, name, ratio=method_ratio(method, ratio), **arguments):
            yield


def method_ratio(method: str | None, ratio: float) -> float | None:
    """The ratio ``method`` runs at: ``ratio``, except for a caching schedule without a ``merge`` option, which
    runs at its own defaults without a merging strategy (``None``: it merges nothing; its rows say ratio 0).
    A caching schedule with ``merge`` (``fora:merge=tomesd``) merges the blocks that run at ``ratio``."""
    if method is None or method == TOMESD_PACKAGE:
        return ratio
    name, options = method_spec(method)
    return ratio if options.get("merge") is not None or not _caches(name) else None


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def time_compiled(bench: Bench, methods: Sequence[str | None], ratio: float, fn: Callable[[], object],
                  repeats: int, warmup: int, threads: int, num_steps: int | None, clock: str,
                  mode: str, backend: str = "inductor",
                  peaks: dict[str | None, float] | None = None) -> dict[str | None, tuple[float, float | None]]:
    """Median seconds and spread per method, as :func:`~tomerge.experiments.measure.timing.time_setups` gives them for
    eager models, with compiled models: every method gets its own copy of the model, applied once and compiled
    (``torch.compile(copy, mode=mode)``; a new application would have new hooks and recompile), and
    ``max(1, warmup)`` untimed calls compile it (every step of a loop compiles what it needs). Then the
    methods alternate round after round (``time_setups``), each calling its own compiled copy, so slow drifts of
    the machine hit every method alike. Dynamo's recompile limit is raised to hold every method's graphs, and
    dynamo guards on module hooks (``skip_nnmodule_hook_guards=False``): by default it does not, and the
    copies share their blocks' code with the baseline, so a merged copy would run the baseline's graphs.
    ``peaks``: as for ``time_setups`` (on CUDA each method's peak includes every compiled copy's weights and
    CUDA-graph pools, so compare eager peaks)."""
    import copy

    import torch

    raw = bench.model
    runners: dict[str | None, Any] = {}
    torch._dynamo.reset()
    with contextlib.ExitStack() as applied, \
            torch._dynamo.config.patch(recompile_limit=max(8, 8 * len(methods)), skip_nnmodule_hook_guards=False):
        try:
            for method in methods:
                bench.model = raw if method is None else copy.deepcopy(raw)
                applied.enter_context(merged(bench, method, ratio, num_steps))
                runners[method] = bench.model = torch.compile(
                    bench.model, mode=None if mode == "default" or backend != "inductor" else mode, backend=backend)
                for _ in range(max(1, warmup)):
                    fn()

            def run_compiled(method: str | None) -> contextlib.AbstractContextManager:
                bench.model = runners[method]
                return contextlib.nullcontext()

            seconds = time_setups({m: functools.partial(run_compiled, m) for m in methods}, fn, repeats, 0, threads,
                                  clock, peaks=peaks)  # compiled above: no warm-up rounds
        finally:
            bench.model = raw
    torch._dynamo.reset()
    return seconds


def sdpa_backend(name: str):
    """A context restricting ``scaled_dot_product_attention`` to one backend (``"default"``: no restriction)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel(backends[name])


def default_methods(width: str) -> list[str]:
    """Every registered strategy and schedule; on the UNet the ``tomesd`` package and tomerge's ``tomesd``."""
    if width == "unet":
        return [TOMESD_PACKAGE, "tomesd"]
    return list(tomerge.list_strategies())


def e2e_benchmark(widths: Sequence[str] = ("sd3", "pixart", "flux", "unet"), tokens: Sequence[int] = (1024, 4096),
                  ratios: Sequence[float] = (0.5,), depth: int = 2, batch: int = 2,
                  methods: Sequence[str] | None = None, steps: int = 0, repeats: int = 5, warmup: int = 1,
                  quick: bool = False, text_tokens: int | None = None, threads: int | None = None,
                  dtype: torch.dtype | None = None, device: str = "cpu", sdpa: str = "default",
                  clock: str = "wall", compile_mode: str | None = None, progress: bool = True,
                  frames: int | None = None, compile_backend: str = "inductor") -> list[E2ERow]:
    """Baseline vs every method on every (width, N, ratio): one forward, and a ``steps``-step loop if ``steps``.

    Args:
        widths: model families (:mod:`tomerge.experiments.bench.models`).
        tokens: image token counts (perfect squares; video widths: ``T * H * W``, see
            :func:`~tomerge.experiments.bench.models.video_grid`).
        ratios: merge ratios.
        depth: blocks per model (Flux: of each kind).
        batch: ``B``.
        methods: strategy/schedule names, with options as ``NAME:KEY=VALUE`` (:func:`method_spec`), or
            ``"tomesd package"`` (UNet only); default :func:`default_methods`.
        steps: also time a sampling loop of this many steps (0: forward only).
        repeats, warmup: timed and untimed alternating rounds.
        quick: tiny models (seconds).
        text_tokens: override each width's text length.
        threads: torch threads (default: torch's current count).
        dtype, device: where the models run (``dtype`` default: float32).
        sdpa: attention backend for every call (``"default"``, ``"flash"``, ``"efficient"``, ``"cudnn"``,
            ``"math"``); on CPU ``"flash"`` is the CPU flash kernel that runs by default anyway.
        clock: ``"wall"`` or ``"cpu"`` (process CPU time; see :func:`~tomerge.experiments.measure.timing.time_once`); CUDA always uses events.
        compile_mode: time the baseline and every method compiled with inductor in this ``torch.compile`` mode
            (one of :data:`COMPILE_MODES`; see :func:`time_compiled`); ``None``: eager.
        compile_backend: ``torch.compile``'s backend; another than ``"inductor"`` (``"aot_eager"``: a CPU smoke
            test of the compiled path in seconds) ignores ``compile_mode``.
        progress: show a progress bar.
        frames: video widths: the frames ``T`` of every token grid (default: see
            :func:`~tomerge.experiments.bench.models.video_grid`).

    Returns:
        One :class:`E2ERow` per (width, N, ratio, mode, method).
    """
    import torch
    from tqdm import tqdm

    from ..measure.flops import count_flops_split

    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
    if compile_mode is not None and TOMESD_PACKAGE in (methods or []):
        raise ValueError("the tomesd package is timed eagerly only (its patched forward breaks the graph)")
    check_sizes(widths, tokens, frames)
    threads = threads or torch.get_num_threads()
    rows: list[E2ERow] = []
    configs = [(w, n) for w in widths for n in tokens]
    bar = tqdm(configs, desc="e2e", disable=not progress)
    with torch.inference_mode(), sdpa_backend(sdpa):
        for width, N in bar:
            bench = build(width, N, depth, batch, quick=quick, text_tokens=text_tokens, dtype=dtype, device=device,
                          frames=frames if width in VIDEO_WIDTHS else None)
            names = [m for m in (methods or default_methods(width))
                     if (width == "unet" and compile_mode is None) or m != TOMESD_PACKAGE]
            modes: list[tuple[str, Callable[[], object], int | None]] = [("forward", bench.call, None)]
            if steps > 0:
                modes.append((f"loop{steps}", lambda: bench.sample(steps), steps))
            for ratio in ratios:
                for mode, fn, num_steps in modes:
                    bar.set_postfix_str(f"{width} N={N} r={ratio} {mode}")
                    flops = {}
                    for m in [None, *names]:
                        with merged(bench, m, ratio, num_steps):
                            flops[m] = count_flops_split(fn)  # (total, merging's own)
                    peaks: dict[str | None, float] = {}
                    if compile_mode is None:
                        applied = {m: functools.partial(merged, bench, m, ratio, num_steps) for m in [None, *names]}
                        secs = time_setups(applied, fn, repeats, warmup, threads, clock, peaks=peaks)
                    else:
                        secs = time_compiled(bench, [None, *names], ratio, fn, repeats, warmup, threads, num_steps,
                                             clock, compile_mode, backend=compile_backend, peaks=peaks)
                    for m in names:
                        rows.append(E2ERow(width, bench.spec.hidden, bench.spec.heads, depth, N, bench.spec.text_tokens,
                                           batch, mode, method_ratio(m, ratio) or 0.0, m, secs[None][0] * 1e3,
                                           secs[m][0] * 1e3, flops[None][0] / 1e9, flops[m][0] / 1e9, secs[None][1],
                                           secs[m][1], flops[m][1] / batch / 1e9, peaks.get(None), peaks.get(m)))
            del bench
    return rows


def markdown_table(rows: Sequence[E2ERow]) -> str:
    """One line per row; ``spread`` is the larger timing's (max - min) / median over the repeats, and a
    row above 10% is marked ``(noisy)``: its speed-up is not reliable. Merging's own GFLOPs per image and, on
    CUDA, the peak memory of the baseline's and the method's timed calls."""
    from ..measure.columns import COLUMNS

    titles = ["model", "C", "depth", "N", "text", "mode", "ratio", "method", "base ms", "merged ms", "speed-up",
              "ideal", "efficiency", "spread", COLUMNS["merge_gflops"].table_title, "base peak MiB", "peak MiB"]
    cells = [[r.model, str(r.width), str(r.depth), str(r.tokens), str(r.text_tokens), r.mode, str(r.ratio), r.method,
              f"{r.base_ms:.1f}", f"{r.merged_ms:.1f}", f"{r.speedup:.2f}", f"{r.ideal:.2f}", f"{r.efficiency:.0%}",
              "-" if r.spread is None else f"{r.spread:.0%}" + (" (noisy)" if r.noisy else ""),
              f"{r.merge_gflops:.3g}", _mb(r.peak_memory_base_mb), _mb(r.peak_memory_mb)] for r in rows]
    numeric = [False, True, True, True, True, False, True, False, True, True, True, True, True, True, True, True, True]
    return format_markdown_table(titles, cells, numeric)


def _mb(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def pivot_table(rows: Sequence[E2ERow]) -> str:
    """One line per (model, N, ratio, mode), one column per method; cells ``speed-up / ideal (efficiency)``,
    followed by ``noisy`` when the cell's timing repeats disagree by more than 10%.

    Example:
        >>> row = E2ERow("pixart", 1152, 16, 1, 1024, 120, 2, "forward", 0.5, "ssm", 100.0, 50.0, 10.0, 4.0)
        >>> print(pivot_table([row]).splitlines()[-1])
        | pixart (1152) | 1024 | 0.5 | forward | 100 | 2.00 / 2.50 (80%) |
    """
    methods = list(dict.fromkeys(r.method for r in rows))
    groups: dict[tuple, dict[str, E2ERow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.width, r.tokens, r.ratio, r.mode), {})[r.method] = r
    lines = ["| model (C) | N | ratio | mode | base ms | " + " | ".join(methods) + " |",
             "|---|---:|---:|---|---:|" + "---|" * len(methods)]
    for (model, width, tokens, ratio, mode), by_method in groups.items():
        base = next(iter(by_method.values())).base_ms
        cells = [f"{r.speedup:.2f} / {r.ideal:.2f} ({r.efficiency:.0%}){' noisy' if r.noisy else ''}"
                 if (r := by_method.get(m)) else "" for m in methods]
        lines.append(f"| {model} ({width}) | {tokens} | {ratio} | {mode} | {base:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
