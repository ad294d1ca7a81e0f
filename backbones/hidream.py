"""`hidream`: HiDream-I1 (diffusers `HiDreamImageTransformer2DModel`): double-stream, then single-stream blocks,
with mixture-of-experts feed-forwards.

Merges the image part of every block's joint ``[image, text]`` attention and of its image feed-forward (the real
block sits in a ``HiDreamBlock`` wrapper: ``block.attn1``, ``block.ff_i``); the mixture of experts then routes the
merged slots. The text length joins T5 and Llama tokens. The blocks, RoPE and limits: docs/backbones/hidream.md.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg

_ROPE = Rope("image_rotary_emb", 3, "batched", text="last")  # [B, N + T, 1, d/2, 2, 2], by keyword
_MASK = dict(mask_arg="hidden_states_masks", mask_index=1)  # None for square latents; a merged call refuses one


class HiDreamImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `HiDreamImageTransformer2DModel` (HiDream-I1 Full/Dev/Fast); see the module
    docstring."""

    name: ClassVar[str] = "hidream"
    model_class: ClassVar[str] = "HiDreamImageTransformer2DModel"
    timestep_arg: ClassVar[str] = "timesteps"  # forward(hidden_states, timesteps, encoder_hidden_states_t5, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "double_stream_blocks", ("HiDreamBlock",), (
            Site("attn", "block.attn1", arg="norm_hidden_states", output=0, rope=_ROPE, probe="sdpa", text_keys=True,
                 **_MASK),
            Site("mlp", "block.ff_i", arg="x"),
        ), text_arg="encoder_hidden_states", text_index=2, joint="last",
             outputs=("hidden_states", "encoder_hidden_states")),
        Kind("single", "single_stream_blocks", ("HiDreamBlock",), (
            Site("attn", "block.attn1", arg="norm_hidden_states", tokens="joint", rope=_ROPE, probe="sdpa",
                 text_keys=True, **_MASK),
            Site("mlp", "block.ff_i", arg="x", tokens="joint"),
        ), joint_input="last", joint="last"),
    )

    def call_text(self, args: tuple, kwargs: dict) -> int | None:
        """``T`` of the joint sequences: the T5 tokens and two Llama layers' tokens (the last one's, carried with
        the T5 tokens from block to block, and the block's own)."""
        t5 = call_arg(args, kwargs, "encoder_hidden_states_t5", 2)  # [B, T5, C]
        llama = call_arg(args, kwargs, "encoder_hidden_states_llama3", 3)  # [layers, B, T_llama, C]
        return int(t5.shape[1]) + 2 * int(llama[0].shape[1])

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sample = call_arg(args, kwargs, "hidden_states", 0)
        if sample.dim() != 4 or sample.shape[-2] != sample.shape[-1]:
            return None
        return super().call_grid(args, kwargs)

    def unknown_grid_reason(self) -> str:
        return ("a non-square (or already patchified) latent is padded to max_resolution's token count with a key "
                "mask, hidden_states_masks")
