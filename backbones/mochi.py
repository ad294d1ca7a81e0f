"""`mochi`: Mochi 1 (diffusers `MochiTransformer3DModel`, genmo/mochi-1-preview).

Merges the video stream of every block's joint attention (its RoPE tables, without a batch axis, gathered per slot;
the text mask selects valid text tokens and passes) and feed-forward. The pipeline calls the model with ``t`` rising
from noise to data; the adapter reports ``1000 - t`` so that steps count from the noisiest call. The blocks, RoPE
and grid: docs/backbones/mochi.md.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg
from ._grid import latent_grid


class MochiAdapter(DeclaredAdapter):
    """Adapter for diffusers `MochiTransformer3DModel` (Mochi 1); see the module docstring."""

    name: ClassVar[str] = "mochi"
    model_class: ClassVar[str] = "MochiTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, mask, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("mochi", "transformer_blocks", ("MochiTransformerBlock",), (
            Site("attn", "attn1", output=0, rope=Rope("image_rotary_emb", 3, "broadcast"), mask="pass", probe=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        p = int(self.model.config.patch_size)
        return latent_grid(call_arg(args, kwargs, self.latent_arg, self.latent_index), (1, p, p))

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        t = super().call_timestep(args, kwargs)
        return None if t is None else self.t_max - t

    def scheduler_timesteps(self, timesteps: Tensor) -> Tensor:
        return self.t_max - timesteps.float()
