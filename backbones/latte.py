"""`latte`: Latte text-to-video (diffusers `LatteTransformer3DModel`, maxin-cn/Latte-1): spatial and temporal
blocks alternate; the spatial blocks are merged, frame by frame.

The model folds the frames into the batch, so each spatial block call is ``B * F`` images of one ``H x W`` grid,
merged like PixArt's blocks (self-attention, cross-attention queries, feed-forward). The temporal blocks attend over
each position's frames, which a merged frame no longer has, and run at full length between the spatial blocks,
which unmerge. Details: docs/backbones/latte.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Site
from ._diffusers import call_arg
from ._grid import latent_grid


class LatteAdapter(DeclaredAdapter):
    """Adapter for diffusers `LatteTransformer3DModel` (Latte-1): its spatial blocks, per frame; see the module
    docstring."""

    name: ClassVar[str] = "latte"
    model_class: ClassVar[str] = "LatteTransformer3DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("spatial", "transformer_blocks", ("BasicTransformerBlock",), (
            Site("attn", "attn1", probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sample = call_arg(args, kwargs, self.latent_arg, self.latent_index)  # [B, C, F, H, W]
        p = int(self.model.config.patch_size)
        return latent_grid(sample[:, :, 0], (p, p))  # one frame's grid: the spatial blocks see [B * F, H * W, C]
