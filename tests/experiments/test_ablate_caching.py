"""`tomerge ablate` runs every caching schedule as a grid entry on the tiny reference DiT
(tests/helpers/tiny_reference.py): caching only at ratio 0, and composed with a merging strategy at a ratio. A reused
step costs the model's FLOPs less its blocks', so the FLOP-ideal speed-up of ``fora`` is known from one call's FLOPs;
the others only have to be faster than the baseline and produce their images and metrics."""

import json

import pytest
import torch

from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config
from tomerge.experiments.measure.flops import FlopCounter
from helpers.tiny_reference import write_test_set, write_tiny_dit

STEPS = 4
GRID = ("grid=[{strategy: fora, ratios: [0]}, {strategy: taylorseer, ratios: [0]},"
        " {strategy: first_block_cache, ratios: [0], options: {threshold: 10.0}},"
        " {strategy: block_cache, ratios: [0.5], options: {interval: 2, merge: tomesd}}]")


def test_every_caching_schedule_runs_in_an_ablation_grid(tmp_path):
    write_tiny_dit(tmp_path / "tiny.safetensors")
    data = write_test_set(tmp_path / "data")
    overrides = [f"model.reference={tmp_path / 'tiny.safetensors'}", f"model.call.num_steps={STEPS}",
                 f"data_root={data}", f"out_dir={tmp_path / 'runs'}", "name=caching", "classes=[0, 1]", "per_class=1",
                 "batch_size=2", "timing_batch=2", "warmup=0", "repeats=1", "fd_reference_images=0", "wandb=disabled",
                 GRID]
    folder = run_ablation(load_config(None, overrides), progress=False).path
    rows = {r["run"]: r for r in map(json.loads, (folder / "results.jsonl").read_text().splitlines())}
    assert list(rows) == ["baseline", "fora-r0", "taylorseer-r0", "first_block_cache-r0-threshold=10.0",
                          "block_cache-r0.5-interval=2-merge=tomesd"]
    for name, row in rows.items():
        assert (folder / "images" / f"{name}.png").exists() and row["psnr"] > 0
        if name != "baseline":
            assert row["flop_speedup"] > 1.2 and row["psnr"] < 100, (name, row["flop_speedup"])

    # fora on 4 steps: every block runs on steps 0 and 3; steps 1 and 2 cost the model's FLOPs less its blocks'.
    model = load_dit(tmp_path / "tiny.safetensors")
    counter = FlopCounter()
    with counter, torch.no_grad():
        model(torch.randn(1, 1, 16, 16), torch.full((1,), 0.5), torch.tensor([0]))
    counts = counter.get_flop_counts()
    total = counter.get_total_flops()
    blocks = sum(sum(counts[f"DiT.blocks.{i}"].values()) for i in range(len(model.blocks)))
    assert rows["fora-r0"]["flop_speedup"] == pytest.approx(4 * total / (2 * total + 2 * (total - blocks)), rel=1e-9)
