"""Per-pixel noise in flat regions of an ablation's images (docs/claims.md, the MLP-merge noise study).

Fashion-MNIST images have black left and right borders, so what a sampler leaves there is noise: this
prints, for every run of an ablation folder, the pixel standard deviation of the ``width``-pixel left and
right borders (pixel values in [0, 1]) over all of the run's images.

    python3 scripts/border_noise.py runs/claims_headline [--width 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def border_std(files: list[Path], width: int) -> float:
    """Standard deviation of the pixels in the ``width`` leftmost and rightmost columns of every image."""
    borders = []
    for f in files:
        pixels = np.asarray(Image.open(f).convert("L"), dtype=np.float64) / 255.0  # [H, W]
        borders.append(np.concatenate([pixels[:, :width], pixels[:, -width:]], axis=1))  # [H, 2 * width]
    return float(np.std(np.stack(borders)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an ablation's run folder (runs/<name>)")
    parser.add_argument("--width", type=int, default=3, help="border width in pixels (default 3)")
    args = parser.parse_args()
    runs = sorted(p for p in (args.folder / "images").iterdir() if p.is_dir())
    if not runs:
        raise SystemExit(f"no image folders under {args.folder / 'images'}")
    print(f"| run | images | border std (width {args.width}) |\n|---|---|---|")
    for run in runs:
        files = sorted(run.glob("*.png"))
        if files:
            print(f"| {run.name} | {len(files)} | {border_std(files, args.width):.3f} |")


if __name__ == "__main__":
    main()
