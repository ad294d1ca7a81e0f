"""`easyanimate`: EasyAnimate V5 / V5.1 (diffusers `EasyAnimateTransformer3DModel`), text-to-video and the
inpainting (image-to-video) and control variants.

Merges the video stream of every block's joint ``[text, video]`` attention (RoPE rows gathered) and the first call
of its feed-forward: blocks without text projections call the same ``ff`` again on the text, which runs as it is
(``SharedPoint``). The blocks and grid: docs/backbones/easyanimate.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from tomerge.state import MergeState

from ._declared import DeclaredAdapter, Kind, Rope, SharedPoint, Site
from ._diffusers import call_arg, probe_joint_attention
from ._grid import latent_grid


class EasyAnimateAdapter(DeclaredAdapter):
    """Adapter for diffusers `EasyAnimateTransformer3DModel` (EasyAnimate V5.1 T2V, InP, Control); see the module
    docstring."""

    name: ClassVar[str] = "easyanimate"
    model_class: ClassVar[str] = "EasyAnimateTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, timestep_cond, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 3
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("easyanimate", "transformer_blocks", ("EasyAnimateTransformerBlock",), (
            Site("attn", "attn1", output=0, rope=Rope("image_rotary_emb", 3, "rows"), probe=True),
            Site("mlp", "ff", point=SharedPoint),
        ), text_arg="encoder_hidden_states", outputs=("hidden_states", "encoder_hidden_states")),
    )

    def probe_joint(self, attention: nn.Module, state: MergeState, **options: Any) -> list[Any]:
        """The joint probe of ``attn1``, whose processor normalises q/k with the heads first (``[B, heads, L, d]``) and
        rotates the image rows of the q/k the probe captures in place (``key[:, :, T:] = apply_rotary_emb(...)``),
        so the probe reads the norms so and keeps copies."""
        return probe_joint_attention(attention, state, heads_first=True, copies=True, **options)

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        p = int(self.model.config.patch_size)
        return latent_grid(call_arg(args, kwargs, self.latent_arg, self.latent_index), (1, p, p))
