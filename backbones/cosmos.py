"""`cosmos`: NVIDIA Cosmos world models (diffusers `CosmosTransformer3DModel`): Cosmos 1.0 Text2World /
Video2World, Cosmos Predict2 (2.0) Text2Image / Video2World and Predict2.5.

Merges the video tokens of every block's self-attention (3-D RoPE rows gathered), cross-attention queries and
feed-forward. One model class is called with three timestep conventions, all falling as sampling proceeds, so the
steps are counted in call order rather than matched to the scheduler's timesteps. The blocks, timesteps and grid:
docs/backbones/cosmos.md.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, Site


class CosmosAdapter(DeclaredAdapter):
    """Adapter for diffusers `CosmosTransformer3DModel` (Cosmos 1.0, Predict2, Predict2.5); see the module
    docstring."""

    name: ClassVar[str] = "cosmos"
    model_class: ClassVar[str] = "CosmosTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("cosmos", "transformer_blocks", ("CosmosTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "rows"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def scheduler_timesteps(self, timesteps: Tensor) -> Tensor | None:
        return None  # the pipelines call the model with c_noise, sigma / (sigma + 1) or sigma, not these
