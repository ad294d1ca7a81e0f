"""Pictures of images and merge maps as arrays to save or draw: a grid of images (:func:`image_grid`), one
image as RGB values (:func:`image_rgb`), a merge map coloured by slot (:func:`merge_map_rgb`). Images are
tensors ``[C, H, W]`` in [-1, 1], as the generators write them; torch is imported inside the functions."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["image_grid", "image_rgb", "merge_map_rgb"]


def image_grid(images: Tensor, columns: int = 10) -> Tensor:
    """``[n, C, H, W]`` in [-1, 1] -> a ``[H', W', 3]`` uint8 grid."""
    import torch

    n, c, h, w = images.shape
    rows = -(-n // columns)
    canvas = torch.zeros(rows * columns, c, h, w)
    canvas[:n] = images.float()
    canvas = canvas.view(rows, columns, c, h, w).permute(0, 3, 1, 4, 2).reshape(rows * h, columns * w, c)  # [H', W', C]
    canvas = ((canvas.clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
    return canvas.expand(-1, -1, 3) if c == 1 else canvas[..., :3]


def image_rgb(image: Tensor) -> Tensor:
    """``[C, H, W]`` in [-1, 1] -> ``[H, W, 3]`` in [0, 1] (grey images repeated)."""
    img = ((image.float().clamp(-1, 1) + 1) / 2).permute(1, 2, 0)  # [H, W, C]
    return img.expand(-1, -1, 3) if img.shape[-1] == 1 else img[..., :3]


def merge_map_rgb(slots: Tensor, grid: tuple[int, ...] | None = None, scale: int = 8) -> Tensor:
    """Colours tokens by slot (tokens sharing a slot share a colour): ``[N]`` -> ``[H*s, W*s, 3]`` uint8; a
    video grid ``(T, H, W)`` gives its frames side by side, ``[H*s, T*W*s, 3]``.

    Example:
        >>> import torch
        >>> merge_map_rgb(torch.arange(48) // 2, (3, 4, 4), scale=1).shape
        torch.Size([4, 12, 3])
    """
    import torch

    n = slots.numel()
    if grid is not None and len(grid) == 3:
        T, H, W = grid
    else:
        side = int(round(n ** 0.5))
        T, (H, W) = 1, (grid if grid is not None else (side, n // side))
    if T * H * W != n:
        raise ValueError(f"{n} token slots do not fill the grid {grid or (H, W)}")
    g = torch.Generator().manual_seed(0)
    palette = torch.randint(40, 256, (int(slots.max()) + 1, 3), generator=g, dtype=torch.uint8)
    counts = torch.bincount(slots, minlength=palette.shape[0])
    palette[counts == 1] = 0  # unmerged tokens are black
    rgb = palette[slots].view(T, H, W, 3).permute(1, 0, 2, 3).reshape(H, T * W, 3)  # frames side by side
    return rgb.repeat_interleave(scale, 0).repeat_interleave(scale, 1)
