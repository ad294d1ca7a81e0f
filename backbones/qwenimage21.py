"""`qwenimage21`: Qwen-Image 2.1 (diffusers `QwenImage21Transformer2DModel`), single-stream block-causal blocks.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_qwenimage21.py``):

* The model builds one joint sequence ``[prompt (with condition-image tokens in it), target image]``: the
  vision-language encoder's text with each image slot expanded to its ``2 x 2`` latent tokens, the target
  image's ``N`` tokens LAST (``img_mask`` ends with the target's slots). Every ``QwenImage21TransformerBlock``
  (kind ``"joint"``) runs ``attn(hidden_states=norm(x) * scale, rotary_emb=..., attention_mask=...,
  key_valid=..., segments=..., layer_cache=...)`` and ``img_mlp(norm(x) * scale)`` on the whole sequence.
* Attention is block-causal: the prefix never attends to the target, and the target's queries attend to every
  key. So the prefix does not depend on the target, and merging the target (the last ``N`` tokens of the
  block input, the rest kept: ``joint_context = "rest"``) changes only the target's keys and queries. Merge
  points: ``attn`` (``"attn"``: the complex RoPE table ``[P + N, d/2]`` over the joint sequence has its image rows
  gathered per slot; the key masks ``key_valid [B, P + N]`` (prefill, :class:`KeyValidAttention`) and
  ``attention_mask [B, 1, 1, P + N]`` (cached steps) have their image columns gathered) and ``img_mlp`` (``"mlp"``).
  The prefix ``segments`` and the prefix KV cache (``kv_cache_mode="extract"`` stores the prefix keys of the first
  step) are untouched; on cached steps (``kv_cache_mode="cached"``) the blocks get the target alone, with the cached
  prefix keys.
* ``QwenImage21FlexAttnProcessor`` passes a flex ``BlockMask`` built for the unmerged sequence: a merged call
  raises (use the default ``QwenImage21AttnProcessor``).
* Grid: ``img_shapes[0][-1] = (1, h, w)``, the target (samples share one layout; ``img_mask`` must end with its
  slots, read on the host once per mask tensor); condition images are part of the prefix and are not merged. The
  pipeline calls the model with ``timestep / 1000`` (``t_max = 1``).
* Received attention (``idm``, the ``sdtm`` schedules): the prompt's queries never see the target, so the probe
  reads the target's queries (``Site(probe="sdpa", probe_queries="image")``): at most 64 strided target queries'
  softmax over every key (prefix and target, with ``key_valid``), from the processor's SDPA call of the target
  (its call over the most keys: the prefill attends segment by segment; cached steps attend to the cached
  prefix keys), averaged over heads and queries, restricted to the target's keys and renormalised per sample.
  ``QwenImage21FlexAttnProcessor``'s prefill calls flex attention, not SDPA: the probe raises there.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar, Literal

from torch import nn

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site
from ._diffusers import call_arg
from ._host import HostFacts


@dataclasses.dataclass(frozen=True, eq=False)
class KeyValidAttention(DeclaredPoint):
    """``attn``, whose key mask ``key_valid`` (by keyword) is adjusted like its ``attention_mask``."""

    def mask_args(self) -> tuple[tuple[str, int | None], ...]:
        return (*super().mask_args(), ("key_valid", None))


class QwenImage21Adapter(DeclaredAdapter):
    """Adapter for diffusers `QwenImage21Transformer2DModel` (Qwen-Image 2.1, text-to-image and editing); see the
    module docstring."""

    name: ClassVar[str] = "qwenimage21"
    model_class: ClassVar[str] = "QwenImage21Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_shapes, img_mask)
    joint_context: ClassVar[Literal["text", "rest"]] = "rest"
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("joint", "transformer_blocks", ("QwenImage21TransformerBlock",), (
            # QwenImage21Attention.forward(hidden_states, **kwargs): every other argument by keyword
            Site("attn", "attn", tokens="joint", rope=Rope("rotary_emb", 1, "complex"), mask="keys",
                 mask_index=1, probe="sdpa", probe_queries="image", point=KeyValidAttention),
            Site("mlp", "img_mlp", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        # whether the first sample's img_mask ends with `slots` image slots: read once per mask tensor and count
        self._ends_with_image = HostFacts(lambda mask, slots: bool(mask[0, -slots:].all()))

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        shapes = call_arg(args, kwargs, "img_shapes", 3)
        img_mask = call_arg(args, kwargs, "img_mask", 4)  # [B, S] bool: True at image slots (2 x 2 tokens each)
        if not shapes or img_mask is None or any(list(s) != list(shapes[0]) for s in shapes):
            return None
        frames, h, w = shapes[0][-1]  # the target image, last
        slots = math.prod((frames, h, w)) // 4
        if int(frames) != 1 or slots == 0 or not self._ends_with_image(img_mask, slots):
            return None
        return int(h), int(w)

    def unknown_grid_reason(self) -> str:
        return "its img_shapes / img_mask do not end with one single-frame target image shared by the samples"
