"""`ltx2`: LTX-2, joint video and audio generation (diffusers `LTX2VideoTransformer3DModel`, LTX-2.0 / 2.3).

Merges the video stream of every block (self-attention, text and audio cross-attention, feed-forward); the audio
tokens are context and the audio-to-video direction's video keys stay at full length. The blocks, merge points,
RoPE layouts and grid: docs/backbones/ltx2.md.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import Tensor

from ._declared import DeclaredPoint, Kind, Rope, Site
from ._gather import gather_rope
from .ltx import LTXAdapter

# LTX2Attention(hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
_ROPE = Rope("query_rotary_emb", 3, "batched")


@dataclasses.dataclass(frozen=True, eq=False)
class SplitRopePoint(DeclaredPoint):
    """An attention whose ``"batched"`` rotary tables, when 4-D, are per head, ``[B or 1, H, N, d]``, their tokens on
    axis 2 (the split RoPE; the interleaved ``[B, N, d]`` tables keep the tokens on axis 1)."""

    def merged_rope(self, freqs: Any, dst: Tensor, num_tokens: int) -> Any:
        return gather_rope(freqs, dst, num_tokens, self.site.rope.layout, text_side=self.site.rope.text,
                           lengths=self.info.lengths, heads=True)


class LTX2Adapter(LTXAdapter):
    """Adapter for diffusers `LTX2VideoTransformer3DModel` (LTX-2.0, LTX-2.3); see the module docstring."""

    name: ClassVar[str] = "ltx2"
    model_class: ClassVar[str] = "LTX2VideoTransformer3DModel"
    # forward(hidden_states, audio_hidden_states, encoder_hidden_states, audio_encoder_hidden_states, timestep, ...)
    timestep_index: ClassVar[int] = 4
    text_index: ClassVar[int] = 2
    grid_args: ClassVar[tuple[tuple[str, int], ...]] = (("num_frames", 10), ("height", 11), ("width", 12))
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("ltx2", "transformer_blocks", ("LTX2VideoTransformerBlock",), (
            Site("attn", "attn1", rope=_ROPE, mask="pairs", probe=True, point=SplitRopePoint),
            Site("crossattn", "attn2", mask="pass"),
            Site("crossattn", "audio_to_video_attn", rope=_ROPE, point=SplitRopePoint),
            Site("mlp", "ff"),
        ), outputs=("hidden_states", "audio_hidden_states")),
    )
