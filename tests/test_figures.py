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
from tomerge.experiments.flops import COUNTER_VERSION  # noqa: E402

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
NOISY = 0.10  # speed.NOISY_SPREAD


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
    from tomerge.experiments.generate import Item, save_image, write_index

    out = folder / "images" / run
    out.mkdir(parents=True)
    items = [Item(i, i, label=None if prompts else (labels[i] if labels else 0),
                  prompt=prompts[i] if prompts else None) for i in range(images.shape[0])]
    for item, image in zip(items, images):
        save_image(image, out / item.filename)
    write_index(out, items)


def make_run_folder(root: Path, name: str = "synthetic", prompts: list[str] | None = None,
                    labels: list[int] | None = None, spreads: dict | None = None, speed_scale: float = 1.0,
                    psnr_shift: float = 0.0) -> Path:
    """A run folder as ``tomerge ablate`` writes it, with the rows of ``RUNS`` (speed-ups times
    ``speed_scale``, PSNR plus ``psnr_shift``), timing spreads ``spreads`` (default ``SPREADS``; runs not
    in it: 0.01 and 0.01), item class ``labels`` (default all 0) or ``prompts``."""
    from safetensors.torch import save_file

    spreads = SPREADS if spreads is None else spreads

    folder = root / name
    (folder / "images").mkdir(parents=True)
    (folder / "maps").mkdir()
    (folder / "config.yaml").write_text(yaml.safe_dump({"name": name, "num_steps": STEPS, "seed": 0}))
    gen = torch.Generator().manual_seed(0)
    rows = [{"run": "baseline", "strategy": "none", "ratio": 0.0, "options": {}, "flops": 1000, "flop_counter": COUNTER_VERSION,
             "psnr": 100.0,
             "ssim": 1.0, "fd_effnetlite0": 0.0, "versions": {}, "git_commit": None}]
    channels = 3 if prompts else 1
    save_images(folder, "baseline", torch.rand(N_IMAGES, channels, SIDE, SIDE, generator=gen) * 2 - 1, prompts,
                labels)
    for run, strategy, ratio, options, speedup, psnr, fd in RUNS:
        speedup, psnr = speedup * speed_scale, psnr + psnr_shift
        sb, sm = spreads.get(run, (0.01, 0.01))
        spread = None if sb is None else max(sb, sm)
        rows.append({"run": run, "strategy": strategy, "ratio": ratio, "options": options, "time_base_s": 1.0,
                     "time_spread_base": sb, "time_spread": sm, "timing_spread": spread,
                     "timing_noisy": spread is not None and spread > NOISY, "timing_repeats": 1 if sb is None else 3,
                     "time_s": 1 / speedup, "speedup": speedup, "flops_base": 1000, "flops": 600, "flop_counter": COUNTER_VERSION,
                     "flop_speedup": 1000 / 600, "overhead_ratio": speedup / (1000 / 600), "peak_memory_mb": None,
                     "tokens_removed_mean": 0.4, "psnr": psnr, "ssim": psnr / 40, "fd_effnetlite0": fd,
                     "versions": {}, "git_commit": None})
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


# ------------------------------------------------------------------ figures that compare runs (issue 16)
def _folders(tmp_path: Path, *specs: tuple[str, dict]) -> list:
    """Loaded run folders named as given, built by ``make_run_folder`` with the given arguments."""
    return [figures.load_run(make_run_folder(tmp_path / f"root{i}", name, **kw)) for i, (name, kw) in enumerate(specs)]


def _marker_path(marker: str):
    from matplotlib.markers import MarkerStyle

    style = MarkerStyle(marker)
    return style.get_path().transformed(style.get_transform())


def _label_boxes(fig, ax):
    renderer = fig.canvas.get_renderer()
    fig.draw(renderer)
    return [t.get_bbox_patch().get_window_extent(renderer) for t in ax.texts]


def _intersecting(boxes) -> list[tuple[int, int]]:
    def area(a, b):
        return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))

    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if area(boxes[i], boxes[j]) > 0]


def test_two_folders_marker_per_folder_colour_per_strategy(tmp_path):
    import numpy as np
    from matplotlib.colors import to_rgba

    a, b = _folders(tmp_path, ("a", {}), ("b", {"speed_scale": 1.02, "psnr_shift": 0.3, "spreads": {}}))
    styles = figures.point_styles([a, b])
    strategies = list(dict.fromkeys(r[1] for r in RUNS))
    for run, strategy, *_ in RUNS:
        sa, sb = styles[("a", run)], styles[("b", run)]
        assert sa.colour == sb.colour == f"C{strategies.index(strategy)}"  # colour: strategy
        assert (sa.marker, sb.marker) == (figures.MARKERS[0], figures.MARKERS[1])  # marker: folder
        sm = max(SPREADS.get(run, (0.01, 0.01)), key=lambda v: v or 0)
        assert sa.hollow == (sm is not None and sm > NOISY) and not sb.hollow  # b: spreads 0.01, never noisy
    assert {s.hollow for s in styles.values()} == {True, False}

    fig, _ = figures.pareto_plot([a, b], "psnr")
    ax = fig.axes[0]
    drawn = {c.get_gid(): c for c in ax.collections if c.get_gid()}
    assert set(drawn) == {f"{f}/{r[0]}" for f in "ab" for r in RUNS}
    for (folder, run), st in styles.items():
        c = drawn[f"{folder}/{run}"]
        assert np.allclose(c.get_paths()[0].vertices, _marker_path(st.marker).vertices)
        face = to_rgba("white") if st.hollow else to_rgba(st.colour)
        assert np.allclose(c.get_facecolor()[0], face)
        if st.hollow:
            assert np.allclose(c.get_edgecolor()[0], to_rgba(st.colour))
    legend = fig.legends[0]
    entries = dict(zip([t.get_text() for t in legend.get_texts()], legend.legend_handles))
    for header in ("colour: strategy", "marker: run folder", "timing repeats"):
        assert header in entries
    for i, s in enumerate(strategies):
        assert entries[s].get_marker() == "o" and np.allclose(to_rgba(entries[s].get_markerfacecolor()),
                                                               to_rgba(f"C{i}"))
    assert entries["a"].get_marker() == figures.MARKERS[0] and entries["b"].get_marker() == figures.MARKERS[1]
    assert any(name.startswith("hollow: noisy timing") for name in entries)

    # one folder: marker per strategy as before, no folder entries
    one = figures.point_styles([a])
    assert len({one[("a", r[0])].marker for r in RUNS}) == len(strategies)
    fig, _ = figures.pareto_plot([a], "psnr")
    names = [t.get_text() for t in fig.legends[0].get_texts()]
    assert "marker: run folder" not in names and "colour: strategy" not in names
    # FLOP-ideal axis: timing does not move the points, so no bars and nothing hollow
    fig, _ = figures.pareto_plot([a, b], "psnr", x_key="flop_speedup")
    assert not fig.axes[0].containers
    assert not any(s.hollow for s in figures.point_styles([a, b], "flop_speedup").values())


def test_labels_do_not_overlap(tmp_path):
    """Three folders: two with identical points, one shifted a little (the labels the fixed offset overprinted)."""
    data = _folders(tmp_path, ("reference", {}), ("reference", {}),
                    ("reference-quiet", {"speed_scale": 1.015, "psnr_shift": 0.25}))
    data[1].name = "reference-1"
    for metric, x_key in (("psnr", "speedup"), ("fd_effnetlite0", "speedup"), ("psnr", "flop_speedup")):
        fig, _ = figures.pareto_plot(data, metric, x_key)
        ax = fig.axes[0]
        places = {(r[x_key], r[metric]) for d in data for r in d.merged}
        assert len(ax.texts) == len(places)  # one label per place: coincident points share it
        assert _intersecting(_label_boxes(fig, ax)) == [], (metric, x_key)
        # the same labels at the old fixed offset (5, 3) points overprint: the case is a real one
        for t in ax.texts:
            t.xyann, t.arrowprops, t.arrow_patch = (5, 3), None, None
            t.set_horizontalalignment("left")
            t.set_verticalalignment("baseline")
        assert _intersecting(_label_boxes(fig, ax))
    # the labels of identical points name every folder they hold
    fig, _ = figures.pareto_plot(data, "psnr")
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "tomesd r=0.5 (reference, reference-1)\nssm r=0.5 (reference, reference-1)" in texts
    assert "r=0.75 (reference, reference-1)" in texts and "r=0.75" in texts  # reference-quiet's alone


def test_error_bars_show_the_timing_range(tmp_path):
    (a,) = _folders(tmp_path, ("a", {}))
    fig, _ = figures.pareto_plot([a], "psnr")
    ax = fig.axes[0]
    bars = sorted(tuple(round(float(v), 9) for v in (seg[0][0], seg[1][0], seg[0][1]))
                  for c in ax.containers for seg in c.lines[2][0].get_segments())
    expected = []
    for run, _, _, _, s, psnr, _ in RUNS:
        sb, sm = SPREADS.get(run, (0.01, 0.01))
        if sb is not None:
            expected.append((round(s * (1 - sb / 2) / (1 + sm / 2), 9), round(s * (1 + sb / 2) / (1 - sm / 2), 9),
                             psnr))
    assert bars == sorted(expected) and len(bars) == len(RUNS) - 1  # toma: one repeat, no bar
    assert "timing repeats" in ax.get_xlabel()
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert any("s(1 - sb/2)/(1 + sm/2)" in t and "s(1 + sb/2)/(1 - sm/2)" in t for t in legend)
    assert figures.timing_interval({"speedup": 1.5, "time_spread_base": 0.1, "time_spread": 2.5})[1] == float("inf")
    assert figures.timing_interval({"speedup": 1.5}) is None


def test_grid_shows_one_image_per_class(tmp_path):
    folder = make_run_folder(tmp_path, "classes", labels=[0, 0, 1, 1, 2, 2])
    data = figures.load_run(folder)
    assert data.grid_items(8) == [0, 2, 4] and data.grid_items(2) == [0, 2]
    assert data.grid_items(3, "first") == [0, 1, 2] and data.grid_items(None, "first") == list(range(N_IMAGES))
    every = data.images("ssm-r0.5")
    assert torch.equal(data.images("ssm-r0.5", indices=[4, 0, 2]), every[[4, 0, 2]])
    calls = []
    images = data.images
    data.images = lambda run, k=None, indices=None: calls.append((run, indices)) or images(run, k, indices)
    written = figures.image_grid_figure(data, tmp_path / "grid")
    assert written and calls == [(r["run"], [0, 2, 4]) for r in data.rows]  # the same items in every row
    calls.clear()
    figures.image_grid_figure(data, tmp_path / "grid_first", k=4, select="first")
    assert {tuple(i) for _, i in calls} == {(0, 1, 2, 3)}
    # an item one run lacks is left out for every run: like with like
    (folder / "images" / "ssm-r0.5" / data.index("ssm-r0.5")[2]["file"]).unlink()
    assert data.grid_items(8) == [0, 3, 4]
    with pytest.raises(ValueError, match="unknown grid selection"):
        data.grid_items(8, "random")


def test_grid_shows_one_image_per_prompt(tmp_path):
    prompts = [f"prompt {i // 2}, a photo of a cat" for i in range(N_IMAGES)]  # two images per prompt
    data = figures.load_run(make_run_folder(tmp_path, "t2i", prompts=prompts))
    assert data.grid_items(8) == [0, 2, 4]
    assert data.prompts(indices=[0, 2, 4]) == [prompts[0], prompts[2], prompts[4]]
    written = figures.image_grid_figure(data, tmp_path / "grid")
    from PIL import Image

    with Image.open(written[0]) as im:  # 3 prompt rows of 9 runs: wider than tall
        assert im.size[0] > im.size[1] > 300
    assert figures.main([str(data.path), "--out", str(tmp_path / "figs"), "--metrics", "psnr",
                         "--grid-items", "first", "--k", "2"]) == 0


def test_doctests_of_the_module_pass():
    import doctest

    result = doctest.testmod(figures, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_an_unknown_metric_is_a_user_error(tmp_path, capsys):
    from tomerge.experiments.cli import UsageError, main

    folder = make_run_folder(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: one line, exit 2
        main(["figures", str(folder), "--out", str(tmp_path / "figs"), "--metrics", "psnrr"])
    assert exit_.value.code == 2 and "invalid choice: 'psnrr'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown metric 'psnrr'"):  # the Python API says the same
        figures.make_figures([folder], tmp_path / "figs", metrics=["psnrr"])


def test_flop_matched_runs_are_labelled_by_their_target():
    from tomerge.experiments.figures import _point_text

    matched = {"strategy": "sdtm", "ratio": 0.569629, "flop_target": 1.5, "options": {"switch": 1.0}}
    plain = {"strategy": "sdtm", "ratio": 0.5, "options": {"switch": 1.0}}
    assert _point_text([("f", matched)], False, {"sdtm": {"switch"}}) == "1.5x FLOPs (r=0.57) switch=1.0"
    assert _point_text([("f", plain)], False, {"sdtm": {"switch"}}) == "r=0.5 switch=1.0"


def test_rows_of_another_flop_counter_are_refused_with_what_to_do(tmp_path):
    """FLOP-ideal speed-ups of an older counter (no CPU attention) must not enter a figure beside current ones."""
    folder = make_run_folder(tmp_path)
    results = folder / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows[-1].pop("flop_counter")  # the last row of a run is the one read
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(figures.UsageError, match=rf"1 runs \({re.escape(rows[-1]['run'])}\).*rerun tomerge ablate"):
        figures.load_run(folder)
