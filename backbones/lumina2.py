"""`lumina2`: Lumina-Image 2.0 (diffusers `Lumina2Transformer2DModel`): image and caption refiners, then
single-stream blocks over the joint caption-image sequence.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_lumina2.py``):

* Every block is a ``Lumina2TransformerBlock``: ``attn(hidden_states=x, encoder_hidden_states=x, attention_mask,
  image_rotary_emb)`` (a self-attention called as ``attn(x, x)``, grouped-query heads, RoPE applied to q and k
  with a complex table ``[B, L, d/2]``, the key mask ``[B, L]`` broadcast over the queries), then
  ``feed_forward``. The model runs ``context_refiner`` on the caption alone (not merged), ``noise_refiner`` on
  the image tokens alone (kind ``"refiner"``), then ``layers`` (kind ``"joint"``) on the joint sequence.
* The joint sequence of sample ``b`` is ``[caption_b, image, padding]``: only the caption's real tokens
  (``encoder_attention_mask.sum()``, read on the host once per mask tensor, before the first block) precede the
  image, and shorter samples are padded at the end to the longest;
  the key mask is passed only when the lengths differ. Merge points, on the image part: ``attn`` (``"attn"``;
  the image rows of the rotary table gathered per slot, the caption and padding rows kept, the key mask
  likewise) and ``feed_forward`` (``"mlp"``). With per-sample caption lengths the image part starts at another
  row in every sample (a ragged joint sequence, :func:`~tomerge.backbones._gather.ragged_index`).
* Grid: the latent ``(H0 // p, W0 // p)``. Timesteps: the pipeline passes ``1 - t / 1000`` (0 is noise, 1 the
  image); the adapter reads ``1 - timestep`` (``t_max = 1``), so steps count from the noisiest as elsewhere.

Received attention (``idm``, the ``sdtm`` schedules): ``attn`` of every merged block, from its SDPA call
(:func:`~tomerge.backbones._diffusers.probe_sdpa_attention`: grouped-query heads, complex rotary tables, per-sample
caption offsets): strided image queries in the refiner, the caption queries against all keys in the joint
layers (the image keys' share, at each sample's offset). No text keys for prompt reweighting are declared (the
text-key bias takes one text length for the batch; Lumina 2's captions start the image at per-sample rows).
"""

from __future__ import annotations

from typing import Any, ClassVar

from torch import nn

from ._declared import DeclaredAdapter, Kind, RaggedText, Rope, SelfKVPoint, Site
from ._diffusers import call_arg
from ._host import HostFacts

_ROPE = Rope("image_rotary_emb", 3, "batched")  # [B, L, d/2] complex, caption rows first, by keyword


class Lumina2Adapter(DeclaredAdapter):
    """Adapter for diffusers `Lumina2Transformer2DModel` (Lumina-Image 2.0); see the module docstring."""

    name: ClassVar[str] = "lumina2"
    model_class: ClassVar[str] = "Lumina2Transformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, encoder_attention_mask)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("refiner", "noise_refiner", ("Lumina2TransformerBlock",), (
            Site("attn", "attn", rope=_ROPE, probe="sdpa", point=SelfKVPoint),
            Site("mlp", "feed_forward", arg="x"),
        )),
        Kind("joint", "layers", ("Lumina2TransformerBlock",), (
            Site("attn", "attn", tokens="joint", rope=_ROPE, mask="keys", probe="sdpa", point=SelfKVPoint),
            Site("mlp", "feed_forward", arg="x", tokens="joint"),
        ), joint_input="first"),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        # the caption lengths on the host, read once per mask tensor (the pipeline passes the same one every step)
        self._lengths = HostFacts(lambda mask: mask.sum(dim=1).tolist())

    def call_text(self, args: tuple, kwargs: dict) -> int | RaggedText:
        """The caption length (the real tokens of ``encoder_attention_mask [B, L]``), or per-sample lengths when
        they differ: read on the host once per mask tensor, before the first block."""
        mask = call_arg(args, kwargs, "encoder_attention_mask", 3)  # [B, L]
        lengths = self._lengths(mask)
        if len(set(lengths)) == 1:
            return lengths[0]
        return RaggedText(max(lengths), mask.sum(dim=1))  # [B] on the model's device

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        t = super().call_timestep(args, kwargs)
        return None if t is None else 1 - t
