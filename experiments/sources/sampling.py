"""Euler sampler for rectified-flow class-conditional models with classifier-free guidance.

Rectified flow as in SD3: ``x_t = (1 - t) * x0 + t * noise`` with ``t`` in ``[0, 1]``; the model
predicts the velocity ``v = noise - x0`` (``dx_t/dt``). Sampling integrates from ``t = 1`` (noise) to
``t = 0`` (data) with Euler steps. Guidance batches the conditional and the unconditional (null
class) inputs in one forward call: ``[cond; uncond]``.

Example:
    >>> from tomerge.backbones.timm_dit import load_dit
    >>> from tomerge.experiments.sources.models import REFERENCE_CHECKPOINT   # the bundled reference DiT
    >>> model = load_dit(REFERENCE_CHECKPOINT)                                       # doctest: +SKIP
    >>> g = torch.Generator().manual_seed(0)
    >>> images = sample(model, torch.arange(10), num_steps=20, cfg_scale=2.0, generator=g)  # doctest: +SKIP
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

__all__ = ["flow_timesteps", "sample"]


def flow_timesteps(num_steps: int, shift: float = 1.0, device: torch.device | str = "cpu") -> Tensor:
    """``num_steps + 1`` times from 1 to 0; ``shift > 1`` spends more steps at high noise (SD3's shift).

    ``t' = shift * t / (1 + (shift - 1) * t)``.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, device=device)
    return shift * t / (1 + (shift - 1) * t)


@torch.no_grad()
def sample(
    model: nn.Module,
    labels: Tensor | Sequence[int],
    num_steps: int = 20,
    cfg_scale: float = 1.5,
    generator: torch.Generator | None = None,
    image_size: int | tuple[int, int] | None = None,
    in_channels: int | None = None,
    null_class: int | None = None,
    shift: float = 1.0,
    noise: Tensor | None = None,
    progress: bool = False,
) -> Tensor:
    """Draw images with Euler steps of the probability-flow ODE.

    Args:
        model: ``model(x [B, C, H, W], t [B] in [0, 1], y [B] long) -> velocity [B, C(or 2C), H, W]``
            (a native DiT; with ``learn_sigma`` the first ``C`` channels are used).
        labels: ``[B]`` class indices.
        num_steps: Euler steps (model calls per image, doubled in batch by guidance).
        cfg_scale: guidance scale ``s``: ``v = v_uncond + s * (v_cond - v_uncond)``; 1 disables the
            unconditional branch.
        generator: RNG for the initial noise; the result is deterministic for a given seed.
        image_size: ``H`` or ``(H, W)``; defaults to ``model.config.input_size``.
        in_channels: defaults to ``model.config.in_channels``.
        null_class: label of the unconditional branch; defaults to ``model.config.num_classes``.
        shift: timestep shift (1 = uniform steps).
        noise: optional initial noise ``[B, C, H, W]`` (overrides ``generator``).
        progress: show a tqdm bar.

    Returns:
        ``[B, C, H, W]`` images, clamped to ``[-1, 1]``, on the model's device, float32.
    """
    param = next(model.parameters())
    device, dtype = param.device, param.dtype
    config = getattr(model, "config", None)
    labels = torch.as_tensor(labels, dtype=torch.long, device=device).reshape(-1)  # [B]
    batch = labels.shape[0]
    if image_size is None:
        if config is None:
            raise ValueError("pass image_size= (the model has no .config)")
        image_size = config.input_size
    h, w = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    if in_channels is None:
        if config is None:
            raise ValueError("pass in_channels= (the model has no .config)")
        in_channels = config.in_channels
    if null_class is None:
        if config is None and cfg_scale != 1.0:
            raise ValueError("pass null_class= for classifier-free guidance (the model has no .config)")
        null_class = config.num_classes if config is not None else -1
    if noise is None:
        noise = torch.randn((batch, in_channels, h, w), generator=generator, dtype=torch.float32,
                            device=generator.device if generator is not None else "cpu")
    elif noise.shape != (batch, in_channels, h, w):
        raise ValueError(f"noise must have shape {(batch, in_channels, h, w)}, got {tuple(noise.shape)}")
    x = noise.to(device=device, dtype=torch.float32)  # [B, C, H, W]

    guided = cfg_scale != 1.0
    y = torch.cat([labels, torch.full_like(labels, null_class)]) if guided else labels  # [2B] or [B]
    times = flow_timesteps(num_steps, shift).tolist()
    was_training = model.training
    model.eval()
    steps = range(num_steps)
    if progress:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="sampling", leave=False)
    try:
        for i in steps:
            t, t_next = times[i], times[i + 1]
            x_in = torch.cat([x, x]) if guided else x  # [2B or B, C, H, W]
            t_in = torch.full((x_in.shape[0],), t, device=device, dtype=torch.float32)
            v = model(x_in.to(dtype), t_in, y).float()[:, :in_channels]  # [2B or B, C, H, W]
            if guided:
                v_cond, v_uncond = v.chunk(2)
                v = v_uncond + cfg_scale * (v_cond - v_uncond)
            x = x + (t_next - t) * v
    finally:
        model.train(was_training)
    return x.clamp(-1.0, 1.0)
