"""`allegro`: Allegro text-to-video (diffusers `AllegroTransformer3DModel`, rhymes-ai/Allegro).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_allegro.py``):

* Every ``AllegroTransformerBlock`` (kind ``"allegro"``, in ``transformer_blocks``) runs ``attn1(norm1(x) *
  (1 + scale) + shift, attention_mask=None, image_rotary_emb=...)`` (self-attention over the video tokens with
  3-D RoPE), ``attn2(x, encoder_hidden_states=text, attention_mask=text_bias)`` (cross-attention to T5, no norm
  before it) and ``ff`` on ``norm2(x) * (1 + scale) + shift``.
* Merge points: ``attn1`` (``"attn"``; RoPE: ``apply_rotary_emb_allegro`` looks up per-axis ``(cos, sin)``
  tables with the ``(t, h, w)`` position ids ``[1, N]`` of every token, so the ids are gathered per slot:
  layout ``"allegro"``), ``attn2`` (``"crossattn"``: video queries; the text bias ``[B, 1, T]`` is over the keys
  and broadcasts; off unless ``merge_crossattn=True``), ``ff`` (``"mlp"``). ``attn1`` is a plain softmax
  self-attention: ``idm`` records the attention received there (``probe=True``).
* The self-attention ``attention_mask`` over video tokens (the pipeline never passes one) would have to follow
  the merge: a merged call with one raises.
* Grid: the latent ``[B, C, F, H, W]``: ``(F / p_t, H / p, W / p)`` (the release: ``p_t = 1``, ``p = 2``),
  frames x height x width in raster order. The pipeline passes the scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site


class AllegroAdapter(DeclaredAdapter):
    """Adapter for diffusers `AllegroTransformer3DModel` (Allegro T2V); see the module docstring."""

    name: ClassVar[str] = "allegro"
    model_class: ClassVar[str] = "AllegroTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size_t", "patch_size", "patch_size")
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("allegro", "transformer_blocks", ("AllegroTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "allegro"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )
