"""Offline image quality metrics for ablations: PSNR, SSIM, FD-EffNetLite0, and opt-in FID, CLIP score and DINO
distance.

Images are float tensors ``[B, C, H, W]`` in ``[-1, 1]`` (C = 1 or 3), as the samplers return them, compared by the
features of :mod:`~tomerge.experiments.measure.features`. :func:`compute_quality` scores one ablation cell held in
memory; ``measure.image_sets.ImageSetQuality`` scores sets of files on disk with these functions. The opt-in metrics
read only weights the user points to (``metrics.fid_weights``, ``metrics.clip_model``, ``metrics.dino_model``), so
nothing is ever downloaded; the Frechet distance on EfficientNet-Lite0 features is labelled FD-EffNetLite0, never
"FID". What each metric compares: docs/experiments.md, "Per run it records" and "DINO distance".
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from ..errors import MissingWeightsError
from ..sources.weights import check_dino_model, require_path
from .columns import FD_LABEL, quality_labels
from .features import FeatureExtractor, check_images, check_pair, cosine_distance, dino_embeddings, frechet_distance, \
    load_clip, to_rgb, to_uint8

__all__ = ["FD_LABEL", "QUALITY_LABELS", "MissingWeightsError", "psnr", "ssim", "ssim_kernel", "fd_effnet_lite0",
           "fid", "clip_score", "dino_distance", "compute_quality"]

QUALITY_LABELS = quality_labels()  # dict key -> label for tables, figures and W&B (columns.COLUMNS)


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
    check_pair(a, b)
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
    check_pair(a, b)
    if min(a.shape[-2:]) < kernel_size:
        raise ValueError(f"ssim needs images of at least {kernel_size}x{kernel_size} pixels, got "
                         f"{tuple(a.shape[-2:])}; pass a smaller odd kernel_size")
    from torchmetrics.functional.image import structural_similarity_index_measure

    return structural_similarity_index_measure(a.detach().double(), b.detach().double(), data_range=float(data_range),
                                               kernel_size=kernel_size, sigma=sigma, reduction="none")  # [B]


def ssim_kernel(images: Tensor) -> int:
    """11, or the largest odd window that fits images smaller than 11 pixels."""
    k = min(11, *images.shape[-2:])
    return k if k % 2 else k - 1


# ---------------------------------------------------------------- feature distances
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
    path = require_path(inception_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
    check_images(images_a, "images_a", channels=(1, 3))
    check_images(images_b, "images_b", channels=(1, 3))
    try:
        from torchmetrics.image.fid import FrechetInceptionDistance

        metric = FrechetInceptionDistance(feature=2048, feature_extractor_weights_path=path, normalize=False)
    except ModuleNotFoundError as e:
        raise ImportError("Standard FID needs torch-fidelity: pip install torch-fidelity") from e
    metric = metric.to(device)
    with torch.no_grad():
        for images, real in ((images_a, True), (images_b, False)):
            for chunk in images.split(batch_size):
                metric.update(to_rgb(to_uint8(chunk)).to(device), real=real)  # [b, 3, H, W] uint8
        return float(metric.compute())


def clip_score(images: Tensor, prompts: str | Sequence[str], clip_model_path: str | os.PathLike | None,
               batch_size: int = 32, device: str | torch.device = "cpu") -> Tensor:
    """CLIP scores ``max(100 cos(E_image, E_text), 0)`` per image (Hessel et al. 2021, as torchmetrics defines
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
        ``[N]`` float64 tensor of the images' CLIP scores (their mean is the set's CLIP score).

    Example:
        >>> clip_score(x, "a photo of a cat", clip_model_path="/models/clip-vit-base-patch16")  # doctest: +SKIP
    """
    path = require_path(clip_model_path, "metrics.clip_model", "CLIP score")
    check_images(images, "images", channels=(1, 3))
    prompt_list = [prompts] * images.shape[0] if isinstance(prompts, str) else list(prompts)
    if len(prompt_list) != images.shape[0]:
        raise ValueError(f"clip_score needs one prompt per image: {images.shape[0]} images, {len(prompt_list)} prompts")
    model, processor = load_clip(str(Path(path).resolve()), str(device))
    scores = []
    with torch.no_grad():
        for start in range(0, images.shape[0], batch_size):
            chunk = to_rgb(to_uint8(images[start:start + batch_size]))  # [b, 3, H, W] uint8
            inputs = processor(text=prompt_list[start:start + batch_size], images=list(chunk), return_tensors="pt",
                               padding=True, truncation=True).to(device)
            out = model(**inputs)
            cos = (out.image_embeds * out.text_embeds).sum(-1)  # [b]; both are unit vectors
            scores.append((100 * cos).clamp_min(0).float().cpu())
    return torch.cat(scores).double()


def dino_distance(images_a: Tensor, images_b: Tensor, dino_model_path: str | os.PathLike | None,
                  batch_size: int = 32, device: str | torch.device = "cpu") -> Tensor:
    """ToMA's DINO metric per image pair (Lu et al., ICML 2025): ``1 - cos(E_a, E_b)`` of the DINO CLS
    embeddings (:func:`~tomerge.experiments.measure.features.dino_embeddings`) of paired images, e.g. a
    merged image and the unmerged image of the same seed and prompt. 0 for identical images; lower is better.

    Args:
        images_a, images_b: ``[N, 1|3, H, W]`` in [-1, 1], same shape.
        dino_model_path: a local DINO folder (option ``metrics.dino_model``).
        batch_size, device: as for :func:`~tomerge.experiments.measure.features.dino_embeddings`.

    Returns:
        ``[N]`` float64 tensor of distances in [0, 2].

    Example:
        >>> dino_distance(x, x, "/models/dinov2-base").max() < 1e-6          # doctest: +SKIP
        tensor(True)
    """
    check_pair(images_a, images_b)
    return cosine_distance(dino_embeddings(images_a, dino_model_path, batch_size, device),
                            dino_embeddings(images_b, dino_model_path, batch_size, device))


# ---------------------------------------------------------------- one ablation cell in memory
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
    check_pair(baseline_images, merged_images)
    if fid_weights is not None:  # fail before the expensive part
        require_path(fid_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
        if reference_images is None:
            raise ValueError("fid_weights given but no reference_images to compare against")
    if clip_model_path is not None:
        require_path(clip_model_path, "metrics.clip_model", "CLIP score")
        if prompts is None:
            raise ValueError("clip_model_path given but no prompts for the CLIP score")
    if dino_model_path is not None:
        check_dino_model(dino_model_path)
    out: dict[str, float] = {
        "psnr": float(psnr(baseline_images, merged_images).mean()),
        "ssim": float(ssim(baseline_images, merged_images, kernel_size=ssim_kernel(baseline_images)).mean())}
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
        out["clip_score"] = float(clip_score(merged_images, prompts, clip_model_path, device=device).mean())
    if dino_model_path is not None:
        out["dino_dist"] = float(dino_distance(baseline_images, merged_images, dino_model_path, batch_size=batch_size,
                                               device=device).mean())
    out["n_images"] = float(baseline_images.shape[0])
    return out
