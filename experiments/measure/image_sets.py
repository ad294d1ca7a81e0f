"""The quality of generated image (or video) sets on disk against their baseline set: :class:`ImageSetQuality`
reads the files in chunks and scores them with ``measure.metrics``' functions and ``measure.features``'
models, so any number of images fits.

Videos are scored frame by frame: :class:`ImageSetQuality` takes folders of frames (``frame_000.png``, ...),
pairs frame ``t`` of a video with frame ``t`` of its baseline video (PSNR/SSIM per frame, averaged, and per
frame index), and treats the frames as images for the feature distances (docs/experiments.md, "Video
pipelines").
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..generation.files import expand_videos, load_image_files
from ..sources.weights import check_dino_model, require_path
from .features import FeatureExtractor, ResampledFrechet, check_pair, cosine_distance, dino_embeddings, \
    frechet_distance, to_rgb, to_uint8
from .intervals import quality_intervals, video_groups
from .metrics import clip_score, psnr, ssim, ssim_kernel

__all__ = ["ImageSetQuality"]


class ImageSetQuality:
    """Quality of generated image (or video) sets against a baseline set, read from files in chunks.

    Any number of images fits: paired metrics are kept per image, EfficientNet-Lite0 features
    (``[N, 1280]`` float32) are the only large thing kept per set. The baseline's and the reference set's
    features are computed once (or passed in, e.g. from a cache) and reused by every :meth:`score`.

    Videos (folders of ``frame_*.png``, :func:`~tomerge.experiments.generation.files.expand_videos`) are scored
    as their frames: every frame is paired with the same frame of the baseline video, features are per frame
    (``[N * T, 1280]``), the CLIP score compares every frame with the item's prompt, the DINO distance pairs
    frame ``t`` with frame ``t`` of the baseline video, and the reference images are compared with frames.

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
            require_path(clip_model, "metrics.clip_model", "CLIP score")
            if prompts is None:
                raise ValueError("metrics.clip_model needs prompts: the CLIP score compares images with their prompts")
        if fid_weights is not None:
            require_path(fid_weights, "metrics.fid_weights", "Standard FID (Inception-v3)")
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
                metric.update(to_rgb(to_uint8(chunk)).to(self.device), real=True)  # [b, 3, H, W] uint8
        return metric

    def score(self, files: Sequence[Path]) -> dict[str, Any]:
        """The quality numbers of one set (same items, same order as the baseline); see :meth:`score_features`."""
        return self.score_features(files)[0]

    def score_features(self, files: Sequence[Path]) -> tuple[dict[str, Any], Tensor]:
        """The quality numbers of one set (same items, same order as the baseline), and its EfficientNet-Lite0
        features ``[N (* T), 1280]`` (a comparison of two runs resamples them: ``measure.intervals``).

        The numbers: ``psnr``, ``ssim`` (means; PSNR capped at 100 dB), ``feat_cos_dist`` (mean
        EfficientNet-Lite0 feature cosine distance to the paired baseline image), ``fd_effnetlite0`` (vs the
        baseline set), with a reference set ``fd_effnetlite0_ref`` and ``fd_effnetlite0_ref_baseline``,
        ``clip_score``, ``fid``, ``dino_dist`` (mean DINO CLS cosine distance to the paired baseline image),
        ``n_images``; the 95% interval of each but FID and the baseline's own FD, ``<metric>_lo`` /
        ``<metric>_hi`` (:func:`~tomerge.experiments.measure.intervals.quality_intervals`); ``per_image``, each
        per-image metric's values in item order (what a paired comparison of two runs resamples).

        Videos: the means are over every frame of every video (equal frame counts: the mean of the
        per-video means), ``psnr_per_frame`` / ``ssim_per_frame`` (and ``dino_dist_per_frame``) are the
        means over videos of frame ``t`` (one value per frame index), the distances and scores treat
        frames as images; the intervals resample videos (all their frames together), ``per_image`` holds each
        video's mean; ``n_images`` counts videos, ``n_frames`` frames and ``frames_per_video`` is ``T``."""
        files = list(files)
        if len(files) != len(self.baseline_files):
            raise ValueError(f"{len(files)} images against {len(self.baseline_files)} baseline images")
        frames, per_video = expand_videos(files)
        if per_video != self.frames_per_video:
            raise ValueError(f"{per_video} frames per video against the baseline's {self.frames_per_video}")
        psnrs, ssims, feats, dinos, clips = [], [], [], [], []
        if self._fid is not None:
            self._fid.reset()  # keeps the reference features
        for start, chunk in self._chunks(frames):  # chunk: [b, C, H, W], b frames (or images)
            base = load_image_files(self.baseline_frames[start:start + chunk.shape[0]])
            check_pair(base, chunk)
            psnrs.append(psnr(base, chunk))  # [b]
            ssims.append(ssim(base, chunk, kernel_size=ssim_kernel(base)))  # [b]
            feats.append(self.extract(chunk))
            if self.dino_model is not None:
                dinos.append(self._dino(chunk))  # [b, D]
            if self.clip_model is not None:
                prompts = list(self.prompts[start:start + chunk.shape[0]])
                clips.append(clip_score(chunk, prompts, self.clip_model, device=self.device))  # [b]
            if self._fid is not None:
                with torch.no_grad():
                    self._fid.update(to_rgb(to_uint8(chunk)).to(self.device), real=False)
        n = len(frames)
        f_run = torch.cat(feats)  # [n, 1280]
        per_frame = {  # [n] each
            "psnr": torch.cat(psnrs), "ssim": torch.cat(ssims),
            "feat_cos_dist": (1 - torch.nn.functional.cosine_similarity(
                self.baseline_features, f_run, dim=1)).clamp_min(0)}  # rounding: 1 - cos >= 0
        if self.dino_model is not None:
            per_frame["dino_dist"] = cosine_distance(self.baseline_dino, torch.cat(dinos))
        if self.clip_model is not None:
            per_frame["clip_score"] = torch.cat(clips)
        out: dict[str, Any] = {key: float(values.mean()) for key, values in per_frame.items()}
        out["psnr"], out["ssim"] = float(per_frame["psnr"].sum()) / n, float(per_frame["ssim"].sum()) / n
        if per_video is not None:
            # [n] = [videos * T] in video-major order -> [videos, T] -> mean over videos: [T]
            for key in ("psnr", "ssim", "dino_dist"):
                if key in per_frame:
                    out[f"{key}_per_frame"] = per_frame[key].view(-1, per_video).mean(0).tolist()
        fd: dict[str, ResampledFrechet] = {}
        if n >= 2:
            out["fd_effnetlite0"] = frechet_distance(self.baseline_features, f_run)
            fd["fd_effnetlite0"] = ResampledFrechet(f_run, self.baseline_features, paired=True)
        if self.reference_features is not None:
            out["fd_effnetlite0_ref"] = frechet_distance(f_run, self.reference_features)
            out["fd_effnetlite0_ref_baseline"] = frechet_distance(self.baseline_features, self.reference_features)
            fd["fd_effnetlite0_ref"] = ResampledFrechet(f_run, self.reference_features, paired=False)
        if self._fid is not None:
            out["fid"] = float(self._fid.compute())
        # per item: [n] -> [videos, T] -> each video's mean, [videos]
        per_item = {k: (v if per_video is None else v.view(-1, per_video).mean(1)).double().numpy()
                    for k, v in per_frame.items()}
        groups = video_groups(len(files), per_video)
        if len(files) >= 2:
            out.update(quality_intervals(per_item, fd, groups))
        out["per_image"] = {k: v.tolist() for k, v in per_item.items()}
        out["n_images"] = float(len(files))
        if per_video is not None:
            out["n_frames"], out["frames_per_video"] = float(n), float(per_video)
        return out, f_run
