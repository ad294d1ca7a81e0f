"""The native timm-based class-conditional DiT (Peebles & Xie), the bundled reference model's architecture: the original
DiT code's layout and parameter names, and the flow time ``t`` in ``[0, 1]``; both: docs/backbones/dit.md.

    >>> import torch
    >>> from tomerge.backbones.timm_dit import DiT, DiTConfig
    >>> model = DiT(DiTConfig.preset("reference"))
    >>> x = torch.randn(2, 1, 32, 32); t = torch.rand(2); y = torch.tensor([0, 3])
    >>> model(x, t, y).shape
    torch.Size([2, 1, 32, 32])
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch import Tensor, nn
from timm.models.vision_transformer import Attention, Mlp, PatchEmbed

__all__ = [
    "DiTConfig", "DiT", "DiTBlock", "FinalLayer", "TimestepEmbedder", "LabelEmbedder",
    "get_2d_sincos_pos_embed", "load_dit", "save_dit", "DIT_PRESETS",
]


# ----------------------------------------------------------------------------------------- config
@dataclass(frozen=True)
class DiTConfig:
    """Architecture of a class-conditional DiT. Change with ``dataclasses.replace``.

    Args:
        input_size: latent/image size ``H`` (square) or ``(H, W)``; ``pos_embed`` is built for it.
        patch_size: patch side ``p``; the token grid is ``(H / p, W / p)``.
        in_channels: input channels ``C``.
        hidden_size: token width.
        depth: number of ``DiTBlock``s.
        num_heads: attention heads.
        mlp_ratio: MLP hidden width / ``hidden_size``.
        num_classes: real classes; index ``num_classes`` is the null class used by classifier-free guidance.
        class_dropout_prob: probability of replacing a label by the null class in training.
        learn_sigma: output ``2 * in_channels`` channels (mean/velocity + variance) as the original DiT.
        timestep_scale: ``t`` in ``[0, 1]`` is multiplied by this before the sinusoidal embedding.
    """

    input_size: int | tuple[int, int] = 32
    patch_size: int = 2
    in_channels: int = 4
    hidden_size: int = 1152
    depth: int = 28
    num_heads: int = 16
    mlp_ratio: float = 4.0
    num_classes: int = 1000
    class_dropout_prob: float = 0.1
    learn_sigma: bool = True
    timestep_scale: float = 1000.0

    def __post_init__(self) -> None:
        size = self.input_size
        if isinstance(size, list):
            object.__setattr__(self, "input_size", tuple(size))
        h, w = self.image_hw
        if h % self.patch_size or w % self.patch_size:
            raise ValueError(f"input_size {self.input_size} must be divisible by patch_size {self.patch_size}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} must be divisible by num_heads {self.num_heads}")
        if self.hidden_size % 4:
            raise ValueError("hidden_size must be divisible by 4 for the 2D sin-cos position embedding")

    @property
    def image_hw(self) -> tuple[int, int]:
        s = self.input_size
        return (int(s), int(s)) if isinstance(s, int) else (int(s[0]), int(s[1]))

    @property
    def grid_hw(self) -> tuple[int, int]:
        h, w = self.image_hw
        return h // self.patch_size, w // self.patch_size

    @property
    def out_channels(self) -> int:
        return self.in_channels * 2 if self.learn_sigma else self.in_channels

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if isinstance(d["input_size"], tuple):
            d["input_size"] = list(d["input_size"])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "DiTConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown DiTConfig fields {sorted(unknown)}; valid: {sorted(known)}")
        return cls(**dict(d))

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DiTConfig":
        """A named configuration: ``'DiT-XL/2'`` (and the other original sizes) or ``'reference'``."""
        if name not in DIT_PRESETS:
            raise KeyError(f"unknown DiT preset {name!r}; choose one of {', '.join(DIT_PRESETS)}")
        return dataclasses.replace(DIT_PRESETS[name], **overrides)

    @classmethod
    def reference(cls) -> "DiTConfig":
        """The bundled reference model: 32x32x1 Fashion-MNIST, patch 2 (16x16 = 256 tokens), 10 classes."""
        return DIT_PRESETS["reference"]


def _original(depth: int, hidden: int, patch: int, heads: int) -> DiTConfig:
    # Original DiT: 256x256 images -> 32x32x4 SD-VAE latents, 1000 ImageNet classes, learn_sigma.
    return DiTConfig(input_size=32, patch_size=patch, in_channels=4, hidden_size=hidden, depth=depth,
                     num_heads=heads, num_classes=1000, class_dropout_prob=0.1, learn_sigma=True)


DIT_PRESETS: dict[str, DiTConfig] = {
    **{f"DiT-XL/{p}": _original(28, 1152, p, 16) for p in (2, 4, 8)},
    **{f"DiT-L/{p}": _original(24, 1024, p, 16) for p in (2, 4, 8)},
    **{f"DiT-B/{p}": _original(12, 768, p, 12) for p in (2, 4, 8)},
    **{f"DiT-S/{p}": _original(12, 384, p, 6) for p in (2, 4, 8)},
    "reference": DiTConfig(input_size=32, patch_size=2, in_channels=1, hidden_size=192, depth=6,
                           num_heads=6, mlp_ratio=4.0, num_classes=10, class_dropout_prob=0.1,
                           learn_sigma=False),
}
# The same network on 64 x 64 Fashion-MNIST: 32 x 32 = 1,024 image tokens (the second reference model).
DIT_PRESETS["reference-1024"] = dataclasses.replace(DIT_PRESETS["reference"], input_size=64)


# ------------------------------------------------------------------------------------ embeddings
def modulate(x: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation: ``x [B, N, C]``, ``shift/scale [B, C]``."""
    return x * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


class TimestepEmbedder(nn.Module):
    """Scalar timesteps -> vectors: sinusoidal features then a 2-layer MLP (``mlp.0``, ``mlp.2``)."""

    def __init__(self, hidden_size: int, frequency_embedding_size: int = 256) -> None:
        super().__init__()
        self.mlp = nn.Sequential(
            nn.Linear(frequency_embedding_size, hidden_size, bias=True),
            nn.SiLU(),
            nn.Linear(hidden_size, hidden_size, bias=True),
        )
        self.frequency_embedding_size = frequency_embedding_size

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """Sinusoidal embedding as in the original DiT: ``t [B]`` -> ``[B, dim]`` (cos first, then sin)."""
        half = dim // 2
        freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
        args = t[:, None].float() * freqs[None]  # [B, half]
        embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)  # [B, 2*half]
        if dim % 2:
            embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
        return embedding

    def forward(self, t: Tensor) -> Tensor:
        t_freq = self.timestep_embedding(t, self.frequency_embedding_size)
        return self.mlp(t_freq.to(self.mlp[0].weight.dtype))


class LabelEmbedder(nn.Module):
    """Class labels -> vectors; row ``num_classes`` is the null class; label dropout in training."""

    def __init__(self, num_classes: int, hidden_size: int, dropout_prob: float) -> None:
        super().__init__()
        use_cfg_embedding = int(dropout_prob > 0)
        self.embedding_table = nn.Embedding(num_classes + use_cfg_embedding, hidden_size)
        self.num_classes = num_classes
        self.dropout_prob = dropout_prob

    def token_drop(self, labels: Tensor, force_drop_ids: Tensor | None = None) -> Tensor:
        """Replace labels by the null class with probability ``dropout_prob`` (or where ``force_drop_ids == 1``)."""
        if force_drop_ids is None:
            drop_ids = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop_ids = force_drop_ids == 1
        return torch.where(drop_ids, torch.full_like(labels, self.num_classes), labels)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Tensor | None = None) -> Tensor:
        if (train and self.dropout_prob > 0) or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


def _sincos_1d(embed_dim: int, pos: Tensor) -> Tensor:
    """``pos [M]`` -> ``[M, embed_dim]`` (sin half, cos half), float64 as the original numpy code."""
    omega = torch.arange(embed_dim // 2, dtype=torch.float64) / (embed_dim / 2.0)
    omega = 1.0 / 10000**omega  # [D/2]
    out = pos.reshape(-1).double()[:, None] * omega[None]  # [M, D/2]
    return torch.cat([torch.sin(out), torch.cos(out)], dim=1)


def get_2d_sincos_pos_embed(embed_dim: int, grid_hw: tuple[int, int]) -> Tensor:
    """Fixed 2D sin-cos embedding of the original DiT/MAE code for a ``(gh, gw)`` grid -> ``[gh*gw, D]``.

    Tokens are in row-major order (the order ``PatchEmbed`` flattens to). As in the original code the
    first half of the channels encodes the column (w) coordinate and the second half the row.
    """
    gh, gw = grid_hw
    grid_h = torch.arange(gh, dtype=torch.float64)
    grid_w = torch.arange(gw, dtype=torch.float64)
    ww, hh = torch.meshgrid(grid_w, grid_h, indexing="xy")  # each [gh, gw]; ww[i, j] = j, hh[i, j] = i
    emb_a = _sincos_1d(embed_dim // 2, ww)  # [gh*gw, D/2]
    emb_b = _sincos_1d(embed_dim // 2, hh)  # [gh*gw, D/2]
    return torch.cat([emb_a, emb_b], dim=1).float()  # [gh*gw, D]


# ---------------------------------------------------------------------------------------- blocks
def _approx_gelu() -> nn.Module:
    return nn.GELU(approximate="tanh")


class DiTBlock(nn.Module):
    """adaLN-Zero block: ``x + gate * attn(modulate(norm1(x)))``, then the same with ``mlp``/``norm2``.

    Merge points for token merging: the input of ``attn`` and the input of ``mlp``.
    """

    def __init__(self, hidden_size: int, num_heads: int, mlp_ratio: float = 4.0) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.attn = Attention(hidden_size, num_heads=num_heads, qkv_bias=True)
        self.norm2 = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.mlp = Mlp(in_features=hidden_size, hidden_features=int(hidden_size * mlp_ratio),
                       act_layer=_approx_gelu, drop=0)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 6 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        # x [B, N, C], c [B, C]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.adaLN_modulation(c).chunk(6, dim=1)
        x = x + gate_msa.unsqueeze(1) * self.attn(modulate(self.norm1(x), shift_msa, scale_msa))
        x = x + gate_mlp.unsqueeze(1) * self.mlp(modulate(self.norm2(x), shift_mlp, scale_mlp))
        return x


class FinalLayer(nn.Module):
    """adaLN-modulated LayerNorm then a linear map to ``p*p*out_channels`` per token."""

    def __init__(self, hidden_size: int, patch_size: int, out_channels: int) -> None:
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=True))

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.adaLN_modulation(c).chunk(2, dim=1)
        return self.linear(modulate(self.norm_final(x), shift, scale))  # [B, N, p*p*C_out]


# ----------------------------------------------------------------------------------------- model
class DiT(nn.Module):
    """Class-conditional diffusion transformer with adaLN-Zero blocks (original DiT layout).

    Args:
        config: the architecture; ``DiTConfig.preset("reference")`` for the bundled model.

    Example:
        >>> model = DiT(DiTConfig.preset("DiT-S/8", num_classes=10))
        >>> model(torch.randn(1, 4, 32, 32), torch.rand(1), torch.tensor([1])).shape
        torch.Size([1, 8, 32, 32])
    """

    def __init__(self, config: DiTConfig | None = None) -> None:
        super().__init__()
        config = config if config is not None else DiTConfig()
        self.config = config
        self.in_channels = config.in_channels
        self.out_channels = config.out_channels
        self.patch_size = config.patch_size
        self.num_heads = config.num_heads
        self.num_classes = config.num_classes
        hidden = config.hidden_size

        # strict_img_size=False: the size check happens in forward with a clearer message.
        self.x_embedder = PatchEmbed(config.image_hw, config.patch_size, config.in_channels, hidden,
                                     bias=True, strict_img_size=False)
        self.t_embedder = TimestepEmbedder(hidden)
        self.y_embedder = LabelEmbedder(config.num_classes, hidden, config.class_dropout_prob)
        num_patches = config.grid_hw[0] * config.grid_hw[1]
        # Fixed sin-cos embedding: a persistent buffer, so it is in the state dict like the original
        # (there a Parameter with requires_grad=False) and original checkpoints load unchanged.
        self.register_buffer("pos_embed", torch.zeros(1, num_patches, hidden), persistent=True)
        self.blocks = nn.ModuleList(DiTBlock(hidden, config.num_heads, config.mlp_ratio) for _ in range(config.depth))
        self.final_layer = FinalLayer(hidden, config.patch_size, self.out_channels)
        self.initialize_weights()

    def initialize_weights(self) -> None:
        """Initialisation of the original DiT, including adaLN-Zero (every block starts as identity)."""

        def _basic_init(module: nn.Module) -> None:
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.constant_(module.bias, 0)

        self.apply(_basic_init)
        self.pos_embed.copy_(get_2d_sincos_pos_embed(self.config.hidden_size, self.config.grid_hw).unsqueeze(0))
        w = self.x_embedder.proj.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        nn.init.constant_(self.x_embedder.proj.bias, 0)
        nn.init.normal_(self.y_embedder.embedding_table.weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[0].weight, std=0.02)
        nn.init.normal_(self.t_embedder.mlp[2].weight, std=0.02)
        for block in self.blocks:
            nn.init.constant_(block.adaLN_modulation[-1].weight, 0)
            nn.init.constant_(block.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].weight, 0)
        nn.init.constant_(self.final_layer.adaLN_modulation[-1].bias, 0)
        nn.init.constant_(self.final_layer.linear.weight, 0)
        nn.init.constant_(self.final_layer.linear.bias, 0)

    def token_grid(self, x: Tensor) -> tuple[int, int]:
        """Token grid ``(H/p, W/p)`` of an input ``[B, C, H, W]``; raises if it is not the configured size."""
        if x.ndim != 4:
            raise ValueError(f"expected x of shape [B, C, H, W], got {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ValueError(f"expected {self.in_channels} input channels, got {x.shape[1]}")
        h, w = x.shape[-2:]
        if (h, w) != self.config.image_hw:
            raise ValueError(
                f"input is {h}x{w} but this DiT's fixed pos_embed is for {self.config.image_hw[0]}x"
                f"{self.config.image_hw[1]}; build the model with DiTConfig(input_size=({h}, {w}), ...)"
            )
        return h // self.patch_size, w // self.patch_size

    def unpatchify(self, x: Tensor, grid_hw: tuple[int, int]) -> Tensor:
        """``x [B, gh*gw, p*p*C]`` -> images ``[B, C, gh*p, gw*p]``."""
        c, p = self.out_channels, self.patch_size
        gh, gw = grid_hw
        x = x.reshape(x.shape[0], gh, gw, p, p, c)  # [B, gh, gw, p, p, C]
        x = torch.einsum("nhwpqc->nchpwq", x)  # [B, C, gh, p, gw, p]
        return x.reshape(x.shape[0], c, gh * p, gw * p)

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """Predict the model output (velocity for the reference model).

        Args:
            x: ``[B, C, H, W]`` noisy input at the configured size.
            t: ``[B]`` float flow time in ``[0, 1]`` (scaled by ``config.timestep_scale`` inside).
            y: ``[B]`` long class labels; ``num_classes`` is the null (unconditional) class.

        Returns:
            ``[B, C_out, H, W]`` with ``C_out = 2*C`` when ``learn_sigma`` else ``C``.
        """
        grid = self.token_grid(x)
        if t.ndim == 0:
            t = t.expand(x.shape[0])
        x = self.x_embedder(x) + self.pos_embed.to(x.dtype)  # [B, N, D]
        c = self.t_embedder(t * self.config.timestep_scale) + self.y_embedder(y, self.training)  # [B, D]
        for block in self.blocks:
            x = block(x, c)  # [B, N, D]
        x = self.final_layer(x, c)  # [B, N, p*p*C_out]
        return self.unpatchify(x, grid)


# ----------------------------------------------------------------------------------- load / save
def _infer_config(state: Mapping[str, Tensor]) -> DiTConfig:
    """Best-effort config from an original DiT state dict (heads from the known presets, else width/64)."""
    w = state["x_embedder.proj.weight"]  # [D, C, p, p]
    hidden, in_ch, patch = w.shape[0], w.shape[1], w.shape[2]
    depth = 1 + max(int(k.split(".")[1]) for k in state if k.startswith("blocks."))
    n_tokens = state["pos_embed"].shape[1]
    side = int(round(math.sqrt(n_tokens)))
    if side * side != n_tokens:
        raise ValueError("cannot infer a non-square input_size from the checkpoint; pass config=DiTConfig(...)")
    out_ch = state["final_layer.linear.weight"].shape[0] // (patch * patch)
    rows = state["y_embedder.embedding_table.weight"].shape[0]
    heads = {1152: 16, 1024: 16, 768: 12, 384: 6, 192: 6}.get(hidden, max(1, hidden // 64))
    mlp_ratio = state["blocks.0.mlp.fc1.weight"].shape[0] / hidden
    return DiTConfig(input_size=side * patch, patch_size=patch, in_channels=in_ch, hidden_size=hidden,
                     depth=depth, num_heads=heads, mlp_ratio=mlp_ratio, num_classes=rows - 1,
                     class_dropout_prob=0.1, learn_sigma=out_ch == 2 * in_ch)


def _read_state(path: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    if path.endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(path, framework="pt", device="cpu") as f:
            meta = dict(f.metadata() or {})
            state = {k: f.get_tensor(k) for k in f.keys()}
        return state, meta
    obj = torch.load(path, map_location="cpu", weights_only=True)
    for key in ("ema", "model", "state_dict"):  # original DiT training checkpoints nest the weights
        if isinstance(obj, dict) and key in obj and isinstance(obj[key], dict):
            obj = obj[key]
            break
    if not isinstance(obj, dict) or not all(isinstance(v, Tensor) for v in obj.values()):
        raise ValueError(f"{path} does not hold a DiT state dict (a mapping of names to tensors)")
    return dict(obj), {}


def load_dit(path: str | os.PathLike, config: DiTConfig | None = None, map_location: str | torch.device = "cpu") -> DiT:
    """Load a DiT from a local ``.safetensors`` or ``.pt``/``.pth`` file (original DiT layout).

    Args:
        path: local file. ``.safetensors`` files written by :func:`save_dit` carry their config in the
            header; for other files the config is taken from ``config``, a JSON file next to the weights
            (same stem, ``.json``, with a ``"config"`` entry), or inferred from the tensor shapes.
        config: the architecture; overrides the stored one.
        map_location: device for the returned model.

    Returns:
        The model in eval mode.

    Example:
        The bundled reference model, ``experiments/reference/dit_reference.safetensors`` (installed with
        the package; its path is ``tomerge.experiments.sources.models.REFERENCE_CHECKPOINT``):

        >>> from tomerge.experiments.sources.models import REFERENCE_CHECKPOINT
        >>> model = load_dit(REFERENCE_CHECKPOINT)
        >>> model.config.num_classes, model.config.image_hw
        (10, (32, 32))
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"DiT weights not found at {path!r}; give the local path of a .safetensors/.pt file "
            "(train one with `tomerge train-reference`, nothing is downloaded)"
        )
    state, meta = _read_state(path)
    if config is None and "dit_config" in meta:
        config = DiTConfig.from_dict(json.loads(meta["dit_config"]))
    if config is None:
        side = os.path.splitext(path)[0] + ".json"
        if os.path.isfile(side):
            with open(side) as f:
                info = json.load(f)
            if "config" in info:
                config = DiTConfig.from_dict(info["config"])
    if config is None:
        try:
            config = _infer_config(state)
        except KeyError as err:
            raise ValueError(f"{path} is not an original-layout DiT state dict (no {err}); pass config=") from err
    model = DiT(config)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    wrong = [f"{k}: file {tuple(state[k].shape)} vs model {tuple(v.shape)}"
             for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if missing or unexpected or wrong:
        raise ValueError(
            f"{path} does not match DiT config {config}:\n"
            f"  missing keys ({len(missing)}): {missing[:8]}\n"
            f"  unexpected keys ({len(unexpected)}): {unexpected[:8]}\n"
            f"  shape mismatches ({len(wrong)}): {wrong[:8]}\n"
            "pass the matching config=DiTConfig(...) (e.g. DiTConfig.preset('DiT-XL/2'))"
        )
    model.load_state_dict(state, strict=True)
    return model.to(map_location).eval()


def save_dit(model: DiT, path: str | os.PathLike, extra_metadata: Mapping[str, str] | None = None) -> None:
    """Write the weights to ``.safetensors`` with the config in the header (read back by :func:`load_dit`)."""
    from safetensors.torch import save_file

    state = {k: v.detach().to("cpu").contiguous() for k, v in model.state_dict().items()}
    meta = {"dit_config": json.dumps(model.config.to_dict()), "format": "pt"}
    meta.update(extra_metadata or {})
    save_file(state, os.fspath(path), metadata=meta)
