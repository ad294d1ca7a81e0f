"""`kandinsky6`: Kandinsky 6, video and audio generated together (diffusers `Kandinsky6Transformer3DModel`).

Merges the video stream of the fused blocks (self-attention, text and audio cross-attention, feed-forward); the
audio tokens, the text and an image-to-video reference frame are context. The blocks, merge points, RoPE layout and
grid: docs/backbones/kandinsky6.md.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ._context import NO_CONTEXT, ContextTokens
from ._declared import Kind, Rope, Site
from ._diffusers import call_arg
from ._host import HostFacts
from .kandinsky5 import Kandinsky5Adapter

# Kandinsky6Attention(hidden_states, encoder_hidden_states, attn_mask, rotary_emb, rope_q, rope_kv)
_SELF_ROPE = Rope("rotary_emb", 3, "broadcast")
_QUERY_ROPE = Rope("rope_q", 4, "broadcast")


class Kandinsky6Adapter(Kandinsky5Adapter):
    """Adapter for diffusers `Kandinsky6Transformer3DModel` (Kandinsky 6 T2VA / TI2VA); see the module docstring."""

    name: ClassVar[str] = "kandinsky6"
    model_class: ClassVar[str] = "Kandinsky6Transformer3DModel"
    # forward(hidden_states, encoder_hidden_states, pooled_projections, timestep, audio_hidden_states,
    #         visual_rope_pos, encoder_attention_mask, visual_token_type_ids, return_dict)
    timestep_index: ClassVar[int] = 3
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("kandinsky6", "visual_transformer_blocks", ("Kandinsky6FusedTransformerDecoderBlock",), (
            Site("attn", "video_dec_block.self_attention", rope=_SELF_ROPE, probe=True),  # probe(): its norms
            Site("crossattn", "video_dec_block.cross_attention", mask="pass", mask_arg="attn_mask"),
            Site("crossattn", "va_cross_attention", rope=_QUERY_ROPE),
            Site("mlp", "video_dec_block.feed_forward"),
        ), arg="vis", outputs=("vis", "aud")),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self._reference_frames = HostFacts(self.reference_frames)  # read once per type-ids tensor and frame count

    def call_layout(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ContextTokens]:
        latent = call_arg(args, kwargs, "hidden_states", 0)  # [B, F, H, W, C]
        frames, rows, cols = (int(size) // int(p) for size, p in zip(latent.shape[1:4], self.model.config.patch_size))
        token_types = call_arg(args, kwargs, "visual_token_type_ids", 7)  # [B, F] or None
        reference = 0 if token_types is None else self._reference_frames(token_types, frames)
        if reference is None:
            return None, NO_CONTEXT
        context = ContextTokens(after=reference * rows * cols) if reference else NO_CONTEXT
        return (frames - reference, rows, cols), context

    @staticmethod
    def reference_frames(token_types: Tensor | None, frames: int) -> int | None:
        """The reference frames at the end of the call's ``frames`` patchified frames: the trailing frames whose
        ``visual_token_type_ids [B, F]`` are not 0, the same in every sample; ``None`` when the type ids mark
        other frames (not one target grid followed by context). Runs on the host (the adapter reads the type ids
        once per tensor)."""
        if token_types is None:
            return 0
        marked = token_types.detach().cpu() != 0  # [B, F]
        count = int(marked[0].sum())
        trailing = torch.arange(frames, device=marked.device) >= frames - count  # [F]: the last `count` frames
        if count >= frames or not torch.equal(marked, trailing.expand_as(marked)):
            return None
        return count

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        return self.call_layout(args, kwargs)[0]

    def unknown_grid_reason(self) -> str:
        return ("its visual_token_type_ids mark frames other than trailing reference frames shared by the batch, or "
                "every frame")
