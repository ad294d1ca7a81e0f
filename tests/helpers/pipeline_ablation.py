"""`tomerge ablate` on the tiny saved pipelines of ``local_pipelines``: the overrides, the run and what it writes.

Each family's pipeline is saved once into ``<root>/tiny-<family>`` and loaded by ``tomerge ablate`` with
``DiffusionPipeline.from_pretrained(folder, local_files_only=True)`` (docs/experiments.md, "Video pipelines"); its
call defaults (``local_pipelines.CURRENT_CALL_DEFAULTS``, or ``EDIT_CALL_DEFAULTS`` for an editing pipeline) are the
``model.call`` of the run. Every run generates the 2 ``PROMPTS`` in one batch of 2, times one call of 1, and leaves
wandb off.

The test modules (tests/experiments/test_ablate_*.py) import the ``offline`` and ``root`` fixtures from here.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from helpers import local_pipelines
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config

PROMPTS = ["a photo of a cat", "a red car in the city"]
ITEMS = ("00000_seed0", "00001_seed1")  # the file (image) or folder (video) of each prompt, seeds 0 and 1
TOMESD = "{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}"
SSM = "{strategy: ssm, ratios: [0.5]}"
TOCA = "{strategy: toca, ratios: [0.0]}"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def root(tmp_path_factory, request) -> Path:
    """The test module's folder: prompts.txt (``PROMPTS``), the saved pipelines and the runs."""
    root = tmp_path_factory.mktemp(request.module.__name__)
    write_prompts(root)
    return root


def write_prompts(root: Path) -> None:
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")


def write_edits(root: Path, edits: list[tuple[str, str]], size: tuple[int, int]) -> None:
    """edits.jsonl of ``(prompt, image file)`` pairs, each image a random RGB image of ``size`` (width, height)."""
    rng = np.random.default_rng(0)
    for _, name in edits:
        pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
        Image.fromarray(pixels).save(root / name)
    (root / "edits.jsonl").write_text("".join(json.dumps({"prompt": p, "image": f}) + "\n" for p, f in edits))


def grid(*entries: str) -> str:
    """The ``grid`` override of the strategy entries ``entries`` (``TOMESD``, ``SSM``, ...)."""
    return f"grid=[{', '.join(entries)}]"


def ablation_overrides(root: Path, family: str, *extra: str, name: str | None = None) -> list[str]:
    """The ``--set`` overrides running ``family``'s pipeline (saved into ``root`` on first use) on the prompts of
    ``root`` (prompts.txt, or edits.jsonl with an input image per prompt for an editing pipeline) into
    ``root/runs/<name>`` (the family by default), then ``extra``. ``model.pipeline`` comes first."""
    folder = root / f"tiny-{family}"
    if not folder.exists():
        local_pipelines.save_tiny_pipeline(family, folder)
    edit = family in local_pipelines.EDIT_CALL_DEFAULTS
    defaults = (local_pipelines.EDIT_CALL_DEFAULTS if edit else local_pipelines.CURRENT_CALL_DEFAULTS)[family]
    call = yaml.safe_dump(defaults, default_flow_style=True, width=1 << 16).strip()
    prompts = f"{{file: {root / 'edits.jsonl'}, image_field: image}}" if edit else root / "prompts.txt"
    return [f"model.pipeline={folder}", f"model.call={call}", f"prompts={prompts}", f"out_dir={root / 'runs'}",
            f"name={name or family}", "batch_size=2", "timing_batch=1", "warmup=0", "repeats=1", "wandb=disabled",
            *extra]


def run_family(root: Path, family: str, *entries: str) -> tuple[Path, list[dict]]:
    """``family``'s saved pipeline through ``run_ablation`` with the grid ``entries``: the run folder and its result
    rows (baseline first)."""
    config = load_config(None, ablation_overrides(root, family, grid(*entries)))
    folder = run_ablation(config, progress=False).path
    return folder, result_rows(folder)


def result_rows(folder: Path) -> list[dict]:
    """results.jsonl of the run folder: one row per run, the baseline first."""
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def block_records(folder: Path, run: str) -> list[dict]:
    """maps/<run>.json: one record per merged block call (``num_tokens`` it saw, ``num_removed``, ``step``, ...);
    a merging run has some."""
    records = json.loads((folder / "maps" / f"{run}.json").read_text())
    assert records, run
    return records


def item_index(folder: Path, run: str) -> list[dict]:
    """images/<run>/prompts.jsonl: per item its ``file`` (or video folder), ``prompt`` and input ``image``."""
    return [json.loads(line) for line in (folder / "images" / run / "prompts.jsonl").read_text().splitlines()]


def check_rows(folder: Path, rows: list[dict], runs: list[str], *, size: tuple[int, int], frames: int | None = None,
               merging: Sequence[str] = ()) -> None:
    """The baseline then ``runs``; the baseline is itself (PSNR capped at 100 dB), every run differs from it and
    costs fewer FLOPs, and the runs of ``merging`` remove tokens. Every run wrote the 2 items as RGB PNGs of
    ``size`` (width, height): images, or with ``frames``, a folder of ``frames`` PNGs per video, scored per frame."""
    baseline, *others = rows
    assert [r["run"] for r in rows] == ["baseline", *runs]
    assert baseline["psnr"] == 100.0
    for r in rows:
        assert r["n_images"] == 2, r["run"]
        if frames is None:
            assert "n_frames" not in r and "psnr_per_frame" not in r, r["run"]
        else:
            assert r["n_frames"] == 2 * frames and r["frames_per_video"] == frames, r["run"]
            assert len(r["psnr_per_frame"]) == len(r["ssim_per_frame"]) == frames, r["run"]
    if frames is not None:
        assert baseline["psnr_per_frame"] == [100.0] * frames
    for r in others:
        assert r["psnr"] < 100.0 and r["flops"] < r["flops_base"], r["run"]
        if r["run"] in merging:
            assert r["tokens_removed_mean"] > 0, r["run"]
    for run in ("baseline", *runs):
        written = folder / "images" / run
        if frames is None:
            assert sorted(f.name for f in written.glob("*.png")) == [f"{item}.png" for item in ITEMS], run
        else:
            for item in ITEMS:
                names = sorted(f.name for f in (written / item).iterdir())
                assert names == [f"frame_{t:03d}.png" for t in range(frames)], (run, item)
        for file in written.rglob("*.png"):
            with Image.open(file) as image:
                assert image.size == size and image.mode == "RGB", file
