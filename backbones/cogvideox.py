"""`cogvideox` and `consisid`: CogVideoX 1.0 / 1.5 and ConsisID (diffusers `CogVideoXTransformer3DModel`,
`ConsisIDTransformer3DModel`).

Merges the video part of every block's joint ``[text, video]`` attention (RoPE rows gathered, where there is RoPE)
and of the feed-forward, which reads the joint sequence. The latent is frames first, ``[B, F, C, H, W]``. ConsisID's
face cross-attention runs between the blocks, at full length. The blocks and grid: docs/backbones/cogvideox.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from tomerge.state import MergeState

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg, probe_joint_attention


class CogVideoXAdapter(DeclaredAdapter):
    """Adapter for diffusers `CogVideoXTransformer3DModel` (CogVideoX 2B/5B, 5B-I2V, 1.5-5B, 1.5-5B-I2V); see the
    module docstring."""

    name: ClassVar[str] = "cogvideox"
    model_class: ClassVar[str] = "CogVideoXTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("cogvideox", "transformer_blocks", ("CogVideoXBlock",), (
            Site("attn", "attn1", output=0, rope=Rope("image_rotary_emb", 3, "rows"), probe=True),
            Site("mlp", "ff", tokens="joint"),
        ), text_arg="encoder_hidden_states", outputs=("hidden_states", "encoder_hidden_states")),
    )

    def probe_joint(self, attention: nn.Module, state: MergeState, **options: Any) -> list[Any]:
        """The joint probe of ``attn1``, whose processor normalises q/k with the heads first (``[B, heads, L, d]``) and
        rotates the image rows of the q/k the probe captures in place (``key[:, :, T:] = apply_rotary_emb(...)``),
        so the probe reads the norms so and keeps copies."""
        return probe_joint_attention(attention, state, heads_first=True, copies=True, **options)

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sample = call_arg(args, kwargs, self.latent_arg, self.latent_index)  # [B, F, C, H, W]
        if sample.dim() != 5:
            raise ValueError(f"{type(self.model).__name__} expects a latent [B, F, C, H, W], got {tuple(sample.shape)}")
        config = self.model.config
        p, p_t = int(config.patch_size), int(getattr(config, "patch_size_t", None) or 1)  # ConsisID: no p_t
        F, _, H, W = sample.shape[1:]
        return (int(F) // p_t, int(H) // p, int(W) // p)


class ConsisIDAdapter(CogVideoXAdapter):
    """Adapter for diffusers `ConsisIDTransformer3DModel` (ConsisID, identity-preserving CogVideoX-5B); see the
    module docstring."""

    name: ClassVar[str] = "consisid"
    model_class: ClassVar[str] = "ConsisIDTransformer3DModel"
    block_names: ClassVar[tuple[str, ...]] = ("ConsisIDBlock",)
    kinds: ClassVar[tuple[Kind, ...]] = (dataclasses.replace(CogVideoXAdapter.kinds[0], classes=("ConsisIDBlock",)),)
