"""`hidream`: HiDream-I1 (diffusers `HiDreamImageTransformer2DModel`): double-stream, then single-stream blocks,
with mixture-of-experts feed-forwards.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_hidream_image.py``):

* Every block is a ``HiDreamBlock`` wrapper whose ``block`` is the real one. ``HiDreamImageTransformerBlock``
  (kind ``"double"``, in ``double_stream_blocks``) runs ``attn1(norm_image, hidden_states_masks, norm_text,
  image_rotary_emb=...)``: the processor projects image and text separately, joins ``[image, text]``, applies
  RoPE to the joint q/k with one table ``[B, N + T, 1, d/2, 2, 2]`` (image rows first) and returns ``(image,
  text)``; then ``ff_i`` on the image stream (``ff_t`` on the text). The text ``T`` of a double block is the
  T5 tokens, the last Llama layer's and this block's Llama layer's.
* ``HiDreamImageSingleTransformerBlock`` (kind ``"single"``, in ``single_stream_blocks``) gets the joint
  ``[image, text]`` sequence (``T`` as in the double blocks) and runs ``attn1`` (single-stream: one projection)
  and ``ff_i`` on all of it.
* Merge points: ``block.attn1`` (``"attn"``; the image rows of the rotary table gathered per slot, the text rows
  kept) and ``block.ff_i`` (``"mlp"``), on the image part of the joint sequences. ``ff_i`` is a mixture of
  experts (``MOEFeedForwardSwiGLU``: a softmax router picks 2 of 4 experts per token, plus a shared expert):
  merging before it routes the merged slots, one routing per slot; each slot still costs 2 experts.
* Grid: the latent ``(H0 // p, W0 // p)`` of a square latent. A non-square latent is padded to
  ``max_resolution``'s token count with a key mask (``hidden_states_masks``): such calls are not merged (a
  warning). Timesteps: the scheduler's, ``[0, 1000]``.

Received attention (``idm``, the ``sdtm`` schedules): ``block.attn1`` of every block, from its SDPA call
(:func:`~tomerge.backbones._diffusers.probe_sdpa_attention`: HiDream's attention has its own projections and
rotary function), text queries against all keys, the image keys' share. Prompt reweighting
(``Site(text_keys=True)``): the text keys of ``block.attn1``, the block call's ``T`` last.
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
