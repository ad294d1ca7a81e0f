"""`tomerge ablate`: a grid of strategies x ratios x options against the unmerged baseline.

    tomerge ablate                                        # default grid on the bundled reference DiT (CPU, minutes)
    tomerge ablate --config experiments/configs/quality.yaml --set per_class=10 --set name=big
    tomerge ablate --config experiments/configs/papers/sdtm_sd3_medium.yaml \\
        --set model.pipeline=/models/sd3-medium --set prompts=/data/coco/captions_val2017.json

Every run generates the baseline's items with the same seeds, on the bundled reference DiT or a diffusers
pipeline folder (images or videos), and records speed (baseline and merged alternating), FLOPs, quality against
the baseline and real images, and versions, one row per run appended to ``runs/<name>/results.jsonl``, so an
interrupted grid resumes. What each column means and the run folder's files: docs/experiments.md, "3. Run the
ablation" and "8. Video pipelines".
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config.grid import valid_ratios
from ..config.schema import AblationConfig, ConfigError, RunSpec
from ..generation.files import image_files, output_complete
from ..generation.distributed import generate_distributed
from ..generation.generate import INDEX_FILE, GenerateSpec, generate_local, item_output, merging, prepare
from ..measure.timing import overhead_ratio, speed_columns, time_baseline_and_merged
from ..sources.items import Item
from .records import RESULTS, RunFolder, environment, last_rows

if TYPE_CHECKING:
    from torch import Tensor

# run_ablation is the grid; measure_run, speed_row and match_flop_speedups measure one run of it, and
# `tomerge bench --config` times a grid with them (without images or quality metrics).
__all__ = ["run_ablation", "measure_run", "speed_row", "match_flop_speedups", "FlopSpeedups"]




def _spec(config: AblationConfig, run: RunSpec | None) -> GenerateSpec:
    if run is None:
        return GenerateSpec(model=config.model, batch_size=config.batch_size, plugins=config.plugins)
    return GenerateSpec(model=config.model, strategy=run.strategy, ratio=run.ratio, options=run.options,
                        batch_size=config.batch_size, plugins=config.plugins)


class ParentModel:
    """The model source of the process running the grid, loaded when first asked for (:meth:`get`) and released
    (:meth:`release`) before generation ranks start (``devices > 1``): every rank loads its own copy on its device,
    so a copy kept here would sit on ``cuda:0`` beside rank 0's. It is loaded again when the grid next needs it
    (FLOPs, timings). Hold no other reference to what :meth:`get` returns across a :func:`produce_images` call."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self._source: Any = None

    def get(self) -> Any:
        if self._source is None:
            self._source = self.spec.load()
        return self._source

    def release(self) -> None:
        """Drops this process's model and returns CUDA's cached blocks to the device."""
        if self._source is None:
            return
        self._source = None
        import gc

        gc.collect()
        import torch

        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()


def produce_images(folder: RunFolder, run_id: str, spec: GenerateSpec, items: Sequence[Item], model: ParentModel,
                   config: AblationConfig, progress: bool) -> list[Path]:
    """Writes (or resumes) the run's images; returns their files (videos: frame folders) in item order. With
    ``config.devices > 1`` the ranks generate, after this process released its model (:class:`ParentModel`)."""
    out = folder.images_dir(run_id)
    if config.devices > 1:
        prepare(out, items, spec)
        on_gpu = config.model.device.startswith("cuda")
        launcher = config.launcher if config.launcher != "auto" else ("ddp_spawn" if on_gpu else "ddp_fork")
        model.release()
        generate_distributed(items, spec, out, devices=config.devices, accelerator="gpu" if on_gpu else "cpu",
                             launcher=launcher, progress=progress)
    else:
        generate_local(items, spec, out, source=model.get(), progress=progress)
    files = [item_output(out, item, config.model.is_video) for item in items]
    missing = [f.name for f in files if not output_complete(f)]
    if missing:
        raise RuntimeError(f"{len(missing)} images of {run_id} were not written (first: {missing[0]})")
    return files


def measure_run(source: Any, config: AblationConfig, timing_items: Sequence[Item], run: RunSpec | None,
                map_steps: bool = True) -> dict[str, Any]:
    """The counted side of one run: FLOPs of the denoiser for ``timing_items`` with the run's merging
    (``run=None``: the unmerged baseline) as ``flops``, ``flops_per_image``, ``denoiser_calls_per_image`` and
    ``merge_gflops`` (planning, merging and unmerging, GFLOPs per image, a part of ``flops``;
    :func:`~tomerge.experiments.measure.flops.count_denoiser_flops`); with ``map_steps``, the merge maps of
    its first image at the config's map steps (``maps``: ``[N]`` slots per key, ``grids``: each map's token
    grid); and every block call's decision record (``records``)."""
    from ..measure.flops import count_denoiser_flops

    call = lambda: source.generate(timing_items)  # noqa: E731
    n = len(timing_items)
    if run is None:
        flops, calls, merge_flops = count_denoiser_flops(source.denoiser, call)
        return {"flops": flops, "flops_per_image": flops / n, "denoiser_calls_per_image": calls / n,
                "merge_gflops": merge_flops / n / 1e9, "maps": {}, "grids": {}, "records": []}
    maps: dict[str, Any] = {}
    grids: dict[str, tuple[int, ...]] = {}
    with merging(source, run) as handle:
        def keep_map(block_call, plan) -> None:
            where = block_call.where
            key = f"step{where.step:03d}_layer{where.layer:02d}"
            steps = config.map_steps_for(handle.state.clock.num_steps or source.num_steps)
            if map_steps and where.step in steps and key not in maps:
                maps[key] = plan.slot_of_token[0].cpu()  # [N]
                if block_call.grid is not None:
                    grids[key] = tuple(block_call.grid)  # (H, W) or (T, H, W)
        handle.state.observers.append(keep_map)
        flops, calls, merge_flops = count_denoiser_flops(source.denoiser, call)
        records = list(handle.state.records)
    return {"flops": flops, "flops_per_image": flops / n, "denoiser_calls_per_image": calls / n,
            "merge_gflops": merge_flops / n / 1e9, "maps": maps, "grids": grids, "records": records}


class FlopSpeedups:
    """The FLOP-ideal speed-up of a run at any ratio on ``items``: counted (:func:`measure_run`) at each ratio asked,
    against the unmerged FLOPs counted once."""

    def __init__(self, source: Any, config: AblationConfig, items: Sequence[Item], base: float | None = None) -> None:
        self.source, self.config, self.items = source, config, items
        self.base = measure_run(source, config, items, None, map_steps=False)["flops"] if base is None else base

    def __call__(self, run: RunSpec, ratio: float) -> float:
        with warnings.catch_warnings():  # e.g. "capping at N windows" at ratios the search only tries
            warnings.simplefilter("ignore")
            at_ratio = dataclasses.replace(run, ratio=ratio, flop_target=None)
            return self.base / measure_run(self.source, self.config, self.items, at_ratio, map_steps=False)["flops"]

    def bisect(self, run: RunSpec, target: float, lo: float, hi: float, at_lo: float, at_hi: float,
               steps: int = 10, reach: bool = False) -> float:
        """The ratio in ``[lo, hi]`` whose speed-up is closest to ``target`` (``at_lo <= target <= at_hi``, the
        speed-ups at the ends). It is a step function of the ratio (token counts are integers) and rises with it,
        so after ``steps`` halvings the closer of the two bracketing ratios is kept; with ``reach``, the upper one,
        rounded up, which reaches the target (a step can jump past it: SSM's 2 x 2 windows go from 2.5x to 4.6x
        between ratios 0.7497 and 0.75 on the reference DiT, and the closer one is then below)."""
        top = hi
        for _ in range(steps):
            mid = (lo + hi) / 2
            at_mid = self(run, mid)
            if at_mid < target:
                lo, at_lo = mid, at_mid
            else:
                hi, at_hi = mid, at_mid
        if reach:  # rounded up: at least the upper ratio, whose speed-up reaches
            return min(math.ceil(hi * 1e6) / 1e6, top)
        return round(lo if target - at_lo < at_hi - target else hi, 6)


def match_flop_speedups(source: Any, config: AblationConfig, runs: Sequence[RunSpec], items: Sequence[Item],
                        steps: int = 10) -> list[RunSpec]:
    """``runs`` with every FLOP-matched one (``flop_target`` set) at the ratio whose FLOP-ideal speed-up on
    ``items`` is closest to its target (:meth:`FlopSpeedups.bisect` within the ratios the strategy accepts with the
    run's options, :func:`~tomerge.experiments.config.grid.valid_ratios`); the others as they are. Raises
    :class:`~tomerge.experiments.errors.ConfigError` (a usage error: one message, exit code 2) when a target
    lies outside the speed-ups of the smallest and the largest accepted ratio.
    """
    if all(run.flop_target is None for run in runs):
        return list(runs)
    speedup = FlopSpeedups(source, config, items)

    def matched(run: RunSpec) -> RunSpec:
        lo, hi = valid_ratios(run.strategy, run.options)
        at_lo, at_hi = speedup(run, lo), speedup(run, hi)  # ratio 0 may merge (sdtm's curve around centre 0)
        if not at_lo <= run.flop_target <= at_hi:
            raise ConfigError([f"{run.run_id}: FLOP-ideal speed-up {run.flop_target:g}x is out of reach; the ratios "
                               f"{run.strategy} accepts ({lo:g} to {hi:g}) give {at_lo:.3f}x to {at_hi:.3f}x"])
        return dataclasses.replace(run, ratio=speedup.bisect(run, run.flop_target, lo, hi, at_lo, at_hi, steps))

    return [run if run.flop_target is None else matched(run) for run in runs]


def speed_row(source: Any, config: AblationConfig, timing_items: Sequence[Item], run: RunSpec) -> dict[str, Any]:
    """The timed side of one run: the generation call of ``timing_items``, baseline and merged alternating
    (the config's ``warmup`` and ``repeats``; :func:`~tomerge.experiments.measure.timing.time_baseline_and_merged`),
    as a result row's measured columns (:func:`~tomerge.experiments.measure.timing.speed_columns`: medians,
    spreads, per image, denoiser time, memory)."""
    base, merged = time_baseline_and_merged(lambda: source.generate(timing_items), lambda: merging(source, run),
                                            source.denoiser, warmup=config.warmup, repeats=config.repeats)
    return speed_columns(base, merged, items=len(timing_items), repeats=config.repeats)


def quality_scorer(folder: RunFolder, config: AblationConfig, baseline_files: Sequence[Path],
                   prompts: Sequence[str] | None):
    """The run folder's :class:`~tomerge.experiments.measure.image_sets.ImageSetQuality`: EfficientNet-Lite0
    features of the baseline images and of the real reference images are computed once
    (``features.safetensors``) and reused by every run, with the optional CLIP score, FID and DINO
    distance of ``metrics:``.

    Reference images: ``metrics.reference_images`` (a folder), else for the reference DiT
    ``fd_reference_images`` Fashion-MNIST test images (0: none).
    """
    from ..measure.features import FeatureExtractor
    from ..measure.image_sets import ImageSetQuality

    m = config.metrics
    cached = folder.load_tensors("features") or {}
    reference = cached.get("reference")
    if reference is None and m.reference_images is None and config.fd_reference_images \
            and config.model.kind == "reference":
        from PIL import Image

        from ..sources.data import FashionMNIST

        with Image.open(baseline_files[0]) as first:  # the test images at the model's resolution
            side = first.size[0]
        real = FashionMNIST(config.data_root, split="test", limit=config.fd_reference_images, size=side,
                            root_hint="--set data_root=DIR")
        extract = FeatureExtractor(device=config.model.device, batch_size=m.batch_size)
        reference = extract(real.images.float().div(127.5).sub(1.0).unsqueeze(1))  # [n, 1, H, W] -> [n, 1280]
    reference_files = image_files(m.reference_images, m.reference_limit) if m.reference_images else None
    scorer = ImageSetQuality(baseline_files, prompts=prompts, baseline_features=cached.get("baseline"),
                             reference_features=reference, reference_files=reference_files,
                             clip_model=m.clip_model, fid_weights=m.fid_weights, dino_model=m.dino_model,
                             batch_size=m.batch_size, device=config.model.device)
    cached["baseline"] = scorer.baseline_features
    if scorer.reference_features is not None:
        cached["reference"] = scorer.reference_features
    folder.save_tensors("features", cached)
    return scorer


def run_ablation(config: AblationConfig, progress: bool = True) -> RunFolder:
    """Runs (or resumes) the grid; returns the run folder with every result written.

    The inputs besides the config's own files (Fashion-MNIST for FD, EfficientNet-Lite0) are checked
    first (:meth:`~tomerge.experiments.config.schema.AblationConfig.input_problems`; a :class:`ConfigError`), so a
    missing one stops the grid before the first image."""
    problems = config.input_problems()
    if problems:
        raise ConfigError(problems)
    folder = RunFolder.open(config)  # locked: one process per run folder
    try:
        return _run_grid(config, folder, progress)
    finally:
        folder.close()  # on success, on an error and on Ctrl-C


def complete_finished_runs(folder: RunFolder, config: AblationConfig, items: Sequence[Item],
                           model: ParentModel) -> None:
    """Regenerates the missing or truncated images of the grid's runs that already have a row (deleted, a
    broken copy): the same seeds give the same images, so the row stays true and figures find them all."""
    cells = {run.run_id: run for run in config.runs()}
    ratios = {r["run"]: r.get("ratio") for r in folder.rows}
    for run_id, ratio in ratios.items():
        if run_id not in cells or ratio is None:
            continue
        out = folder.images_dir(run_id)
        video = config.model.is_video
        if (out / INDEX_FILE).is_file() and all(output_complete(item_output(out, i, video)) for i in items):
            continue
        warnings.warn(f"{out}: images (or their {INDEX_FILE}) missing or truncated; writing them again", stacklevel=2)
        run = dataclasses.replace(cells[run_id], ratio=ratio)  # a FLOP-matched run: the ratio it was run at
        produce_images(folder, run_id, _spec(config, run), items, model, config, progress=False)


def keep_features(folder: RunFolder, run_id: str, features: Tensor) -> None:
    """The run's EfficientNet-Lite0 features ``[N (* T), 1280]`` in ``features.safetensors`` (``run/<id>``), beside
    the baseline's: what ``tomerge compare`` resamples for a paired FD difference."""
    cached = folder.load_tensors("features") or {}
    cached[f"run/{run_id}"] = features
    folder.save_tensors("features", cached)


def add_missing_intervals(folder: RunFolder, config: AblationConfig, items: Sequence[Item], quality: Any) -> None:
    """Rows written before quality intervals were recorded get them: the run's images are scored again and the
    row, with its intervals, per-image values and features added, is appended (the last row of a run is the
    one read). A row without a speed-up interval (timed before it was recorded, or with one repeat) keeps none:
    a warning says which and that deleting their lines re-times them."""
    untimed = []
    for row in last_rows(folder.rows):
        run_id = row["run"]
        if run_id != "baseline" and row.get("speedup") is not None and row.get("speedup_lo") is None \
                and row.get("timing_repeats", 0) > 1:
            untimed.append(run_id)
        if "psnr_lo" in row or len(items) < 2:
            continue
        files = [item_output(folder.images_dir(run_id), item, config.model.is_video) for item in items]
        if not all(output_complete(f) for f in files):
            continue  # complete_finished_runs rewrites the images of the grid's runs; a run left out of it stays
        scores, features = quality.score_features(files)
        if run_id != "baseline":
            keep_features(folder, run_id, features)
        folder.append({**row, **scores})
    if untimed:
        warnings.warn(f"{folder.path}: {len(untimed)} rows were timed before speed-up intervals were recorded "
                      f"({', '.join(untimed[:3])}{', ...' if len(untimed) > 3 else ''}); delete their lines in "
                      f"{RESULTS} to time them again", stacklevel=2)


def _run_grid(config: AblationConfig, folder: RunFolder, progress: bool) -> RunFolder:
    from tqdm import tqdm

    # The model is fetched from `model` at each use and never held in a local: with devices > 1 it is released
    # before the ranks generate and loaded again after (ParentModel).
    model = ParentModel(config.model)
    items = config.items()
    model.get().check_items(items)
    timing_items = items[: config.timing_batch]
    env = environment()
    logger = folder.logger(config, env)
    prompts = [i.prompt for i in items] if config.model.conditioning == "prompt" else None

    # FLOP-matched runs find their ratios first: a target out of reach stops the grid before any image
    todo = match_flop_speedups(model.get(), config, [r for r in config.runs() if not folder.has(r.run_id)], items[:1])

    baseline_files = produce_images(folder, "baseline", _spec(config, None), items, model, config, progress)
    quality = quality_scorer(folder, config, baseline_files, prompts)
    if not folder.has("baseline"):
        measured = measure_run(model.get(), config, timing_items, None)
        row = {"run": "baseline", "strategy": "none", "ratio": 0.0, "options": {},
               **_counts(measured), **quality.score(baseline_files), **env}  # its intervals: zero width
        folder.save_grid("baseline", baseline_files)
        folder.append(row)
        logger.row(row, images=baseline_files, prompts=prompts)
    complete_finished_runs(folder, config, items, model)
    add_missing_intervals(folder, config, items, quality)

    for run in tqdm(todo, desc=f"ablate {config.name}", disable=not progress):
        files = produce_images(folder, run.run_id, _spec(config, run), items, model, config, progress=False)
        measured = measure_run(model.get(), config, timing_items, run)
        scores, features = quality.score_features(files)
        keep_features(folder, run.run_id, features)
        flops_base = folder.baseline_row()["flops"]
        row = {
            "run": run.run_id, "strategy": run.strategy, "ratio": run.ratio, "options": run.options,
            **({} if run.flop_target is None else {"flop_target": run.flop_target}),
            **speed_row(model.get(), config, timing_items, run),
            "flops_base": flops_base, **_counts(measured), "flop_speedup": flops_base / measured["flops"],
            "tokens_removed_mean": _mean_removed(measured["records"]), **scores, **env,
        }
        row["overhead_ratio"] = overhead_ratio(row["speedup"], row["flop_speedup"])
        folder.save_grid(run.run_id, files)
        folder.save_maps(run.run_id, measured["maps"], measured["records"], measured["grids"])
        folder.append(row)
        logger.row(row, images=files, prompts=prompts, maps=measured["maps"], grids=measured["grids"])
    folder.finish()
    logger.finish(folder)
    return folder


def _counts(measured: dict[str, Any]) -> dict[str, float]:
    """The FLOP and call counts of :func:`measure_run` that go into a result row, with the counter's version."""
    from ..measure.flops import COUNTER_VERSION

    return {**{k: measured[k] for k in ("flops", "flops_per_image", "denoiser_calls_per_image", "merge_gflops")},
            "flop_counter": COUNTER_VERSION}


def _mean_removed(records: Sequence) -> float:
    merged = [r.num_removed / r.num_tokens for r in records if r.num_tokens]
    return float(sum(merged) / len(merged)) if merged else 0.0
