"""Declared adapters: a model family described by class attributes instead of hand-written hooks.

Most current diffusion transformers are built from the same few pieces: a list (or two) of blocks, and
in each block an attention whose image tokens are passed alone or inside a joint ``[text, image]``
sequence, perhaps a cross-attention to text, and a feed-forward; rotary positions arrive as an argument of
the attention call. :class:`DeclaredAdapter` turns a declaration of those pieces into merge points:

* :class:`Kind`: one block type: the model attribute holding the blocks (``container``), their class
  names, the block's text argument (its length ``T`` splits joint sequences), whether the block input is
  itself a joint sequence (FLUX.2's single-stream blocks get ``[text, image]`` with ``T`` from the model
  call), which side text is on in joint sequences, whether its image stream carries context tokens around the
  target tokens (below), and its :class:`Site` s.
* :class:`Site`: one merge point: sublayer, submodule path in the block, the tokens' argument, the output
  element, the token layout (``"image"``: image tokens only; ``"joint"``: a joint sequence whose image
  part is merged; ``"conv"``: a channels-first ``[B, C, H, W]`` input of a 1x1 convolution), how the
  call's rotary table (:class:`Rope`) and attention mask are adjusted, and whether its output stays merged
  for a later site of the same block (parallel attention + MLP blocks).

A new family that fits is a subclass with a few class attributes (see ``backbones/wan.py``); what does not
fit (the grid of a packed latent, a timestep scale) is a method override. ``docs/backbones/adding-a-family.md``
walks through it.

Context tokens (:class:`Kind` ``context``): the block's image stream is ``[context, target]`` (``"first"``)
or ``[target, context]`` (``"last"``), where the target tokens are the model call's grid (``N`` =
``prod(grid)``) and the ``C`` context tokens (FramePack's clean history latents) are every other token of the
stream (``C`` = stream length - ``N``, read at every block call). Only the target tokens are merged; the
context tokens go through every site as they are (attended to as keys and queries, like text), and the rotary
rows and mask columns of the context are kept.

Rotary tables (:class:`Rope` ``layout``), gathered per slot with the plan's representatives ``plan.dst
[B, M]`` (a merged slot takes the position of the token that represents it; one row of destinations gives
a plain table shared by the batch); the rows of text and context tokens are kept:

* ``"rows"``: ``(cos, sin)``, each ``[R + N, d]`` with ``R`` text rows first (``R = 0``: image rows only),
  applied by diffusers' ``apply_rotary_emb(..., sequence_dim=1)``; per-sample tables are passed as
  :class:`~tomerge.backbones.flux.BatchedRotaryTable` (FLUX.1/2, HunyuanVideo).
* ``"batched"``: ``(cos, sin)``, each ``[B or 1, N, d]`` broadcast against ``[B, N, d]`` q/k (LTX-Video,
  LTX-2's interleaved RoPE), or ``[B or 1, H, N, d]`` per head (LTX-2's split RoPE): the tokens are the
  second-to-last axis; or one such table (Helios: ``[B or 1, N, 2d]``, cos and sin concatenated).
* ``"wan"``: ``(cos, sin)``, each ``[1, N, 1, d]`` (Wan): gathered to ``[B, M, 1, d]``.
* ``"qwen"``: ``(image, text)`` complex tables ``[N, d/2]``, ``[T, d/2]`` (Qwen-Image): the image table
  is gathered; per-sample ones go as :class:`BatchedComplexTable`, which Qwen's ``apply_rotary_emb_qwen``
  broadcasts per sample.

Attention masks (:class:`Site` ``mask``): ``None``: a mask on a merged call raises (it would cover the
unmerged sequence); ``"pass"``: passed through (text-only masks, or biases over text keys, that broadcast
over any number of queries or that the processor pads itself); ``"keys"``: a key mask ``[B, 1, 1, L]`` or
``[B, L]`` over the joint sequence (text on the kind's ``joint`` side), whose image columns are gathered
per slot (HunyuanVideo); ``"square"``: a self-attention mask ``[B or 1, ..., L, L]`` over the image stream
(queries x keys: SkyReels-V2's block-causal mask, LTX-2's video self-attention mask), whose image rows and
columns are both gathered per slot.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, MergePoint, TextKeys, class_names
from tomerge.plan import MergePlan

from tomerge.state import MergeState

from ._diffusers import call_arg, check_ff_chunking, probe_joint_attention, probe_self_attention, submodel
from .flux import BatchedRotaryTable

Side = Literal["first", "last"]


# ---------------------------------------------------------------------- declarations
@dataclasses.dataclass(frozen=True)
class Rope:
    """The rotary argument of a merge point's call.

    Args:
        arg: its keyword; ``index``: its position when given positionally.
        layout: ``"rows"``, ``"batched"``, ``"wan"`` or ``"qwen"`` (see the module docstring).
    """

    arg: str = "image_rotary_emb"
    index: int = 3
    layout: Literal["rows", "batched", "wan", "qwen"] = "rows"


@dataclasses.dataclass(frozen=True)
class Site:
    """One merge point of a block kind (see the module docstring).

    Args:
        sublayer: ``"attn"``, ``"crossattn"`` or ``"mlp"``.
        path: the submodule, a dotted path from the block (``"attn"``, ``"ff.conv_inverted"``). A missing
            submodule (or ``None``, e.g. a block without ``attn2``) has no merge point.
        arg, index: keyword and position of the tokens in the submodule's call.
        output: index of the image tokens in a tuple output; ``None``: a tensor output.
        tokens: ``"image"``, ``"joint"`` or ``"conv"``.
        rope: the call's rotary table, gathered for the merged tokens; ``None``: none.
        mask: ``None``, ``"pass"``, ``"keys"`` or ``"square"``; ``mask_arg``, ``mask_index``: the mask's
            keyword/position.
        stays_merged_with: the output stays merged when the block call also merges this sublayer (a later
            site of the block reads it, passes it through and unmerges).
        context: the submodule's tokens include the kind's context tokens; ``False``: the block passes it the
            target tokens alone (Helios's cross-attention).
        count_arg, count_index: a call argument holding the number of target tokens (Helios's
            ``original_context_length``), set to the number of slots in merged calls; ``None``: none.
        text_keys: the submodule is a joint text-image attention whose text is its ``encoder_hidden_states``
            (prompt reweighting can bias its text keys).
        probe: ``idm`` records the attention each image token receives in this submodule, a softmax attention
            with diffusers-style projections. In a kind without text (no ``text_arg``, no ``joint_input``) it is a
            self-attention over the image tokens alone with ``to_q``/``to_k`` (and ``norm_q``/``norm_k``):
            strided image queries, from q and k before the rotary rotation, which the processor applies after
            them (:func:`~tomerge.backbones._diffusers.probe_self_attention`). In a kind with text it is the
            joint text-image attention of the block (text on the kind's ``joint`` side): the text queries'
            softmax over all keys, the image keys' share renormalised, with the model's rotary rotation
            (``rope``, layout ``"rows"`` or ``"qwen"``) and mask (``mask_arg``/``mask_index``)
            (:func:`~tomerge.backbones._diffusers.probe_joint_attention`).
    """

    sublayer: str
    path: str
    arg: str = "hidden_states"
    index: int = 0
    output: int | None = None
    tokens: Literal["image", "joint", "conv"] = "image"
    rope: Rope | None = None
    mask: Literal["pass", "keys", "square"] | None = None
    mask_arg: str = "attention_mask"
    mask_index: int = 2
    stays_merged_with: str | None = None
    context: bool = True
    count_arg: str | None = None
    count_index: int = 4
    text_keys: bool = False
    probe: bool = False


@dataclasses.dataclass(frozen=True)
class Kind:
    """One block type of a family.

    Args:
        name: the block kind (``Where.block_kind``, what schedules see).
        container: model attribute of the ``nn.ModuleList`` of these blocks.
        classes: class names of the blocks (the adapter's ``block_names``).
        sites: the merge points.
        arg, index: keyword/position of the block's token input.
        text_arg, text_index: the block's text argument (its length is ``T`` of joint sequences); ``None``.
        joint_input: the block input is itself a joint sequence with text on this side, ``T`` taken from the
            model call's text (``DeclaredAdapter.model_text``); ``None``: the block input is image tokens.
        joint: the side of text in the block's joint sequences (``"joint"`` sites, ``"keys"`` masks).
        context: the block's image stream holds context tokens on this side of the target tokens (the model
            call's grid): they are kept as they are (see the module docstring); ``None``: no context tokens.
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
    context: Side | None = None

    def __post_init__(self) -> None:
        if self.context is not None and any(site.tokens == "conv" for site in self.sites):
            raise ValueError(f"kind {self.name!r}: context tokens are not supported with 'conv' sites")


# ---------------------------------------------------------------------- runtime
@dataclasses.dataclass
class DeclaredCall:
    """The block call in progress, shared by its points: text and image lengths, the last merge."""

    text: int | None = None
    image: int | None = None
    context: int = 0  # context tokens in the image stream (Kind.context)
    merged: tuple[Tensor, MergePlan, Tensor] | None = None  # (input view, plan, merged): reused for the same input
    shapes: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # conv points: [H, W] of the input
    merging: dict[str, bool] = dataclasses.field(default_factory=dict)  # sublayer -> this call merges it
    kept: set[str] = dataclasses.field(default_factory=set)  # sublayers whose sites get an already merged input

    def reset(self) -> None:
        self.text = self.image = self.merged = None
        self.context = 0
        self.shapes.clear()
        self.merging.clear()
        self.kept.clear()


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredBlock(BlockSpec):
    """A block of a declared kind; reading its input also records the call's text, image and context lengths
    (the input returned is the target tokens only: the context tokens of a ``context`` kind are cut off)."""

    decl: Kind = dataclasses.field(kw_only=True)
    info: DeclaredCall = dataclasses.field(kw_only=True)
    model_text: Any = dataclasses.field(kw_only=True)  # () -> T of the model call (joint_input kinds)
    model_grid: Any = dataclasses.field(kw_only=True)  # () -> the model call's grid (context kinds)

    def block_input(self, args: tuple, kwargs: dict) -> Tensor:
        self.info.reset()
        x = call_arg(args, kwargs, self.decl.arg, self.decl.index)  # [B, N, C] (or [B, T + N, C])
        if self.decl.joint_input is not None:
            T = self.model_text()
            if T is None or x.shape[1] < T:
                raise RuntimeError(f"tomerge: the {self.decl.name!r} block input {tuple(x.shape)} is a joint sequence, "
                                   f"but the model call's text length is {T}")
            self.info.text = T
            x = x[:, T:] if self.decl.joint_input == "first" else x[:, : x.shape[1] - T]
        elif self.decl.text_arg is not None:
            text = call_arg(args, kwargs, self.decl.text_arg, self.decl.text_index)
            self.info.text = int(text.shape[1]) if isinstance(text, Tensor) else 0
        if self.decl.context is not None:
            x = self._target(x)
        self.info.image = int(x.shape[1])
        return x

    def _target(self, stream: Tensor) -> Tensor:
        """The target tokens of an image stream ``[B, C + N, C']``; records ``C``. A stream shorter than the
        model call's grid (or a call without one) is returned whole: its grid does not match, it is not merged."""
        grid = self.model_grid()
        N = math.prod(grid) if grid is not None else None
        if N is None or stream.shape[1] < N:
            return stream
        self.info.context = int(stream.shape[1]) - N
        return stream[:, self.info.context:] if self.decl.context == "first" else stream[:, :N]


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredPoint(MergePoint):
    """The merge point of a :class:`Site` (see the module docstring)."""

    site: Site = dataclasses.field(kw_only=True)
    info: DeclaredCall = dataclasses.field(kw_only=True)
    joint: Side = dataclasses.field(default="first", kw_only=True)
    context: Side | None = dataclasses.field(default=None, kw_only=True)

    # -------------------------------------------------------------- the tokens
    def _raw(self, args: tuple, kwargs: dict) -> Tensor:
        return call_arg(args, kwargs, self.arg, self.site.index)

    def _text(self, joint: Tensor) -> int:
        T = self.info.text
        if T is None or joint.shape[1] < T:
            raise RuntimeError(f"tomerge: {type(self.module).__name__} got {tuple(joint.shape)}, expected a joint "
                               f"sequence with T={T} text and N={self.info.image} image tokens of this block call")
        return T

    def _context(self) -> tuple[int, int]:
        """The context tokens of this block call before and after the target tokens in this site's image stream."""
        C = self.info.context if self.site.context else 0
        return (C, 0) if self.context == "first" else (0, C)

    def _around(self, seq: Tensor) -> tuple[int, int]:
        """How many tokens of this site's sequence ``seq`` (the image stream, or a joint sequence with text on the
        kind's ``joint`` side) come before and after the target tokens: context tokens, and text for joint sites."""
        before, after = self._context()
        if self.site.tokens == "joint":
            T = self._text(seq)
            before, after = (before + T, after) if self.joint == "first" else (before, after + T)
        if seq.shape[1] < before + after:
            raise RuntimeError(f"tomerge: {type(self.module).__name__} got {tuple(seq.shape)}, shorter than the "
                               f"{before + after} text and context tokens of this block call")
        return before, after

    def _image_part(self, seq: Tensor) -> Tensor:
        before, after = self._around(seq)
        return seq[:, before: seq.shape[1] - after]  # [B, N, C] (or [B, M, C] when an earlier site kept it merged)

    def _with_image(self, seq: Tensor, x: Tensor) -> Tensor:
        before, after = self._around(seq)
        if before == after == 0:
            return x
        return torch.cat([seq[:, :before], x, seq[:, seq.shape[1] - after:]], dim=1)

    def _has_others(self) -> bool:
        """This site's sequence holds tokens other than the target ones (text or context)."""
        return self.site.tokens == "joint" or self._context() != (0, 0)

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        raw = self._raw(args, kwargs)
        if self.site.tokens != "conv" and self._has_others():
            return self._image_part(raw)
        if self.site.tokens == "conv":
            self.info.shapes[id(self)] = tuple(raw.shape[2:])
            return raw.flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, H*W, C]
        return raw

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        if self.site.tokens != "conv" and self._has_others():
            x = self._with_image(self._raw(args, kwargs), x)
        elif self.site.tokens == "conv":
            x = x.transpose(1, 2).unsqueeze(-1)  # [B, M, C] -> [B, C, M, 1]: a 1x1 convolution takes any layout
        return with_arg(args, kwargs, self.arg, self.site.index, x)

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
        y = out if self.output is None else out[self.output]
        if self.site.tokens != "conv" and self._has_others():
            return self._image_part(y)
        if self.site.tokens == "conv":
            return y.flatten(2).transpose(1, 2)  # [B, C', M, 1] -> [B, M, C']
        return y

    def set_output(self, out: Any, y: Tensor) -> Any:
        if self.site.tokens != "conv" and self._has_others():
            y = self._with_image(out if self.output is None else out[self.output], y)
        elif self.site.tokens == "conv":
            y = y.transpose(1, 2).unflatten(2, self.info.shapes[id(self)])  # [B, N, C'] -> [B, C', H, W]
        return super().set_output(out, y)

    # -------------------------------------------------------------- what follows the tokens
    def _merge_mask(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        mask = call_arg(args, kwargs, self.site.mask_arg, self.site.mask_index)
        if mask is None or self.site.mask == "pass":
            return args, kwargs
        if self.site.mask is None:
            raise ValueError(f"tomerge: {type(self.module).__name__} got an attention mask ({self.site.mask_arg}) over "
                             "the unmerged sequence, which merged image tokens cannot use; run without the mask or "
                             "without merging")
        before, _ = self._context()
        N = plan.num_tokens
        if self.site.mask == "square":
            merged = gather_square_mask(mask, plan.dst, before, N)
        else:  # "keys": [text?][context, target][text?], the text T = L - C - N on the kind's joint side
            text = mask.shape[-1] - self.info.context - N
            merged = gather_key_mask(mask, plan.dst, before + (text if self.joint == "first" else 0), N)
        return with_arg(args, kwargs, self.site.mask_arg, self.site.mask_index, merged)

    def _merge_rope(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        rope = self.site.rope
        freqs = call_arg(args, kwargs, rope.arg, rope.index)
        if freqs is None:
            return args, kwargs
        return with_arg(args, kwargs, rope.arg, rope.index,
                        gather_rope(freqs, plan.dst, plan.num_tokens, rope.layout, context=self._context()))


# ---------------------------------------------------------------------- gathers
def with_arg(args: tuple, kwargs: dict, name: str, index: int, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the argument ``name`` (keyword, or positional ``index``) set to ``value``."""
    if name not in kwargs and len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}


def merged_positions(dst: Tensor, start: int, num_tokens: int, length: int) -> Tensor:
    """The positions, in a sequence of ``length`` whose ``num_tokens`` image tokens begin at ``start``, that the
    merged sequence reads: the other positions (text, context) as they are, then for each slot its
    representative ``start + dst``.

    Args:
        dst: ``[B', M]`` representatives (``plan.dst``; ``B' = 1``: shared by the batch).
        start: the position of the first image token; ``num_tokens``: ``N``; ``length``: ``L``.

    Returns:
        ``[B', L - N + M]`` (long, on ``dst``'s device).

    Example:
        >>> merged_positions(torch.tensor([[2, 0]]), 1, 3, 5).tolist()      # [text, 3 image tokens, context]
        [[0, 3, 1, 4]]
    """
    if start < 0 or start + num_tokens > length:
        raise ValueError(f"tomerge: {num_tokens} image tokens from position {start} do not fit a sequence of {length}")
    index = dst.long() + start  # [B', M]
    if length == num_tokens:
        return index
    B = index.shape[0]
    ahead = torch.arange(start, device=index.device).expand(B, -1)  # [B', start]
    behind = torch.arange(start + num_tokens, length, device=index.device).expand(B, -1)  # [B', L - start - N]
    return torch.cat([ahead, index, behind], dim=1)


def _rows(t: Tensor, positions: Tensor, dim: int) -> Tensor:
    """``t`` with its ``dim`` axis (the tokens) indexed per sample by ``positions [B', L']``; a leading axis of size
    1 (or none, ``dim == 0``) is shared by the samples. Returns ``[B', L', ...]`` (``dim == 0``: ``[L', ...]`` when
    ``B' == 1``); ``dim > 1`` keeps the axis in place (``[B', ..., L', ...]``)."""
    index = positions.to(t.device)
    if dim == 0:
        return t[index[0]] if index.shape[0] == 1 else t[index]  # [L', ...] or [B', L', ...]
    if dim > 1:
        return _rows(t.movedim(dim, 1), positions, 1).movedim(1, dim)
    if t.shape[0] == 1:
        return t[0][index]  # [B', L', ...]
    batch = torch.arange(t.shape[0], device=t.device)[:, None]  # [B, 1]
    return t[batch, index.expand(t.shape[0], -1)]  # [B, L', ...]


def gather_rope(freqs: Any, dst: Tensor, num_tokens: int, layout: str, context: tuple[int, int] = (0, 0)) -> Any:
    """The rotary argument of a merged call (see the module docstring's layouts): the ``N`` image rows gathered per
    slot, text and context rows kept.

    Args:
        freqs: the call's rotary argument.
        dst: ``[B, M]`` (or ``[1, M]``) token position representing each slot (``plan.dst``).
        num_tokens: ``N``, the image tokens of the unmerged call.
        layout: ``"rows"``, ``"batched"``, ``"wan"`` or ``"qwen"``.
        context: the context tokens before and after the ``N`` target tokens in the image stream (their rows
            follow the text rows of a ``"rows"`` table; the other layouts' tables cover the image stream only).

    Example:
        >>> cos = torch.arange(4.0).view(1, 4, 1, 1)                      # wan layout, N = 4
        >>> c, _ = gather_rope((cos, cos), torch.tensor([[3, 0], [1, 2]]), 4, "wan")
        >>> c.flatten(1).tolist()
        [[3.0, 0.0], [1.0, 2.0]]
    """
    before, after = context
    stream = before + num_tokens + after
    if layout == "rows":
        out = []
        for t in freqs:
            if not isinstance(t, Tensor) or t.dim() != 2 or t.shape[0] < stream:
                raise ValueError(f"tomerge: a 'rows' rotary table must be (cos, sin) tables [R + {stream}, d] for "
                                 f"{num_tokens} image and {before + after} context tokens, got "
                                 f"{tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__}")
            rows = t.shape[0]
            gathered = _rows(t, merged_positions(dst, rows - after - num_tokens, num_tokens, rows), 0)
            out.append(gathered if gathered.dim() == 2 else BatchedRotaryTable(gathered))  # [L', d] or [B, L', d]
        return tuple(out)
    if layout in ("batched", "wan"):
        if isinstance(freqs, Tensor):  # one table (Helios)
            return gather_rope((freqs,), dst, num_tokens, layout, context)[0]
        out = []
        for t in freqs:
            dim = t.dim() - 2 if layout == "batched" else 1  # batched: [B, N, d] or [B, H, N, d]; wan: [1, N, 1, d]
            if t.dim() < 3 or t.shape[dim] != stream:
                raise ValueError(f"tomerge: a {layout!r} rotary table must have {stream} rows ({num_tokens} image "
                                 f"and {before + after} context tokens) on axis {dim}, got {tuple(t.shape)}")
            out.append(_rows(t, merged_positions(dst, before, num_tokens, stream), dim))
        return tuple(out)
    if layout == "qwen":
        image, text = freqs
        if image.shape[0] != stream:
            raise ValueError(f"tomerge: the image rotary table has {image.shape[0]} rows for {num_tokens} image and "
                             f"{before + after} context tokens")
        gathered = _rows(image, merged_positions(dst, before, num_tokens, stream), 0)  # [L', d/2] or [B, L', d/2]
        return (gathered if gathered.dim() == image.dim() else BatchedComplexTable(gathered), text)
    raise ValueError(f"unknown rotary layout {layout!r}")


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


def _gather_last(mask: Tensor, positions: Tensor, dim: int) -> Tensor:
    """``mask`` indexed along ``dim`` (``-1`` or ``-2``) by ``positions [B', L']`` per sample; a leading axis of
    size 1 is shared (expanded to ``B'``)."""
    index = positions.to(mask.device)
    if index.shape[0] == 1:
        return mask.index_select(dim, index[0])
    B, L = index.shape
    mask = mask.expand(B, *mask.shape[1:])
    view = [B] + [1] * (mask.dim() - 1)
    view[dim] = L
    shape = list(mask.shape)
    shape[dim] = L
    return torch.gather(mask, dim, index.view(view).expand(shape))


def gather_key_mask(mask: Tensor, dst: Tensor, start: int, num_tokens: int) -> Tensor:
    """A key mask over a joint sequence, its ``N`` image columns (from ``start``) gathered per slot, the other
    columns (text, context) kept.

    Args:
        mask: ``[B or 1, ..., L]``, e.g. ``[B, 1, 1, L]``.
        dst: ``[B, M]`` or ``[1, M]`` representatives.
        start: the first image column; ``num_tokens``: ``N``.

    Returns:
        ``[B, ..., L - N + M]``.

    Example:
        >>> m = torch.tensor([[True, False, True, True, False]])            # 3 image, then 2 text columns
        >>> gather_key_mask(m, torch.tensor([[2, 1]]), 0, 3).tolist()
        [[True, False, True, False]]
    """
    return _gather_last(mask, merged_positions(dst, start, num_tokens, mask.shape[-1]), -1)


def gather_square_mask(mask: Tensor, dst: Tensor, start: int, num_tokens: int) -> Tensor:
    """A self-attention mask over the image stream (queries x keys), its ``N`` image rows and columns (from
    ``start``) gathered per slot, the rows and columns of context tokens kept.

    Args:
        mask: ``[B or 1, ..., L, L]`` (boolean or additive).
        dst: ``[B, M]`` or ``[1, M]`` representatives.
        start: the first image token in the stream; ``num_tokens``: ``N``.

    Returns:
        ``[B, ..., L - N + M, L - N + M]``.

    Example:
        >>> causal = torch.ones(3, 3).tril().bool()[None]                   # [1, 3, 3]: token i sees 0..i
        >>> gather_square_mask(causal, torch.tensor([[2, 0]]), 0, 3).int().tolist()
        [[[1, 1], [0, 1]]]
    """
    L = mask.shape[-1]
    if mask.dim() < 3 or mask.shape[-2] != L:
        raise ValueError(f"tomerge: a square attention mask must be [B or 1, ..., L, L], got {tuple(mask.shape)}")
    positions = merged_positions(dst, start, num_tokens, L)
    return _gather_last(_gather_last(mask, positions, -2), positions, -1)


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
    """

    model_class: ClassVar[str] = ""
    kinds: ClassVar[tuple[Kind, ...]] = ()
    timestep_arg: ClassVar[str] = "timestep"
    timestep_index: ClassVar[int] = 1
    text_arg: ClassVar[str] = "encoder_hidden_states"
    text_index: ClassVar[int] = 1
    latent_arg: ClassVar[str] = "hidden_states"
    latent_index: ClassVar[int] = 0
    patch_attrs: ClassVar[tuple[str, ...]] = ("patch_size",)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.kinds and not cls.__dict__.get("block_names"):
            cls.block_names = tuple(dict.fromkeys(name for kind in cls.kinds for name in kind.classes))

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.grid_size: tuple[int, ...] | None = None
        self.model_text: int | None = None
        self._warned_grid = False

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The transformer: ``obj`` itself or a pipeline's ``obj.transformer``."""
        return submodel(obj, "transformer", cls.model_class)

    # -------------------------------------------------------------- blocks
    def block_modules(self) -> list[tuple[Kind, nn.Module]]:
        found = []
        for kind in self.kinds:
            for module in getattr(self.model, kind.container, None) or ():
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
                                                info=info, joint=kind.joint, context=kind.context))
            specs.append(DeclaredBlock(module, layer=len(specs), kind=kind.name, points=tuple(points), arg=kind.arg,
                                       decl=kind, info=info, model_text=lambda: self.model_text,
                                       model_grid=lambda: self.grid_size))
        return specs

    def check(self) -> None:
        check_ff_chunking([module for _, module in self.block_modules()])

    # -------------------------------------------------------------- calls
    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        text = call_arg(args, kwargs, self.text_arg, self.text_index)
        self.model_text = int(text.shape[1]) if isinstance(text, Tensor) else None
        self.grid_size = self.call_grid(args, kwargs)
        if self.grid_size is None and not self._warned_grid:
            self._warned_grid = True
            warnings.warn(f"tomerge {self.name}: the token grid of this {type(self.model).__name__} call is unknown "
                          f"({self.unknown_grid_reason()}); its blocks are not merged", stacklevel=3)
        return self.call_timestep(args, kwargs)

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

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        """The image-token grid of a model call (default: the latent's sizes divided by the patch sizes)."""
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

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        site = point.site if isinstance(point, DeclaredPoint) else None
        if site is None or not site.probe:
            if isinstance(block, DeclaredBlock) and any(s.probe for s in block.decl.sites):
                return []  # another site of the block (its attention) records
            raise NotImplementedError(
                f"backbone {self.name!r} cannot record received attention in its {block.kind!r} blocks (no probe is "
                "declared for their attention: docs/backbones/adding-a-family.md); use a strategy that needs none, "
                "e.g. idm(variant='streak') or ssm")
        kind = block.decl
        if kind.text_arg is None and kind.joint_input is None:
            handles = probe_self_attention(block, point, state, context=point._context)
            if site.mask is not None:
                handles.append(point.module.register_forward_pre_hook(_refuse_masked_probe(point, state),
                                                                      with_kwargs=True))
            return handles
        rope = site.rope
        inner = [s.path for s in kind.sites if s.path.startswith(site.path + ".")]  # merge points inside the attention
        return probe_joint_attention(point.module, state, text_side=kind.joint, text_len=lambda: point.info.text,
                                     rope=None if rope is None else (rope.arg, rope.index),
                                     rope_layout="rows" if rope is None else rope.layout,
                                     mask=(site.mask_arg, site.mask_index),
                                     record_before=_submodule(block.module, inner[0]) if inner else None,
                                     context=point._context)

    def text_keys(self, block: BlockSpec, point: MergePoint) -> TextKeys | None:
        if not isinstance(point, DeclaredPoint) or not point.site.text_keys:
            return None

        def text_len(args: tuple, kwargs: dict) -> int:
            text = call_arg(args, kwargs, "encoder_hidden_states", 1)
            return 0 if text is None else int(text.shape[1])
        return TextKeys(point.module, text_len=text_len, text_first=point.joint == "first")


def _refuse_masked_probe(point: DeclaredPoint, state: MergeState):
    """A forward pre-hook raising when a probed attention call of a merging block has an attention mask: the
    probe's softmax runs over every key (:func:`~tomerge.probe.received_attention`), so it would record attention
    the masked model does not pay."""
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        call = state.call
        if call is not None and call.decision.merges and call_arg(args, kwargs, point.site.mask_arg,
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
