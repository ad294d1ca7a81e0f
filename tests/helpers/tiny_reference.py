"""A tiny native DiT checkpoint and Fashion-MNIST stand-in files, for the tests that run `tomerge ablate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tomerge.backbones.timm_dit import DiT, DiTConfig, save_dit
from tomerge.experiments.sources.data import write_idx


def write_tiny_dit(path: Path) -> Path:
    """Saves a 16 x 16, 3-class, depth-2 DiT with seeded random weights (seed 0) to ``path``."""
    torch.manual_seed(0)
    model = DiT(DiTConfig(input_size=16, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=3))
    for p in model.parameters():  # leave adaLN-Zero's identity init so merging changes the output
        p.data.normal_(0, 0.05)
    save_dit(model, path)
    return path


def write_test_set(folder: Path) -> Path:
    """Six random 12 x 12 test images and labels in Fashion-MNIST's IDX files (the global RNG continues)."""
    folder.mkdir()
    write_idx(folder / "t10k-images-idx3-ubyte", torch.randint(0, 256, (6, 12, 12), dtype=torch.uint8))
    write_idx(folder / "t10k-labels-idx1-ubyte", torch.randint(0, 10, (6,), dtype=torch.uint8))
    return folder


def tiny_config(root: Path, name: str, num_steps: int, per_class: int, batch_size: int, **sections: Any) -> dict:
    """A run config on the tiny DiT and test set written under ``root`` (classes 0 and 1, one timing round, no
    W&B), with ``sections`` (e.g. ``search=...``) added."""
    write_tiny_dit(root / "tiny.safetensors")
    return {"name": name, "model": {"reference": str(root / "tiny.safetensors"), "call": {"num_steps": num_steps}},
            "data_root": str(write_test_set(root / "data")), "out_dir": str(root / "runs"), "classes": [0, 1],
            "per_class": per_class, "batch_size": batch_size, "timing_batch": 2, "warmup": 0, "repeats": 1,
            "fd_reference_images": 0, "wandb": "disabled", **sections}
