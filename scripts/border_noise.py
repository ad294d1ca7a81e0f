"""Per-pixel noise in flat regions of an ablation's images (docs/claims.md, the MLP-merge noise study).

Fashion-MNIST images have black left and right borders, so what a sampler leaves there is noise: this
prints, for every run of an ablation folder, the pixel standard deviation of the ``width``-pixel left and
right borders (pixel values in [0, 1]) over all of the run's images, with its 95% interval over the images.

    python3 scripts/border_noise.py runs/claims_headline [--width 3]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
from PIL import Image


def borders(files: list[Path], width: int) -> np.ndarray:
    """The ``width`` leftmost and rightmost pixel columns of every image, ``[N, H, 2 * width]`` in [0, 1]."""
    out = []
    for f in files:
        pixels = np.asarray(Image.open(f).convert("L"), dtype=np.float64) / 255.0  # [H, W]
        out.append(np.concatenate([pixels[:, :width], pixels[:, -width:]], axis=1))  # [H, 2 * width]
    return np.stack(out)


def border_std(files: list[Path], width: int) -> tuple[float, float, float]:
    """Standard deviation of the border pixels of all images, with its 95% interval from a bootstrap over the
    images (``measure.intervals``)."""
    from tomerge.experiments.measure.intervals import bootstrap_interval

    b = borders(files, width)
    lo, hi = bootstrap_interval(lambda idx: float(np.std(b[idx])), len(files))
    return float(np.std(b)), lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path, help="an ablation's run folder (runs/<name>)")
    parser.add_argument("--width", type=int, default=3, help="border width in pixels (default 3)")
    args = parser.parse_args()
    runs = sorted(p for p in (args.folder / "images").iterdir() if p.is_dir())
    if not runs:
        raise SystemExit(f"no image folders under {args.folder / 'images'}")
    print(f"| run | images | border std (width {args.width}) [95% interval] |\n|---|---|---|")
    for run in runs:
        files = sorted(run.glob("*.png"))
        if files:
            std, lo, hi = border_std(files, args.width)
            print(f"| {run.name} | {len(files)} | {std:.3f} [{lo:.3f}, {hi:.3f}] |")


if __name__ == "__main__":
    main()
