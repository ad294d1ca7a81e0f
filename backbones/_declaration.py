"""The declaration language of the declared adapters (:mod:`tomerge.backbones._declared`): a family's block kinds
(:class:`Kind`), their merge points (:class:`Site`) and rotary arguments (:class:`Rope`), as frozen dataclasses.

The fields say what most families share; what one family does otherwise is a method of its adapter, block or point
class in its own file (``docs/backbones/adding-a-family.md``).
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
            (see the module docstring).
        text: the side of the table's text rows, when it has more rows than image tokens (``"rows"``: always
            ``"first"``; ``"complex"``: the kind's other rows).
        heads: a 4-D ``"batched"`` table is per head, ``[B or 1, H, N, d]``, its tokens on axis 2 (LTX-2's split
            RoPE; its interleaved ``[B, N, d]`` tables keep the tokens on axis 1).
    """

    arg: str = "image_rotary_emb"
    index: int = 3
    layout: Literal["rows", "batched", "wan", "qwen", "complex", "broadcast", "allegro"] = "rows"
    text: Side = "first"
    heads: bool = False

    def __post_init__(self) -> None:
        if self.layout == "rows" and self.text != "first":
            raise ValueError("a 'rows' rotary table has its text rows first (diffusers' joint [text, image] tables)")


@dataclasses.dataclass(frozen=True)
class Site:
    """One merge point of a block kind (see the module docstring).

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
            keyword/position; ``more_masks``: keywords of further masks of the call, adjusted the same way
            (Qwen-Image 2.1 passes ``attention_mask`` and ``key_valid``).
        stays_merged_with: the output stays merged when the block call also merges this sublayer (a later
            site of the block reads it, passes it through and unmerges).
        text_keys: the submodule is the joint text-image attention of a kind with text (``text_arg`` or
            ``joint_input``: ``T`` text tokens on the kind's ``joint`` side of the sequence it attends over);
            prompt reweighting biases its text keys for the image queries (:mod:`tomerge.text_bias`).
        shared: the block calls the submodule again on its text stream, after the image call (EasyAnimate's
            ``ff`` in the blocks without text projections, CogView4's one ``ff`` for both streams): only its first
            call in a block call reads image tokens, the others run as they are (:meth:`MergePoint.reads_tokens`).
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
        probe_heads_first: the joint attention's processor normalises q/k after moving the heads before the
            tokens (``[B, heads, L, d]``: CogVideoX, EasyAnimate), so the joint probe reads its norms so.
        probe_copies: the joint attention's processor rotates the image rows of the q/k the probe captures in
            place (``key[:, :, T:] = apply_rotary_emb(...)``: CogVideoX, EasyAnimate), so the probe keeps copies.
        self_kv: the call passes its tokens again as ``encoder_hidden_states``, the keys' and values' input
            (Lumina 2 and OmniGen call their self-attention as ``attn(x, x)``): it gets the merged tokens too.
        batch_dim: the batch axis of the tokens and the output: 1 for sequence-first ``[L, B, C]`` tensors
            (ERNIE-Image's feed-forward).
        context: the submodule's tokens include the block call's context tokens; ``False``: the block passes it
            the target tokens alone (Helios's cross-attention).
        count_arg, count_index: a call argument holding the number of target tokens (Helios's
            ``original_context_length``), set to the number of slots in merged calls; ``None``: none.
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
    more_masks: tuple[str, ...] = ()
    stays_merged_with: str | None = None
    text_keys: bool = False
    shared: bool = False
    probe: bool | Literal["sdpa"] = False
    probe_queries: Literal["text", "image"] = "text"
    probe_heads_first: bool = False
    probe_copies: bool = False
    self_kv: bool = False
    batch_dim: Literal[0, 1] = 0
    context: bool = True
    count_arg: str | None = None
    count_index: int = 4

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
        batch_dim: the batch axis of the block's token input: 1 for sequence-first ``[L, B, C]`` blocks
            (ERNIE-Image).
        context: the block's image stream holds context tokens on this side of the target tokens (the model
            call's grid), every token of the stream beyond the grid (FramePack's and Helios's history latents):
            the block call's :class:`~tomerge.backbones._context.ContextTokens`; ``None``: those of the model call
            (:meth:`DeclaredAdapter.call_layout`).
        uncached: why the block cache cannot run on these blocks (their output is no new value of their inputs,
            which ``outputs`` cannot declare): caching schedules that skip whole blocks are refused at ``apply``
            with it (:meth:`~tomerge.adapter.BackboneAdapter.uncached_kinds`); ``None``: they run.
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
    batch_dim: Literal[0, 1] = 0
    context: Side | None = None
    uncached: str | None = None

    def __post_init__(self) -> None:
        if self.context is not None and any(site.tokens == "conv" for site in self.sites):
            raise ValueError(f"kind {self.name!r}: context tokens are not supported with 'conv' sites")
