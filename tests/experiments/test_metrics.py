"""Offline image quality metrics: PSNR, SSIM, Frechet distance, FD-EffNetLite0, opt-in FID / CLIP errors.

The EfficientNet-Lite0 forward costs ~0.1-0.3 s per image on a small CPU, so the feature tests use a
handful of images.
"""

import math
import socket

import numpy as np
import pytest
import torch

from tomerge.experiments.measure import features as F
from tomerge.experiments.measure import metrics as M
from tomerge.experiments.sources import weights

N_IMG = 4  # images per set in the EfficientNet tests


def _images(n: int, seed: int, channels: int = 1, size: int = 32) -> torch.Tensor:
    """Smooth, structured images in [-1, 1]: upsampled 4x4 random patterns plus a gradient."""
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, channels, 4, 4, generator=g) * 2 - 1  # [n, C, 4, 4]
    x = torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)
    ramp = torch.linspace(-0.3, 0.3, size).view(1, 1, 1, size)
    return (x + ramp).clamp(-1, 1)  # [n, C, size, size]


def _noised(x: torch.Tensor, sigma: float, seed: int = 123) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (x + sigma * torch.randn(x.shape, generator=g)).clamp(-1, 1)


# ---------------------------------------------------------------- PSNR / SSIM
def test_psnr_identical_is_capped_or_inf():
    x = _images(3, 0)
    assert M.psnr(x, x).tolist() == [100.0, 100.0, 100.0]
    assert torch.isinf(M.psnr(x, x, max_db=None)).all()


def test_psnr_matches_known_mse():
    a = _images(4, 1, channels=3)
    b = _noised(a, 0.1)
    mse = ((a.double() - b.double()) ** 2).mean(dim=(1, 2, 3))  # [B]
    expected = 10 * torch.log10(2.0**2 / mse)
    got = M.psnr(a, b)
    assert got.shape == (4,)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)  # torchmetrics: log10(range) in float32
    # a constant offset of 0.02 on a [-1, 1] range: MSE 4e-4 -> exactly 40 dB
    z = torch.zeros(2, 1, 8, 8, dtype=torch.float64)
    torch.testing.assert_close(M.psnr(z, z + 0.02), torch.full((2,), 40.0, dtype=torch.float64))


def test_ssim_identical_is_one_and_decreases_with_noise():
    x = _images(3, 2, channels=3)
    torch.testing.assert_close(M.ssim(x, x), torch.ones(3, dtype=torch.float64), rtol=0, atol=1e-6)
    s = [M.ssim(x, _noised(x, sigma)) for sigma in (0.02, 0.1, 0.4)]
    assert all(v.shape == (3,) for v in s)
    assert bool((s[0] > s[1]).all() and (s[1] > s[2]).all()) and bool((s[0] < 1).all())


def test_paired_metrics_check_inputs():
    x = _images(2, 0)
    with pytest.raises(ValueError, match="equal shapes"):
        M.psnr(x, x[:1])
    with pytest.raises(ValueError, match="floating point"):
        M.ssim(x.to(torch.uint8), x.to(torch.uint8))
    with pytest.raises(ValueError, match=r"\[B, C, H, W\]"):
        M.psnr(x[0], x[0])
    with pytest.raises(ValueError, match="kernel_size"):
        M.ssim(x[..., :8, :8], x[..., :8, :8])


# ---------------------------------------------------------------- Frechet distance
def _exact_moments(n: int, mean: np.ndarray, cov: np.ndarray, seed: int) -> np.ndarray:
    """Samples whose empirical mean and unbiased covariance equal ``mean`` and ``cov`` exactly."""
    z = np.random.default_rng(seed).standard_normal((n, len(mean)))
    z -= z.mean(axis=0)
    z = z @ np.linalg.inv(np.linalg.cholesky(np.cov(z, rowvar=False))).T  # empirical cov = I
    return z @ np.linalg.cholesky(cov).T + mean


def _closed_form(mu1, s1, mu2, s2) -> float:
    """||mu1 - mu2||^2 + tr(S1 + S2 - 2 (S1^1/2 S2 S1^1/2)^1/2), all symmetric."""
    w, v = np.linalg.eigh(s1)
    r = (v * np.sqrt(w)) @ v.T
    cross = np.sqrt(np.clip(np.linalg.eigvalsh(r @ s2 @ r), 0, None)).sum()
    return float(((mu1 - mu2) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * cross)


@pytest.mark.parametrize("method", ["auto", "sqrtm"])
def test_frechet_identity_covariances_is_squared_mean_distance(method):
    d = 5
    mu1, mu2 = np.zeros(d), np.array([1.0, -2.0, 0.5, 0.0, 3.0])
    a = _exact_moments(200, mu1, np.eye(d), 0)
    b = _exact_moments(300, mu2, np.eye(d), 1)
    assert F.frechet_distance(a, b, method=method) == pytest.approx(float(((mu1 - mu2) ** 2).sum()), abs=1e-8)
    assert F.frechet_distance(torch.from_numpy(a), torch.from_numpy(a), method=method) == pytest.approx(0, abs=1e-8)


@pytest.mark.parametrize("method", ["auto", "sqrtm"])
def test_frechet_matches_closed_form(method):
    d = 4
    rng = np.random.default_rng(7)
    mu1, mu2 = rng.standard_normal(d), rng.standard_normal(d)
    # diagonal covariances commute: FD = ||mu1 - mu2||^2 + sum (sqrt(s1) - sqrt(s2))^2
    s1, s2 = np.array([1.0, 4.0, 0.25, 2.0]), np.array([9.0, 1.0, 0.25, 0.5])
    a, b = _exact_moments(100, mu1, np.diag(s1), 2), _exact_moments(150, mu2, np.diag(s2), 3)
    expected = float(((mu1 - mu2) ** 2).sum() + ((np.sqrt(s1) - np.sqrt(s2)) ** 2).sum())
    assert F.frechet_distance(a, b, method=method) == pytest.approx(expected, rel=1e-9)
    # full, non-commuting covariances
    q1, q2 = rng.standard_normal((d, d)), rng.standard_normal((d, d))
    c1, c2 = q1 @ q1.T + 0.1 * np.eye(d), q2 @ q2.T + 0.1 * np.eye(d)
    a, b = _exact_moments(100, mu1, c1, 4), _exact_moments(120, mu2, c2, 5)
    assert F.frechet_distance(a, b, method=method) == pytest.approx(_closed_form(mu1, c1, mu2, c2), rel=1e-7)


def test_frechet_fewer_samples_than_dimensions():
    """Singular covariances (N <= D, as with 1280-d features): the SVD path agrees with an eigvals reference."""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal((6, 10)), rng.standard_normal((8, 10)) + 0.5
    s1, s2 = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    ev = np.linalg.eigvals(s1 @ s2)
    cross = np.sqrt(np.clip(ev.real, 0, None)).sum()
    expected = ((a.mean(0) - b.mean(0)) ** 2).sum() + np.trace(s1) + np.trace(s2) - 2 * cross
    assert F.frechet_distance(a, b) == pytest.approx(expected, rel=1e-8)
    assert F.frechet_distance(a, a) == pytest.approx(0, abs=1e-9)
    assert F.frechet_distance(a, b, method="sqrtm") == pytest.approx(expected, rel=1e-3)


def test_frechet_checks_inputs():
    x = np.zeros((4, 3))
    with pytest.raises(ValueError, match="N >= 2"):
        F.frechet_distance(x[:1], x)
    with pytest.raises(ValueError, match="dimensions differ"):
        F.frechet_distance(x, np.zeros((4, 2)))
    with pytest.raises(ValueError, match="method"):
        F.frechet_distance(x, x, method="exact")
    with pytest.raises(ValueError, match="NaN"):
        F.frechet_distance(x, np.full((4, 3), np.nan))


# ---------------------------------------------------------------- EfficientNet-Lite0 features
def test_extractor_loads_offline_and_is_cached(monkeypatch):
    def no_network(*args, **kwargs):
        raise AssertionError("the EfficientNet-Lite0 extractor tried to open a network connection")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", no_network)
    F._load_effnet_lite0.cache_clear()
    fx = F.FeatureExtractor(batch_size=2)
    assert F.FeatureExtractor(batch_size=2).model is fx.model  # cached per process
    assert not fx.model.training and not any(p.requires_grad for p in fx.model.parameters())
    gray = _images(2, 3)
    f = fx(gray)
    assert f.shape == (2, 1280) and f.dtype == torch.float32 and torch.isfinite(f).all()
    torch.testing.assert_close(fx(gray.repeat(1, 3, 1, 1)), f)  # grayscale is repeated to 3 channels
    assert fx.preprocess(gray).shape == (2, 3, 224, 224)


def test_extractor_errors(tmp_path):
    with pytest.raises(M.MissingWeightsError, match="not found"):
        F.FeatureExtractor(weights_path=tmp_path / "missing.pth")
    fx = F.FeatureExtractor()
    with pytest.raises(ValueError, match="1 or 3 channels"):
        fx(torch.zeros(2, 2, 8, 8))


def test_packaged_weights_are_a_plain_state_dict():
    state = torch.load(weights.default_effnet_lite0_weights(), map_location="cpu", weights_only=True)
    assert len(state) == 296 and state["_conv_head.weight"].shape == (1280, 320, 1, 1)


def test_fd_effnet_lite0_self_and_noised():
    x = _images(N_IMG, 4, channels=3)
    fd_self = M.fd_effnet_lite0(x, x, batch_size=N_IMG)
    fd_noise = M.fd_effnet_lite0(x, _noised(x, 0.3), batch_size=N_IMG)
    assert fd_self == pytest.approx(0.0, abs=1e-6)
    assert fd_noise > 1.0 and math.isfinite(fd_noise)


def test_compute_quality_keys_and_values():
    base = _images(N_IMG, 5)
    merged = _noised(base, 0.1)
    q = M.compute_quality(base, merged, reference_images=base, batch_size=N_IMG)
    assert set(q) == {"psnr", "ssim", "feat_cos_dist", "fd_effnetlite0", "fd_effnetlite0_ref",
                      "fd_effnetlite0_ref_baseline", "n_images"}
    assert q["psnr"] == pytest.approx(float(M.psnr(base, merged).mean()))
    assert q["ssim"] == pytest.approx(float(M.ssim(base, merged).mean()))
    assert 0 < q["ssim"] < 1 and 0 < q["feat_cos_dist"] < 1 and q["n_images"] == N_IMG
    assert q["fd_effnetlite0"] > 0 and q["fd_effnetlite0_ref"] == pytest.approx(q["fd_effnetlite0"], rel=1e-6)
    assert q["fd_effnetlite0_ref_baseline"] == pytest.approx(0.0, abs=1e-6)
    assert all(k in M.QUALITY_LABELS for k in q)
    assert M.FD_LABEL == "FD-EffNetLite0" and "FID" not in M.QUALITY_LABELS["fd_effnetlite0"]


def test_missing_weights_message_names_the_metric_that_needs_none():
    with pytest.raises(M.MissingWeightsError, match=f"tomerge never downloads .*; {M.FD_LABEL} works offline"):
        weights.require_path(None, "metrics.clip_model", "CLIP score")


# ---------------------------------------------------------------- opt-in FID / CLIP: never download
@pytest.mark.parametrize("weights", [None, "/nonexistent/pt_inception-2015-12-05-6726825d.pth"])
def test_fid_without_weights_names_the_option(weights):
    x = _images(2, 0)
    with pytest.raises(M.MissingWeightsError, match="metrics.fid_weights"):
        M.fid(x, x, inception_weights=weights)


@pytest.mark.parametrize("path", [None, "/nonexistent/clip-vit-base-patch16"])
def test_clip_score_without_weights_names_the_option(path):
    with pytest.raises(M.MissingWeightsError, match="metrics.clip_model"):
        M.clip_score(_images(2, 0), ["a shoe", "a bag"], clip_model_path=path)


def test_compute_quality_opt_in_metrics_need_their_inputs(tmp_path):
    x = _images(2, 0)
    with pytest.raises(ValueError, match="reference_images"):
        M.compute_quality(x, x, fid_weights=tmp_path)
    assert issubclass(M.MissingWeightsError, FileNotFoundError)


def test_clip_score_is_100_times_the_clamped_cosine_of_the_projected_embeddings():
    """Known answer from the CLIP towers themselves: pooled outputs, projections, unit vectors,
    ``max(100 cos, 0)`` per image, mean over images (Hessel et al. 2021)."""
    from helpers import local_pipelines
    from transformers import CLIPModel, CLIPProcessor

    folder = local_pipelines.clip_folder()
    images = _images(4, 3, channels=3)
    prompts = ["a red shoe", "a bag on a chair", "two dogs", "a shirt with stripes"]
    model = CLIPModel.from_pretrained(folder, local_files_only=True).eval()
    processor = CLIPProcessor.from_pretrained(folder, local_files_only=True)
    uint8 = ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
    inputs = processor(text=prompts, images=list(uint8), return_tensors="pt", padding=True)
    with torch.no_grad():
        image = model.visual_projection(model.vision_model(pixel_values=inputs["pixel_values"]).pooler_output)
        text = model.text_projection(model.text_model(input_ids=inputs["input_ids"],
                                                      attention_mask=inputs["attention_mask"]).pooler_output)
    cos = torch.nn.functional.cosine_similarity(image, text, dim=-1)  # [4]
    expected = (100 * cos).clamp_min(0).mean().item()
    assert float(M.clip_score(images, prompts, folder, batch_size=3).mean()) == pytest.approx(expected, rel=1e-5, abs=1e-4)
    assert float(M.clip_score(images[:1], prompts[0], folder)[0]) == pytest.approx(max(100 * cos[0].item(), 0), abs=1e-4)
