"""`hunyuan_dit`: Hunyuan-DiT (diffusers `HunyuanDiT2DModel`): a DiT with cross-attention to CLIP and T5 text and
long skip connections (U-ViT style).

Facts from the installed diffusers (0.42.1, ``models/transformers/hunyuan_transformer_2d.py``):

* Every ``HunyuanDiTBlock`` (kind ``"hunyuan_dit"``, in ``blocks``) runs ``attn1(norm1(x), image_rotary_emb=...)``
  (self-attention over the image tokens), ``attn2(norm2(x), encoder_hidden_states=text, image_rotary_emb=...)``
  (cross-attention to the joined CLIP + T5 text; RoPE rotates its image queries only) and ``ff(norm3(x))``. The
  blocks of the second half first fuse a long skip connection (``skip_linear(cat([x, skip]))``, the output of a
  first-half block) into their input; merging happens after it, inside the block, and every block's output is
  full length, so the skips are untouched.
* Merge points: ``attn1`` (``"attn"``), ``attn2`` (``"crossattn"``, image queries; off unless
  ``merge_crossattn=True``) and ``ff`` (``"mlp"``). Both attentions take the same ``(cos, sin)`` tables ``[N, d]``
  (image rows only, from the pipeline): gathered per slot. No attention mask (padded text is replaced by a
  learned padding embedding before the blocks).
* Grid: the latent ``(H0 // p, W0 // p)``. Timesteps: the scheduler's, ``[0, 1000]``.

Received attention (``idm``, the ``sdtm`` schedules): ``attn1`` is a softmax self-attention over the image tokens
with ``to_q``/``to_k`` and q/k norms: a declared probe (from q and k before the rotary rotation).
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # image rows only [N, d], by keyword


class HunyuanDiTAdapter(DeclaredAdapter):
    """Adapter for diffusers `HunyuanDiT2DModel` (Hunyuan-DiT v1.0-v1.2); see the module docstring."""

    name: ClassVar[str] = "hunyuan_dit"
    model_class: ClassVar[str] = "HunyuanDiT2DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("hunyuan_dit", "blocks", ("HunyuanDiTBlock",), (
            Site("attn", "attn1", rope=_ROPE, probe=True),
            Site("crossattn", "attn2", rope=_ROPE),
            Site("mlp", "ff"),
        )),
    )
