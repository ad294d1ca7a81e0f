"""`tomerge figures` on a synthetic run folder: every file written, tables right, Pareto fronts exact."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("matplotlib")

from tomerge.experiments import figures  # noqa: E402

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


def save_images(folder: Path, run: str, images: torch.Tensor, prompts: list[str] | None = None) -> None:
    """A run's images as ``tomerge ablate`` writes them: ``images/<run>/`` PNGs and their ``prompts.jsonl``."""
    from tomerge.experiments.generate import Item, save_image, write_index

    out = folder / "images" / run
    out.mkdir(parents=True)
    items = [Item(i, i, label=None if prompts else 0, prompt=prompts[i] if prompts else None)
             for i in range(images.shape[0])]
    for item, image in zip(items, images):
        save_image(image, out / item.filename)
    write_index(out, items)


def make_run_folder(root: Path, name: str = "synthetic", prompts: list[str] | None = None) -> Path:
    from safetensors.torch import save_file

    folder = root / name
    (folder / "images").mkdir(parents=True)
    (folder / "maps").mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"name": name, "num_steps": STEPS, "seed": 0}))
    gen = torch.Generator().manual_seed(0)
    rows = [{"run": "baseline", "strategy": "none", "ratio": 0.0, "options": {}, "flops": 1000, "psnr": 100.0,
             "ssim": 1.0, "fd_effnetlite0": 0.0, "versions": {}, "git_commit": None}]
    channels = 3 if prompts else 1
    save_images(folder, "baseline", torch.rand(N_IMAGES, channels, SIDE, SIDE, generator=gen) * 2 - 1, prompts)
    for run, strategy, ratio, options, speedup, psnr, fd in RUNS:
        rows.append({"run": run, "strategy": strategy, "ratio": ratio, "options": options, "time_base_s": 1.0,
                     "time_s": 1 / speedup, "speedup": speedup, "flops_base": 1000, "flops": 600,
                     "flop_speedup": 1000 / 600, "overhead_ratio": speedup / (1000 / 600), "peak_memory_mb": None,
                     "tokens_removed_mean": 0.4, "psnr": psnr, "ssim": psnr / 40, "fd_effnetlite0": fd,
                     "versions": {}, "git_commit": None})
        save_images(folder, run, torch.rand(N_IMAGES, channels, SIDE, SIDE, generator=gen) * 2 - 1, prompts)
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


def non_dominated(points: dict[str, tuple[float, float]], higher_y: bool) -> set[str]:
    """Brute force, independent of figures.pareto_front: maximise x, and y (or -y)."""
    s = 1 if higher_y else -1
    return {a for a, (xa, ya) in points.items()
            if not any((xb >= xa and s * yb >= s * ya) and (xb, yb) != (xa, ya) for xb, yb in points.values())}


def test_pareto_front_random_points():
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.choice([1.0, 1.2, 1.5, 2.0]), rng.choice([20.0, 25.0, 30.0])) for _ in range(rng.randint(1, 9))]
        for higher in (True, False):
            expected = non_dominated({str(i): p for i, p in enumerate(pts)}, higher)
            assert {str(i) for i in figures.pareto_front(pts, higher)} == expected


def test_figures_from_synthetic_run_folder(tmp_path):
    folder = make_run_folder(tmp_path)
    out = tmp_path / "figs"
    assert figures.main([str(folder), "--out", str(out), "--k", "4", "--metrics", "psnr", "fd_effnetlite0"]) == 0

    expected = ["ablation.md", "ablation.tex", "pareto.json", "pareto_psnr.png", "pareto_fd_effnetlite0.png",
                "synthetic/schedules.png", "synthetic/grid.png", *[f"synthetic/maps/{r[0]}.png" for r in RUNS]]
    for name in expected:
        assert (out / name).is_file() and (out / name).stat().st_size > 0, name
    from PIL import Image

    for png in out.rglob("*.png"):
        with Image.open(png) as im:
            assert im.size[0] > 300 and im.size[1] > 150, png

    # Pareto fronts: exactly the non-dominated merged runs
    fronts = json.loads((out / "pareto.json").read_text())["fronts"]
    psnr = {r[0]: (r[4], r[5]) for r in RUNS}
    fd = {r[0]: (r[4], r[6]) for r in RUNS}
    assert {f.split("/", 1)[1] for f in fronts["psnr"]} == non_dominated(psnr, True)
    assert {f.split("/", 1)[1] for f in fronts["fd_effnetlite0"]} == non_dominated(fd, False)
    assert {"ssm-r0.5", "tomesd-r0.5-use_rand=False"} <= non_dominated(psnr, True)  # the tie is kept
    assert "idm-r0.5" not in non_dominated(psnr, True) | non_dominated(fd, False)

    # tables: every run once, with its numbers (the duplicated row's last value wins)
    md = (out / "ablation.md").read_text().splitlines()
    tex = (out / "ablation.tex").read_text()
    for run, _, ratio, _, speedup, p, f in RUNS:
        line = next(ln for ln in md if ln.startswith(f"| {run} |"))
        cells = [c.strip().strip("*") for c in line.strip("|").split("|")]
        assert cells[:3] == [run, f"{ratio:g}", f"{speedup:.2f}"]
        assert f"{p:.2f}" in cells and f"{f:.2f}" in cells and f"{p / 40:.3f}" in cells
        tex_line = next(ln for ln in tex.splitlines() if ln.startswith(run.replace("_", r"\_") + " &"))
        assert f"{p:.2f}" in tex_line and f"{f:.2f}" in tex_line
    assert sum(ln.startswith("| baseline |") for ln in md) == 1
    assert len([ln for ln in md if ln.startswith("| ")]) == len(RUNS) + 2  # header, baseline, runs
    assert "**1.70**" in "\n".join(md) and "**36.00**" in "\n".join(md) and "**1.00**" in "\n".join(md)
    assert r"\textbf{36.00}" in tex
    for token in (r"\toprule", r"\midrule", r"\bottomrule", r"\begin{tabular}", r"\end{table}"):
        assert token in tex
    assert not re.search(r"(?<!\\)_", tex.split(r"\begin{tabular}")[1].split(r"\end{tabular}")[0])


def test_step_profile_phases(tmp_path):
    data = figures.load_run(make_run_folder(tmp_path))
    steps, removed, ratios, labels = figures.step_profile(data.records("sdtm-r0.5"))
    assert steps == list(range(STEPS))
    assert labels == ["structure"] * 6 + ["detail"] * 4
    assert removed[0] == pytest.approx(2 * 0.5 / 3) and removed[-1] == pytest.approx(2 * 0.25 / 3)
    _, removed, _, labels = figures.step_profile(data.records("toma-r0.5-merge_every=2"))
    assert labels[:2] == ["merge", "skip_step"] and removed[1] == 0.0


def test_wandb_dir_and_several_folders(tmp_path):
    a = make_run_folder(tmp_path, "a")
    b = make_run_folder(tmp_path / "other", "a")  # same name: disambiguated
    wandb_run = a / "wandb" / "offline-run-20250101_000000-abc"
    wandb_run.mkdir(parents=True)
    (wandb_run / "run-abc.wandb").write_bytes(b"")
    assert figures.load_run(wandb_run).path == a
    standalone = tmp_path / "standalone" / "offline-run-x"
    standalone.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not supported"):
        figures.load_run(standalone)
    out = tmp_path / "figs"
    written = figures.make_figures([wandb_run, b], out, metrics=["psnr"], runs=["tomesd-*"], k=2)
    md = (out / "ablation.md").read_text()
    assert md.startswith("| folder | run |") and md.count("| a | tomesd-") == 3 and md.count("| a-1 | tomesd-") == 3
    assert "ssm-r0.5" not in md
    assert (out / "a" / "grid.png") in written and (out / "a-1" / "grid.png") in written
    assert len(json.loads((out / "pareto.json").read_text())["fronts"]["psnr"]) == 6  # same points in both


def test_text_to_image_grid_has_one_row_per_prompt(tmp_path):
    prompts = [f"prompt number {i}, a photo of a cat on a mat" for i in range(N_IMAGES)]
    folder = make_run_folder(tmp_path, "t2i", prompts=prompts)
    data = figures.load_run(folder)
    assert data.prompts(3) == prompts[:3]
    assert data.images("ssm-r0.5", 2).shape == (2, 3, SIDE, SIDE)
    written = figures.image_grid_figure(data, tmp_path / "grid", k=3)
    from PIL import Image

    with Image.open(written[0]) as im:  # 3 prompt rows, 9 columns (baseline + 8 runs): wider than tall
        assert im.size[0] > im.size[1] > 300
    class_data = figures.load_run(make_run_folder(tmp_path, "classes"))
    assert class_data.prompts() is None
