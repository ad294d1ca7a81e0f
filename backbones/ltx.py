"""`ltx`: LTX-Video (diffusers `LTXVideoTransformer3DModel`, LTX-Video 0.9.x).

Merges the video tokens of every block's self-attention (its RoPE, over the whole width, gathered per sample and
slot), cross-attention queries and feed-forward. The model gets a packed latent with its frame, height and width
counts, which give the grid. The merge points, grid, timesteps and limits: docs/backbones/ltx.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg


class LTXAdapter(DeclaredAdapter):
    """Adapter for diffusers `LTXVideoTransformer3DModel` (LTX-Video 0.9.x); see the module docstring."""

    name: ClassVar[str] = "ltx"
    model_class: ClassVar[str] = "LTXVideoTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, mask, F, H, W, ...)
    #: keyword and position of the model call's latent ``num_frames``, ``height``, ``width``
    grid_args: ClassVar[tuple[tuple[str, int], ...]] = (("num_frames", 4), ("height", 5), ("width", 6))
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("ltx", "transformer_blocks", ("LTXVideoTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "batched"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sizes = [call_arg(args, kwargs, name, i) for name, i in self.grid_args]
        if any(s is None for s in sizes):
            return None
        grid = tuple(int(s) for s in sizes)
        p, pt = int(self.model.config.patch_size), int(self.model.config.patch_size_t)
        return (grid[0] // pt, grid[1] // p, grid[2] // p)

    def unknown_grid_reason(self) -> str:
        return "num_frames, height and width were not passed"
