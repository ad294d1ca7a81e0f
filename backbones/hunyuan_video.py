"""`hunyuan_video` and `hunyuan_video15`: HunyuanVideo and HunyuanVideo 1.5 (diffusers
`HunyuanVideoTransformer3DModel`, `HunyuanVideo15Transformer3DModel`).

Facts from the installed diffusers (0.42.1, ``transformer_hunyuan_video.py``, ``transformer_hunyuan_video15.py``):

* Double-stream blocks (kind ``"double"``, ``transformer_blocks``: ``HunyuanVideoTransformerBlock``, the
  token-replace variant of image-to-video, and ``HunyuanVideo15TransformerBlock``) run ``attn(hidden_states=
  norm1(x), encoder_hidden_states=norm1_context(c), attention_mask=..., image_rotary_emb=freqs)``: a joint
  attention over ``[image, text]`` (text LAST) with RoPE on the image rows only, returning ``(image, text)``;
  then ``ff`` on the image stream. Merge points: ``attn`` (``"attn"``; the ``[N, d]`` RoPE table gathered per
  slot) and ``ff`` (``"mlp"``).
* HunyuanVideo's attention mask is a key mask ``[B, 1, 1, N + T]`` over ``[image, text]``: its image columns
  are gathered per slot. HunyuanVideo 1.5 passes a text-only mask ``[B, T]`` that the processor pads to the
  (merged) joint length itself: passed through.
* HunyuanVideo's single-stream blocks (kind ``"single"``, ``single_transformer_blocks``) concatenate
  ``[image, text]`` before their norm; ``proj_mlp`` reads the normalised joint sequence, ``attn`` its image
  part (and its text part as ``encoder_hidden_states``), and ``proj_out`` reads ``cat([attn, mlp], -1)`` of
  the joint sequence. As in FLUX.1's single blocks: ``proj_mlp`` and ``attn`` are ``"attn"`` (the parallel
  branch that reads the normalised tokens; merged once, shared), ``proj_out`` is ``"mlp"``; with both on the
  block runs merged from its norm to ``proj_out`` and only ``proj_out``'s output is unmerged. HunyuanVideo 1.5
  has no single-stream blocks.
* Grid: the latent ``[B, C, F, H, W]`` divided by ``(patch_size_t, patch_size, patch_size)``: ``(T, H, W)``
  frames x height x width. Both pipelines pass the scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # image rows only; by keyword in every block


class HunyuanVideoAdapter(DeclaredAdapter):
    """Adapter for diffusers `HunyuanVideoTransformer3DModel` (HunyuanVideo T2V and I2V); see the module docstring."""

    name: ClassVar[str] = "hunyuan_video"
    model_class: ClassVar[str] = "HunyuanVideoTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size_t", "patch_size", "patch_size")
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("HunyuanVideoTransformerBlock", "HunyuanVideoTokenReplaceTransformerBlock"), (
            Site("attn", "attn", output=0, rope=_ROPE, mask="keys", probe=True, text_keys=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
        Kind("single", "single_transformer_blocks",
             ("HunyuanVideoSingleTransformerBlock", "HunyuanVideoTokenReplaceSingleTransformerBlock"), (
            Site("attn", "proj_mlp", arg="input", tokens="joint", stays_merged_with="mlp"),
            Site("attn", "attn", output=0, rope=_ROPE, mask="keys", stays_merged_with="mlp", probe=True,
                 text_keys=True),
            Site("mlp", "proj_out", arg="input", tokens="joint"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )


class HunyuanVideo15Adapter(HunyuanVideoAdapter):
    """Adapter for diffusers `HunyuanVideo15Transformer3DModel` (HunyuanVideo 1.5 T2V and I2V); see the module
    docstring."""

    name: ClassVar[str] = "hunyuan_video15"
    model_class: ClassVar[str] = "HunyuanVideo15Transformer3DModel"
    block_names: ClassVar[tuple[str, ...]] = ("HunyuanVideo15TransformerBlock",)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("double", "transformer_blocks", ("HunyuanVideo15TransformerBlock",), (
            Site("attn", "attn", output=0, rope=_ROPE, mask="pass", probe=True, text_keys=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )
