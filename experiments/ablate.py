"""`tomerge ablate`: a grid of strategies x ratios x options against the unmerged baseline.

    tomerge ablate                                        # default grid on the bundled reference DiT (CPU, minutes)
    tomerge ablate --config experiments/configs/quality.yaml --set images.per_class=10 --set name=big

Every run uses the same labels and the same initial noise as the baseline (noise of image ``i`` comes
from ``seed + i``), and records: its config, wall-clock time of the sampling loop (median of
alternating baseline/merged repeats after a warm-up, in one process), FLOPs of the loop
(``FlopCounterMode``) and the FLOP-ideal speed-up, peak memory, PSNR/SSIM against the baseline
images, FD-EffNetLite0 against the baseline images and against real test images, versions and the
git commit. Results are appended to ``runs/<name>/results.jsonl`` as each run finishes, so an
interrupted grid resumes where it stopped;
``results.csv`` and ``table.md`` are rewritten at the end, and W&B gets the same (offline by default).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import tomerge

from .config import AblationConfig, RunSpec, load_config
from .records import RunFolder, environment
from .sampling import sample


def load_model(config: AblationConfig) -> nn.Module:
    """The model the grid runs on: a DiT checkpoint (default: the bundled reference model)."""
    from tomerge.backbones.native_dit import load_dit

    return load_dit(config.checkpoint_path(), map_location=config.device).eval()


def _noise(config: AblationConfig, indices: range, model: nn.Module) -> Tensor:
    c = model.config
    size = (c.in_channels, *c.image_hw)
    return torch.stack([torch.randn(size, generator=torch.Generator().manual_seed(config.seed + i)) for i in indices])


def generate(model: nn.Module, config: AblationConfig, progress: bool = False) -> Tensor:
    """All images of the config (``[n, C, H, W]`` in [-1, 1]), batch by batch, same noise every time."""
    labels = config.labels()
    images = []
    for start in range(0, len(labels), config.batch_size):
        idx = range(start, min(start + config.batch_size, len(labels)))
        images.append(sample(model, labels[idx.start:idx.stop], num_steps=config.num_steps,
                             cfg_scale=config.cfg_scale, noise=_noise(config, idx, model)).cpu())
    return torch.cat(images)


def _timing_call(model: nn.Module, config: AblationConfig):
    labels = config.labels()[: config.timing_batch]
    noise = _noise(config, range(len(labels)), model)

    def call() -> None:
        sample(model, labels, num_steps=config.num_steps, cfg_scale=config.cfg_scale, noise=noise)

    return call


def _seconds(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - start


def merging(model: nn.Module, run: RunSpec, config: AblationConfig):
    """``tomerge.merging`` for one run; the step count is the sampler's, so schedules see exact progress."""
    return tomerge.merging(model, run.strategy, ratio=run.ratio, **{"num_steps": config.num_steps, **run.options})


def time_alternating(model: nn.Module, run: RunSpec, config: AblationConfig) -> tuple[float, float]:
    """Median seconds of the timing batch's sampling loop, baseline and merged alternating."""
    call = _timing_call(model, config)
    base, merged = [], []
    for i in range(config.warmup + config.repeats):
        b = _seconds(call)
        with merging(model, run, config):
            m = _seconds(call)
        if i >= config.warmup:
            base.append(b)
            merged.append(m)
    return statistics.median(base), statistics.median(merged)


def count_flops(model: nn.Module, config: AblationConfig, run: RunSpec | None) -> int:
    """FLOPs of the timing batch's full sampling loop (with the run's merging, if any)."""
    from torch.utils.flop_counter import FlopCounterMode

    call = _timing_call(model, config)
    counter = FlopCounterMode(display=False)
    if run is None:
        with counter:
            call()
    else:
        with merging(model, run, config), counter:
            call()
    return counter.get_total_flops()


def peak_memory_mb(fn) -> float | None:
    """Peak CUDA memory of ``fn`` in MiB (``None`` on CPU, where torch does not track it)."""
    if not torch.cuda.is_available():
        fn()
        return None
    torch.cuda.reset_peak_memory_stats()
    fn()
    return torch.cuda.max_memory_allocated() / 2**20


def generate_merged(model: nn.Module, run: RunSpec, config: AblationConfig) -> tuple[Tensor, dict[str, Any], list]:
    """Images with the run's merging, the merge maps of the first image, and the decision records."""
    maps: dict[str, Any] = {}
    with merging(model, run, config) as handle:
        def keep_map(call, plan) -> None:
            key = f"step{call.where.step:03d}_layer{call.where.layer:02d}"
            if call.where.step in config.map_steps_for(handle.state.clock.num_steps) and key not in maps:
                maps[key] = plan.slot_of_token[0].cpu()
        handle.state.observers.append(keep_map)
        images = generate(model, config)
        records = list(handle.state.records)
    return images, maps, records


class QualityFeatures:
    """EfficientNet-Lite0 features of the baseline images and of real test images, computed once per
    run folder (``features.safetensors``) and reused by every run's quality numbers."""

    def __init__(self, folder: RunFolder, config: AblationConfig, baseline: Tensor) -> None:
        from .metrics import FeatureExtractor

        cached = folder.load_tensors("features") or {}
        extract = FeatureExtractor(device=config.device)
        if "baseline" not in cached:
            cached["baseline"] = extract(baseline)
        if config.fd_reference_images and "reference" not in cached:
            from .data import FashionMNIST

            real = FashionMNIST(config.data_root, split="test", limit=config.fd_reference_images)
            cached["reference"] = extract(real.images.float().div(127.5).sub(1.0).unsqueeze(1))  # [n, 1, H, W]
        folder.save_tensors("features", cached)
        self.features = cached

    def kwargs(self) -> dict[str, Tensor]:
        out = {"baseline_features": self.features["baseline"]}
        if "reference" in self.features:
            out["reference_features"] = self.features["reference"]
        return out


def run_ablation(config: AblationConfig, progress: bool = True) -> RunFolder:
    """Runs (or resumes) the grid; returns the run folder with every result written."""
    from tqdm import tqdm

    from .metrics import compute_quality

    folder = RunFolder.open(config)
    model = load_model(config)
    env = environment()
    logger = folder.logger(config, env)
    baseline = folder.load_images("baseline")
    if baseline is None:
        baseline = generate(model, config)
        folder.save_images("baseline", baseline)
        logger.images("baseline", baseline)
    features = QualityFeatures(folder, config, baseline)
    if not folder.has("baseline"):
        quality = compute_quality(baseline, baseline, **features.kwargs())
        row = {"run": "baseline", "strategy": "none", "ratio": 0.0, "options": {},
               "flops": count_flops(model, config, None), **quality, **env}
        folder.append(row)
        logger.row(row)

    todo = [r for r in config.runs() if not folder.has(r.run_id)]
    for run in tqdm(todo, desc=f"ablate {config.name}", disable=not progress):
        images, maps, records = generate_merged(model, run, config)
        t_base, t_merged = time_alternating(model, run, config)
        flops_base = folder.baseline_row()["flops"]
        flops = count_flops(model, config, run)
        memory = peak_memory_mb(_timing_call(model, config)) if torch.cuda.is_available() else None
        quality = compute_quality(baseline, images, **features.kwargs())
        row = {
            "run": run.run_id, "strategy": run.strategy, "ratio": run.ratio, "options": run.options,
            "time_base_s": t_base, "time_s": t_merged, "speedup": t_base / t_merged,
            "flops_base": flops_base, "flops": flops, "flop_speedup": flops_base / flops,
            "overhead_ratio": (t_base / t_merged) / (flops_base / flops),
            "peak_memory_mb": memory, "tokens_removed_mean": _mean_removed(records), **quality, **env,
        }
        folder.save_images(run.run_id, images)
        folder.save_maps(run.run_id, maps, records)
        folder.append(row)
        logger.row(row, images=images, maps=maps)
    folder.finish()
    logger.finish(folder)
    return folder


def _mean_removed(records: Sequence) -> float:
    merged = [r.num_removed / r.num_tokens for r in records if r.num_tokens]
    return float(sum(merged) / len(merged)) if merged else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config (default: experiments/configs/ablate.yaml, the reference-model grid)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config entry, dotted keys, YAML values (repeatable)")
    parser.add_argument("--wandb", choices=["disabled", "offline", "online"], default=None,
                        help="W&B mode (default: offline unless an API key is configured)")
    parser.add_argument("--out-dir", type=Path, default=None, help="parent folder of run folders (default runs/)")


def run(args: argparse.Namespace) -> int:
    overrides = list(args.overrides)
    if args.wandb is not None:
        overrides.append(f"wandb={args.wandb}")
    if args.out_dir is not None:
        overrides.append(f"out_dir={args.out_dir}")
    config = load_config(args.config, overrides)
    folder = run_ablation(config)
    print()
    print(folder.table_path.read_text())
    print(f"results: {folder.path}/results.csv, {folder.path}/results.jsonl; images and merge maps in {folder.path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tomerge ablate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
