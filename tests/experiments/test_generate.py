"""`tomerge generate`: item naming, sharding, resume, and DDP (2 CPU processes, gloo) == one process."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tomerge.experiments.commands import generate as command
from tomerge.experiments.generation import distributed
from tomerge.experiments.generation import generate as gen
from tomerge.experiments.sources.items import class_items, read_class_file
from tomerge.experiments.sources.models import ModelSpec

CLASSES = [0, 1, 2]
PER_CLASS = 2  # 6 images
EXPECTED = [f"{i:05d}_class{c}_seed{10 + i}.png" for i, c in enumerate([0, 0, 1, 1, 2, 2])]
COMMON = ["--classes", *map(str, CLASSES), "--per-class", str(PER_CLASS), "--seed", "10", "--call", "num_steps=3",
          "--batch-size", "2", "--strategy", "tomesd", "--ratio", "0.5", "--no-progress", "--threads", "1"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from tomerge.backbones.timm_dit import DiT, DiTConfig, save_dit

    torch.manual_seed(0)
    model = DiT(DiTConfig(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=3, learn_sigma=False))
    with torch.no_grad():
        for p in model.parameters():  # adaLN-Zero starts as identity; random weights make real images
            p.normal_(0, 0.05)
    path = tmp_path_factory.mktemp("ckpt") / "tiny.safetensors"
    save_dit(model, path)
    return path


def _pngs(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.suffix == ".png")


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    return np.asarray(Image.open(path))


def _spec(checkpoint: Path) -> gen.GenerateSpec:
    model = ModelSpec(kind="reference", path=str(checkpoint.resolve()), call={"num_steps": 3})
    return gen.GenerateSpec(model=model, strategy="tomesd", ratio=0.5, batch_size=2)


def test_items_batches_and_shards():
    items = class_items(CLASSES, PER_CLASS, seed=10)
    assert [i.filename for i in items] == EXPECTED
    batches = gen.make_batches(items, 4)
    assert [len(b) for b in batches] == [4, 2]
    for world in (1, 2, 3, 5):
        shards = [gen.shard(7, r, world) for r in range(world)]
        flat = [b for s in shards for b in s]
        assert sorted(flat) == list(range(7)) and len(flat) == 7  # disjoint and complete


def test_class_file(tmp_path):
    (tmp_path / "c.json").write_text(json.dumps([2, 0, 1]))
    (tmp_path / "c.txt").write_text("2, 0  # comment\n1\n")
    assert read_class_file(tmp_path / "c.json") == read_class_file(tmp_path / "c.txt") == [2, 0, 1]
    (tmp_path / "bad.txt").write_text("1 two")
    with pytest.raises(ValueError, match="integers"):
        read_class_file(tmp_path / "bad.txt")


def test_single_process_resume_and_ddp_match(checkpoint, tmp_path, monkeypatch):
    single, ddp = tmp_path / "single", tmp_path / "ddp"

    # one process, through the command line
    assert command.main([*COMMON, "--checkpoint", str(checkpoint), "--out", str(single)]) == 0
    assert _pngs(single) == EXPECTED
    assert json.loads((single / "generate.json").read_text())["strategy"] == "tomesd"

    # rerun: everything skipped, nothing rewritten
    mtimes = {n: (single / n).stat().st_mtime_ns for n in EXPECTED}
    assert command.main([*COMMON, "--checkpoint", str(checkpoint), "--out", str(single)]) == 0
    assert {n: (single / n).stat().st_mtime_ns for n in EXPECTED} == mtimes

    # partial resume: only the missing file is written, identical to before (batch recomputed whole)
    before = _pixels(single / EXPECTED[3])
    (single / EXPECTED[3]).unlink()
    assert command.main([*COMMON, "--checkpoint", str(checkpoint), "--out", str(single)]) == 0
    np.testing.assert_array_equal(_pixels(single / EXPECTED[3]), before)
    assert all((single / n).stat().st_mtime_ns == mtimes[n] for n in EXPECTED if n != EXPECTED[3])

    # other settings into the same folder are refused
    with pytest.raises(ValueError, match="other settings"):
        command.main([*COMMON, "--ratio", "0.25", "--checkpoint", str(checkpoint), "--out", str(single)])

    # Lightning Trainer.predict, DDP over 2 CPU processes (gloo); 3 batches -> shards of 2 and 1 batches
    ddp.mkdir()
    shard_log = tmp_path / "shards"
    shard_log.mkdir()

    def logged_shard(num_batches: int, rank: int, world_size: int) -> list[int]:
        mine = real_shard(num_batches, rank, world_size)
        (shard_log / f"rank{rank}-of-{world_size}.json").write_text(json.dumps(mine))  # forked ranks see this patch
        return mine

    real_shard = distributed.shard
    monkeypatch.setattr(distributed, "shard", logged_shard)
    items = class_items(CLASSES, PER_CLASS, seed=10)
    gen.prepare(ddp, items, _spec(checkpoint))
    assert distributed.generate_distributed(items, _spec(checkpoint), ddp, devices=2, accelerator="cpu",
                                            launcher="ddp_fork", threads=1, progress=False)
    shards = {p.name: json.loads(p.read_text()) for p in shard_log.iterdir()}
    assert shards == {"rank0-of-2.json": [0, 2], "rank1-of-2.json": [1]}  # two processes, disjoint shards
    assert _pngs(ddp) == EXPECTED  # every item exactly once, nothing else
    for name in EXPECTED:
        np.testing.assert_array_equal(_pixels(ddp / name), _pixels(single / name), err_msg=name)
    images = np.stack([_pixels(ddp / n) for n in EXPECTED]).astype(float)
    assert images.std(axis=0).mean() > 1  # different seeds give different images


def test_strategy_none_rejects_options(checkpoint):
    with pytest.raises(ValueError, match="needs a --strategy"):
        gen.GenerateSpec(model=ModelSpec(path=str(checkpoint)), options={"use_rand": False})
