"""`hunyuan_video` and `hunyuan_video15`: HunyuanVideo and HunyuanVideo 1.5 (diffusers
`HunyuanVideoTransformer3DModel`, `HunyuanVideo15Transformer3DModel`).

Merges the video stream of the double-stream blocks' joint ``[image, text]`` attention (text last) and
feed-forward, and in HunyuanVideo's single-stream blocks the image part of the parallel branch, as in FLUX.1's. The
blocks, RoPE, masks and grid: docs/backbones/hunyuan_video.md, which also holds FramePack and HunyuanImage 2.1,
built on these blocks.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # image rows only; by keyword in every block


class HunyuanVideoAdapter(DeclaredAdapter):
    """Adapter for diffusers `HunyuanVideoTransformer3DModel` (HunyuanVideo T2V and I2V); see the module docstring."""

    name: ClassVar[str] = "hunyuan_video"
    model_class: ClassVar[str] = "HunyuanVideoTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size_t", "patch_size", "patch_size")
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("HunyuanVideoTransformerBlock", "HunyuanVideoTokenReplaceTransformerBlock"), (
            Site("attn", "attn", output=0, rope=_ROPE, mask="keys", probe=True, text_keys=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
        Kind("single", "single_transformer_blocks",
             ("HunyuanVideoSingleTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock"), (
            Site("attn", "proj_mlp", arg="input", tokens="joint", stays_merged_with="mlp"),
            Site("attn", "attn", output=0, rope=_ROPE, mask="keys", stays_merged_with="mlp", probe=True,
                 text_keys=True),
            Site("mlp", "proj_out", arg="input", tokens="joint"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )


class HunyuanVideo15Adapter(HunyuanVideoAdapter):
    """Adapter for diffusers `HunyuanVideo15Transformer3DModel` (HunyuanVideo 1.5 T2V and I2V); see the module
    docstring."""

    name: ClassVar[str] = "hunyuan_video15"
    model_class: ClassVar[str] = "HunyuanVideo15Transformer3DModel"
    block_names: ClassVar[tuple[str, ...]] = ("HunyuanVideo15TransformerBlock",)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("HunyuanVideo15TransformerBlock",), (
            Site("attn", "attn", output=0, rope=_ROPE, mask="pass", probe=True, text_keys=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )
