"""FLUX.1-derived families: `chroma` (Chroma), `bria` (Bria 3.x), `bria_fibo` (FIBO), `longcat_image`
(LongCat-Image) and `ovis_image` (Ovis-Image), declared on FLUX.1's block layout.

Facts from the installed diffusers (0.42.1; ``transformer_chroma.py``, ``transformer_bria.py``,
``transformer_bria_fibo.py``, ``transformer_longcat_image.py``, ``transformer_ovis_image.py``), shared by all five:

* Double-stream blocks (kind ``"double"``, ``transformer_blocks``) run ``attn(hidden_states=norm1(x),
  encoder_hidden_states=norm1_context(c), image_rotary_emb=...)``: the processor projects image and text
  separately, attends over ``[text, image]`` with RoPE ``(cos, sin)`` of ``[T + N, d]`` (text rows first) and
  returns ``(image, text)``; then ``ff`` on the image stream. Merge points: ``attn`` (``"attn"``; the image rows
  of the RoPE table gathered per slot) and ``ff`` (``"mlp"``); ``ff_context`` (text) is left alone.
* Single-stream blocks (kind ``"single"``, ``single_transformer_blocks``) normalise the joint ``[text, image]``
  sequence; ``proj_mlp`` and ``attn`` read it in parallel and ``proj_out`` reads ``cat([attn, mlp], -1)``. As
  in FLUX.1's single blocks: ``proj_mlp`` and ``attn`` are ``"attn"`` (the parallel branch that reads the
  normalised tokens), ``proj_out`` is ``"mlp"``; with both on, the block runs merged from its norm to
  ``proj_out`` and only ``proj_out``'s output is unmerged. Bria, LongCat-Image and Ovis-Image concatenate the
  block's ``encoder_hidden_states`` and image tokens themselves (``T`` from the block call); Chroma and FIBO get
  the joint sequence from the model (``T`` from the model call's ``encoder_hidden_states``).
* Received attention (``idm``): the joint probe of both attentions (the text queries' attention, with the
  call's RoPE and mask).
* Grid: ``img_ids [N, 3]`` hold ``(0, row, col)`` of every image token in raster order; the grid is read from
  them on every call. Editing pipelines that append reference-image tokens (FIBO Edit, LongCat-Image Edit)
  give ids that are no single grid: those calls are not merged, with a warning.

Family differences:

* Chroma (pruned modulation, a T5 text mask): the pipeline's ``attention_mask [B, T + N]`` becomes, inside every
  block, the query-by-key mask ``m[:, None, None, :] * m[:, None, :, None]`` ``[B, 1, L, L]``: its image rows and
  columns are gathered per slot (``mask="pairs"``). Called with ``timestep / 1000`` (``t_max = 1``).
* FIBO: the pipeline passes a key mask ``[B, 1, 1, T + N]`` (``joint_attention_kwargs["attention_mask"]``, text
  first) to every attention when a prompt is padded: its image columns are gathered (``mask="keys"``). Its text
  stream is renewed per block from the text encoder's layers (outside the blocks). Called with the scheduler's
  timestep (``t_max = 1000``), as is Bria.
* LongCat-Image and Ovis-Image (an Ovis SwiGLU MLP): no masks; called with ``timestep / 1000`` (``t_max = 1``).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # attn.forward(hidden_states, encoder_hidden_states, attention_mask, rope)
_Mask = Literal["keys", "pairs"] | None


def double_kind(block_class: str, mask: _Mask = None) -> Kind:
    """The double-stream blocks ``transformer_blocks`` of ``block_class`` (see the module docstring)."""
    return Kind("double", "transformer_blocks", (block_class,), (
        Site("attn", "attn", output=0, rope=_ROPE, mask=mask, probe=True),
        Site("mlp", "ff"),
    ), text_arg="encoder_hidden_states", outputs=("encoder_hidden_states", "hidden_states"))


def single_kind(block_class: str, joint_input: bool, mask: _Mask = None) -> Kind:
    """The single-stream blocks ``single_transformer_blocks`` of ``block_class``; ``joint_input``: the block gets
    the joint ``[text, image]`` sequence from the model, else ``(hidden_states, encoder_hidden_states)``."""
    sites = (
        Site("attn", "proj_mlp", arg="input", tokens="joint", stays_merged_with="mlp"),
        Site("attn", "attn", tokens="joint", rope=_ROPE, mask=mask, stays_merged_with="mlp", probe=True),
        Site("mlp", "proj_out", arg="input", tokens="joint"),
    )
    if joint_input:
        return Kind("single", "single_transformer_blocks", (block_class,), sites, joint_input="first")
    return Kind("single", "single_transformer_blocks", (block_class,), sites, text_arg="encoder_hidden_states",
                outputs=("encoder_hidden_states", "hidden_states"))


class ChromaAdapter(DeclaredAdapter):
    """Adapter for diffusers `ChromaTransformer2DModel` (Chroma1-HD, Chroma1-Base); see the module docstring."""

    name: ClassVar[str] = "chroma"
    model_class: ClassVar[str] = "ChromaTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 3)
    kinds: ClassVar[tuple[Kind, ...]] = (
        double_kind("ChromaTransformerBlock", mask="pairs"),
        single_kind("ChromaSingleTransformerBlock", joint_input=True, mask="pairs"),
    )


class BriaAdapter(DeclaredAdapter):
    """Adapter for diffusers `BriaTransformer2DModel` (Bria 3.2); see the module docstring."""

    name: ClassVar[str] = "bria"
    model_class: ClassVar[str] = "BriaTransformer2DModel"
    timestep_index: ClassVar[int] = 3  # forward(hidden_states, encoder_hidden_states, pooled, timestep, img_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 4)
    kinds: ClassVar[tuple[Kind, ...]] = (
        double_kind("BriaTransformerBlock"),
        single_kind("BriaSingleTransformerBlock", joint_input=False),
    )


class BriaFiboAdapter(DeclaredAdapter):
    """Adapter for diffusers `BriaFiboTransformer2DModel` (FIBO); see the module docstring."""

    name: ClassVar[str] = "bria_fibo"
    model_class: ClassVar[str] = "BriaFiboTransformer2DModel"
    timestep_index: ClassVar[int] = 4  # forward(hidden_states, encoder_hidden_states, layers, pooled, timestep, img_ids)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 5)
    kinds: ClassVar[tuple[Kind, ...]] = (
        double_kind("BriaFiboTransformerBlock", mask="keys"),
        single_kind("BriaFiboSingleTransformerBlock", joint_input=True, mask="keys"),
    )


class LongCatImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `LongCatImageTransformer2DModel` (LongCat-Image); see the module docstring."""

    name: ClassVar[str] = "longcat_image"
    model_class: ClassVar[str] = "LongCatImageTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 3)
    kinds: ClassVar[tuple[Kind, ...]] = (
        double_kind("LongCatImageTransformerBlock"),
        single_kind("LongCatImageSingleTransformerBlock", joint_input=False),
    )


class OvisImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `OvisImageTransformer2DModel` (Ovis-Image); see the module docstring."""

    name: ClassVar[str] = "ovis_image"
    model_class: ClassVar[str] = "OvisImageTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, img_ids, ...)
    ids_arg: ClassVar[tuple[str, int]] = ("img_ids", 3)
    kinds: ClassVar[tuple[Kind, ...]] = (
        double_kind("OvisImageTransformerBlock"),
        single_kind("OvisImageSingleTransformerBlock", joint_input=False),
    )
