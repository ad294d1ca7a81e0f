"""Declared adapters: a model family described by class attributes instead of hand-written hooks.

Most current diffusion transformers are built from the same few pieces: a list (or two) of blocks, and
in each block an attention whose image tokens are passed alone or inside a joint ``[text, image]``
sequence, perhaps a cross-attention to text, and a feed-forward; rotary positions arrive as an argument of
the attention call. :class:`DeclaredAdapter` turns a declaration of those pieces into merge points:

* :class:`Kind`: one block type: the model attribute holding the blocks (``container``), their class
  names, the block's text argument (its length ``T`` splits joint sequences), whether the block input is
  itself a joint sequence (FLUX.2's single-stream blocks get ``[text, image]`` with ``T`` from the model
  call), which side text is on in joint sequences, and its :class:`Site` s.
* :class:`Site`: one merge point: sublayer, submodule path in the block, the tokens' argument, the output
  element, the token layout (``"image"``: image tokens only; ``"joint"``: a joint sequence whose image
  part is merged; ``"conv"``: a channels-first ``[B, C, H, W]`` input of a 1x1 convolution, or ``[B * F, C,
  H, W]`` with a video's frames folded into the batch), how the
  call's rotary table (:class:`Rope`) and attention mask are adjusted, and whether its output stays merged
  for a later site of the same block (parallel attention + MLP blocks).

A new family that fits is a subclass with a few class attributes (see ``backbones/wan.py``); what does not
fit (the grid of a packed latent, a timestep scale) is a method override. ``docs/backbones/adding-a-family.md``
walks through it.

Rotary tables (:class:`Rope` ``layout``), gathered per slot with the plan's representatives ``plan.dst
[B, M]`` (a merged slot takes the position of the token that represents it; one row of destinations gives
a plain table shared by the batch):

* ``"rows"``: ``(cos, sin)``, each ``[R + N, d]`` with ``R`` text rows first (``R = 0``: image rows only),
  applied by diffusers' ``apply_rotary_emb(..., sequence_dim=1)``; per-sample tables are passed as
  :class:`~tomerge.backbones.flux.BatchedRotaryTable` (FLUX.1/2, HunyuanVideo).
* ``"batched"``: a table ``[B or 1, R + N, ...]`` (tokens on axis 1), or a tuple of them (``(cos, sin)``), applied
  elementwise to q/k of the same sequence: LTX-Video's ``[B, N, d]``, HiDream's ``[B, N + R, 1, d/2, 2, 2]``. The
  ``R`` text rows are on the side ``Rope.text`` and kept. With ``Rope(heads=True)`` a 4-D table is per head,
  ``[B or 1, H, N, d]``, its tokens on axis 2 (LTX-2's split RoPE); Helios passes one ``[B or 1, N, 2d]`` table.
* ``"wan"``: ``(cos, sin)``, each ``[1, N, 1, d]`` (Wan): gathered to ``[B, M, 1, d]`` (as ``"batched"``).
* ``"qwen"``: ``(image, text)`` complex tables ``[N, d/2]``, ``[T, d/2]`` (Qwen-Image): the image table
  is gathered; per-sample ones go as :class:`BatchedComplexTable`, which Qwen's ``apply_rotary_emb_qwen``
  broadcasts per sample.
* ``"complex"``: one complex table over the joint sequence, ``[R + N, d/2]`` (Qwen-Image 2.1) or
  ``[B, R + N, d/2]`` (Z-Image), its ``R`` other rows on the kind's ``joint`` side: the image rows are
  gathered, the others kept; a per-sample table built from a shared one goes as :class:`BatchedComplexTable`.
* ``"broadcast"``: ``(cos, sin)``, each ``[N, ...]`` without a batch axis, broadcast from the right against
  ``[B, N, ...]`` q/k (Mochi's ``[N, heads, d/2]``), or one such table (Kandinsky 6's rotation matrices
  ``[N, 1, d/2, 2, 2]``, broadcast over the heads): gathered to ``[B, M, ...]`` (or ``[M, ...]``).
* ``"allegro"``: ``(tables, positions)``: per-axis ``(cos, sin)`` tables indexed by the ``(t, h, w)`` position
  ids ``[1 or B, N]`` of every token (Allegro's ``apply_rotary_emb_allegro``): the position ids are gathered to
  ``[B, M]`` (or ``[1, M]``), the tables kept.

Context tokens (:class:`~tomerge.backbones._context.ContextTokens`): a block call's image stream may hold
context tokens before or after the generated image's (the *target*): the reference images of editing calls, as
:meth:`DeclaredAdapter.call_layout` reads them from the model call, or, for a :class:`Kind` with ``context``,
every token of the stream beyond the model call's grid on that side (FramePack's and Helios's history latents).
The grid and the plan are the target's; every site merges the target part of its stream (inside a joint
sequence: of the stream after or before the text) and passes the context tokens through (a ``Site(context=False)``
gets the target alone); rotary tables and masks keep the context rows, as they keep the text's.

Attention masks (:class:`Site` ``mask``): ``None``: a mask on a merged call raises (it would cover the
unmerged sequence); ``"pass"``: passed through (text-only masks, or biases over text keys, that broadcast
over any number of queries or that the processor pads itself); ``"keys"``: a key mask ``[B, 1, 1, L]`` or
``[B, L]`` over the joint sequence (text on the kind's ``joint`` side), whose image columns are gathered
per slot (HunyuanVideo); ``"pairs"``: a query-by-key mask ``[B, 1, L, L]`` over the joint sequence, whose image
rows and columns are gathered (Chroma builds it as the outer product of a ``[B, L]`` mask; without text, a
self-attention mask ``[B or 1, ..., L, L]`` over the image stream: SkyReels-V2's block-causal mask, LTX-2's). A mask that is not
a tensor (e.g. a flex-attention ``BlockMask``) cannot be merged and raises. Per-sample text lengths (ragged joint
sequences, :meth:`DeclaredAdapter.call_text`) gather ``"keys"`` and ``"pairs"`` masks per sample (OmniGen's
causal-text, bidirectional-image mask is a ``"pairs"`` one).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, KindSummary, MergePoint, TextKeys, class_names
from tomerge.plan import MergePlan

from tomerge.state import MergeState

from ._context import NO_CONTEXT, ContextTokens
from ._diffusers import (call_arg, check_ff_chunking, probe_joint_attention, probe_sdpa_attention, probe_self_attention,
                         submodel)
from ._host import HostFacts
from .flux import BatchedRotaryTable, gather_rotary, grid_from_ids

Side = Literal["first", "last"]


# ---------------------------------------------------------------------- declarations
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


# ---------------------------------------------------------------------- runtime
@dataclasses.dataclass(frozen=True)
class RaggedText:
    """Per-sample text lengths of a ragged joint sequence (text first), known once per model call
    (:meth:`DeclaredAdapter.call_text`): ``longest`` read on the host, ``lengths [B]`` on the model's device."""

    longest: int
    lengths: Tensor


def text_lengths(lengths: Tensor) -> int | RaggedText:
    """One text length when every sample's is the same, else a :class:`RaggedText`. Reads ``lengths [B]`` on the
    host (one copy): call it once per model call, never inside a block call."""
    host = lengths.detach().cpu().tolist()
    return host[0] if len(set(host)) == 1 else RaggedText(max(host), lengths)


@dataclasses.dataclass
class DeclaredCall:
    """The block call in progress, shared by its points: text and target image lengths, the model call's
    context tokens in the image stream, the last merge."""

    batch: int | None = None
    text: int | None = None  # T of the block call's joint sequences (with per-sample lengths: the longest)
    lengths: Tensor | None = None  # [B] per-sample text lengths when they differ (a ragged joint sequence)
    image: int | None = None
    context: ContextTokens = NO_CONTEXT
    merged: tuple[Tensor, MergePlan, Tensor] | None = None  # (input view, plan, merged): reused for the same input
    shapes: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # conv points: [F, H, W] of the input
    merging: dict[str, bool] = dataclasses.field(default_factory=dict)  # sublayer -> this call merges it
    kept: set[str] = dataclasses.field(default_factory=set)  # sublayers whose sites get an already merged input
    called: set[int] = dataclasses.field(default_factory=set)  # shared points: id() of those called already

    def reset(self) -> None:
        self.batch = self.text = self.lengths = self.image = self.merged = None
        self.context = NO_CONTEXT
        self.shapes.clear()
        self.merging.clear()
        self.kept.clear()
        self.called.clear()

    def set_text(self, text: int | RaggedText | Tensor) -> None:
        """The block call's text length: one ``T``, or per-sample lengths (a :class:`RaggedText`, as the adapter
        resolved them for the model call; equal ones count as one ``T``). A tensor of lengths ``[B]`` is resolved
        here by :func:`text_lengths`, a host read: adapters resolve it once per model call instead."""
        if isinstance(text, Tensor):
            text = text_lengths(text)
        if isinstance(text, RaggedText):
            self.text, self.lengths = text.longest, text.lengths
        else:
            self.text, self.lengths = int(text), None

    # A joint sequence is [text, image stream] or [image stream, text] (``side``: where the text is). With
    # per-sample lengths (``lengths``, text first only) sample b is [text_b, image stream, padding]: its image
    # stream starts at lengths[b] and the padding fills it up to the longest text (``text``), as Lumina 2 joins
    # caption and image.
    def _check(self, joint: Tensor, side: Side, who: str) -> int:
        T = self.text
        if T is None or joint.shape[1] < T + self.context.count:
            raise RuntimeError(f"tomerge: {who} got {tuple(joint.shape)}, expected a joint sequence with T={T} text "
                               f"and N={self.image} image tokens of this block call"
                               + (f" and {self.context.count} context tokens" if self.context else ""))
        if self.lengths is not None and side != "first":
            raise ValueError(f"tomerge: {who}: per-sample text lengths need the text first in the joint sequence")
        return T

    def stream(self, joint: Tensor, side: Side, who: str) -> Tensor:
        """The image stream ``[B, K, C]`` of a joint sequence ``[B, T + K, C]`` (``K``: the target's ``N`` or ``M``
        and the context tokens)."""
        T = self._check(joint, side, who)
        if self.lengths is not None:
            index = self.lengths[:, None] + torch.arange(joint.shape[1] - T, device=joint.device)  # [B, K]
            return _rows(joint, index, 1)
        return joint[:, T:] if side == "first" else joint[:, : joint.shape[1] - T]

    def with_stream(self, joint: Tensor, stream: Tensor, side: Side, who: str) -> Tensor:
        """The joint sequence ``[B, T + K, C]`` with its image stream replaced by ``stream [B, K', C]``:
        ``[B, T + K', C]``."""
        T = self._check(joint, side, who)
        if self.lengths is not None:
            L, K = joint.shape[1], joint.shape[1] - T
            appended = L + torch.arange(stream.shape[1], device=joint.device)[None]  # [1, K']: rows after joint's
            return _rows(torch.cat([joint, stream], dim=1), ragged_index(self.lengths, T, K, appended), 1)
        if side == "first":
            return torch.cat([joint[:, :T], stream], dim=1)
        return torch.cat([stream, joint[:, joint.shape[1] - T:]], dim=1)


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredBlock(BlockSpec):
    """A block of a declared kind; reading its input also records the call's text and image lengths and the
    model call's context tokens. Its input is the target part of the image stream."""

    decl: Kind = dataclasses.field(kw_only=True)
    info: DeclaredCall = dataclasses.field(kw_only=True)
    joint_text: Any = dataclasses.field(kw_only=True)  # (block input length) -> T (joint_input kinds)
    model_context: Any = dataclasses.field(default=lambda: NO_CONTEXT, kw_only=True)  # () -> ContextTokens
    model_grid: Any = dataclasses.field(default=lambda: None, kw_only=True)  # () -> the model call's grid

    def block_input(self, args: tuple, kwargs: dict) -> Tensor:
        self.info.reset()
        x = call_arg(args, kwargs, self.decl.arg, self.decl.index)  # [B, N, C] (or [B, T + N, C])
        if self.decl.batch_dim == 1:
            x = x.transpose(0, 1)  # [L, B, C] -> [B, L, C]
        if self.decl.joint_input is not None:
            T = self.joint_text(int(x.shape[1]))
            if T is None:
                raise RuntimeError(f"tomerge: the {self.decl.name!r} block input {tuple(x.shape)} is a joint sequence, "
                                   "but the model call has no text length")
            self.info.set_text(T)
            x = self.info.stream(x, self.decl.joint_input, f"the {self.decl.name!r} block input")
        elif self.decl.text_arg is not None:
            text = call_arg(args, kwargs, self.decl.text_arg, self.decl.text_index)
            self.info.text = int(text.shape[1]) if isinstance(text, Tensor) else 0
        context = self.model_context() if self.decl.context is None else self._kind_context(x)
        context.check(x, f"the {self.decl.name!r} block")
        self.info.context = context
        x = context.target(x)  # [B, N, C]: the target part of the image stream
        self.info.batch, self.info.image = int(x.shape[0]), int(x.shape[1])
        return x

    def _kind_context(self, stream: Tensor) -> ContextTokens:
        """The context tokens of a ``Kind(context=)`` block's image stream ``[B, C + N, C']``: the ``C`` tokens beyond
        the model call's grid, on the kind's side. A stream shorter than the grid (or a call without one) has
        none: its grid does not match, it is not merged."""
        grid = self.model_grid()
        if grid is None or stream.shape[1] < math.prod(grid):
            return NO_CONTEXT
        C = int(stream.shape[1]) - math.prod(grid)
        return ContextTokens(before=C) if self.decl.context == "first" else ContextTokens(after=C)


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredPoint(MergePoint):
    """The merge point of a :class:`Site` (see the module docstring)."""

    site: Site = dataclasses.field(kw_only=True)
    info: DeclaredCall = dataclasses.field(kw_only=True)
    joint: Side = dataclasses.field(default="first", kw_only=True)

    # -------------------------------------------------------------- the tokens
    def _raw(self, args: tuple, kwargs: dict) -> Tensor:
        return call_arg(args, kwargs, self.arg, self.site.index)

    def _stream(self, joint: Tensor) -> Tensor:
        """The image stream of a joint sequence (``[B, before + N + after, C]``, or ``M`` when merged)."""
        return self.info.stream(joint, self.joint, type(self.module).__name__)

    def _with_stream(self, joint: Tensor, stream: Tensor) -> Tensor:
        return self.info.with_stream(joint, stream, self.joint, type(self.module).__name__)

    def _batch_first(self, t: Tensor) -> Tensor:
        """``[B, L, C]`` tokens of the submodule's input or output (a sequence-first ``[L, B, C]`` one transposed, and
        back)."""
        return t.transpose(0, 1) if self.site.batch_dim == 1 else t

    def _around(self) -> ContextTokens:
        """The context tokens of this site's image stream: the block call's, or none where the block passes the
        submodule the target alone (``Site(context=False)``)."""
        return self.info.context if self.site.context else NO_CONTEXT

    def _target(self, tokens: Tensor) -> Tensor:
        """The target image tokens of a site's input or output (a joint sequence or an image stream)."""
        stream = self._stream(tokens) if self.site.tokens == "joint" else tokens
        return self._around().target(stream)

    def _with_target(self, tokens: Tensor, x: Tensor) -> Tensor:
        """``tokens`` (a joint sequence or an image stream) with its target image tokens replaced by ``x``."""
        context = self._around()
        if self.site.tokens == "joint":
            return self._with_stream(tokens, context.with_target(self._stream(tokens), x))
        return context.with_target(tokens, x)

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        raw = self._batch_first(self._raw(args, kwargs))
        if self.site.tokens == "conv":
            if self._around():
                raise RuntimeError(f"tomerge: {type(self.module).__name__} takes a channels-first grid, which holds "
                                   "no context (reference-image) tokens")
            frames = raw.shape[0] // self.info.batch  # 1, or a video's frames folded into the batch (SANA-Video)
            self.info.shapes[id(self)] = (frames, *raw.shape[2:])
            return raw.unflatten(0, (-1, frames)).permute(0, 1, 3, 4, 2).flatten(1, 3)  # [B*F, C, H, W] -> [B, F*H*W, C]
        return self._target(raw)  # [B, N, C] (or [B, M, C] when an earlier site kept it merged)

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        raw = self._raw(args, kwargs)
        if self.site.tokens == "conv":
            x = x.transpose(1, 2).unsqueeze(-1)  # [B, M, C] -> [B, C, M, 1]: a 1x1 convolution takes any layout
        else:
            x = self._batch_first(self._with_target(self._batch_first(raw), x))  # in the call's layout
        if self.site.self_kv:
            if call_arg(args, kwargs, "encoder_hidden_states", 1) is not raw:
                raise RuntimeError(f"tomerge: {type(self.module).__name__} is declared a self-attention called as "
                                   "attn(x, x), but its encoder_hidden_states is another tensor than its tokens")
            args, kwargs = with_arg(args, kwargs, "encoder_hidden_states", 1, x)
        return with_arg(args, kwargs, self.arg, self.site.index, x)

    def reads_tokens(self, args: tuple, kwargs: dict) -> bool:
        if not self.site.shared:
            return True
        first = id(self) not in self.info.called
        self.info.called.add(id(self))
        return first

    def enter_block(self, merges: bool) -> None:
        self.info.merging[self.sublayer] = self.info.merging.get(self.sublayer, False) or merges

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        if self.sublayer in self.info.kept:  # an earlier site of this block call kept its output merged for it
            if x.shape[1] != plan.num_slots:
                raise RuntimeError(f"tomerge: {type(self.module).__name__} expected {plan.num_slots} merged image tokens, "
                                   f"got {x.shape[1]}")
            return args, kwargs
        later = self.site.stays_merged_with
        if later is not None and self.info.merging.get(later, False):
            self.info.kept.add(later)  # keeps_merged() will leave this site's output merged
        if x.shape[1] != plan.num_tokens:
            raise RuntimeError(f"tomerge: {type(self.module).__name__} got {x.shape[1]} image tokens, the block call's "
                               f"plan has {plan.num_tokens}")
        args, kwargs = self.set_input(args, kwargs, self._merged(x, plan))
        args, kwargs = self._merge_mask(args, kwargs, plan)
        if self.site.rope is not None:
            args, kwargs = self._merge_rope(args, kwargs, plan)
        count = self.site.count_arg, self.site.count_index
        if count[0] is not None and call_arg(args, kwargs, *count) is not None:
            args, kwargs = with_arg(args, kwargs, *count, plan.num_slots)  # the target tokens are now M slots
        return args, kwargs

    def _merged(self, x: Tensor, plan: MergePlan) -> Tensor:
        """``plan.merge(x)``, computed once for sites that read the same tensor (the cache holds the input, so
        its memory cannot be reused by another tensor while the block call runs)."""
        cached = self.info.merged
        # The same tensor object (the sites of one projection input): no data_ptr() or _version reads, which
        # inference tensors lack and compiled graphs cannot trace.
        if cached is not None and cached[1] is plan and cached[0] is x:
            return cached[2]
        merged = plan.merge(x)
        self.info.merged = (x, plan, merged)
        return merged

    def keeps_merged(self, sublayers: frozenset[str]) -> bool:
        return self.site.stays_merged_with is not None and self.site.stays_merged_with in sublayers

    def get_output(self, out: Any) -> Tensor:
        y = self._batch_first(out if self.output is None else out[self.output])
        if self.site.tokens == "conv":
            return y.flatten(2).transpose(1, 2)  # [B, C', M, 1] -> [B, M, C']
        return self._target(y)

    def set_output(self, out: Any, y: Tensor) -> Any:
        if self.site.tokens == "conv":  # [B, F*H*W, C'] -> [B, F, H, W, C'] -> [B*F, C', H, W]
            y = y.unflatten(1, self.info.shapes[id(self)]).permute(0, 1, 4, 2, 3).flatten(0, 1)
        else:
            y = self._batch_first(self._with_target(self._batch_first(out if self.output is None else out[self.output]), y))
        return super().set_output(out, y)

    # -------------------------------------------------------------- what follows the tokens
    def _merge_mask(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        if self.site.mask == "pass":
            return args, kwargs
        masks = [(self.site.mask_arg, self.site.mask_index)] + [(name, None) for name in self.site.more_masks]
        for name, index in masks:  # more_masks: keyword only
            mask = call_arg(args, kwargs, name, index) if index is not None else kwargs.get(name)
            if mask is None:
                continue
            if self.site.mask is None or not isinstance(mask, Tensor):
                raise ValueError(f"tomerge: {type(self.module).__name__} got an attention mask ({name}: "
                                 f"{type(mask).__name__}) over the unmerged sequence, which merged image tokens cannot "
                                 "use; run without the mask or without merging")
            gather = gather_key_mask if self.site.mask == "keys" else gather_pair_mask
            merged = gather(mask, *self._stream_positions(plan), text_side=self.joint, lengths=self.info.lengths)
            if index is None:
                kwargs = {**kwargs, name: merged}
            else:
                args, kwargs = with_arg(args, kwargs, name, index, merged)
        return args, kwargs

    def _merge_rope(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        rope = self.site.rope
        freqs = call_arg(args, kwargs, rope.arg, rope.index)
        if freqs is None:
            return args, kwargs
        dst, stream = self._stream_positions(plan)
        return with_arg(args, kwargs, rope.arg, rope.index,
                        gather_rope(freqs, dst, stream, rope.layout, text_side=rope.text, lengths=self.info.lengths,
                                   heads=rope.heads))

    def _stream_positions(self, plan: MergePlan) -> tuple[Tensor, int]:
        """``(positions [B, before + M + after], before + N + after)``: the plan's representatives in the image
        stream (each context token its own), and the stream's length, for the gathers below."""
        context = self._around()
        return context.stream_positions(plan.dst, plan.num_tokens), plan.num_tokens + context.count


# ---------------------------------------------------------------------- gathers
def with_arg(args: tuple, kwargs: dict, name: str, index: int, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the argument ``name`` (keyword, or positional ``index``) set to ``value``."""
    if name not in kwargs and len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}


def _rows(t: Tensor, dst: Tensor, dim: int) -> Tensor:
    """``t`` with its ``dim`` axis (the tokens) indexed per sample by ``dst [B', M]``; a leading axis of size 1
    (or none, ``dim == 0``) is shared by the samples. Returns ``[B', M, ...]`` (``dim == 0``: ``[M, ...]`` when
    ``B' == 1``)."""
    index = dst.to(t.device)
    if dim == 0:
        return t[index[0]] if index.shape[0] == 1 else t[index]  # [M, ...] or [B', M, ...]
    if t.shape[0] == 1:
        return t[0][index]  # [B', M, ...]
    batch = torch.arange(t.shape[0], device=t.device)[:, None]  # [B, 1]
    return t[batch, index.expand(t.shape[0], -1)]  # [B, M, ...]


def gather_rope(freqs: Any, dst: Tensor, num_tokens: int, layout: str, text_side: Side = "first",
                lengths: Tensor | None = None, heads: bool = False) -> Any:
    """The rotary argument of a merged call (see the module docstring's layouts).

    Args:
        freqs: the call's rotary argument.
        dst: ``[B, M]`` (or ``[1, M]``) token position representing each slot (``plan.dst``).
        num_tokens: ``N``, the image tokens of the unmerged call.
        layout: ``"rows"``, ``"batched"``, ``"wan"``, ``"qwen"``, ``"complex"``, ``"broadcast"`` or ``"allegro"``.
        text_side: where a ``"batched"``, ``"wan"`` or ``"complex"`` table's text (other) rows are (``"rows"``: first).
        lengths: ``[B]`` per-sample text lengths of a ragged joint sequence (:func:`ragged_index`; ``"batched"``
            tables only, text first); ``None``: one text length.
        heads: a 4-D ``"batched"`` table is per head, ``[B or 1, H, N, d]`` (:attr:`Rope.heads`).

    Example:
        >>> cos = torch.arange(4.0).view(1, 4, 1, 1)                      # wan layout, N = 4
        >>> c, _ = gather_rope((cos, cos), torch.tensor([[3, 0], [1, 2]]), 4, "wan")
        >>> c.flatten(1).tolist()
        [[3.0, 0.0], [1.0, 2.0]]
    """
    if layout == "rows":
        rows = freqs[0].shape[0]
        if rows < num_tokens:
            raise ValueError(f"tomerge: the rotary table has {rows} rows for {num_tokens} image tokens")
        return gather_rotary(freqs, dst, rows - num_tokens)  # text rows first, kept
    if lengths is not None and layout != "batched":
        raise ValueError(f"tomerge: per-sample text lengths need a 'batched' rotary table, not {layout!r}")
    if layout in ("batched", "wan"):
        def gather(t: Tensor) -> Tensor:
            if heads and layout == "batched" and t.dim() == 4:  # [B, H, N, d]: the tokens on axis 2
                return _gather_table_rows(t.movedim(2, 1), dst, num_tokens, layout, text_side, lengths).movedim(1, 2)
            return _gather_table_rows(t, dst, num_tokens, layout, text_side, lengths)
        return gather(freqs) if isinstance(freqs, Tensor) else tuple(gather(t) for t in freqs)
    if layout == "qwen":
        image, text = freqs
        if image.shape[0] != num_tokens:
            raise ValueError(f"tomerge: the image rotary table has {image.shape[0]} rows for {num_tokens} image tokens")
        gathered = _rows(image, dst, 0)  # [M, d/2] or [B, M, d/2]
        return (gathered if gathered.dim() == image.dim() else BatchedComplexTable(gathered), text)
    if layout == "complex":
        return _gather_complex_rows(freqs, dst, num_tokens, text_side)
    if layout == "broadcast":
        out = []
        for t in (freqs,) if isinstance(freqs, Tensor) else freqs:
            if t.dim() < 2 or t.shape[0] != num_tokens:
                raise ValueError(f"tomerge: a 'broadcast' rotary table must be [N={num_tokens}, ...], got {tuple(t.shape)}")
            out.append(_rows(t, dst, 0))  # [M, ...] or [B, M, ...]
        return out[0] if isinstance(freqs, Tensor) else tuple(out)
    if layout == "allegro":
        tables, positions = freqs
        out = []
        for ids in positions:
            if ids.dim() != 2 or ids.shape[1] != num_tokens:
                raise ValueError(f"tomerge: Allegro's rotary position ids must be [1 or B, N={num_tokens}], got "
                                 f"{tuple(ids.shape)}")
            out.append(_rows(ids, dst, 1))  # [B', M]
        return tables, tuple(out)
    raise ValueError(f"unknown rotary layout {layout!r}")


def _gather_complex_rows(table: Tensor, dst: Tensor, num_tokens: int, text_side: Side) -> Tensor | BatchedComplexTable:
    """A ``"complex"`` rotary table ``[L, d/2]`` or ``[B, L, d/2]`` (``L = R + N``, the ``R`` other rows on
    ``text_side``) with its image rows gathered per slot: ``[R + M, d/2]`` for a shared table and one row of
    destinations, else ``[B, R + M, d/2]`` (a :class:`BatchedComplexTable` when the table was shared)."""
    if not isinstance(table, Tensor) or not table.is_complex() or table.dim() not in (2, 3):
        raise ValueError(f"tomerge: a 'complex' rotary table must be a complex [L, d/2] or [B, L, d/2] tensor, got "
                         f"{type(table).__name__}{tuple(table.shape) if isinstance(table, Tensor) else ''}")
    axis = table.dim() - 2  # the rows
    L = table.shape[axis]
    if L < num_tokens:
        raise ValueError(f"tomerge: the rotary table has {L} rows for {num_tokens} image tokens")
    R = L - num_tokens
    image_start, other_start = (R, 0) if text_side == "first" else (0, num_tokens)
    image = table.narrow(axis, image_start, num_tokens)  # [N, d/2] or [B, N, d/2]
    other = table.narrow(axis, other_start, R)  # [R, d/2] or [B, R, d/2]
    gathered = _rows(image, dst, axis)  # [M, d/2] or [B', M, d/2]
    if gathered.dim() == 3:
        other = other.expand(gathered.shape[0], *other.shape[-2:])  # [B', R, d/2]
    joint = torch.cat([other, gathered] if text_side == "first" else [gathered, other], dim=-2)
    return BatchedComplexTable(joint) if table.dim() == 2 and joint.dim() == 3 else joint


def _gather_table_rows(t: Tensor, dst: Tensor, num_tokens: int, layout: str, text_side: Side,
                       lengths: Tensor | None = None) -> Tensor:
    """A ``[B or 1, R + N, ...]`` table with its ``N`` image rows gathered per slot and its ``R`` text rows (on
    ``text_side``) kept: ``[B', R + M, ...]``; with per-sample text ``lengths``, a ragged table (text first)."""
    if t.dim() < 3 or t.shape[1] < num_tokens:
        raise ValueError(f"tomerge: a {layout!r} rotary table must be [B or 1, R + N, ...] with N={num_tokens} image "
                         f"rows, got {tuple(t.shape)}")
    R = t.shape[1] - num_tokens
    if lengths is not None:
        return _rows(t, ragged_index(lengths, R, num_tokens, lengths[:, None] + dst.to(t.device)), 1)
    text, image = (t[:, :R], t[:, R:]) if text_side == "first" else (t[:, num_tokens:], t[:, :num_tokens])
    gathered = _rows(image, dst, 1)  # [B', M, ...]
    if R == 0:
        return gathered
    text = text.expand(gathered.shape[0], *text.shape[1:])  # [B', R, ...]
    return torch.cat([text, gathered] if text_side == "first" else [gathered, text], dim=1)


class BatchedComplexTable:
    """A per-sample Qwen-Image rotary table ``[B, M, d/2]`` (complex): Qwen's ``apply_rotary_emb_qwen`` calls
    ``freqs.unsqueeze(1)`` on an ``[S, d/2]`` table to broadcast over ``[B, S, heads, d/2]``; here that gives
    ``[B, M, 1, d/2]``. Any other use raises, so a processor that uses the table differently fails loudly.

    Example:
        >>> BatchedComplexTable(torch.zeros(2, 5, 4, dtype=torch.complex64)).unsqueeze(1).shape
        torch.Size([2, 5, 1, 4])
    """

    def __init__(self, table: Tensor) -> None:
        if table.dim() != 3:
            raise ValueError(f"a batched complex rotary table is [B, M, d], got {tuple(table.shape)}")
        self.table = table

    def unsqueeze(self, dim: int) -> Tensor:
        if dim != 1:
            raise TypeError(f"tomerge: the per-sample rotary table was unsqueezed at {dim}; only apply_rotary_emb_qwen's "
                            "unsqueeze(1) is supported")
        return self.table[:, :, None, :]

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"tomerge: the per-sample rotary table [B, M, d] has no {name!r}; an attention processor "
                             "that uses the rotary table other than through apply_rotary_emb_qwen cannot run merged")


def gather_key_mask(mask: Tensor, dst: Tensor, num_tokens: int, text_side: Side,
                    lengths: Tensor | None = None) -> Tensor:
    """A key mask over a joint sequence, its ``N`` image columns gathered per slot (text columns kept).

    Args:
        mask: ``[B, ..., L]`` with ``L = T + N`` (text on ``text_side``), e.g. ``[B, 1, 1, L]``.
        dst: ``[B, M]`` or ``[1, M]`` representatives.
        num_tokens: ``N``.
        lengths: ``[B]`` per-sample text lengths of a ragged joint sequence (:func:`ragged_index`; a ``[B, L]``
            mask, text first); ``None``: one text length.

    Returns:
        ``[B, ..., T + M]``.

    Example:
        >>> m = torch.tensor([[True, False, True, True, False]])            # 3 image, then 2 text columns
        >>> gather_key_mask(m, torch.tensor([[2, 1]]), 3, "last").tolist()
        [[True, False, True, False]]
    """
    L = mask.shape[-1]
    T = L - num_tokens
    if T < 0:
        raise ValueError(f"tomerge: an attention mask over {L} keys cannot cover {num_tokens} image tokens")
    if lengths is not None:
        if mask.dim() != 2 or text_side != "first":
            raise ValueError(f"tomerge: a mask over ragged joint sequences must be [B, L] with text first, got "
                             f"{tuple(mask.shape)}, text {text_side}")
        return _rows(mask, ragged_index(lengths, T, num_tokens, lengths[:, None] + dst.to(mask.device)), 1)
    index = dst.to(mask.device)
    if index.shape[0] > 1 and mask.dim() > 1 and mask.shape[0] == 1:
        mask = mask.expand(index.shape[0], *mask.shape[1:])  # a mask shared by the batch, per-sample slots
    image, text = (mask[..., T:], mask[..., :T]) if text_side == "first" else (mask[..., :num_tokens], mask[..., num_tokens:])
    if index.shape[0] == 1:
        gathered = image[..., index[0]]
    else:
        shape = (mask.shape[0],) + (1,) * (mask.dim() - 2) + (index.shape[1],)
        gathered = torch.gather(image, -1, index.view(shape).expand(*image.shape[:-1], index.shape[1]))
    return torch.cat([text, gathered] if text_side == "first" else [gathered, text], dim=-1)


def gather_pair_mask(mask: Tensor, dst: Tensor, num_tokens: int, text_side: Side,
                     lengths: Tensor | None = None) -> Tensor:
    """A query-by-key mask ``[B, 1, L, L]`` over a joint sequence (``L = T + N``, text on ``text_side``), its
    image rows and columns gathered per slot (text rows and columns kept): ``[B, 1, T + M, T + M]``; ``lengths``:
    per-sample text lengths (:func:`gather_key_mask`).

    Example:
        >>> m = torch.tensor([1.0, 0, 1, 1])                            # 1 text token, then 3 image tokens
        >>> pairs = (m[:, None] * m[None, :])[None, None]               # [1, 1, 4, 4]
        >>> gather_pair_mask(pairs, torch.tensor([[2, 0]]), 3, "first")[0, 0].tolist()
        [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    """
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"tomerge: a query-by-key mask must be [B, 1, L, L], got {tuple(mask.shape)}")
    columns = gather_key_mask(mask, dst, num_tokens, text_side, lengths)  # [B, 1, L, T + M]
    return gather_key_mask(columns.transpose(-1, -2), dst, num_tokens, text_side, lengths).transpose(-1, -2)


def ragged_index(lengths: Tensor, text: int, image: int, image_rows: Tensor) -> Tensor:
    """Row indices of a ragged joint sequence with new image rows: sample ``b`` is ``[text_b, image, padding]``
    (``lengths[b]`` text rows, padding up to ``text``, the longest), before and after.

    Args:
        lengths: ``[B]`` per-sample text lengths.
        text: ``T``, the longest (the sequences hold ``T + image`` rows).
        image: ``N``, the image rows of the indexed sequence.
        image_rows: ``[B or 1, M]``: the row of the indexed sequence each new image row takes (a token's row
            ``lengths[b] + dst``, or rows appended after the sequence).

    Returns:
        ``[B, T + M]``: text rows stay, image rows are ``image_rows``, padding rows follow the image.

    Example:
        >>> ragged_index(torch.tensor([1, 2]), 2, 3, torch.tensor([[2, 1], [4, 3]]))   # 3 image rows -> 2
        tensor([[0, 2, 1, 4],
                [0, 1, 4, 3]])
    """
    B, M = lengths.shape[0], image_rows.shape[1]
    p = torch.arange(text + M, device=lengths.device)[None]  # [1, T + M]
    T = lengths[:, None]  # [B, 1]
    slot = (p - T).clamp(0, M - 1)  # [B, T + M]: the image slot of image positions
    new_image = image_rows.to(lengths.device).expand(B, -1).gather(1, slot)  # [B, T + M]
    return torch.where(p < T, p, torch.where(p < T + M, new_image, p - M + image))


def latent_grid(sample: Tensor, patch: tuple[int, ...]) -> tuple[int, ...]:
    """The token grid of a patchified latent ``[B, C, H, W]`` or ``[B, C, F, H, W]``: each size floor-divided
    by its patch size (``patch``: one per spatial/temporal axis, as ``(p_h, p_w)`` or ``(p_t, p_h, p_w)``).

    Example:
        >>> latent_grid(torch.zeros(1, 4, 5, 12, 18), (1, 2, 2))
        (5, 6, 9)
    """
    sizes = sample.shape[2:]
    if len(sizes) != len(patch):
        raise ValueError(f"a latent {tuple(sample.shape)} needs {len(sizes)} patch sizes, got {patch}")
    return tuple(int(s) // int(p) for s, p in zip(sizes, patch))


# ---------------------------------------------------------------------- the adapter
class DeclaredAdapter(BackboneAdapter):
    """Base of the declared adapters (see the module docstring).

    Class attributes (besides ``name`` and ``t_max``):
        model_class: class name of the transformer (found as the model or a pipeline's ``.transformer``).
        kinds: the block kinds, in execution order.
        timestep_arg, timestep_index: the model's timestep argument.
        text_arg, text_index: the model's text argument (its length is :attr:`model_text`, for
            ``joint_input`` kinds).
        latent_arg, latent_index: the model's latent argument (:meth:`call_grid`'s default reads its shape).
        patch_attrs: config attributes giving the patch size per axis of the latent (one attribute may hold
            a tuple, e.g. Wan's ``patch_size = (1, 2, 2)``; a single int for a 2-D latent is used for both axes).
        ids_arg: ``(keyword, position)`` of the model's packed-latent position ids (FLUX.1-style ``img_ids``
            ``[N, 3+]``, ``(·, row, col, ...)``): :meth:`call_grid` reads the grid from them (``grid_from_ids``)
            instead of from the latent's shape; ``None``: the latent's shape.
        joint_context: what ``T`` of a ``joint_input`` block call is (:meth:`joint_text`): ``"text"``, the model
            call's text length; ``"rest"``, every token of the block input beyond the call's image grid (the
            joint sequence holds more than the text: Z-Image's padding, Qwen-Image 2.1's condition images).
    """

    kinds: ClassVar[tuple[Kind, ...]] = ()
    timestep_arg: ClassVar[str] = "timestep"
    timestep_index: ClassVar[int] = 1
    text_arg: ClassVar[str] = "encoder_hidden_states"
    text_index: ClassVar[int] = 1
    latent_arg: ClassVar[str] = "hidden_states"
    latent_index: ClassVar[int] = 0
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size",)
    ids_arg: ClassVar[tuple[str, int] | None] = None
    joint_context: ClassVar[Literal["text", "rest"]] = "text"

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kinds and not cls.__dict__.get("block_names"):
            cls.block_names = tuple(dict.fromkeys(name for kind in cls.kinds for name in kind.classes))

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.grid_size: tuple[int, ...] | None = None
        self.context = NO_CONTEXT  # context tokens in the image stream of the model call in progress
        self.model_text: int | RaggedText | None = None
        self._warned_grid = False
        self._ids_grid = HostFacts(grid_from_ids)  # ids_arg: read once per ids tensor

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The transformer: ``obj`` itself or a pipeline's ``obj.transformer``."""
        return submodel(obj, "transformer", cls.model_class)

    # -------------------------------------------------------------- blocks
    def block_modules(self) -> list[tuple[Kind, nn.Module]]:
        found = []
        for kind in self.kinds:
            for module in _submodule(self.model, kind.container) or ():
                if any(name in class_names(module) for name in kind.classes):
                    found.append((kind, module))
        return found

    def blocks(self) -> list[BlockSpec]:
        specs: list[BlockSpec] = []
        for kind, module in self.block_modules():
            info = DeclaredCall()
            points = []
            for site in kind.sites:
                sub = _submodule(module, site.path)
                if sub is not None:
                    points.append(DeclaredPoint(site.sublayer, sub, arg=site.arg, output=site.output, site=site,
                                                info=info, joint=kind.joint))
            specs.append(DeclaredBlock(module, layer=len(specs), kind=kind.name, points=tuple(points), arg=kind.arg,
                                       outputs=kind.outputs, decl=kind, info=info, joint_text=self.joint_text,
                                       model_context=lambda: self.context, model_grid=lambda: self.grid_size))
        return specs

    def joint_text(self, length: int) -> int | RaggedText | None:
        """``T`` of a ``joint_input`` block call whose input has ``length`` tokens (see :attr:`joint_context`).
        With ``"rest"`` and no grid for the call, ``0``: the whole input, which is then not merged."""
        if self.joint_context == "text":
            return self.model_text
        image = math.prod(self.grid_size) + self.context.count if self.grid_size is not None else None
        if image is None or length < image:
            return 0  # no grid for this call: grid() leaves the block unmerged
        return length - image  # the target's and the context's tokens are the image stream

    def check(self) -> None:
        check_ff_chunking([module for _, module in self.block_modules()])

    # -------------------------------------------------------------- calls
    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        self.model_text = self.call_text(args, kwargs)
        self.grid_size, self.context = self.call_layout(args, kwargs)
        if self.grid_size is None and not self._warned_grid:
            self._warned_grid = True
            warnings.warn(f"tomerge {self.name}: the token grid of this {type(self.model).__name__} call is unknown "
                          f"({self.unknown_grid_reason()}); its blocks are not merged", stacklevel=3)
        return self.call_timestep(args, kwargs)

    def call_text(self, args: tuple, kwargs: dict) -> int | RaggedText | None:
        """The text length ``T`` that ``joint_input`` kinds split off their input (default: the length of the
        model's text argument; ``None``: none), or the per-sample lengths of ragged joint sequences (text first, a
        :class:`RaggedText`, see :meth:`DeclaredCall.stream`), resolved here, once per model call. Families that
        add tokens to the text side (AuraFlow's register tokens), join several text inputs (HiDream) or join only
        the real text tokens (Lumina 2) override it."""
        text = call_arg(args, kwargs, self.text_arg, self.text_index)
        return int(text.shape[1]) if isinstance(text, Tensor) else None

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        """The call's timestep; per-token timesteps (``[B, N]``: conditioning frames at 0) give their largest."""
        t = call_arg(args, kwargs, self.timestep_arg, self.timestep_index)
        if isinstance(t, Tensor) and t.dim() > 1:
            return t.flatten(1).amax(dim=1)
        return t

    def patch(self) -> tuple[int, ...]:
        """The patch size per axis of the latent, from :attr:`patch_attrs`."""
        sizes: list[int] = []
        for attr in self.patch_attrs:
            value = getattr(self.model.config, attr)
            sizes.extend(int(v) for v in value) if isinstance(value, (tuple, list)) else sizes.append(int(value))
        return tuple(sizes)

    def call_layout(self, args: tuple, kwargs: dict) -> tuple[tuple[int, ...] | None, ContextTokens]:
        """The target's token grid and the context tokens of a model call's image stream (default:
        :meth:`call_grid`, no context). Families whose calls carry reference images override it."""
        return self.call_grid(args, kwargs), NO_CONTEXT

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """The image-token grid of a model call (default: from :attr:`ids_arg`, else the latent's sizes divided by
        the patch sizes)."""
        if self.ids_arg is not None:
            ids = call_arg(args, kwargs, *self.ids_arg)
            return self._ids_grid(ids) if ids is not None else None
        sample = call_arg(args, kwargs, self.latent_arg, self.latent_index)
        patch = self.patch()
        if sample.dim() == 4 and len(patch) == 1:
            patch = patch * 2
        return latent_grid(sample, patch)

    def unknown_grid_reason(self) -> str:
        return "its inputs do not describe one raster-ordered grid"

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, ...] | None:
        check_ff_chunking([block.module])
        if self.grid_size is None or math.prod(self.grid_size) != num_tokens:
            return None
        return self.grid_size

    # -------------------------------------------------------------- what it merges (tomerge backbones)
    @staticmethod
    def probes_site(site: Site) -> bool:
        """Whether :meth:`probe` records received attention at an ``"attn"`` site (the one rule it and
        :meth:`probed_kinds` share)."""
        return site.probe

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        """The kinds with an ``"attn"`` site that :meth:`probes_site` (it records for the block; the block's other
        ``"attn"`` sites, e.g. one inside that attention, record nothing themselves)."""
        return frozenset(kind.name for kind in cls.kinds
                         if any(site.sublayer == "attn" and cls.probes_site(site) for site in kind.sites))

    @classmethod
    def uncached_kinds(cls) -> dict[str, str]:
        """Read from :attr:`kinds` (``Kind.uncached``)."""
        return {kind.name: kind.uncached for kind in cls.kinds if kind.uncached is not None}

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        """Read from :attr:`kinds`. The context is a joint attention (text on the kind's side) when the block input
        is a joint sequence (``joint_input``), the block takes text for joint sites (``text_arg``) or an ``"attn"``
        site returns a tuple (``output`` set: the image and text streams of a joint attention); else a
        cross-attention when there is a ``"crossattn"`` site."""
        summaries = []
        for kind in cls.kinds:
            attn = [site for site in kind.sites if site.sublayer == "attn"]
            if kind.joint_input is not None or kind.text_arg is not None or any(s.output is not None for s in attn):
                context = f"joint attention, text {kind.joint_input or kind.joint}"
            elif any(site.sublayer == "crossattn" for site in kind.sites):
                context = "cross-attention"
            else:
                context = "none in these blocks"
            ropes = dict.fromkeys(site.rope.layout for site in kind.sites if site.rope is not None)
            summaries.append(KindSummary(kind.name, tuple(dict.fromkeys(site.sublayer for site in kind.sites)),
                                         context=context, rope=", ".join(ropes) or None))
        return tuple(summaries)

    # -------------------------------------------------------------- probes, text keys
    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        site = point.site if isinstance(point, DeclaredPoint) else None
        if site is None or not self.probes_site(site):
            if isinstance(block, DeclaredBlock) and block.kind in self.probed_kinds():
                return []  # another site of the block (its attention) records
            raise NotImplementedError(
                f"backbone {self.name!r} cannot record received attention in its {block.kind!r} blocks (no probe is "
                "declared for their attention: docs/backbones/adding-a-family.md); use a strategy that needs none, "
                "e.g. idm(variant='streak') or ssm")
        kind = block.decl
        if site.probe == "sdpa":
            return probe_sdpa_attention(point.module, state, text_side=kind.joint, text_len=lambda: point.info.text,
                                        lengths=lambda: point.info.lengths, queries=site.probe_queries)
        if kind.text_arg is None and kind.joint_input is None:
            handles = probe_self_attention(block, point, state, context=point._around)
            if site.mask is not None:
                handles.append(point.module.register_forward_pre_hook(_refuse_masked_probe(point, state),
                                                                      with_kwargs=True))
            return handles
        rope = site.rope
        inner = [s.path for s in kind.sites if s.path.startswith(site.path + ".")]  # merge points inside the attention
        return probe_joint_attention(point.module, state, text_side=kind.joint, text_len=lambda: point.info.text,
                                     rope=None if rope is None else (rope.arg, rope.index),
                                     rope_layout="rows" if rope is None else rope.layout,
                                     mask=(site.mask_arg, site.mask_index), context=lambda: point.info.context,
                                     record_before=_submodule(block.module, inner[0]) if inner else None,
                                     heads_first=site.probe_heads_first, copies=site.probe_copies)

    def text_keys(self, block: BlockSpec, point: MergePoint) -> TextKeys | None:
        if not isinstance(point, DeclaredPoint) or not point.site.text_keys:
            return None
        return TextKeys(point.module, text_len=lambda args, kwargs: point.info.text or 0,  # the block call's T
                        text_first=point.joint == "first")


def _refuse_masked_probe(point: DeclaredPoint, state: MergeState):
    """A forward pre-hook raising when a probed self-attention call of a merging block has an attention mask: the
    probe's softmax runs over every key (:func:`~tomerge.probe.received_attention`), so it would record attention
    the masked model does not pay."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = state.call
        if call is not None and call.records_attention and call_arg(args, kwargs, point.site.mask_arg,
                                                                   point.site.mask_index) is not None:
            raise NotImplementedError(
                f"tomerge: {type(module).__name__} got an attention mask ({point.site.mask_arg}); the "
                "received-attention probe ignores masks, so idm's attention variant cannot rank its tokens. Use a "
                "strategy that needs no probe (e.g. idm(variant='streak'), ssm) or run without the mask")
    return hook


def _submodule(module: nn.Module, path: str) -> nn.Module | None:
    for part in path.split("."):
        module = getattr(module, part, None)
        if module is None:
            return None
    return module if isinstance(module, nn.Module) else None
