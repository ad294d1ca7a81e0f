"""`ltx2`: LTX-2, joint video and audio generation (diffusers `LTX2VideoTransformer3DModel`, LTX-2.0 / 2.3).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_ltx2.py``):

* Every ``LTX2VideoTransformerBlock`` (kind ``"ltx2"``, in ``transformer_blocks``) carries two streams, the video
  tokens ``hidden_states [B, N, C]`` and the audio tokens ``audio_hidden_states [B, Na, Ca]``, and returns both.
  The video stream runs ``attn1`` (self-attention, ``query_rotary_emb`` the video RoPE, ``attention_mask`` the
  optional video self-attention mask ``[B, N, N]``), ``attn2`` (cross-attention to the prompt, a key bias
  ``[B, 1, T]``), ``audio_to_video_attn`` (a2v: video queries with the cross-modal RoPE ``query_rotary_emb``, audio
  keys/values with ``key_rotary_emb``) and ``ff``; the audio stream its own ``audio_attn1``, ``audio_attn2``,
  ``video_to_audio_attn`` (v2a: audio queries, video keys/values) and ``audio_ff``. Every sublayer is gated and
  added to its stream's residual.
* The block returns ``(hidden_states, audio_hidden_states)``, the new values of both streams (``outputs``): the
  block cache of the caching schedules keeps and reuses a residual per stream.
* The video stream is merged; the audio tokens are context. Merge points: ``attn1`` (``"attn"``; the RoPE gathered
  per slot, the self-attention mask gathered on both axes, received-attention probe), ``attn2`` (``"crossattn"``,
  the text bias broadcasts), ``audio_to_video_attn`` (``"crossattn"``: merged video queries with their gathered
  RoPE, the audio keys/values at full length; unmerged before its residual like every point) and ``ff``
  (``"mlp"``).
* ``video_to_audio_attn`` runs at full length and needs no merge point: its video keys/values are the modulated
  ``audio_to_video_norm(hidden_states)`` of the video residual stream after ``attn2`` (the normalisation that
  ``audio_to_video_attn`` reads too), which is full length between the merge points (each unmerges before its
  residual): one key and value per video token, ``[B, N, C]``. They equal the plain model's only when nothing
  before them is merged or reused from a cache: a merged ``attn1`` or ``attn2`` of the block, or any merge point of
  an earlier block, changes the residual stream they are read from. Merging them would change what it computes: a
  slot that stands for ``k`` tokens would get the softmax weight of one key (merged keys are exact only with a
  ``log k`` bias on the slot's logits, which the strategies' plans do not add). Keeping them is also cheap: its
  queries are the ``Na`` audio tokens (126 for 121 frames at 24 fps, against ``N = 6144`` video tokens at
  512 x 768), so its attention costs ``Na * N`` and its video side two projections of ``N`` tokens.
* RoPE: ``rope_type="split"`` (the released checkpoints) gives ``(cos, sin)`` tables ``[B, H, N, d/2]`` per head,
  ``"interleaved"`` ``[B, N, C]``: both the ``"batched"`` layout (tokens on the second-to-last axis; the split
  tables per head: :class:`SplitRopePoint`).
* Grid: the model gets the packed latent ``[B, N, C]`` and the latent ``num_frames``, ``height``, ``width`` (patch
  size 1): frames x height x width in raster order, as LTX-Video's. The timestep (``[B]``, or per token ``[B, N]``
  for image-to-video) is on the scheduler's scale (``timestep_scale_multiplier = 1000``): ``t_max = 1000``, per-token
  timesteps give their largest value.
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
