"""A tiny native DiT checkpoint and Fashion-MNIST stand-in files, for the tests that run `tomerge ablate`."""

from __future__ import annotations

from pathlib import Path

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
