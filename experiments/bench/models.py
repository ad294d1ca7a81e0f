"""The end-to-end benchmark's models (``tomerge bench --e2e --widths ...``): random-weight diffusers models
whose blocks see exactly ``N`` image tokens, at the widths that matter, with their call inputs
(:func:`build`, :class:`Bench`); what the sizes on a command line may be (:func:`check_sizes`).

The widths (model class, channels, heads, patch, text tokens) and how a video width's ``N`` is factored into
``(T, H, W)`` (:func:`video_grid`): docs/benchmarks.md, "What is measured" and "Video (Wan)".
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn
# torch and diffusers are imported in the functions that build models: `tomerge bench --help` and the
# constants below load without them.

VIDEO_WIDTHS = ("wan", "wan14b", "hunyuan_video")  # token count N = T * H * W, see video_grid
WIDTHS = ("sd3", "pixart", "dit", "flux", "unet", *VIDEO_WIDTHS)


@dataclasses.dataclass(frozen=True)
class WidthSpec:
    """The size of one model family in the benchmark."""

    family: str
    hidden: int
    heads: int
    text_tokens: int
    text_dim: int = 4096
    pooled_dim: int = 0
    ffn: int = 0  # feed-forward width where the family does not derive it from ``hidden`` (Wan)


FULL = {
    "sd3": WidthSpec("sd3", 1536, 24, 333, 4096, 2048),
    "pixart": WidthSpec("pixart", 1152, 16, 120, 4096),
    "dit": WidthSpec("dit", 1152, 16, 0),
    "flux": WidthSpec("flux", 3072, 24, 512, 4096, 768),
    "unet": WidthSpec("unet", 320, 8, 77, 768),
    "wan": WidthSpec("wan", 1536, 12, 512, 4096, ffn=8960),  # Wan2.1-T2V-1.3B
    "wan14b": WidthSpec("wan", 5120, 40, 512, 4096, ffn=13824),  # Wan2.1-T2V-14B
    "hunyuan_video": WidthSpec("hunyuan_video", 3072, 24, 256, 4096, 768),
}
QUICK = {  # tiny models of the same families (tests, smoke runs)
    "sd3": WidthSpec("sd3", 32, 2, 8, 24, 16),
    "pixart": WidthSpec("pixart", 32, 2, 8, 24),
    "dit": WidthSpec("dit", 32, 2, 0),
    "flux": WidthSpec("flux", 32, 2, 8, 24, 16),
    "unet": WidthSpec("unet", 32, 2, 8, 32),
    "wan": WidthSpec("wan", 32, 2, 8, 24, ffn=64),
    "wan14b": WidthSpec("wan", 64, 4, 8, 24, ffn=128),
    "hunyuan_video": WidthSpec("hunyuan_video", 64, 2, 8, 24, 16),
}


@dataclasses.dataclass
class Bench:
    """A model, its call inputs, and how to call it at a timestep."""

    name: str
    model: nn.Module
    inputs: dict[str, Any]
    latent_key: str
    time_key: str
    t_max: float
    spec: WidthSpec
    depth: int

    def call(self, latent: Tensor | None = None, t: float | None = None) -> Tensor:
        import torch

        kw = dict(self.inputs)
        if latent is not None:
            kw[self.latent_key] = latent
        if t is not None:
            ref = kw[self.time_key]
            kw[self.time_key] = torch.full_like(ref, t) if isinstance(ref, torch.Tensor) else t
        out = self.model(kw.pop(self.latent_key), **kw)  # positional, as tomesd's size hook reads args[0]
        return out.sample if hasattr(out, "sample") else out[0]

    def sample(self, steps: int) -> Tensor:
        """A ``steps``-step Euler loop from the input latent (velocity = the model output's first channels;
        image ``[B, C, H, W]`` and video ``[B, C, T, H, W]`` latents in the timestep's units, Flux's packed
        ``[B, N, C]`` in ``[0, 1]``)."""
        import torch

        x = self.inputs[self.latent_key]
        ts = torch.linspace(self.t_max, 0.0, steps + 1).tolist()
        for t, t_next in zip(ts[:-1], ts[1:]):
            v = self.call(x, t)
            x = x + (t_next - t) / self.t_max * v[:, : x.shape[1]] if x.dim() >= 4 else x + (t_next - t) * v
        return x


def build(width: str, tokens: int, depth: int, batch: int, quick: bool = False,
          text_tokens: int | None = None, dtype: torch.dtype | None = None,
          device: torch.device | str = "cpu", seed: int = 0, frames: int | None = None) -> Bench:
    """A random-weight model of ``width`` whose blocks see exactly ``tokens`` image tokens, with inputs.

    Args:
        width: one of :data:`WIDTHS` (see the module docstring).
        tokens: image tokens ``N``: a perfect square (UNet: tokens of its full-resolution blocks); video
            widths: ``T * H * W``, factored by :func:`video_grid`.
        depth: transformer blocks (Flux, HunyuanVideo: of each kind; UNet: layers per block, 1).
        batch: ``B``.
        quick: tiny widths instead of the real ones.
        text_tokens: override the width's default text length.
        dtype, device: where the model runs (``dtype`` default: float32).
        seed: weights and inputs.
        frames: video widths: the token grid's frames ``T`` (default: see :func:`video_grid`).
    """
    import torch

    dtype = torch.float32 if dtype is None else dtype
    if width not in WIDTHS:
        raise ValueError(f"unknown width {width!r}; choose from {WIDTHS}")
    if width in VIDEO_WIDTHS:
        size: int | tuple[int, int, int] = video_grid(tokens, frames)
    else:
        if frames is not None:
            raise ValueError(f"--frames is for the video widths {VIDEO_WIDTHS}, not {width!r}")
        size = math.isqrt(tokens)
        if size * size != tokens:
            raise ValueError(f"--tokens must be perfect squares for image widths, got {tokens}")
    spec = (QUICK if quick else FULL)[width]
    if text_tokens is not None:
        spec = dataclasses.replace(spec, text_tokens=text_tokens)
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed + 1)
    model, inputs, latent_key, time_key, t_max = _BUILDERS[width](spec, size, depth, batch, g)
    if dtype != torch.float32 or torch.device(device).type != "cpu":
        model = model.to(device=device, dtype=dtype)
    model = model.eval()
    keep = ("timestep", "img_ids", "txt_ids")  # stay fp32 (positions, timesteps)
    inputs = {k: v.to(device=device, dtype=dtype if v.is_floating_point() and k not in keep else v.dtype)
              if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    return Bench(width, model, inputs, latent_key, time_key, t_max, spec, depth)


WAN_LATENT_FRAMES = 21  # 81 video frames through Wan's VAE (temporal factor 4): (81 - 1) / 4 + 1
WAN_ASPECT = 832 / 480  # Wan's 480p landscape frame (W / H)


def video_grid(tokens: int, frames: int | None = None) -> tuple[int, int, int]:
    """The token grid ``(T, H, W)`` of ``tokens = T * H * W`` video tokens (after patchification).

    ``T`` is ``frames``, or else the largest divisor of ``tokens`` not above 21 (:data:`WAN_LATENT_FRAMES`);
    ``(H, W)`` is the factor pair of ``tokens / T`` with ``H <= W`` whose aspect ``W / H`` is closest (in
    log) to 832 / 480.

    Example:
        >>> video_grid(32760), video_grid(4096), video_grid(16384), video_grid(4096, frames=4)
        ((21, 30, 52), (16, 16, 16), (16, 32, 32), (4, 32, 32))
    """
    if tokens < 1:
        raise ValueError(f"--tokens must be positive, got {tokens}")
    if frames is None:
        frames = max(t for t in range(1, WAN_LATENT_FRAMES + 1) if tokens % t == 0)
    if frames < 1 or tokens % frames:
        raise ValueError(f"--frames {frames} does not divide --tokens {tokens} (N = T * H * W)")
    per_frame = tokens // frames
    pairs = [(h, per_frame // h) for h in range(1, math.isqrt(per_frame) + 1) if per_frame % h == 0]
    height, width = min(pairs, key=lambda hw: abs(math.log(hw[1] / hw[0] / WAN_ASPECT)))
    return frames, height, width


def _sd3(spec: WidthSpec, side: int, depth: int, batch: int, g: torch.Generator):
    import torch
    from diffusers import SD3Transformer2DModel

    head_dim = spec.hidden // spec.heads
    model = SD3Transformer2DModel(
        sample_size=2 * side, patch_size=2, in_channels=16, out_channels=16, num_layers=depth,
        attention_head_dim=head_dim, num_attention_heads=spec.heads, joint_attention_dim=spec.text_dim,
        caption_projection_dim=spec.hidden, pooled_projection_dim=spec.pooled_dim,
        pos_embed_max_size=max(96, side))
    inputs = dict(hidden_states=torch.randn(batch, 16, 2 * side, 2 * side, generator=g),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g),
                  pooled_projections=torch.randn(batch, spec.pooled_dim, generator=g),
                  timestep=torch.full((batch,), 500.0))
    return model, inputs, "hidden_states", "timestep", 1000.0


def _pixart(spec: WidthSpec, side: int, depth: int, batch: int, g: torch.Generator):
    import torch
    from diffusers import PixArtTransformer2DModel

    model = PixArtTransformer2DModel(
        num_attention_heads=spec.heads, attention_head_dim=spec.hidden // spec.heads, in_channels=4,
        out_channels=8, num_layers=depth, cross_attention_dim=spec.hidden, sample_size=2 * side, patch_size=2,
        caption_channels=spec.text_dim, use_additional_conditions=False)
    inputs = dict(hidden_states=torch.randn(batch, 4, 2 * side, 2 * side, generator=g),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g),
                  timestep=torch.full((batch,), 500.0),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    _contiguous_patch_embedding(model)
    return model, inputs, "hidden_states", "timestep", 1000.0


def _contiguous_patch_embedding(model: nn.Module) -> None:
    """Make the patch embedding's output contiguous, as the input of every block after the first is.

    diffusers' ``PatchEmbed`` returns ``[B, N, C]`` as a transposed view of the convolution output (strides
    ``(N*C, 1, N)``); the first block's residual add returns a contiguous tensor, so in a 28-block model
    only block 0 sees that layout. With the reduced depth here every block would, and on CPU each
    element-wise op of a block (norm, modulation, gated residual) runs several times slower on it. One copy
    after the embedding, in the baseline and every method alike, lets the benchmark's blocks run as
    blocks 1-27 of the full model do.
    """
    model.pos_embed.register_forward_hook(lambda module, args, out: out.contiguous())


def _dit(spec: WidthSpec, side: int, depth: int, batch: int, g: torch.Generator):
    import torch
    from diffusers import DiTTransformer2DModel

    model = DiTTransformer2DModel(
        num_attention_heads=spec.heads, attention_head_dim=spec.hidden // spec.heads, in_channels=4,
        out_channels=8, num_layers=depth, sample_size=2 * side, patch_size=2, num_embeds_ada_norm=1000)
    inputs = dict(hidden_states=torch.randn(batch, 4, 2 * side, 2 * side, generator=g),
                  timestep=torch.full((batch,), 500.0), class_labels=torch.arange(batch) % 1000)
    _contiguous_patch_embedding(model)
    return model, inputs, "hidden_states", "timestep", 1000.0


def _flux(spec: WidthSpec, side: int, depth: int, batch: int, g: torch.Generator):
    import torch
    from diffusers import FluxTransformer2DModel

    head_dim = spec.hidden // spec.heads
    a = 2 * max(1, head_dim // 16)
    b = 2 * ((head_dim - a) // 4)
    rope = (a, b, head_dim - a - b)  # (16, 56, 56) for head_dim 128, as FLUX.1
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=depth, num_single_layers=depth, attention_head_dim=head_dim,
        num_attention_heads=spec.heads, joint_attention_dim=spec.text_dim, pooled_projection_dim=spec.pooled_dim,
        axes_dims_rope=rope)
    rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
    img_ids = torch.stack([torch.zeros(side * side), rows.flatten(), cols.flatten()], dim=1)  # [N, 3]
    inputs = dict(hidden_states=torch.randn(batch, side * side, 64, generator=g),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g),
                  pooled_projections=torch.randn(batch, spec.pooled_dim, generator=g),
                  timestep=torch.full((batch,), 0.5), img_ids=img_ids, txt_ids=torch.zeros(spec.text_tokens, 3))
    return model, inputs, "hidden_states", "timestep", 1.0


def _unet(spec: WidthSpec, side: int, depth: int, batch: int, g: torch.Generator):
    import torch
    from diffusers import UNet2DConditionModel

    base = spec.hidden
    channels = (base, 2 * base, 4 * base, 4 * base) if base >= 64 else (base, 2 * base)
    down = ("CrossAttnDownBlock2D",) * (len(channels) - 1) + ("DownBlock2D",)
    up = ("UpBlock2D",) + ("CrossAttnUpBlock2D",) * (len(channels) - 1)
    if base < 64:  # quick: both levels with attention, like the tests' tiny UNet
        down, up = ("CrossAttnDownBlock2D",) * 2, ("CrossAttnUpBlock2D",) * 2
    model = UNet2DConditionModel(
        sample_size=side, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=channels,
        down_block_types=down, up_block_types=up, cross_attention_dim=spec.text_dim,
        attention_head_dim=spec.heads, norm_num_groups=min(32, base // 4))
    inputs = dict(sample=torch.randn(batch, 4, side, side, generator=g), timestep=torch.tensor(500.0),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g))
    return model, inputs, "sample", "timestep", 1000.0


def _wan(spec: WidthSpec, grid: tuple[int, int, int], depth: int, batch: int, g: torch.Generator):
    """Wan 2.1 T2V (1.3B or 14B widths): patch (1, 2, 2), 16 latent channels, head dim 128 (quick: the spec's),
    frequency dim 256, cross-attention to ``text_tokens`` UMT5 embeddings, RMS q/k norm across heads."""
    import torch
    from diffusers import WanTransformer3DModel

    frames, height, width = grid
    model = WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=spec.heads, attention_head_dim=spec.hidden // spec.heads,
        in_channels=16, out_channels=16, text_dim=spec.text_dim, freq_dim=256 if spec.hidden >= 256 else 32,
        ffn_dim=spec.ffn, num_layers=depth, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6)
    inputs = dict(hidden_states=torch.randn(batch, 16, frames, 2 * height, 2 * width, generator=g),  # [B, C, T, 2H, 2W]
                  timestep=torch.full((batch,), 500.0),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g))
    return model, inputs, "hidden_states", "timestep", 1000.0


def _hunyuan_video(spec: WidthSpec, grid: tuple[int, int, int], depth: int, batch: int, g: torch.Generator):
    """HunyuanVideo: patch 2, temporal patch 1, 16 latent channels, ``depth`` double- and ``depth`` single-stream
    blocks, 1 token refiner block (2 in the release), RoPE axes (16, 56, 56) (quick: split of the head), guidance
    embedding, joint attention with ``text_tokens`` LLaVA tokens (all valid)."""
    import torch
    from diffusers import HunyuanVideoTransformer3DModel

    frames, height, width = grid
    head_dim = spec.hidden // spec.heads
    rope = (16, 56, 56) if head_dim == 128 else (head_dim - 2 * (3 * head_dim // 8), 3 * head_dim // 8,
                                                 3 * head_dim // 8)
    model = HunyuanVideoTransformer3DModel(
        in_channels=16, out_channels=16, num_attention_heads=spec.heads, attention_head_dim=head_dim,
        num_layers=depth, num_single_layers=depth, num_refiner_layers=1, mlp_ratio=4.0, patch_size=2,
        patch_size_t=1, guidance_embeds=True, text_embed_dim=spec.text_dim, pooled_projection_dim=spec.pooled_dim,
        rope_axes_dim=rope)
    inputs = dict(hidden_states=torch.randn(batch, 16, frames, 2 * height, 2 * width, generator=g),  # [B, C, T, 2H, 2W]
                  timestep=torch.full((batch,), 500.0),
                  encoder_hidden_states=torch.randn(batch, spec.text_tokens, spec.text_dim, generator=g),
                  encoder_attention_mask=torch.ones(batch, spec.text_tokens, dtype=torch.long),
                  pooled_projections=torch.randn(batch, spec.pooled_dim, generator=g),
                  guidance=torch.full((batch,), 6000.0))
    return model, inputs, "hidden_states", "timestep", 1000.0


_BUILDERS: dict[str, Callable] = {"sd3": _sd3, "pixart": _pixart, "dit": _dit, "flux": _flux, "unet": _unet,
                               "wan": _wan, "wan14b": _wan, "hunyuan_video": _hunyuan_video}


def check_sizes(widths: Sequence[str], tokens: Sequence[int], frames: int | None = None) -> None:
    """Raises ``ValueError`` before any model is built: unknown widths, token counts the widths cannot take
    (image widths: perfect squares; video widths: ``frames`` must divide them), ``frames`` without a video
    width."""
    unknown = sorted(set(widths) - set(WIDTHS))
    if unknown:
        raise ValueError(f"unknown width(s) {unknown}; choose from {WIDTHS}")
    video = sorted(set(widths) & set(VIDEO_WIDTHS))
    if frames is not None and not video:
        raise ValueError(f"--frames is for the video widths {VIDEO_WIDTHS}")
    for n in tokens:
        if video:
            video_grid(n, frames)
        if set(widths) - set(VIDEO_WIDTHS) and math.isqrt(n) ** 2 != n:
            raise ValueError(f"--tokens must be perfect squares for image widths, got {n}")

