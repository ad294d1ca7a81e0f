"""`kandinsky6`: Kandinsky 6, video and audio generated together (diffusers `Kandinsky6Transformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_kandinsky6.py`` and
``pipelines/kandinsky6/pipeline_kandinsky6_ti2va.py``):

* Two text branches (``video_text_transformer_blocks``, ``audio_text_transformer_blocks``) refine the Qwen2.5-VL
  prompt alone, before the fused blocks: no video tokens, not merged. Every fused block
  (``Kandinsky6FusedTransformerDecoderBlock``, kind ``"kandinsky6"``, in ``visual_transformer_blocks``) is called
  ``block(vis, aud, text_v, text_a, (t_v, t_a), vis_rope, aud_rope, attn_mask)`` with the video tokens ``vis
  [B, N, C]`` and the audio tokens ``aud [B, Na, Ca]`` (``None`` for a call without audio), and returns both,
  ``(vis, aud)``.
* The video stream is Kandinsky 5's block (``video_dec_block``: ``self_attention`` with the 3-D RoPE,
  ``cross_attention`` to the video text branch with the prompt's key mask, ``feed_forward``), with one more
  sublayer between the cross-attention and the feed-forward: ``va_cross_attention`` (video queries, the audio
  stream's modulated tokens as keys/values; with ``ca_rope``, as released, the video RoPE on the queries as
  ``rope_q`` and the audio RoPE on the keys as ``rope_kv``). The audio stream (``audio_dec_block``) runs its own
  self-attention, text cross-attention and feed-forward, and ``av_cross_attention`` (audio queries, keys/values the
  video stream's modulated input of ``cross_attention``).
* The video stream is merged; the audio tokens, the text and an image-to-video reference frame are context. Merge
  points: ``video_dec_block.self_attention`` (``"attn"``; RoPE gathered per slot, received-attention probe on the
  per-head ``query_norm``/``key_norm`` outputs as Kandinsky 5's), ``video_dec_block.cross_attention``
  (``"crossattn"``; the prompt's ``[B, T]`` key mask, reshaped to ``[B, 1, 1, T]`` by the attention backend,
  broadcasts over any number of queries), ``va_cross_attention`` (``"crossattn"``: merged video queries with their
  gathered ``rope_q``, the audio keys/values and their ``rope_kv`` at full length) and
  ``video_dec_block.feed_forward`` (``"mlp"``). Each is unmerged before its gated residual.
* ``av_cross_attention`` runs at full length and needs no merge point: its video keys/values are the block's
  ``vis_pre_ca``, the modulated video stream that ``cross_attention`` gets; a merge point replaces the tokens of
  that call only, so the block's variable stays the full-length stream (the residual stream, unmerged before each
  residual). Merging them would give a slot of ``k`` tokens the softmax weight of one key (as LTX-2's
  ``video_to_audio_attn``); its queries are the ``Na`` audio tokens, so it costs ``Na * N``.
* RoPE: one table of 2 x 2 rotation matrices per token, ``[N, 1, d/2, 2, 2]``, without a batch axis and broadcast
  over the heads of ``[B, N, heads, d/2, 1, 2]`` q/k (``apply_rotary``): the ``"broadcast"`` layout with one table.
  The self-attention passes it as ``rotary_emb``, which also rotates its keys.
* Grid: the latent is channels-last, ``[B, F, H, W, C]`` (noise, condition and mask channels with ``visual_cond``),
  patchified by ``patch_size = (1, 2, 2)`` and flattened frame by frame. Image-to-video appends the clean reference
  frame as one more latent frame, marked by ``visual_token_type_ids [B, F]`` (1 on the appended frame, 0 on the
  generated ones) and placed at temporal RoPE position 0: its ``H / 2 x W / 2`` tokens are context after the target
  ``(F - 1, H / 2, W / 2)``. The pipelines pass the scheduler's timestep, ``[B]`` (``t_max = 1000``).
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
