"""The bundled reference checkpoint loads offline and generates garments, not noise."""

import pytest
import torch

from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.config.schema import REFERENCE_CHECKPOINT
from tomerge.experiments.sources.sampling import sample


def border_and_roughness(images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per image: fraction of the 2-pixel padding frame that is background (-1, as in every training
    image), and mean absolute difference of neighbouring pixels (noise is rough, garments are smooth)."""
    frame = torch.ones(images.shape[-2:], dtype=torch.bool)
    frame[2:-2, 2:-2] = False
    background = (images[:, 0][:, frame] < -0.8).float().mean(-1)  # [n]
    rough = (images[..., 1:, :] - images[..., :-1, :]).abs().mean((1, 2, 3))  # [n]
    return background, rough


@pytest.fixture(scope="module")
def generated():
    model = load_dit(REFERENCE_CHECKPOINT)
    labels = torch.arange(10)
    images = sample(model, labels, num_steps=12, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(10, 1, 32, 32, generator=torch.Generator().manual_seed(1)).clamp(-1, 1)
    return model, images, noise


def test_reference_checkpoint_loads_with_its_config(generated):
    model, images, _ = generated
    assert model.config.input_size == 32 and model.config.num_classes == 10
    assert images.shape == (10, 1, 32, 32) and torch.isfinite(images).all()


def test_samples_are_separated_from_noise_by_simple_statistics(generated):
    _, images, noise = generated
    bg_samples, rough_samples = border_and_roughness(images)
    bg_noise, rough_noise = border_and_roughness(noise)
    # A threshold halfway between the two populations separates every sample from every noise image.
    assert bg_samples.min() > 0.8 > bg_noise.max()
    assert rough_samples.max() < rough_noise.min()


def test_the_1024_token_reference_loads_and_samples_in_two_steps():
    """The second bundled model (docs/reference-model.md): the same network at 64 x 64, 32 x 32 = 1,024 tokens."""
    from tomerge.experiments.sources.reference_model import BUNDLED_REFERENCES

    model = load_dit(BUNDLED_REFERENCES["bundled-1024"])
    assert model.config.image_hw == (64, 64) and model.config.grid_hw == (32, 32) and model.config.num_classes == 10
    assert model.config.hidden_size == 192 and model.config.depth == 6  # the reference-1024 preset
    images = sample(model, torch.tensor([0, 7]), num_steps=2, cfg_scale=2.0, generator=torch.Generator().manual_seed(0))
    assert images.shape == (2, 1, 64, 64) and torch.isfinite(images).all()
