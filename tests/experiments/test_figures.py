"""`tomerge figures` on a synthetic run folder: every file written, tables right, Pareto fronts exact."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("matplotlib")

from tomerge.experiments.commands import figures as command  # noqa: E402
from tomerge.experiments.errors import UsageError  # noqa: E402
from tomerge.experiments.figures import pareto  # noqa: E402
from tomerge.experiments.figures.image_grids import image_grid_figure  # noqa: E402
from tomerge.experiments.figures.make import make_figures  # noqa: E402
from tomerge.experiments.figures.run_data import load_run  # noqa: E402
from tomerge.experiments.figures.schedules import step_profile  # noqa: E402
from helpers.run_folders import N_IMAGES, NOISY, RUNS, SIDE, SPREADS, STEPS, make_run_folder  # noqa: E402


def non_dominated(points: dict[str, tuple[float, float]], higher_y: bool) -> set[str]:
    """Brute force, independent of pareto.pareto_front: maximise x, and y (or -y)."""
    s = 1 if higher_y else -1
    return {a for a, (xa, ya) in points.items()
            if not any((xb >= xa and s * yb >= s * ya) and (xb, yb) != (xa, ya) for xb, yb in points.values())}


def test_pareto_front_random_points():
    rng = random.Random(0)
    for _ in range(50):
        pts = [(rng.choice([1.0, 1.2, 1.5, 2.0]), rng.choice([20.0, 25.0, 30.0])) for _ in range(rng.randint(1, 9))]
        for higher in (True, False):
            expected = non_dominated({str(i): p for i, p in enumerate(pts)}, higher)
            assert {str(i) for i in pareto.pareto_front(pts, higher)} == expected


def test_figures_from_synthetic_run_folder(tmp_path):
    folder = make_run_folder(tmp_path)
    out = tmp_path / "figs"
    assert command.main([str(folder), "--out", str(out), "--k", "4", "--metrics", "psnr", "fd_effnetlite0"]) == 0

    stems = ["pareto_psnr", "pareto_fd_effnetlite0", "synthetic/schedules", "synthetic/grid",
             *[f"synthetic/maps/{r[0]}" for r in RUNS]]
    figures_written = [f"{stem}.{fmt}" for stem in stems for fmt in ("png", "pdf")]  # PDF beside PNG by default
    expected = ["ablation.md", "ablation.tex", "pareto.json", *figures_written]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()) == sorted(expected)
    from PIL import Image

    for png in out.rglob("*.png"):
        with Image.open(png) as im:
            assert im.size[0] > 300 and im.size[1] > 150, png
    for pdf in out.rglob("*.pdf"):
        assert pdf.read_bytes()[:5] == b"%PDF-", pdf

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
        cells = [c.strip().replace("**", "") for c in line.strip("|").split("|")]
        sb, sm = SPREADS.get(run, (0.01, 0.01))
        bounds = "" if sb is None else f" [{speedup * (1 - sb):.2f}, {speedup * (1 + sm):.2f}]"  # its interval
        assert cells[:3] == [run, f"{ratio:g}", f"{speedup:.2f}{bounds}"]
        assert f"{p:.2f}" in cells and f"{f:.2f}" in cells and f"{p / 40:.3f}" in cells
        tex_line = next(ln for ln in tex.splitlines() if ln.startswith(run.replace("_", r"\_") + " &"))
        assert f"{p:.2f}" in tex_line and f"{f:.2f}" in tex_line
        assert not bounds or f"{{\\scriptsize{bounds}}}" in tex_line
    assert sum(ln.startswith("| baseline |") for ln in md) == 1
    assert len([ln for ln in md if ln.startswith("| ")]) == len(RUNS) + 2  # header, baseline, runs
    assert "**1.70**" in "\n".join(md) and "**36.00**" in "\n".join(md) and "**1.00**" in "\n".join(md)
    assert r"\textbf{36.00}" in tex
    for token in (r"\toprule", r"\midrule", r"\bottomrule", r"\begin{tabular}", r"\end{table}"):
        assert token in tex
    assert not re.search(r"(?<!\\)_", tex.split(r"\begin{tabular}")[1].split(r"\end{tabular}")[0])


def test_step_profile_phases(tmp_path):
    data = load_run(make_run_folder(tmp_path))
    steps, removed, ratios, labels = step_profile(data.records("sdtm-r0.5"))
    assert steps == list(range(STEPS))
    assert labels == ["structure"] * 6 + ["detail"] * 4
    assert removed[0] == pytest.approx(2 * 0.5 / 3) and removed[-1] == pytest.approx(2 * 0.25 / 3)
    _, removed, _, labels = step_profile(data.records("toma-r0.5-merge_every=2"))
    assert labels[:2] == ["merge", "skip_step"] and removed[1] == 0.0


def test_wandb_dir_and_several_folders(tmp_path):
    a = make_run_folder(tmp_path, "a")
    b = make_run_folder(tmp_path / "other", "a")  # same name: disambiguated
    wandb_run = a / "wandb" / "offline-run-20250101_000000-abc"
    wandb_run.mkdir(parents=True)
    (wandb_run / "run-abc.wandb").write_bytes(b"")
    assert load_run(wandb_run).path == a
    standalone = tmp_path / "standalone" / "offline-run-x"
    standalone.mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="not supported"):
        load_run(standalone)
    out = tmp_path / "figs"
    written = make_figures([wandb_run, b], out, metrics=["psnr"], runs=["tomesd-*"], k=2)
    md = (out / "ablation.md").read_text()
    assert md.startswith("| folder | run |") and md.count("| a | tomesd-") == 3 and md.count("| a-1 | tomesd-") == 3
    assert "ssm-r0.5" not in md
    assert (out / "a" / "grid.png") in written and (out / "a-1" / "grid.png") in written
    assert len(json.loads((out / "pareto.json").read_text())["fronts"]["psnr"]) == 6  # same points in both


def test_text_to_image_grid_has_one_row_per_prompt(tmp_path):
    prompts = [f"prompt number {i}, a photo of a cat on a mat" for i in range(N_IMAGES)]
    folder = make_run_folder(tmp_path, "t2i", prompts=prompts)
    data = load_run(folder)
    assert data.prompts(3) == prompts[:3]
    assert data.images("ssm-r0.5", 2).shape == (2, 3, SIDE, SIDE)
    written = image_grid_figure(data, tmp_path / "grid", k=3)
    from PIL import Image

    with Image.open(written[0]) as im:  # 3 prompt rows, 9 columns (baseline + 8 runs): wider than tall
        assert im.size[0] > im.size[1] > 300
    class_data = load_run(make_run_folder(tmp_path, "classes"))
    assert class_data.prompts() is None


# ------------------------------------------------------------------ figures that compare runs
def _folders(tmp_path: Path, *specs: tuple[str, dict]) -> list:
    """Loaded run folders named as given, built by ``make_run_folder`` with the given arguments."""
    return [load_run(make_run_folder(tmp_path / f"root{i}", name, **kw)) for i, (name, kw) in enumerate(specs)]


def _marker_path(marker: str):
    from matplotlib.markers import MarkerStyle

    style = MarkerStyle(marker)
    return style.get_path().transformed(style.get_transform())


def _drawn_texts(fig) -> list[tuple[str, object]]:
    """``(text, window extent)`` of every text the figure draws, after a draw with its layout: titles, axis
    labels, the tick labels in view, legend entries, annotations."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    renderer = canvas.get_renderer()
    tick_labels, in_view = set(), []
    for ax in fig.axes:
        for axis in (ax.xaxis, ax.yaxis):
            lo, hi = sorted(axis.get_view_interval())
            locs = axis.get_majorticklocs()
            ticks = axis.get_major_ticks(len(locs))
            tick_labels |= {id(t) for tick in ticks + axis.get_minor_ticks() for t in (tick.label1, tick.label2)}
            in_view += [t for tick, loc in zip(ticks, locs) if lo - 1e-9 <= loc <= hi + 1e-9
                        for t in (tick.label1, tick.label2)]
    texts = [t for t in fig.findobj(Text) if id(t) not in tick_labels] + in_view
    return [(t.get_text(), (t.get_bbox_patch() or t).get_window_extent(renderer))
            for t in texts if t.get_visible() and t.get_text().strip()]


def _intersecting(boxes) -> list[tuple[int, int]]:
    def area(a, b):
        return max(0.0, min(a.x1, b.x1) - max(a.x0, b.x0)) * max(0.0, min(a.y1, b.y1) - max(a.y0, b.y0))

    return [(i, j) for i in range(len(boxes)) for j in range(i + 1, len(boxes)) if area(boxes[i], boxes[j]) > 0]


# more methods of the same strategies (another option value, a FLOP-matched run), and the strategies of a presets
# folder: the crowded figure of the issue
CROWDED = RUNS + [
    ("ssm-r0.75", "ssm", 0.75, {}, 1.30, 26.0, 6.0),  # slower than ssm r0.5: the line turns back
    ("sdtm-r0.25-order=detail_first", "sdtm", 0.25, {"order": "detail_first"}, 1.25, 31.0, 3.0),
    ("sdtm-r0.5-order=detail_first", "sdtm", 0.5, {"order": "detail_first"}, 1.50, 28.0, 6.0),
    ("sdtm-flops1.5x", "sdtm", 0.5696, {}, 1.45, 29.5, 4.5),
    ("toma-r0.5-merge_every=1", "toma", 0.5, {"merge_every": 1}, 1.00, 35.0, 1.2),
    ("facility_location-r0.25", "facility_location", 0.25, {}, 1.15, 30.5, 3.2),
    ("facility_location-r0.5", "facility_location", 0.5, {}, 1.35, 27.0, 5.5),
    ("sdtm_release-r0.2", "sdtm_release", 0.2, {}, 1.12, 35.5, 0.8),
    ("sdtm_release-r0.65", "sdtm_release", 0.65, {}, 1.50, 33.5, 1.1),
    ("sdtm_paper-r0.35", "sdtm_paper", 0.35, {}, 1.30, 29.0, 5.1),
    ("toma_release-r0.35", "toma_release", 0.35, {}, 1.20, 32.0, 2.2),
]
CROWDED_KEYS = {run: {"flop_speedup": round(1.25 * speedup, 6)} for run, *_, speedup, _, _ in CROWDED}
CROWDED_KEYS["sdtm-flops1.5x"]["flop_target"] = 1.5
# the legend's method entries, written out: each method once, its ratios (and FLOP targets) over every folder
CROWDED_LEGEND = ["tomesd (r 0.25-0.75)", "ssm (r 0.25-0.75)", "sdtm (r 0.5; FLOP-matched 1.5x)",
                  "sdtm order=detail_first (r 0.25-0.5)", "toma merge_every=2 (r 0.5)", "toma merge_every=1 (r 0.5)",
                  "idm (r 0.5)", "facility_location (r 0.25-0.5)", "sdtm_release (r 0.2-0.65)", "sdtm_paper (r 0.35)",
                  "toma_release (r 0.35)"]


def _crowded(tmp_path: Path, *specs: tuple[str, dict]) -> list:
    return _folders(tmp_path, *[(name, {"runs": CROWDED, "row_keys": CROWDED_KEYS, **kw}) for name, kw in specs])


def _legend(fig) -> tuple[list[str], list]:
    """The legend's entries (wrapped lines joined) and handles."""
    (legend,) = [a for ax in fig.axes for a in [ax.get_legend()] if a] + fig.legends
    return [t.get_text().replace("\n  ", " ") for t in legend.get_texts()], legend.legend_handles


def test_one_line_per_method_through_its_ratios(tmp_path):
    import numpy as np
    from matplotlib.colors import to_rgba

    a, b = _crowded(tmp_path, ("a", {}), ("b", {"speed_scale": 1.02, "psnr_shift": 0.3, "spreads": {}}))
    strategies = list(dict.fromkeys(r[1] for r in CROWDED))
    second_variants = {"sdtm order=detail_first", "toma merge_every=1"}  # each strategy's second option values
    found = pareto.methods([a, b])
    assert [(m.folder, m.name) for m in found] == [(f, n.split(" (")[0]) for f in "ab" for n in CROWDED_LEGEND]
    for m in found:
        strategy = m.name.split()[0]
        assert m.colour == f"C{strategies.index(strategy)}"  # colour: strategy
        assert m.marker == pareto.MARKERS["ab".index(m.folder)]  # marker: folder
        assert m.linestyle == pareto.LINESTYLES[m.name in second_variants]  # line style: option values
        ratios = [r["ratio"] for r in m.rows]
        assert ratios == sorted(ratios)

    fig, _ = pareto.pareto_plot([a, b], "psnr")
    ax = fig.axes[0]
    assert not ax.texts  # no text by the points
    caps = {id(line) for c in ax.containers for line in c.lines[1]}  # the error bars' caps
    lines = {line.get_gid(): line for line in ax.lines if id(line) not in caps and line.get_gid()}
    scale = {"a": 1.0, "b": 1.02}
    for folder in "ab":  # the ssm line through its ratios 0.25, 0.5, 0.75, not by speed-up
        ssm = [r for r in CROWDED if r[1] == "ssm"]
        assert [r[2] for r in ssm] == [0.25, 0.5, 0.75] and ssm[2][4] < ssm[1][4]
        assert np.allclose(lines[f"{folder}/ssm"].get_xdata(), [r[4] * scale[folder] for r in ssm])
        sdtm = [r for r in CROWDED if r[1] == "sdtm" and not r[3]]  # r 0.5, then the FLOP-matched r 0.5696
        assert np.allclose(lines[f"{folder}/sdtm"].get_ydata(), [r[5] + (folder == "b") * 0.3 for r in sdtm])
    assert set(lines) == {f"{f}/{n.split(' (')[0]}" for f in "ab" for n in CROWDED_LEGEND} | {"pareto-front"}
    points = {c.get_gid(): c for c in ax.collections if c.get_gid() and c.get_gid() != "pareto-front-points"}
    assert set(points) == {f"{f}/{r[0]}" for f in "ab" for r in CROWDED}
    for m in found:
        for r in m.rows:
            c = points[f"{m.folder}/{r['run']}"]
            assert np.allclose(c.get_paths()[0].vertices, _marker_path(m.marker).vertices)
            sb, sm = SPREADS.get(r["run"], (0.01, 0.01)) if m.folder == "a" else (0.01, 0.01)
            noisy = sm is not None and max(sb, sm) > NOISY
            assert np.allclose(c.get_facecolor()[0], to_rgba("white" if noisy else m.colour))  # hollow: noisy
    assert any(r[0] in SPREADS and max(v or 0 for v in SPREADS[r[0]]) > NOISY for r in CROWDED)  # some hollow

    names, handles = _legend(fig)
    assert names[:len(CROWDED_LEGEND)] == CROWDED_LEGEND  # each method named once, for both folders
    for name, handle in zip(CROWDED_LEGEND, handles):
        m = next(m for m in found if m.name == name.split(" (")[0])
        assert to_rgba(handle.get_color()) == to_rgba(m.colour) and handle.get_marker() in (None, "None", "")
    entries = dict(zip(names, handles))
    assert names[len(CROWDED_LEGEND):len(CROWDED_LEGEND) + 3] == ["run folder", "a", "b"]
    assert (entries["a"].get_marker(), entries["b"].get_marker()) == tuple(pareto.MARKERS[:2])
    assert {"Pareto front", "baseline (speed-up 1)", "timing repeats"} <= set(entries)
    assert any(name.startswith("hollow: noisy timing") for name in names)

    # one folder: the marker is the option values' within the strategy (methods of one ratio stay apart), in the
    # legend too; no folder entries
    fig, _ = pareto.pareto_plot([a], "psnr")
    names, handles = _legend(fig)
    assert names[:len(CROWDED_LEGEND)] == CROWDED_LEGEND and "run folder" not in names
    markers = [h.get_marker() for h in handles[:len(CROWDED_LEGEND)]]
    assert markers == [pareto.MARKERS[n.split(" (")[0] in second_variants] for n in CROWDED_LEGEND]
    # FLOP-ideal axis: counted, not timed, so no bars (these rows have no quality intervals) and nothing hollow
    fig, _ = pareto.pareto_plot([a, b], "psnr", x_key="flop_speedup")
    assert not fig.axes[0].containers
    faces = [c.get_facecolor()[0] for c in fig.axes[0].collections if c.get_gid() != "pareto-front-points"]
    assert len(faces) == 2 * len(CROWDED) and not any(np.allclose(f, to_rgba("white")) for f in faces)
    assert "timing repeats" not in _legend(fig)[0]


def test_the_pareto_front_is_highlighted_and_written(tmp_path):
    import numpy as np

    (data,) = _folders(tmp_path, ("a", {}))
    for metric, column, higher in (("psnr", 5, True), ("fd_effnetlite0", 6, False)):
        fig, front = pareto.pareto_plot([data], metric)
        expected = non_dominated({r[0]: (r[4], r[column]) for r in RUNS}, higher)
        assert {f.split("/", 1)[1] for f in front} == expected and len(front) == len(expected)
        xy = sorted((r[4], r[column]) for r in RUNS if r[0] in expected)
        ax = fig.axes[0]
        (band,) = [line for line in ax.lines if line.get_gid() == "pareto-front"]
        (rings,) = [c for c in ax.collections if c.get_gid() == "pareto-front-points"]
        assert np.allclose(np.c_[band.get_xdata(), band.get_ydata()], xy) and band.get_linewidth() > 4
        assert band.get_alpha() < 0.5 and band.get_zorder() < min(c.get_zorder() for c in ax.collections)
        assert np.allclose(sorted(map(tuple, rings.get_offsets())), xy) and not rings.get_facecolor().any()


def test_no_text_overlaps_in_crowded_figures(tmp_path):
    """Three folders, two with identical points, one shifted a little, each with 11 methods."""
    data = _crowded(tmp_path, ("quick", {}), ("quick", {}), ("quick-quiet", {"speed_scale": 1.015, "psnr_shift": 0.25}))
    data[1].name = "quick-1"
    cases = [(data, "psnr", "speedup"), (data, "fd_effnetlite0_ref", "flop_speedup"), (data[:1], "psnr", "speedup")]
    for runs, metric, x_key in cases:
        fig, _ = pareto.pareto_plot(runs, metric, x_key)
        texts = _drawn_texts(fig)
        drawn = [t for t, _ in texts]
        names, _ = _legend(fig)
        # every text is there: title, axis labels, tick labels, each legend entry
        assert fig.get_suptitle() in drawn and fig.axes[0].get_xlabel() in drawn and fig.axes[0].get_ylabel() in drawn
        assert len(drawn) >= 3 + len(names) + 6 and set(CROWDED_LEGEND) <= {t.replace("\n  ", " ") for t in drawn}
        assert _intersecting([box for _, box in texts]) == [], (metric, x_key)
        frame = fig.bbox
        assert all(frame.x0 <= b.x0 and b.x1 <= frame.x1 and frame.y0 <= b.y0 and b.y1 <= frame.y1 for _, b in texts)
        # the ratios written by the points at a fixed offset would overprint: the case is a real one
        ax = fig.axes[0]
        for m in pareto.methods(runs):
            for r in m.rows:
                ax.annotate(f"r={r['ratio']:g}", (r[x_key], r[metric]), xytext=(5, 3), textcoords="offset points",
                            fontsize=7)
        assert _intersecting([box for _, box in _drawn_texts(fig)])


def test_title_names_the_model_metric_and_image_count(tmp_path):
    import dataclasses
    import warnings

    from tomerge.experiments.sources.models import ModelSpec

    sd3 = {"kind": "pipeline", "path": "/models/sd3-medium/"}
    a, b = _folders(tmp_path, ("quick", {}), ("big", {"model": sd3}))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # both folders name their model
        fig, _ = pareto.pareto_plot([a], "psnr")
        assert fig.get_suptitle() == "bundled reference DiT (256 tokens), 6 images: PSNR vs baseline"
        fig, _ = pareto.pareto_plot([a, b], "fd_effnetlite0", "flop_speedup")
    assert fig.get_suptitle().replace("\n", " ") == ("bundled reference DiT (256 tokens) / sd3-medium, 6 images: "
                                                     "FD-EffNetLite0 vs baseline images")  # wrapped to the width
    assert "quick" not in fig.get_suptitle() and "big" not in fig.get_suptitle()
    checkpoint = dataclasses.replace(a, config={"model": ModelSpec(path="/ckpt/dit_b2.safetensors").to_dict()})
    big = dataclasses.replace(b, rows=[{**r, "n_images": 12} for r in b.rows])
    assert pareto.pareto_title([checkpoint, big], "ssim", checkpoint.rows + big.rows) == \
        "dit_b2 / sd3-medium, 6-12 images: SSIM vs baseline"
    videos = [{**r, "n_frames": 4 * r["n_images"]} for r in b.merged]
    assert pareto.pareto_title([b], "psnr", videos) == "sd3-medium, 6 videos: PSNR vs baseline"
    unknown = dataclasses.replace(a, config={"name": "quick"})
    with pytest.warns(UserWarning, match="no model entry"):
        assert pareto.pareto_title([unknown], "psnr", a.merged) == "6 images: PSNR vs baseline"


def test_the_bundled_references_are_named_by_their_token_counts():
    from tomerge.backbones.timm_dit import DIT_PRESETS
    from tomerge.experiments.sources.reference_model import BUNDLED_REFERENCE_NAMES

    grids = {"bundled": DIT_PRESETS["reference"].grid_hw, "bundled-1024": DIT_PRESETS["reference-1024"].grid_hw}
    assert grids == {"bundled": (16, 16), "bundled-1024": (32, 32)}
    assert BUNDLED_REFERENCE_NAMES == {name: f"bundled reference DiT ({h * w:,} tokens)"
                                       for name, (h, w) in grids.items()}


def test_error_bars_show_the_rows_intervals(tmp_path):
    psnr_iv = {"ssm-r0.5": (29.0, 30.5), "idm-r0.5": (24.0, 26.0)}  # PSNR 30 and 25
    (a,) = _folders(tmp_path, ("a", {"row_keys": {run: {"psnr_lo": lo, "psnr_hi": hi}
                                                  for run, (lo, hi) in psnr_iv.items()}}))
    fig, _ = pareto.pareto_plot([a], "psnr")
    ax = fig.axes[0]
    x_bars = sorted(tuple(round(float(v), 9) for v in (seg[0][0], seg[1][0], seg[0][1]))
                    for c in ax.containers if c.has_xerr for seg in c.lines[2][0].get_segments())
    y_bars = sorted(tuple(round(float(v), 9) for v in (seg[0][0], seg[0][1], seg[1][1]))
                    for c in ax.containers if c.has_yerr for seg in c.lines[2][-1].get_segments())
    expected_x = []
    for run, _, _, _, s, psnr, _ in RUNS:
        sb, sm = SPREADS.get(run, (0.01, 0.01))
        if sb is not None:  # the synthetic interval of make_run_folder: [s (1 - sb), s (1 + sm)]
            expected_x.append((round(s * (1 - sb), 9), round(s * (1 + sm), 9), psnr))
    assert x_bars == sorted(expected_x) and len(x_bars) == len(RUNS) - 1  # toma: one repeat, no bar
    assert y_bars == sorted([(1.40, 29.0, 30.5), (1.20, 24.0, 26.0)])
    assert ax.get_xlabel() == "measured speed-up (x)"
    legend, _ = _legend(fig)
    assert any(t.startswith("bars: 95% intervals") for t in legend)
    from tomerge.experiments.measure.intervals import row_interval

    assert row_interval({"speedup": 1.5, "speedup_lo": 1.2, "speedup_hi": float("inf")}, "speedup") is None
    assert row_interval({"speedup": 1.5}, "speedup") is None


def test_grid_shows_one_image_per_class(tmp_path):
    folder = make_run_folder(tmp_path, "classes", labels=[0, 0, 1, 1, 2, 2])
    data = load_run(folder)
    assert data.grid_items(8) == [0, 2, 4] and data.grid_items(2) == [0, 2]
    assert data.grid_items(3, "first") == [0, 1, 2] and data.grid_items(None, "first") == list(range(N_IMAGES))
    every = data.images("ssm-r0.5")
    assert torch.equal(data.images("ssm-r0.5", indices=[4, 0, 2]), every[[4, 0, 2]])
    calls = []
    images = data.images
    data.images = lambda run, k=None, indices=None: calls.append((run, indices)) or images(run, k, indices)
    written = image_grid_figure(data, tmp_path / "grid")
    assert written and calls == [(r["run"], [0, 2, 4]) for r in data.rows]  # the same items in every row
    calls.clear()
    image_grid_figure(data, tmp_path / "grid_first", k=4, select="first")
    assert {tuple(i) for _, i in calls} == {(0, 1, 2, 3)}
    # an item one run lacks is left out for every run: like with like
    (folder / "images" / "ssm-r0.5" / data.index("ssm-r0.5")[2]["file"]).unlink()
    assert data.grid_items(8) == [0, 3, 4]
    with pytest.raises(ValueError, match="unknown grid selection"):
        data.grid_items(8, "random")


def test_grid_shows_one_image_per_prompt(tmp_path):
    prompts = [f"prompt {i // 2}, a photo of a cat" for i in range(N_IMAGES)]  # two images per prompt
    data = load_run(make_run_folder(tmp_path, "t2i", prompts=prompts))
    assert data.grid_items(8) == [0, 2, 4]
    assert data.prompts(indices=[0, 2, 4]) == [prompts[0], prompts[2], prompts[4]]
    written = image_grid_figure(data, tmp_path / "grid")
    from PIL import Image

    with Image.open(written[0]) as im:  # 3 prompt rows of 9 runs: wider than tall
        assert im.size[0] > im.size[1] > 300
    assert command.main([str(data.path), "--out", str(tmp_path / "figs"), "--metrics", "psnr",
                         "--grid-items", "first", "--k", "2", "--formats", "png"]) == 0


def test_doctests_of_the_modules_pass():
    import doctest

    from tomerge.experiments.figures import canvas, schedules, videos
    from tomerge.experiments.generation import pictures
    from tomerge.experiments.measure import columns

    for module in (canvas, schedules, videos, pareto, pictures, columns):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_an_unknown_metric_is_a_user_error(tmp_path, capsys):
    from tomerge.experiments.cli import UsageError, main

    folder = make_run_folder(tmp_path)
    with pytest.raises(SystemExit) as exit_:  # argparse's choices: one line, exit 2
        main(["figures", str(folder), "--out", str(tmp_path / "figs"), "--metrics", "psnrr"])
    assert exit_.value.code == 2 and "invalid choice: 'psnrr'" in capsys.readouterr().err
    with pytest.raises(UsageError, match="unknown metric 'psnrr'"):  # the Python API says the same
        make_figures([folder], tmp_path / "figs", metrics=["psnrr"])


def test_rows_of_another_flop_counter_are_refused_with_what_to_do(tmp_path):
    """FLOP-ideal speed-ups of an older counter (no CPU attention) must not enter a figure beside current ones."""
    folder = make_run_folder(tmp_path)
    results = folder / "results.jsonl"
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows[-1].pop("flop_counter")  # the last row of a run is the one read
    results.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(UsageError, match=rf"1 runs \({re.escape(rows[-1]['run'])}\).*rerun tomerge ablate"):
        load_run(folder)
