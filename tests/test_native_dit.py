"""The native timm-based DiT, the IDX/Fashion-MNIST reader, the sampler and the training script."""

from __future__ import annotations

import gzip
import json
import shutil
import struct

import pytest
import torch

from tomerge.backbones.timm_dit import DiT, DiTConfig, get_2d_sincos_pos_embed, load_dit, save_dit
from tomerge.experiments.sources.data import FashionMNIST, read_idx, write_idx
from tomerge.experiments.sources.sampling import sample

TINY = DiTConfig(input_size=8, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                 num_classes=10, class_dropout_prob=0.1, learn_sigma=False)


def _randomize(model: DiT) -> DiT:
    """Non-zero weights everywhere (the DiT init zeroes the adaLN and output layers)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def _original_dit_keys(depth: int) -> set[str]:
    """State-dict names of facebookresearch/DiT models.py (DiT class), written out by hand."""
    keys = {
        "pos_embed",
        "x_embedder.proj.weight", "x_embedder.proj.bias",
        "t_embedder.mlp.0.weight", "t_embedder.mlp.0.bias", "t_embedder.mlp.2.weight", "t_embedder.mlp.2.bias",
        "y_embedder.embedding_table.weight",
        "final_layer.linear.weight", "final_layer.linear.bias",
        "final_layer.adaLN_modulation.1.weight", "final_layer.adaLN_modulation.1.bias",
    }
    for i in range(depth):
        for name in ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2", "adaLN_modulation.1"):
            keys |= {f"blocks.{i}.{name}.weight", f"blocks.{i}.{name}.bias"}
    return keys


def test_shapes_and_learn_sigma():
    model = DiT(TINY)
    x, t, y = torch.randn(3, 1, 8, 8), torch.rand(3), torch.tensor([0, 5, 10])  # 10 = null class
    assert model(x, t, y).shape == (3, 1, 8, 8)
    wide = DiT(DiTConfig(input_size=8, patch_size=2, in_channels=2, hidden_size=32, depth=1, num_heads=2,
                         num_classes=4, learn_sigma=True))
    assert wide(torch.randn(2, 2, 8, 8), torch.rand(2), torch.tensor([0, 4])).shape == (2, 4, 8, 8)


def test_non_square_input_and_wrong_size_error():
    cfg = DiTConfig(input_size=(8, 12), patch_size=2, in_channels=1, hidden_size=32, depth=1, num_heads=2, num_classes=3,
                    learn_sigma=False)
    model = _randomize(DiT(cfg))
    assert model.pos_embed.shape == (1, 4 * 6, 32)
    assert model(torch.randn(2, 1, 8, 12), torch.rand(2), torch.tensor([0, 1])).shape == (2, 1, 8, 12)
    with pytest.raises(ValueError, match="pos_embed is for 8x12"):
        model(torch.randn(2, 1, 12, 8), torch.rand(2), torch.tensor([0, 1]))


def test_pos_embed_matches_original_square_formula():
    # The original numpy code: grid = meshgrid(w, h); first half of channels from grid[0] (column index).
    emb = get_2d_sincos_pos_embed(8, (3, 3))  # [9, 8]
    omega = 1.0 / 10000 ** (torch.arange(2, dtype=torch.float64) / 2.0)
    col = torch.tensor([0, 1, 2] * 3, dtype=torch.float64)
    row = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2], dtype=torch.float64)
    ref = torch.cat([torch.sin(col[:, None] * omega), torch.cos(col[:, None] * omega),
                     torch.sin(row[:, None] * omega), torch.cos(row[:, None] * omega)], dim=1)
    torch.testing.assert_close(emb, ref.float())


def test_state_dict_layout_matches_original_dit():
    model = DiT(TINY)
    assert set(model.state_dict()) == _original_dit_keys(TINY.depth)
    assert model.y_embedder.embedding_table.weight.shape == (TINY.num_classes + 1, TINY.hidden_size)
    assert "pos_embed" not in dict(model.named_parameters())  # fixed, never trained
    xl = DiTConfig.preset("DiT-XL/2")
    assert (xl.hidden_size, xl.depth, xl.num_heads, xl.patch_size, xl.in_channels, xl.learn_sigma) == (1152, 28, 16, 2, 4, True)
    ref = DiTConfig.preset("reference")
    assert ref.grid_hw == (16, 16) and ref.in_channels == 1 and ref.num_classes == 10 and not ref.learn_sigma


def test_zero_init_output_is_zero():
    model = DiT(TINY)
    out = model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([1, 2]))
    assert torch.count_nonzero(out) == 0


def test_safetensors_round_trip_and_errors(tmp_path):
    model = _randomize(DiT(TINY)).eval()
    path = tmp_path / "dit.safetensors"
    save_dit(model, path)
    loaded = load_dit(path)
    assert loaded.config == TINY
    x, t, y = torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([3, 10])
    torch.testing.assert_close(loaded(x, t, y), model(x, t, y), rtol=0, atol=0)
    # a plain .pt state dict (as the original DiT release) loads with an explicit config or inferred shapes
    torch.save(model.state_dict(), tmp_path / "dit.pt")
    torch.testing.assert_close(load_dit(tmp_path / "dit.pt", TINY)(x, t, y), model(x, t, y), rtol=0, atol=0)
    assert load_dit(tmp_path / "dit.pt").config.hidden_size == 32
    with pytest.raises(FileNotFoundError, match="not found"):
        load_dit(tmp_path / "missing.safetensors")
    with pytest.raises(ValueError, match="missing keys"):
        load_dit(path, config=DiTConfig(**{**TINY.to_dict(), "depth": 3}))


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


def test_sampler_deterministic_and_shape():
    model = _randomize(DiT(TINY))
    labels = torch.tensor([0, 1, 2])
    a = sample(model, labels, num_steps=3, cfg_scale=2.0, generator=torch.Generator().manual_seed(7))
    b = sample(model, labels, num_steps=3, cfg_scale=2.0, generator=torch.Generator().manual_seed(7))
    c = sample(model, labels, num_steps=3, cfg_scale=2.0, generator=torch.Generator().manual_seed(8))
    assert a.shape == (3, 1, 8, 8) and a.min() >= -1 and a.max() <= 1
    assert torch.equal(a, b) and not torch.equal(a, c)
    # the zero-initialised model predicts v = 0, so the sample is the clamped initial noise
    noise = torch.randn((3, 1, 8, 8), generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(sample(DiT(TINY), labels, num_steps=2, generator=torch.Generator().manual_seed(7)),
                               noise.clamp(-1, 1))


def test_training_smoke_checkpoint_resume_export(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from tomerge.experiments.commands.train_reference import main

    data = tmp_path / "data"
    data.mkdir()
    _write_fake_fashion_mnist(data)
    out = tmp_path / "run"
    common = ["--data-root", str(data), "--out-dir", str(out), "--limit-images", "8", "--batch-size", "4",
              "--hidden-size", "32", "--depth", "2", "--num-heads", "2", "--threads", "1", "--wandb", "disabled",
              "--ckpt-every-steps", "2", "--export-every", "0", "--progress-refresh", "0", "--warmup-steps", "1"]
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


TINY_TRAIN = ["--limit-images", "8", "--batch-size", "4", "--hidden-size", "32", "--depth", "2",
              "--num-heads", "2", "--threads", "1", "--wandb", "disabled", "--progress-refresh", "0",
              "--warmup-steps", "1", "--export-every", "0"]


def test_an_interrupted_training_run_resumes_bit_identically(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from tomerge.experiments.commands.train_reference import main

    data = tmp_path / "data"
    data.mkdir()
    _write_fake_fashion_mnist(data)
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


def test_the_1024_token_preset_trains_exports_loads_and_samples(tmp_path):
    pytest.importorskip("pytorch_lightning")
    from tomerge.experiments.commands.train_reference import main

    data = tmp_path / "data"
    data.mkdir()
    _write_fake_fashion_mnist(data)
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
