"""The grid benchmark (``tomerge bench --config FILE``): the generation call of a config's model (the bundled
reference DiT or a diffusers pipeline folder, see docs/experiments.md) on its timing batch, for every run of its
grid, timed and counted as ``tomerge ablate`` times and counts it (the same functions of
:mod:`tomerge.experiments.runs.ablation`), without images or quality metrics.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..config.load import load_config
from ..errors import user_input
from ..measure.timing import overhead_ratio
from ..runs.ablation import match_flop_speedups, measure_run, speed_row


def model_benchmark(config_path: Path, overrides: Sequence[str], plugins: Sequence[str] = ()) -> list[dict]:
    """Speed rows of every run of a config's grid on its model: the timing batch's generation call,
    baseline and merged alternating (``warmup``, ``repeats``), denoiser time and FLOPs (merging's own apart:
    ``merge_gflops``), spread."""
    with user_input():
        config = load_config(config_path, list(overrides), plugins=list(plugins))
    source = config.model.load()
    items = config.items()[: config.timing_batch]
    source.check_items(items)
    flops_base = measure_run(source, config, items, None, map_steps=False)["flops"]
    rows = []
    for run in match_flop_speedups(source, config, config.runs(), items[:1]):
        measured = measure_run(source, config, items, run, map_steps=False)
        flops = measured["flops"]
        row = {"run": run.run_id, "ratio": run.ratio, **speed_row(source, config, items, run),
               "flops_base": flops_base, "flops": flops, "flop_speedup": flops_base / flops,
               "merge_gflops": measured["merge_gflops"]}
        row["overhead_ratio"] = overhead_ratio(row["speedup"], row["flop_speedup"])
        rows.append(row)
    return rows
