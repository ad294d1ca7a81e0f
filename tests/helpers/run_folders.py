"""A synthetic run folder as ``tomerge ablate`` writes it (rows, images, merge maps, timing spreads), for the tests of
``tomerge figures`` and of broken run folders: ``make_run_folder``; ``RUNS`` and ``SPREADS`` are its default rows and
timing spreads.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from tomerge.experiments.measure.flops import COUNTER_VERSION

STEPS, LAYERS, SIDE, N_IMAGES = 10, 3, 16, 6  # 16x16 images, patch 2 -> 8x8 = 64 tokens
# run id, strategy, ratio, options, speed-up, PSNR, FD-EffNetLite0 (vs baseline images)
RUNS = [
    ("tomesd-r0.25-use_rand=False", "tomesd", 0.25, {"use_rand": False}, 1.10, 34.0, 2.0),
    ("tomesd-r0.5-use_rand=False", "tomesd", 0.5, {"use_rand": False}, 1.40, 30.0, 4.0),
    ("tomesd-r0.75-use_rand=False", "tomesd", 0.75, {"use_rand": False}, 1.70, 24.0, 9.0),
    ("ssm-r0.25", "ssm", 0.25, {}, 1.05, 33.0, 1.5),     # PSNR-dominated by tomesd r0.25
    ("ssm-r0.5", "ssm", 0.5, {}, 1.40, 30.0, 3.5),       # PSNR tie with tomesd r0.5: both on the front
    ("sdtm-r0.5", "sdtm", 0.5, {}, 1.55, 29.0, 5.0),
    ("toma-r0.5-merge_every=2", "toma", 0.5, {"merge_every": 2}, 0.90, 36.0, 1.0),
    ("idm-r0.5", "idm", 0.5, {}, 1.20, 25.0, 8.0),        # dominated on both metrics
]
# (baseline, merged) timing spreads, (max - min) / median of the repeats; None: one repeat, no bar
SPREADS = {"tomesd-r0.5-use_rand=False": (0.02, 0.04), "ssm-r0.5": (0.04, 0.02), "sdtm-r0.5": (0.03, 0.16),
           "idm-r0.5": (0.12, 0.02), "toma-r0.5-merge_every=2": (None, None)}
NOISY = 0.10  # timing.NOISY_SPREAD


def _label(strategy: str, step: int, layer: int) -> tuple[str, float, int]:
    """(label, requested ratio, removed of 64) of a synthetic decision."""
    if strategy == "sdtm":
        if layer == 0:
            return "protected", 0.0, 0
        return ("structure", 0.5, 32) if step < 6 else ("detail", 0.25, 16)
    if strategy == "toma":
        if layer == 0:
            return "skip_block", 0.0, 0
        return ("merge", 0.5, 32) if step % 2 == 0 else ("skip_step", 0.0, 0)
    return strategy, 0.5, 32


def _slots(removed: int, gen: torch.Generator) -> torch.Tensor:
    n = SIDE * SIDE // 4
    dst = torch.randperm(n, generator=gen)[: n - removed]
    slots = torch.randint(0, n - removed, (n,), generator=gen)
    slots[dst] = torch.arange(n - removed)
    return slots


def save_images(folder: Path, run: str, images: torch.Tensor, prompts: list[str] | None = None,
                labels: list[int] | None = None) -> None:
    """A run's images as ``tomerge ablate`` writes them: ``images/<run>/`` PNGs and their ``prompts.jsonl``
    (class ``labels[i]`` of item ``i``, all 0 by default)."""
    from tomerge.experiments.generation.generate import save_image, write_index
    from tomerge.experiments.sources.items import Item

    out = folder / "images" / run
    out.mkdir(parents=True)
    items = [Item(i, i, label=None if prompts else (labels[i] if labels else 0),
                  prompt=prompts[i] if prompts else None) for i in range(images.shape[0])]
    for item, image in zip(items, images):
        save_image(image, out / item.filename)
    write_index(out, items)


def speedup_interval(speedup: float, sb: float | None, sm: float | None) -> dict[str, float]:
    """A synthetic speed-up interval from the spreads (none for one repeat): ``[s (1 - sb), s (1 + sm)]``."""
    return {} if sb is None else {"speedup_lo": speedup * (1 - sb), "speedup_hi": speedup * (1 + sm)}


def make_run_folder(root: Path, name: str = "synthetic", prompts: list[str] | None = None,
                    labels: list[int] | None = None, spreads: dict | None = None, speed_scale: float = 1.0,
                    psnr_shift: float = 0.0, runs: list[tuple] = RUNS, row_keys: dict | None = None,
                    model: dict | None = None) -> Path:
    """A run folder as ``tomerge ablate`` writes it, with the rows of ``runs`` (default ``RUNS``; speed-ups
    times ``speed_scale``, PSNR plus ``psnr_shift``; ``row_keys[run]`` added to a run's row), timing spreads
    ``spreads`` (default ``SPREADS``; runs not in it: 0.01 and 0.01), item class ``labels`` (default all 0) or
    ``prompts``, made with the ``ModelSpec(**model)`` (default: the bundled reference DiT)."""
    from safetensors.torch import save_file

    from tomerge.experiments.sources.models import ModelSpec

    spreads = SPREADS if spreads is None else spreads
    row_keys = row_keys or {}

    folder = root / name
    (folder / "images").mkdir(parents=True)
    (folder / "maps").mkdir()
    config = {"name": name, "num_steps": STEPS, "seed": 0, "model": ModelSpec(**(model or {})).to_dict()}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    gen = torch.Generator().manual_seed(0)
    rows = [{"run": "baseline", "strategy": "none", "ratio": 0.0, "options": {}, "flops": 1000, "flop_counter": COUNTER_VERSION,
             "psnr": 100.0, "ssim": 1.0, "fd_effnetlite0": 0.0, "fd_effnetlite0_ref": 90.0, "n_images": N_IMAGES,
             "versions": {}, "git_commit": None}]
    channels = 3 if prompts else 1
    save_images(folder, "baseline", torch.rand(N_IMAGES, channels, SIDE, SIDE, generator=gen) * 2 - 1, prompts,
                labels)
    for run, strategy, ratio, options, speedup, psnr, fd in runs:
        speedup, psnr = speedup * speed_scale, psnr + psnr_shift
        sb, sm = spreads.get(run, (0.01, 0.01))
        spread = None if sb is None else max(sb, sm)
        rows.append({"run": run, "strategy": strategy, "ratio": ratio, "options": options, "time_base_s": 1.0,
                     "time_spread_base": sb, "time_spread": sm, "timing_spread": spread,
                     "timing_noisy": spread is not None and spread > NOISY, "timing_repeats": 1 if sb is None else 3,
                     "time_s": 1 / speedup, "speedup": speedup, **speedup_interval(speedup, sb, sm), "flops_base": 1000, "flops": 600, "flop_counter": COUNTER_VERSION,
                     "flop_speedup": 1000 / 600, "overhead_ratio": speedup / (1000 / 600), "peak_memory_mb": None,
                     "tokens_removed_mean": 0.4, "psnr": psnr, "ssim": psnr / 40, "fd_effnetlite0": fd,
                     "fd_effnetlite0_ref": fd + 100, "n_images": N_IMAGES, "versions": {}, "git_commit": None,
                     **row_keys.get(run, {})})
        save_images(folder, run, torch.rand(N_IMAGES, channels, SIDE, SIDE, generator=gen) * 2 - 1, prompts, labels)
        records, maps = [], {}
        for step in range(STEPS):
            for layer in range(LAYERS):
                label, r, removed = _label(strategy, step, layer)
                records.append({"trajectory": 1, "step": step, "layer": layer, "block_kind": "dit", "label": label,
                                "ratio": r, "sublayers": ["attn", "mlp"] if removed else [],
                                "num_tokens": 64 if removed else 0, "num_removed": removed})
                if step in (0, STEPS - 1) and removed:
                    maps[f"step{step:03d}_layer{layer:02d}"] = _slots(removed, gen)
        (folder / "maps" / f"{run}.json").write_text(json.dumps(records))
        if maps:
            save_file(maps, folder / "maps" / f"{run}.safetensors")
    # an interrupted-and-resumed ablation may append a run twice: the last row counts
    lines = [json.dumps(r) for r in rows]
    (folder / "results.jsonl").write_text("\n".join([lines[0], json.dumps({**rows[1], "psnr": 1.0}), *lines[1:]]) + "\n")
    return folder
