"""End-to-end speed benchmark: random-weight diffusers models at the widths that matter, baseline vs
every strategy/schedule (and the ``tomesd`` package on a UNet), measured and FLOP-ideal speed-ups.

    tomerge bench --e2e --widths sd3 pixart flux --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2
    tomerge bench --e2e --quick                                  # tiny models, seconds (what the tests run)
    tomerge bench --e2e --compile --widths sd3 pixart dit --tokens 1024 4096 --steps 4 --strategies sdtm toma

Per (model, token count, ratio): one transformer forward (``--steps K``: also a ``K``-step Euler
sampling loop) is timed with ``torch.utils.benchmark`` for the baseline and for every method,
alternating in one process (round after round: baseline, method 1, method 2, ...), median over
``--repeats`` rounds after ``--warmup`` untimed ones. FLOPs come from :mod:`tomerge.experiments.measure.flops`
(every attention kernel priced; plan computation, e.g. similarity matmuls, is counted in the merged FLOPs). Reported: ``speedup = t_base / t_merged``, ``ideal = flops_base / flops_merged``
and ``efficiency = speedup / ideal`` (the share of the FLOP saving that survives the merge overhead).

Models (random weights, ``depth`` blocks; Flux: ``depth`` double-stream and ``depth`` single-stream):

=========  ==============================  =====  =====  ======  =====================================
width      model class                      C      heads  patch   text tokens (default)
=========  ==============================  =====  =====  ======  =====================================
sd3        SD3Transformer2DModel (MMDiT)   1536    24    2       333 (77 CLIP + 256 T5), joint
pixart     PixArtTransformer2DModel        1152    16    2       120 (cross-attention)
dit        DiTTransformer2DModel (DiT-XL)  1152    16    2       none (class label)
flux       FluxTransformer2DModel          3072    24    1 (packed 2x2)  512 (T5), joint
unet       UNet2DConditionModel, SD1.5 widths (320, 640, 1280, 1280), 1 layer per block, 77 x 768 text;
           N tokens = the full-resolution latent (64 x 64 for 4096); compared with ``tomesd.apply_patch``
wan        WanTransformer3DModel (Wan 2.1  1536    12    (1, 2, 2)  512 (UMT5), cross-attention;
           T2V 1.3B), FFN 8960                                    video: N = T * H * W (below)
wan14b     WanTransformer3DModel (Wan 2.1  5120    40    (1, 2, 2)  512 (UMT5), cross-attention
           T2V 14B), FFN 13824
hunyuan_   HunyuanVideoTransformer3DModel  3072    24    (1, 2, 2)  256 (LLaVA), joint; ``depth`` double-
video      (MLP ratio 4, RoPE 16/56/56)                            and ``depth`` single-stream blocks
=========  ==============================  =====  =====  ======  =====================================

Video widths take a token count ``N = T * H * W``, the token grid after patchification (81 frames of
480 x 832: latent 21 x 60 x 104, grid 21 x 30 x 52, N = 32760), and factor it by :func:`video_grid`: ``T``
is ``frames`` (``--frames``) or else the largest divisor of ``N`` not above 21 (the latent frames of Wan's
81-frame clips); ``(H, W)`` is the factor pair of ``N / T`` (``H <= W``) whose ``W / H`` is closest to
832 / 480, Wan's 480p landscape frame. So 32760 -> (21, 30, 52), 4096 -> (16, 16, 16), 16384 -> (16, 32, 32).
The latent is ``[B, 16, T, 2H, 2W]``; see docs/benchmarks.md, "Video (Wan)".
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import tomerge

# clock_function, median_and_spread and time_once keep their bench_e2e spellings
from ..measure.columns import format_markdown_table
from ..measure.timing import NOISY_SPREAD, clock_function, median_and_spread, time_once, time_setups  # noqa: F401

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn
# torch and diffusers are imported in the functions that build and time models: `tomerge bench --help`
# and the constants below load without them.

TOMESD_PACKAGE = "tomesd package"
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


@dataclasses.dataclass(frozen=True)
class E2ERow:
    """One (model, N, ratio, method) result; times in milliseconds, FLOPs in GFLOP."""

    model: str
    width: int
    heads: int
    depth: int
    tokens: int
    text_tokens: int
    batch: int
    mode: str  # "forward" or "loop<K>"
    ratio: float
    method: str
    base_ms: float
    merged_ms: float
    base_gflop: float
    merged_gflop: float
    base_spread: float | None = None  # (max - min) / median of the timed repeats
    merged_spread: float | None = None

    @property
    def spread(self) -> float | None:
        """The larger of the two timings' spreads (``None`` with a single repeat)."""
        spreads = [s for s in (self.base_spread, self.merged_spread) if s is not None]
        return max(spreads) if spreads else None

    @property
    def noisy(self) -> bool:
        """The repeats disagree by more than :data:`~tomerge.experiments.measure.timing.NOISY_SPREAD` (10%)."""
        return self.spread is not None and self.spread > NOISY_SPREAD

    @property
    def speedup(self) -> float:
        return self.base_ms / self.merged_ms

    @property
    def ideal(self) -> float:
        return self.base_gflop / self.merged_gflop

    @property
    def efficiency(self) -> float:
        return self.speedup / self.ideal

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "speedup": round(self.speedup, 4), "ideal": round(self.ideal, 4),
                "efficiency": round(self.efficiency, 4)}


# ---------------------------------------------------------------------- models and inputs
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


# ---------------------------------------------------------------------- merging, FLOPs, time
@contextlib.contextmanager
def merged(bench: Bench, method: str | None, ratio: float, num_steps: int | None = None):
    """The model with ``method`` applied (``None``: baseline; ``"tomesd package"``: ``tomesd.apply_patch``)."""
    if method is None:
        yield
    elif method == TOMESD_PACKAGE:
        import tomesd

        tomesd.apply_patch(bench.model, ratio=ratio)
        try:
            yield
        finally:
            tomesd.remove_patch(bench.model)
    else:
        kw = {"num_steps": num_steps} if num_steps else {}
        with tomerge.merging(bench.model, method, ratio=method_ratio(method, ratio), **kw):
            yield


def method_ratio(method: str | None, ratio: float) -> float | None:
    """The ratio ``method`` runs at: ``ratio``, except for a caching schedule, which runs at its own defaults
    without a merging strategy (``None``: it merges nothing; its rows say ratio 0)."""
    from tomerge.experiments.sources.coverage import caches_blocks

    if method is None or method == TOMESD_PACKAGE or not caches_blocks(method):
        return ratio
    return None


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def time_compiled(bench: Bench, methods: Sequence[str | None], ratio: float, fn: Callable[[], object],
                  repeats: int, warmup: int, threads: int, num_steps: int | None, clock: str,
                  mode: str, backend: str = "inductor") -> dict[str | None, tuple[float, float | None]]:
    """Median seconds and spread per method, as :func:`~tomerge.experiments.measure.timing.time_setups` gives them for
    eager models, with compiled models: every method gets its own copy of the model, applied once and compiled
    (``torch.compile(copy, mode=mode)``; a new application would have new hooks and recompile), and
    ``max(1, warmup)`` untimed calls compile it (every step of a loop compiles what it needs). Then the
    methods alternate round after round (``time_setups``), each calling its own compiled copy, so slow drifts of
    the machine hit every method alike. Dynamo's recompile limit is raised to hold every method's graphs, and
    dynamo guards on module hooks (``skip_nnmodule_hook_guards=False``): by default it does not, and the
    copies share their blocks' code with the baseline, so a merged copy would run the baseline's graphs."""
    import copy

    import torch

    raw = bench.model
    runners: dict[str | None, Any] = {}
    torch._dynamo.reset()
    with contextlib.ExitStack() as applied, \
            torch._dynamo.config.patch(recompile_limit=max(8, 8 * len(methods)), skip_nnmodule_hook_guards=False):
        try:
            for method in methods:
                bench.model = raw if method is None else copy.deepcopy(raw)
                applied.enter_context(merged(bench, method, ratio, num_steps))
                runners[method] = bench.model = torch.compile(bench.model, mode=None if mode == "default" else mode,
                                                              backend=backend)
                for _ in range(max(1, warmup)):
                    fn()

            def run_compiled(method: str | None) -> contextlib.AbstractContextManager:
                bench.model = runners[method]
                return contextlib.nullcontext()

            seconds = time_setups({m: functools.partial(run_compiled, m) for m in methods}, fn, repeats, 0, threads,
                                  clock)  # compiled above: no warm-up rounds
        finally:
            bench.model = raw
    torch._dynamo.reset()
    return seconds


def __getattr__(name: str) -> Any:
    if name == "time_alternating":
        raise AttributeError("tomerge.experiments.bench.e2e.time_alternating is "
                             "tomerge.experiments.measure.timing.time_setups({method: context, ...}, fn, repeats, warmup, "
                             "threads, clock)")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sdpa_backend(name: str):
    """A context restricting ``scaled_dot_product_attention`` to one backend (``"default"``: no restriction)."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    return sdpa_kernel(backends[name])


def default_methods(width: str) -> list[str]:
    """Every registered strategy and schedule; on the UNet the ``tomesd`` package and tomerge's ``tomesd``."""
    if width == "unet":
        return [TOMESD_PACKAGE, "tomesd"]
    return list(tomerge.list_strategies())


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


def e2e_benchmark(widths: Sequence[str] = ("sd3", "pixart", "flux", "unet"), tokens: Sequence[int] = (1024, 4096),
                  ratios: Sequence[float] = (0.5,), depth: int = 2, batch: int = 2,
                  methods: Sequence[str] | None = None, steps: int = 0, repeats: int = 5, warmup: int = 1,
                  quick: bool = False, text_tokens: int | None = None, threads: int | None = None,
                  dtype: torch.dtype | None = None, device: str = "cpu", sdpa: str = "default",
                  clock: str = "wall", compile_mode: str | None = None, progress: bool = True,
                  frames: int | None = None) -> list[E2ERow]:
    """Baseline vs every method on every (width, N, ratio): one forward, and a ``steps``-step loop if ``steps``.

    Args:
        widths: model families (see the module docstring).
        tokens: image token counts (perfect squares; video widths: ``T * H * W``, see :func:`video_grid`).
        ratios: merge ratios.
        depth: blocks per model (Flux: of each kind).
        batch: ``B``.
        methods: strategy/schedule names, or ``"tomesd package"`` (UNet only); default :func:`default_methods`.
        steps: also time a sampling loop of this many steps (0: forward only).
        repeats, warmup: timed and untimed alternating rounds.
        quick: tiny models (seconds).
        text_tokens: override each width's text length.
        threads: torch threads (default: torch's current count).
        dtype, device: where the models run (``dtype`` default: float32).
        sdpa: attention backend for every call (``"default"``, ``"flash"``, ``"efficient"``, ``"cudnn"``,
            ``"math"``); on CPU ``"flash"`` is the CPU flash kernel that runs by default anyway.
        clock: ``"wall"`` or ``"cpu"`` (process CPU time; see :func:`~tomerge.experiments.measure.timing.time_once`); CUDA always uses events.
        compile_mode: time the baseline and every method compiled with inductor in this ``torch.compile`` mode
            (one of :data:`COMPILE_MODES`; see :func:`time_compiled`); ``None``: eager.
        progress: show a progress bar.
        frames: video widths: the frames ``T`` of every token grid (default: see :func:`video_grid`).

    Returns:
        One :class:`E2ERow` per (width, N, ratio, mode, method).
    """
    import torch
    from tqdm import tqdm

    from ..measure.flops import count_flops

    if compile_mode is not None and compile_mode not in COMPILE_MODES:
        raise ValueError(f"compile_mode must be one of {COMPILE_MODES}, got {compile_mode!r}")
    if compile_mode is not None and TOMESD_PACKAGE in (methods or []):
        raise ValueError("the tomesd package is timed eagerly only (its patched forward breaks the graph)")
    check_sizes(widths, tokens, frames)
    threads = threads or torch.get_num_threads()
    rows: list[E2ERow] = []
    configs = [(w, n) for w in widths for n in tokens]
    bar = tqdm(configs, desc="e2e", disable=not progress)
    with torch.inference_mode(), sdpa_backend(sdpa):
        for width, N in bar:
            bench = build(width, N, depth, batch, quick=quick, text_tokens=text_tokens, dtype=dtype, device=device,
                          frames=frames if width in VIDEO_WIDTHS else None)
            names = [m for m in (methods or default_methods(width))
                     if (width == "unet" and compile_mode is None) or m != TOMESD_PACKAGE]
            modes: list[tuple[str, Callable[[], object], int | None]] = [("forward", bench.call, None)]
            if steps > 0:
                modes.append((f"loop{steps}", lambda: bench.sample(steps), steps))
            for ratio in ratios:
                for mode, fn, num_steps in modes:
                    bar.set_postfix_str(f"{width} N={N} r={ratio} {mode}")
                    flops = {}
                    for m in [None, *names]:
                        with merged(bench, m, ratio, num_steps):
                            flops[m] = count_flops(fn)
                    if compile_mode is None:
                        applied = {m: functools.partial(merged, bench, m, ratio, num_steps) for m in [None, *names]}
                        secs = time_setups(applied, fn, repeats, warmup, threads, clock)
                    else:
                        secs = time_compiled(bench, [None, *names], ratio, fn, repeats, warmup, threads, num_steps,
                                             clock, compile_mode)
                    for m in names:
                        rows.append(E2ERow(width, bench.spec.hidden, bench.spec.heads, depth, N, bench.spec.text_tokens,
                                           batch, mode, method_ratio(m, ratio) or 0.0, m, secs[None][0] * 1e3,
                                           secs[m][0] * 1e3,
                                           flops[None] / 1e9, flops[m] / 1e9, secs[None][1], secs[m][1]))
            del bench
    return rows


def markdown_table(rows: Sequence[E2ERow]) -> str:
    """One line per row; ``spread`` is the larger timing's (max - min) / median over the repeats, and a
    row above 10% is marked ``(noisy)``: its speed-up is not reliable."""
    titles = ["model", "C", "depth", "N", "text", "mode", "ratio", "method", "base ms", "merged ms", "speed-up",
              "ideal", "efficiency", "spread"]
    cells = [[r.model, str(r.width), str(r.depth), str(r.tokens), str(r.text_tokens), r.mode, str(r.ratio), r.method,
              f"{r.base_ms:.1f}", f"{r.merged_ms:.1f}", f"{r.speedup:.2f}", f"{r.ideal:.2f}", f"{r.efficiency:.0%}",
              "-" if r.spread is None else f"{r.spread:.0%}" + (" (noisy)" if r.noisy else "")] for r in rows]
    numeric = [False, True, True, True, True, False, True, False, True, True, True, True, True, True]
    return format_markdown_table(titles, cells, numeric)


def pivot_table(rows: Sequence[E2ERow]) -> str:
    """One line per (model, N, ratio, mode), one column per method; cells ``speed-up / ideal (efficiency)``,
    followed by ``noisy`` when the cell's timing repeats disagree by more than 10%.

    Example:
        >>> row = E2ERow("pixart", 1152, 16, 1, 1024, 120, 2, "forward", 0.5, "ssm", 100.0, 50.0, 10.0, 4.0)
        >>> print(pivot_table([row]).splitlines()[-1])
        | pixart (1152) | 1024 | 0.5 | forward | 100 | 2.00 / 2.50 (80%) |
    """
    methods = list(dict.fromkeys(r.method for r in rows))
    groups: dict[tuple, dict[str, E2ERow]] = {}
    for r in rows:
        groups.setdefault((r.model, r.width, r.tokens, r.ratio, r.mode), {})[r.method] = r
    lines = ["| model (C) | N | ratio | mode | base ms | " + " | ".join(methods) + " |",
             "|---|---:|---:|---|---:|" + "---|" * len(methods)]
    for (model, width, tokens, ratio, mode), by_method in groups.items():
        base = next(iter(by_method.values())).base_ms
        cells = [f"{r.speedup:.2f} / {r.ideal:.2f} ({r.efficiency:.0%}){' noisy' if r.noisy else ''}"
                 if (r := by_method.get(m)) else "" for m in methods]
        lines.append(f"| {model} ({width}) | {tokens} | {ratio} | {mode} | {base:.0f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
