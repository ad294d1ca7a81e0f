"""`cogvideox` and `consisid`: CogVideoX 1.0 / 1.5 and ConsisID (diffusers `CogVideoXTransformer3DModel`,
`ConsisIDTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``cogvideox_transformer_3d.py``, ``consisid_transformer_3d.py``):

* Every ``CogVideoXBlock`` / ``ConsisIDBlock`` (kind ``"cogvideox"``, in ``transformer_blocks``) runs
  ``attn1(hidden_states=norm1(x), encoder_hidden_states=norm1(c), image_rotary_emb=freqs)``: the processor
  (``CogVideoXAttnProcessor2_0``) attends over the joint ``[text, video]`` sequence (text FIRST), rotates the
  video rows only with the ``(cos, sin)`` tables ``[N, d]`` and returns ``(video, text)``. Then ``ff`` reads
  the joint sequence ``cat([norm2(c), norm2(x)])`` and the block splits its output at the text length.
* Merge points: ``attn1`` (``"attn"``; the RoPE rows gathered per slot, 5B and 1.5; CogVideoX-2B has no RoPE:
  sin-cos positions are added at the patch embedding) and ``ff`` (``"mlp"``, ``tokens="joint"``: the video
  part of the joint sequence is merged, the text part kept). No attention mask.
* Grid: the latent is FRAMES FIRST, ``[B, F, C, H, W]``; CogVideoX 1.0 patches each frame ``p x p``
  (``patch_size_t = None``), 1.5 patches ``p_t x p x p`` (``patch_size_t = 2``): ``(F / p_t, H / p, W / p)``,
  frames x height x width in raster order. Image-to-video (CogVideoX-5b-I2V, 1.5-I2V, ConsisID) concatenates
  the image latent along channels: the same grid. The pipelines pass the scheduler's timestep
  (``t_max = 1000``).
* ConsisID adds, between blocks (outside them), a perceiver cross-attention from the video tokens to the face
  embedding; it runs at full length.
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
