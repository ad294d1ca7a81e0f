"""The bundled timm-style DiT of the `native_dit` adapter (tomerge.backbones.timm_dit, backbones/native_dit.py): shapes,
the original DiT's positional embedding and state-dict layout, safetensors round trips, and the sampler
(tomerge.experiments.sources.sampling) on it. The reference model's data and training:
tests/experiments/test_reference_training.py."""

from __future__ import annotations

import pytest
import torch

from tomerge.backbones.timm_dit import DiT, DiTConfig, get_2d_sincos_pos_embed, load_dit, save_dit
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


