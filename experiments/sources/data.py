"""IDX files and the Fashion-MNIST dataset of the bundled reference model.

The Debian package ``dataset-fashion-mnist`` installs the IDX files (gzipped) under
``/usr/share/datasets/fashion-mnist/``; any folder with the same file names works (gzipped or raw).

Example:
    >>> from tomerge.experiments.sources.data import FashionMNIST
    >>> ds = FashionMNIST()                      # doctest: +SKIP
    >>> image, label = ds[0]                     # image [1, 32, 32] in [-1, 1], label long
    >>> big = FashionMNIST(size=64)              # doctest: +SKIP
"""

from __future__ import annotations

import gzip
import os
import struct
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DEFAULT_FASHION_MNIST_ROOT", "FASHION_MNIST_CLASSES", "read_idx", "write_idx", "fashion_mnist_files",
           "FashionMNIST"]

DEFAULT_FASHION_MNIST_ROOT = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)

# IDX type code -> big-endian numpy dtype
_IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def _open(path: Path):
    with open(path, "rb") as f:
        magic = f.read(2)
    return gzip.open(path, "rb") if magic == b"\x1f\x8b" else open(path, "rb")


def read_idx(path: str | os.PathLike) -> Tensor:
    """Read an IDX file (gzipped or raw, detected from the content) into a tensor.

    Args:
        path: the file.

    Returns:
        A tensor of the stored shape; ``torch.uint8`` for unsigned-byte files (images, labels).

    Example:
        >>> labels = read_idx("/usr/share/datasets/fashion-mnist/train-labels-idx1-ubyte.gz")  # doctest: +SKIP
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"IDX file not found: {path}")
    with _open(path) as f:
        data = f.read()
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError(f"{path} is not an IDX file (bad magic number {data[:4].hex()})")
    code, ndim = data[2], data[3]
    if code not in _IDX_DTYPES:
        raise ValueError(f"{path}: unknown IDX data type 0x{code:02x}")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    dtype = np.dtype(_IDX_DTYPES[code])
    count = int(np.prod(dims)) if dims else 1
    offset = 4 + 4 * ndim
    if len(data) - offset < count * dtype.itemsize:
        raise ValueError(f"{path} is truncated: header says {dims}, file holds {len(data) - offset} bytes of data")
    arr = np.frombuffer(data, dtype=dtype, count=count, offset=offset).reshape(dims)
    return torch.from_numpy(arr.astype(dtype.newbyteorder("="), copy=True))


def write_idx(path: str | os.PathLike, tensor: Tensor) -> None:
    """Write a uint8 tensor as an IDX file (gzipped when the name ends in ``.gz``); used by tests."""
    arr = tensor.detach().cpu().numpy()
    if arr.dtype != np.uint8:
        raise ValueError(f"write_idx writes uint8 tensors only, got {arr.dtype}")
    header = bytes([0, 0, 0x08, arr.ndim]) + struct.pack(f">{arr.ndim}I", *arr.shape)
    payload = header + arr.tobytes()
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "wb") as f:
        f.write(payload)


def _find(root: Path, stem: str, root_hint: str) -> Path:
    for name in (stem + ".gz", stem):
        if (root / name).is_file():
            return root / name
    raise FileNotFoundError(
        f"Fashion-MNIST file {stem}(.gz) not found in {root}; install the Debian package "
        f"dataset-fashion-mnist (files under {DEFAULT_FASHION_MNIST_ROOT}) or {root_hint} "
        "with a folder holding the IDX files"
    )


def fashion_mnist_files(root: str | os.PathLike | None = None, split: str = "train",
                        root_hint: str = "pass root=DIR") -> tuple[Path, Path]:
    """The images and labels IDX files of ``split`` in ``root`` (default: the Debian package's folder), without
    reading them; raises ``FileNotFoundError`` naming the folder or file and how to give another folder
    (``root_hint``: what the caller's user writes, e.g. ``"pass --data-root DIR"``).

    Example:
        >>> fashion_mnist_files("/nonexistent", "test", root_hint="--set data_root=DIR")  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        FileNotFoundError: Fashion-MNIST folder /nonexistent does not exist; install ... or --set data_root=DIR with ...
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    root = Path(root if root is not None else DEFAULT_FASHION_MNIST_ROOT)
    if not root.is_dir():
        raise FileNotFoundError(
            f"Fashion-MNIST folder {root} does not exist; install the Debian package dataset-fashion-mnist "
            f"(files under {DEFAULT_FASHION_MNIST_ROOT}) or {root_hint} with a folder holding the IDX files"
        )
    prefix = "train" if split == "train" else "t10k"
    return _find(root, f"{prefix}-images-idx3-ubyte", root_hint), _find(root, f"{prefix}-labels-idx1-ubyte", root_hint)


class FashionMNIST(Dataset):
    """Fashion-MNIST as ``size x size`` images in ``[-1, 1]``.

    ``size`` 32 is the 28x28 image zero-padded by 2 pixels on each side; a multiple ``32 k`` is the image
    upsampled bilinearly to ``28 k`` and padded by ``2 k`` (64: 28 -> 56, padded to 64), so every size
    shows the garment at the same fraction of the frame. (IDX files of other ``s x s`` images work the
    same way, with ``s + 4`` in place of 32.)

    Args:
        root: folder with ``{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]``.
        split: ``"train"`` (60k) or ``"test"`` (10k).
        limit: keep only the first ``limit`` images (smoke tests).
        size: the image side, a multiple of 32 (32 for the reference model, 64 for ``reference-1024``);
            ``None``: 32.
        root_hint: how the caller's user gives another folder, in the message of a missing file
            (``tomerge train-reference``: ``"pass --data-root DIR"``).

    Returns (per item):
        ``(image [1, size, size] float32 in [-1, 1], label long)``.
    """

    def __init__(self, root: str | os.PathLike | None = None, split: str = "train", limit: int | None = None,
                 size: int | None = None, root_hint: str = "pass root=DIR") -> None:
        images_file, labels_file = fashion_mnist_files(root, split, root_hint)
        root = images_file.parent
        images = read_idx(images_file)  # [N, 28, 28] uint8
        labels = read_idx(labels_file)  # [N] uint8
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(f"inconsistent IDX files in {root}: images {tuple(images.shape)}, labels {tuple(labels.shape)}")
        if limit is not None:
            images, labels = images[:limit], labels[:limit]
        side = images.shape[-1]  # 28
        scale, rest = divmod(size or side + 4, side + 4)
        if scale < 1 or rest:
            raise ValueError(f"Fashion-MNIST image size must be a multiple of {side + 4} (its {side}x{side} images "
                             f"padded by 2), got {size}")
        if scale > 1:
            images = _upsample(images, side * scale)  # [N, 28k, 28k] uint8
        pad = 2 * scale
        images = torch.nn.functional.pad(images, (pad, pad, pad, pad))  # [N, size, size], background 0
        self.images = images.contiguous()
        self.labels = labels.long()
        self.root, self.split, self.size = root, split, images.shape[-1]

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        image = self.images[index].float().div_(127.5).sub_(1.0).unsqueeze(0)  # [1, H, W] in [-1, 1]
        return image, self.labels[index]


def _upsample(images: Tensor, side: int, chunk: int = 4096) -> Tensor:
    """``[N, h, w]`` uint8 -> ``[N, side, side]`` uint8, bilinear (rounded), in chunks to bound memory."""
    out = torch.empty(images.shape[0], side, side, dtype=torch.uint8)
    for start in range(0, images.shape[0], chunk):
        part = images[start : start + chunk].unsqueeze(1).float()  # [n, 1, h, w]
        up = torch.nn.functional.interpolate(part, size=(side, side), mode="bilinear", align_corners=False)
        out[start : start + chunk] = up.squeeze(1).round_().clamp_(0, 255).to(torch.uint8)
    return out
