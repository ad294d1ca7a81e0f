"""FLUX.1-derived families: `chroma` (Chroma), `bria` (Bria 3.x), `bria_fibo` (FIBO), `longcat_image`
(LongCat-Image) and `ovis_image` (Ovis-Image), declared on FLUX.1's block layout.

Their blocks, merge points, masks, timestep scales and what differs between them: docs/backbones/flux1_derived.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ._declared import DeclaredAdapter, Kind, Rope, Site

_ROPE = Rope("image_rotary_emb", 3, "rows")  # attn.forward(hidden_states, encoder_hidden_states, attention_mask, rope)
_Mask = Literal["keys", "pairs"] | None


def double_kind(block_class: str, mask: _Mask = None) -> Kind:
    """The double-stream blocks ``transformer_blocks`` of ``block_class`` (docs/backbones/flux1_derived.md)."""
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
