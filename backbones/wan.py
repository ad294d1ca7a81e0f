"""`wan`: Wan 2.1 / 2.2 text-to-video and image-to-video (diffusers `WanTransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_wan.py``):

* Every ``WanTransformerBlock`` (kind ``"wan"``, in ``blocks``) runs ``attn1(norm1(x) * (1 + scale) + shift,
  None, None, rotary_emb)`` (self-attention with 3-D RoPE), ``attn2(norm2(x), encoder_hidden_states, None,
  None)`` (cross-attention to the UMT5 text; image-to-video 2.1 also attends to the CLIP image tokens in front
  of the text, through ``add_k_proj``/``add_v_proj``), and ``ffn`` on ``norm3(x) * (1 + scale) + shift``.
* Merge points: ``attn1`` (``"attn"``; RoPE ``(cos, sin)``, each ``[1, N, 1, d]``, gathered to ``[B, M, 1,
  d]``), ``attn2`` (``"crossattn"``: image queries, keys/values are text and image context and stay; off unless
  ``merge_crossattn=True``), ``ffn`` (``"mlp"``).
* Wan 2.2 TI2V's per-token modulation (``temb [B, N, 6, C]``) is applied by the block before the merge points
  and its gates after the unmerge, so it needs nothing; its per-token timestep ``[B, N]`` (0 on the
  conditioning frame) gives the step by its largest value.
* Grid: the latent ``[B, C, F, H, W]`` divided by ``patch_size = (p_t, p_h, p_w)``: ``(F / p_t, H / p_h,
  W / p_w)``, frames x height x width in raster order (the patch embedding is a strided ``Conv3d`` flattened
  as ``(f, h, w)``). Image-to-video 2.1/2.2 concatenate the condition latents along channels: the same grid.
  The pipeline passes the scheduler's timestep (``t_max = 1000``).
* Wan 2.2 A14B has two transformers (``pipe.transformer`` for high noise, ``pipe.transformer_2`` for low
  noise): ``tomerge.apply(pipe, ...)`` patches ``pipe.transformer``; patch ``pipe.transformer_2`` with its
  own ``tomerge.apply(pipe.transformer_2, ..., num_steps=...)``.
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site


class WanAdapter(DeclaredAdapter):
    """Adapter for diffusers `WanTransformer3DModel` (Wan 2.1/2.2 T2V, I2V, TI2V); see the module docstring."""

    name: ClassVar[str] = "wan"
    model_class: ClassVar[str] = "WanTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("wan", "blocks", ("WanTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("rotary_emb", 3, "wan"), probe=True),
            Site("crossattn", "attn2"),
            Site("mlp", "ffn"),
        )),
    )
