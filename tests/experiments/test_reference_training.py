"""The reference model's data and training (tomerge.experiments.sources.data, training and the `tomerge
train-reference` command): the IDX/Fashion-MNIST reader and the training script (checkpoints, resume, export, the
1024-token preset). The DiT itself and the sampler: tests/backbones/test_native_dit.py."""

from __future__ import annotations

import gzip
import json
import shutil
import struct

import pytest
import torch

from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.sources.data import FashionMNIST, read_idx, write_idx
from tomerge.experiments.sources.sampling import sample


def test_read_idx_gzip_and_raw(tmp_path):
    data = torch.arange(2 * 3 * 4, dtype=torch.uint8).reshape(2, 3, 4)
    raw = bytes([0, 0, 0x08, 3]) + struct.pack(">3I", 2, 3, 4) + data.numpy().tobytes()
    (tmp_path / "a-idx3-ubyte").write_bytes(raw)
    with gzip.open(tmp_path / "a-idx3-ubyte.gz", "wb") as f:
        f.write(raw)
    for name in ("a-idx3-ubyte", "a-idx3-ubyte.gz"):
        out = read_idx(tmp_path / name)
        assert out.dtype == torch.uint8 and torch.equal(out, data)
    write_idx(tmp_path / "b.gz", data)
    assert torch.equal(read_idx(tmp_path / "b.gz"), data)
    (tmp_path / "bad").write_bytes(b"\x12\x34\x08\x01")
    with pytest.raises(ValueError, match="not an IDX file"):
        read_idx(tmp_path / "bad")
    with pytest.raises(FileNotFoundError):
        read_idx(tmp_path / "nope")


def _write_fake_fashion_mnist(root, n: int = 8) -> None:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (n, 28, 28), generator=g, dtype=torch.uint8)
    labels = torch.arange(n, dtype=torch.uint8) % 10
    write_idx(root / "train-images-idx3-ubyte.gz", images)
    write_idx(root / "train-labels-idx1-ubyte.gz", labels)


TINY_TRAIN = ["--limit-images", "8", "--batch-size", "4", "--hidden-size", "32", "--depth", "2",
              "--num-heads", "2", "--threads", "1", "--wandb", "disabled", "--progress-refresh", "0",
              "--warmup-steps", "1", "--export-every", "0"]


@pytest.fixture
def train(tmp_path):
    """The `tomerge train-reference` entry point and a folder of 8 fake Fashion-MNIST training images."""
    pytest.importorskip("pytorch_lightning")
    from tomerge.experiments.commands.train_reference import main

    data = tmp_path / "data"
    data.mkdir()
    _write_fake_fashion_mnist(data)
    return main, data


def test_fashion_mnist_dataset(tmp_path):
    _write_fake_fashion_mnist(tmp_path)
    ds = FashionMNIST(tmp_path, limit=5)
    assert len(ds) == 5
    image, label = ds[3]
    assert image.shape == (1, 32, 32) and label.dtype == torch.long and int(label) == 3
    assert image.min() >= -1 and image.max() <= 1
    assert torch.all(image[:, :2] == -1) and torch.all(image[:, :, -2:] == -1)  # padding is background
    with pytest.raises(FileNotFoundError, match="pass root=DIR"):  # the Python argument; callers name their own
        FashionMNIST(tmp_path, split="test")
    with pytest.raises(FileNotFoundError, match="pass --data-root DIR"):
        FashionMNIST(tmp_path, split="test", root_hint="pass --data-root DIR")


def test_training_smoke_checkpoint_resume_export(train, tmp_path):
    main, data = train
    out = tmp_path / "run"
    common = ["--data-root", str(data), "--out-dir", str(out), *TINY_TRAIN, "--ckpt-every-steps", "2"]
    assert main(common + ["--max-steps", "2"]) == 0
    assert (out / "last.ckpt").is_file()
    assert torch.load(out / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 2
    # resumed in a copied folder, the run overwrites last.ckpt (no last-v1.ckpt that --resume would not read)
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    assert main([a if a != str(out) else str(copy) for a in common] + ["--max-steps", "3", "--resume"]) == 0
    assert torch.load(copy / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in copy.glob("last*.ckpt")) == ["last.ckpt"]
    assert main(common + ["--max-steps", "3", "--resume"]) == 0
    assert torch.load(out / "last.ckpt", map_location="cpu", weights_only=True)["global_step"] == 3
    assert (out / "dit_reference_ema.safetensors").is_file()  # written at the end of training
    target = tmp_path / "export" / "ref.safetensors"
    assert main(["--out-dir", str(out), "--export", str(target)]) == 0
    info = json.loads(target.with_suffix(".json").read_text())
    assert info["steps"] == 3 and info["config"]["hidden_size"] == 32 and info["final_loss"] > 0
    model = load_dit(target)
    assert model(torch.randn(1, 1, 32, 32), torch.rand(1), torch.tensor([1])).shape == (1, 1, 32, 32)
    # A fresh out-dir warm-started from the exported weights: with lr 0 nothing moves, so the
    # weights it exports are exactly the ones it started from.
    warm = [a if a != str(out) else str(tmp_path / "warm") for a in common]
    assert main(warm + ["--max-steps", "1", "--lr", "0", "--init-from", str(target)]) == 0
    again = tmp_path / "export" / "warm.safetensors"
    assert main(["--out-dir", str(tmp_path / "warm"), "--export", str(again)]) == 0
    start, end = load_dit(target).state_dict(), load_dit(again).state_dict()
    assert all(torch.equal(start[k], end[k]) for k in start)


def test_the_training_command_line_is_the_train_reference_command():
    """The library (sources.training) trains from plain values; its command line is commands.train_reference,
    run as ``python -m`` like ``tomerge train-reference``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tomerge.experiments.commands.train_reference", "--help"],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert out.startswith("usage: python -m tomerge.experiments.commands.train_reference")
    assert "--resume [CKPT]" in out and "Train the bundled reference model" in out


def test_fashion_mnist_at_64_keeps_the_garment_at_the_same_fraction_of_the_frame(tmp_path):
    _write_fake_fashion_mnist(tmp_path)
    small, big = FashionMNIST(tmp_path, size=32), FashionMNIST(tmp_path, size=64)
    image, label = big[3]
    assert image.shape == (1, 64, 64) and int(label) == int(small[3][1])
    assert torch.all(image[:, :4] == -1) and torch.all(image[:, -4:] == -1)  # 2 k pixels of background
    assert torch.all(image[:, :, :4] == -1) and torch.all(image[:, :, -4:] == -1)
    # a constant garment stays constant under bilinear upsampling
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", torch.full((8, 28, 28), 200, dtype=torch.uint8))
    flat = FashionMNIST(tmp_path, size=64, limit=2).images
    assert torch.all(flat[:, 4:60, 4:60] == 200) and torch.all(flat[:, :4] == 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        FashionMNIST(tmp_path, size=48)


def test_epoch_permutations_resume_where_the_uninterrupted_order_is():
    from tomerge.experiments.sources.training import EpochPermutations

    full = EpochPermutations(10, 3, seed=5)  # 3 batches per epoch, image 9 of each permutation dropped
    uninterrupted = [b for _ in range(3) for b in full]  # 3 epochs, 9 batches
    assert len(full) == 3 and len(uninterrupted) == 9
    for epoch in range(3):
        seen = [i for b in uninterrupted[3 * epoch:3 * epoch + 3] for i in b]
        assert len(set(seen)) == 9  # each epoch: distinct images ...
    assert uninterrupted[:3] != uninterrupted[3:6]  # ... in a new order
    for step in (0, 2, 3, 4, 8):
        resumed = EpochPermutations(10, 3, seed=5, start_batch=step)
        batches = [b for _ in range(3) for b in resumed]
        assert batches[:9 - step] == uninterrupted[step:]


def test_an_interrupted_training_run_resumes_bit_identically(train, tmp_path):
    main, data = train
    common = ["--data-root", str(data), *TINY_TRAIN, "--ckpt-every-steps", "1000"]
    assert main(common + ["--out-dir", str(tmp_path / "a"), "--max-steps", "5"]) == 0
    assert main(common + ["--out-dir", str(tmp_path / "b"), "--max-steps", "3"]) == 0  # stops mid-epoch 1 (2 per epoch)
    assert main(common + ["--out-dir", str(tmp_path / "b"), "--max-steps", "5", "--resume"]) == 0
    a = torch.load(tmp_path / "a" / "last.ckpt", map_location="cpu", weights_only=True)
    b = torch.load(tmp_path / "b" / "last.ckpt", map_location="cpu", weights_only=True)
    assert a["global_step"] == b["global_step"] == 5
    assert a["state_dict"].keys() == b["state_dict"].keys()
    assert all(torch.equal(a["state_dict"][k], b["state_dict"][k]) for k in a["state_dict"])  # model and EMA
    moments = [s for o in (a, b) for s in o["optimizer_states"][0]["state"].values()]
    assert moments and all(torch.equal(x["exp_avg"], y["exp_avg"]) for x, y in zip(moments[:len(moments) // 2],
                                                                                 moments[len(moments) // 2:]))


def test_the_1024_token_preset_trains_exports_loads_and_samples(train, tmp_path):
    main, data = train
    out = tmp_path / "run"
    args = ["--data-root", str(data), "--out-dir", str(out), "--preset", "reference-1024", *TINY_TRAIN,
            "--max-steps", "1"]
    assert main(args) == 0
    target = tmp_path / "dit_1024.safetensors"
    assert main(["--out-dir", str(out), "--export", str(target)]) == 0
    model = load_dit(target)
    assert model.config.image_hw == (64, 64) and model.config.grid_hw == (32, 32)  # 1,024 image tokens
    assert model.config.hidden_size == 32  # the override, on the preset's 64 x 64 input
    images = sample(model, torch.tensor([0, 7]), num_steps=2, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    assert images.shape == (2, 1, 64, 64) and torch.isfinite(images).all()
