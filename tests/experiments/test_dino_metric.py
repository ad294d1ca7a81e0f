"""ToMA's DINO distance (``metrics.dino_model``): 1 - cos of DINO CLS embeddings, merged vs baseline image.

A tiny random-weight Dinov2 (2 layers, width 32, 28 x 28 input: 2 x 2 patches of 14) is saved with
``save_pretrained`` into a temporary folder and loaded with ``local_files_only=True``, as a researcher's
facebook/dinov2-base folder is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tomerge.experiments.generation.files import load_image_files
from tomerge.experiments.measure import metrics as M
from tomerge.experiments.measure.features import dino_embeddings
from tomerge.experiments.measure.image_sets import ImageSetQuality


@pytest.fixture(scope="module")
def dino_folder(tmp_path_factory) -> Path:
    from transformers import BitImageProcessor, Dinov2Config, Dinov2Model

    folder = tmp_path_factory.mktemp("tiny-dinov2")
    torch.manual_seed(0)
    config = Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                          image_size=28, patch_size=14)
    Dinov2Model(config).eval().save_pretrained(folder)
    # DINOv2's own processor settings, scaled down: resize the short side, centre crop, ImageNet statistics
    BitImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 28, "width": 28},
                      image_mean=[0.485, 0.456, 0.406], image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)
    return folder


def _images(n: int, seed: int, channels: int = 3, size: int = 40) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    low = torch.rand(n, channels, 5, 5, generator=g) * 2 - 1
    return torch.nn.functional.interpolate(low, size=(size, size), mode="bilinear", align_corners=False)


def test_identical_images_are_at_distance_zero(dino_folder):
    x = _images(3, 0)
    d = M.dino_distance(x, x, dino_folder, batch_size=2)
    assert d.shape == (3,)
    torch.testing.assert_close(d, torch.zeros(3, dtype=torch.float64), rtol=0, atol=1e-6)
    gray = _images(2, 1, channels=1)  # grayscale is repeated to RGB
    assert float(M.dino_distance(gray, gray, dino_folder).max()) < 1e-6


def test_distance_is_one_minus_cosine_of_the_cls_tokens(dino_folder):
    """Known answer from the model itself: processor, forward, CLS token of the last hidden state."""
    from transformers import AutoImageProcessor, AutoModel

    a, b = _images(2, 2), _images(2, 3)
    model = AutoModel.from_pretrained(dino_folder, local_files_only=True).eval()
    processor = AutoImageProcessor.from_pretrained(dino_folder, local_files_only=True)

    def cls(images: torch.Tensor) -> torch.Tensor:
        uint8 = ((images + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)
        pixels = processor(images=list(uint8), return_tensors="pt")["pixel_values"]
        with torch.no_grad():
            return model(pixel_values=pixels).last_hidden_state[:, 0]  # [n, 32]

    ea, eb = cls(a), cls(b)
    expected = 1 - (ea * eb).sum(-1) / (ea.norm(dim=-1) * eb.norm(dim=-1))  # [2]
    got = M.dino_distance(a, b, dino_folder)
    assert float(expected.min()) > 1e-4  # really different images
    torch.testing.assert_close(got.float(), expected, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dino_embeddings(a, dino_folder), ea, rtol=1e-5, atol=1e-6)
    q = M.compute_quality(a, b, dino_model_path=dino_folder, batch_size=2)
    assert q["dino_dist"] == pytest.approx(float(expected.mean()), rel=1e-4)
    assert "dino_dist" in M.QUALITY_LABELS


@pytest.mark.parametrize("path", [None, "/nonexistent/dinov2-base"])
def test_missing_weights_name_the_option(path):
    with pytest.raises(M.MissingWeightsError, match="metrics.dino_model"):
        M.dino_distance(_images(1, 0), _images(1, 0), path)


def test_config_refuses_a_missing_or_unloadable_folder_before_any_work(tmp_path, dino_folder):
    from tomerge.experiments.config.load import load_config
    from tomerge.experiments.config.schema import ConfigError
    from tomerge.experiments.errors import UserError

    runs = tmp_path / "runs"
    base = [f"out_dir={runs}", "wandb=disabled"]
    with pytest.raises(ConfigError, match=r"metrics\.dino_model.*/nonexistent/dinov2"):
        load_config(None, base + ["metrics.dino_model=/nonexistent/dinov2"])
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=rf"metrics\.dino_model {empty}"):
        load_config(None, base + [f"metrics.dino_model={empty}"])
    not_dino = tmp_path / "not-dino"  # a loadable config of another model type
    not_dino.mkdir()
    (not_dino / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (not_dino / "preprocessor_config.json").write_text((dino_folder / "preprocessor_config.json").read_text())
    with pytest.raises(ConfigError, match="not a DINO ViT"):
        load_config(None, base + [f"metrics.dino_model={not_dino}"])
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    for name in ("config.json", "preprocessor_config.json"):
        (no_weights / name).write_text((dino_folder / name).read_text())
    with pytest.raises(ConfigError, match="no weights file"):
        load_config(None, base + [f"metrics.dino_model={no_weights}"])
    assert not runs.exists()  # nothing was generated; each problem is one line of one ConfigError
    assert issubclass(ConfigError, UserError) and issubclass(M.MissingWeightsError, UserError)  # the command line reports it without a traceback


def test_video_frames_are_paired_with_the_same_frame_of_the_baseline(tmp_path, dino_folder):
    from tomerge.experiments.generation.generate import save_video

    g = torch.Generator().manual_seed(0)
    base = torch.rand(2, 3, 3, 28, 28, generator=g) * 2 - 1  # [videos, T, C, H, W]
    changed = base.clone()
    changed[0, 1] = -changed[0, 1]  # only frame 1 of video 0 differs
    for name, videos in (("base", base), ("run", changed)):
        (tmp_path / name).mkdir()
        for v in range(2):
            save_video(videos[v], tmp_path / name / f"{v:05d}_seed{v}")
    base_files = sorted((tmp_path / "base").iterdir())
    quality = ImageSetQuality(base_files, dino_model=dino_folder, batch_size=4)
    assert quality.baseline_dino.shape == (6, 32)  # one CLS embedding per frame
    same, other = quality.score(base_files), quality.score(sorted((tmp_path / "run").iterdir()))
    assert same["dino_dist"] == pytest.approx(0.0, abs=1e-6) and same["dino_dist_per_frame"] == [0.0] * 3
    per_frame = other["dino_dist_per_frame"]
    assert per_frame[0] == pytest.approx(0.0, abs=1e-6) and per_frame[2] == pytest.approx(0.0, abs=1e-6)
    assert per_frame[1] > 1e-4 and other["dino_dist"] == pytest.approx(per_frame[1] / 3)


def test_ablate_records_the_dino_distance(tmp_path, dino_folder):
    from helpers.tiny_reference import write_tiny_dit
    from tomerge.experiments.figures.canvas import METRICS
    from tomerge.experiments.figures.run_data import load_run
    from tomerge.experiments.figures.tables import ablation_table
    from tomerge.experiments.runs.ablation import run_ablation
    from tomerge.experiments.config.load import load_config
    from tomerge.experiments.runs.records import TABLE_COLUMNS

    write_tiny_dit(tmp_path / "tiny.safetensors")
    overrides = [f"model.reference={tmp_path / 'tiny.safetensors'}", "model.call.num_steps=2",
                 f"out_dir={tmp_path / 'runs'}", "name=dino", "classes=[0]", "per_class=2", "batch_size=2",
                 "timing_batch=1", "warmup=0", "repeats=1", "fd_reference_images=0", "wandb=disabled",
                 f"metrics.dino_model={dino_folder}",
                 "grid=[{strategy: tomesd, ratios: [0.75], options: {use_rand: false}}]"]
    folder = run_ablation(load_config(None, overrides), progress=False).path
    rows = [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]
    baseline, merged = rows
    assert baseline["dino_dist"] == pytest.approx(0.0, abs=1e-6)
    files = {r: sorted((folder / "images" / r).glob("*.png")) for r in ("baseline", merged["run"])}
    expected = M.dino_distance(load_image_files(files["baseline"]), load_image_files(files[merged["run"]]),
                               dino_folder).mean()
    assert merged["dino_dist"] == pytest.approx(float(expected), rel=1e-5, abs=1e-7)
    assert merged["dino_dist"] > 0 and merged["psnr"] < 100  # merging changed the images
    title = dict(TABLE_COLUMNS)["dino_dist"]
    assert title in (folder / "table.md").read_text()
    assert "dino_dist" in METRICS and not METRICS["dino_dist"][1]  # lower is better
    assert "DINO dist" in ablation_table([load_run(folder)])
