"""The declaration language of the declared adapters (:mod:`tomerge.backbones._declared`): a family's block kinds
(:class:`Kind`), their merge points (:class:`Site`) and rotary arguments (:class:`Rope`), as frozen dataclasses.

The fields say what most families share; what three families or fewer do otherwise is a method of their adapter, or
of a block or point class in their own file named by ``Kind(block=)`` or ``Site(point=)``
(``docs/backbones/adding-a-family.md``).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

Side = Literal["first", "last"]


@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary argument of a merge point's call.

    Args:
        arg: its keyword; ``index``: its position when given positionally.
        layout: ``"rows"``, ``"batched"``, ``"wan"``, ``"qwen"``, ``"complex"``, ``"broadcast"`` or ``"allegro"``
            (``docs/backbones/adding-a-family.md``, "Rotary tables").
        text: the side of the table's text rows, when it has more rows than image tokens (``"rows"``: always
            ``"first"``; ``"complex"``: the kind's other rows).
    """

    arg: str = "image_rotary_emb"
    index: int = 3
    layout: Literal["rows", "batched", "wan", "qwen", "complex", "broadcast", "allegro"] = "rows"
    text: Side = "first"

    def __post_init__(self) -> None:
        if self.layout == "rows" and self.text != "first":
            raise ValueError("a 'rows' rotary table has its text rows first (diffusers' joint [text, image] tables)")


@dataclasses.dataclass(frozen=True)
class Site:
    """One merge point of a block kind.

    Args:
        sublayer: ``"attn"``, ``"crossattn"`` or ``"mlp"``.
        path: the submodule, a dotted path from the block (``"attn"``, ``"ff.conv_inverted"``). A missing
            submodule (or ``None``, e.g. a block without ``attn2``) has no merge point.
        arg, index: keyword and position of the tokens in the submodule's call.
        output: index of the image tokens in a tuple output; ``None``: a tensor output.
        tokens: ``"image"``, ``"joint"`` or ``"conv"`` (``[B, C, H, W]``, or ``[B * F, C, H, W]``: ``F`` is the input's
            batch over the block input's).
        rope: the call's rotary table, gathered for the merged tokens; ``None``: none.
        mask: ``None``, ``"pass"``, ``"keys"`` or ``"pairs"``; ``mask_arg``, ``mask_index``: the mask's
            keyword/position.
        stays_merged_with: the output stays merged when the block call also merges this sublayer (a later
            site of the block reads it, passes it through and unmerges).
        text_keys: the submodule is the joint text-image attention of a kind with text (``text_arg`` or
            ``joint_input``: ``T`` text tokens on the kind's ``joint`` side of the sequence it attends over);
            prompt reweighting biases its text keys for the image queries (:mod:`tomerge.text_bias`).
        probe: ``idm`` records the attention each image token receives in this submodule, a softmax attention
            with diffusers-style projections. In a kind without text (no ``text_arg``, no ``joint_input``) it is a
            self-attention over the image tokens alone with ``to_q``/``to_k`` (and ``norm_q``/``norm_k``):
            strided image queries, from q and k before the rotary rotation, which the processor applies after
            them (:func:`~tomerge.backbones._diffusers.probe_self_attention`). In a kind with text it is the
            joint text-image attention of the block (text on the kind's ``joint`` side): the text queries'
            softmax over all keys, the image keys' share renormalised, with the model's rotary rotation
            (``rope``, layout ``"rows"``, ``"qwen"`` or ``"broadcast"``) and mask (``mask_arg``/``mask_index``)
            (:func:`~tomerge.backbones._diffusers.probe_joint_attention`). ``"sdpa"``: the same rule (text
            queries with text in the block, strided image queries without) from the q, k, mask and scale of the
            submodule's ``scaled_dot_product_attention`` call, for processors whose projections that probe cannot
            read (:func:`~tomerge.backbones._diffusers.probe_sdpa_attention`).
        probe_queries: the queries of a ``probe="sdpa"``: ``"text"`` (the rule above) or ``"image"``, strided image
            queries against all keys with or without text in the block, for an attention where no text query
            sees the image (OmniGen's causal condition tokens, Qwen-Image 2.1's block-causal prompt, Z-Image's
            noise refiner, whose "text" is the image's padding).
        point: the class of the merge point, a :class:`~tomerge.backbones._declared.DeclaredPoint` subclass that
            overrides what this call does otherwise (a further mask, another token layout, an argument that
            counts the tokens); ``None``: ``DeclaredPoint``.
    """

    sublayer: str
    path: str
    arg: str = "hidden_states"
    index: int = 0
    output: int | None = None
    tokens: Literal["image", "joint", "conv"] = "image"
    rope: Rope | None = None
    mask: Literal["pass", "keys", "pairs"] | None = None
    mask_arg: str = "attention_mask"
    mask_index: int = 2
    stays_merged_with: str | None = None
    text_keys: bool = False
    probe: bool | Literal["sdpa"] = False
    probe_queries: Literal["text", "image"] = "text"
    point: type | None = None

    def __post_init__(self) -> None:
        if self.probe_queries != "text" and self.probe != "sdpa":
            raise ValueError(f"Site {self.path!r}: probe_queries={self.probe_queries!r} is a rule of probe='sdpa', "
                             f"not of probe={self.probe!r}")


@dataclasses.dataclass(frozen=True)
class Kind:
    """One block type of a family.

    Args:
        name: the block kind (``Where.block_kind``, what schedules see).
        container: model attribute of the ``nn.ModuleList`` of these blocks (a dotted path reaches into an
            ``nn.ModuleDict``, e.g. FLUX.3's ``"mode_blocks.image"``).
        classes: class names of the blocks (the adapter's ``block_names``).
        sites: the merge points.
        arg, index: keyword/position of the block's token input.
        text_arg, text_index: the block's text argument (its length is ``T`` of joint sequences); ``None``.
        joint_input: the block input is itself a joint sequence with text on this side, ``T`` given by
            :meth:`DeclaredAdapter.joint_text` (the model call's text length unless the family says otherwise);
            ``None``: the block input is image tokens.
        joint: the side of text in the block's joint sequences (``"joint"`` sites, ``"keys"`` masks).
        outputs: the block returns a tuple: the argument each element is the new value of (``BlockSpec.outputs``,
            for the block cache of caching schedules); ``None``: it returns the new value of its token input.
        block: the class of the blocks, a :class:`~tomerge.backbones._declared.DeclaredBlock` subclass that reads
            the block's token input otherwise (ERNIE-Image's sequence-first ``[L, B, C]``); ``None``:
            ``DeclaredBlock``.
    """

    name: str
    container: str
    classes: tuple[str, ...]
    sites: tuple[Site, ...]
    arg: str = "hidden_states"
    index: int = 0
    text_arg: str | None = None
    text_index: int = 1
    joint_input: Side | None = None
    joint: Side = "first"
    outputs: tuple[str, ...] | None = None
    block: type | None = None
