"""Declared adapters: a model family described by class attributes (:mod:`tomerge.backbones._declaration`) instead
of hand-written hooks. :class:`DeclaredAdapter` turns the declaration into blocks (:class:`DeclaredBlock`) and merge
points (:class:`DeclaredPoint`) that share the bookkeeping of the block call in progress (:class:`DeclaredCall`).

A family that fits is a subclass with a few class attributes (``backbones/wan.py``); what does not fit is a method
override in its own file. ``docs/backbones/adding-a-family.md`` walks through it and describes the token layouts,
rotary tables, masks and context tokens handled here.
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
from ._declaration import Kind, Rope, Side, Site
from ._diffusers import (call_arg, check_ff_chunking, probe_joint_attention, probe_sdpa_attention, probe_self_attention,
                         submodel)
from ._gather import gather_key_mask, gather_pair_mask, gather_rope, gather_rows, ragged_index, with_arg
from ._grid import grid_from_ids, latent_grid
from ._host import HostFacts

__all__ = ["DeclaredAdapter", "DeclaredBlock", "DeclaredCall", "DeclaredPoint", "Kind", "RaggedText", "Rope",
           "SelfKVPoint", "SharedPoint", "Side", "Site", "text_lengths"]


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
            return gather_rows(joint, index, 1)
        return joint[:, T:] if side == "first" else joint[:, : joint.shape[1] - T]

    def with_stream(self, joint: Tensor, stream: Tensor, side: Side, who: str) -> Tensor:
        """The joint sequence ``[B, T + K, C]`` with its image stream replaced by ``stream [B, K', C]``:
        ``[B, T + K', C]``."""
        T = self._check(joint, side, who)
        if self.lengths is not None:
            L, K = joint.shape[1], joint.shape[1] - T
            appended = L + torch.arange(stream.shape[1], device=joint.device)[None]  # [1, K']: rows after joint's
            return gather_rows(torch.cat([joint, stream], dim=1), ragged_index(self.lengths, T, K, appended), 1)
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
    # (image stream [B, L, C]) -> its ContextTokens (DeclaredAdapter.block_context)
    stream_context: Any = dataclasses.field(default=lambda stream: NO_CONTEXT, kw_only=True)

    def tokens(self, args: tuple, kwargs: dict) -> Tensor:
        """The block's token input as ``[B, L, C]`` (a family whose blocks take another layout overrides it)."""
        return call_arg(args, kwargs, self.decl.arg, self.decl.index)

    def block_input(self, args: tuple, kwargs: dict) -> Tensor:
        self.info.reset()
        x = self.tokens(args, kwargs)  # [B, N, C] (or [B, T + N, C])
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
        context = self.stream_context(x)
        context.check(x, f"the {self.decl.name!r} block")
        self.info.context = context
        x = context.target(x)  # [B, N, C]: the target part of the image stream
        self.info.batch, self.info.image = int(x.shape[0]), int(x.shape[1])
        return x


@dataclasses.dataclass(frozen=True, eq=False)
class DeclaredPoint(MergePoint):
    """The merge point of a :class:`Site`. A family whose call differs overrides a hook in a subclass named by
    ``Site(point=)``: :meth:`batch_first` (the tokens' layout), :meth:`around` (the context tokens it gets),
    :meth:`mask_args` (the masks adjusted), :meth:`merged_rope` (the rotary gather), :meth:`merge_arguments` (the
    other arguments of a merged call)."""

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

    def batch_first(self, t: Tensor) -> Tensor:
        """``[B, L, C]`` tokens of the submodule's input or output, and back (its own inverse; a family whose
        submodule takes sequence-first ``[L, B, C]`` tokens transposes)."""
        return t

    def around(self) -> ContextTokens:
        """The context tokens of this site's image stream: the block call's (a family whose block passes the
        submodule the target alone returns none)."""
        return self.info.context

    def _target(self, tokens: Tensor) -> Tensor:
        """The target image tokens of a site's input or output (a joint sequence or an image stream)."""
        stream = self._stream(tokens) if self.site.tokens == "joint" else tokens
        return self.around().target(stream)

    def _with_target(self, tokens: Tensor, x: Tensor) -> Tensor:
        """``tokens`` (a joint sequence or an image stream) with its target image tokens replaced by ``x``."""
        context = self.around()
        if self.site.tokens == "joint":
            return self._with_stream(tokens, context.with_target(self._stream(tokens), x))
        return context.with_target(tokens, x)

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        raw = self.batch_first(self._raw(args, kwargs))
        if self.site.tokens == "conv":
            if self.around():
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
            x = self.batch_first(self._with_target(self.batch_first(raw), x))  # in the call's layout
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
        return self.merge_arguments(args, kwargs, plan)

    def merge_arguments(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        """The merged call's other arguments that follow its tokens: the masks and the rotary table."""
        args, kwargs = self._merge_mask(args, kwargs, plan)
        if self.site.rope is not None:
            args, kwargs = self._merge_rope(args, kwargs, plan)
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
        y = self.batch_first(out if self.output is None else out[self.output])
        if self.site.tokens == "conv":
            return y.flatten(2).transpose(1, 2)  # [B, C', M, 1] -> [B, M, C']
        return self._target(y)

    def set_output(self, out: Any, y: Tensor) -> Any:
        if self.site.tokens == "conv":  # [B, F*H*W, C'] -> [B, F, H, W, C'] -> [B*F, C', H, W]
            y = y.unflatten(1, self.info.shapes[id(self)]).permute(0, 1, 4, 2, 3).flatten(0, 1)
        else:
            y = self.batch_first(self._with_target(self.batch_first(out if self.output is None else out[self.output]), y))
        return super().set_output(out, y)

    # -------------------------------------------------------------- what follows the tokens
    def mask_args(self) -> tuple[tuple[str, int | None], ...]:
        """``(keyword, position)`` of each attention mask of the call, adjusted alike (position ``None``: keyword
        only)."""
        return ((self.site.mask_arg, self.site.mask_index),)

    def _merge_mask(self, args: tuple, kwargs: dict, plan: MergePlan) -> tuple[tuple, dict]:
        if self.site.mask == "pass":
            return args, kwargs
        for name, index in self.mask_args():
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
        return with_arg(args, kwargs, rope.arg, rope.index, self.merged_rope(freqs, *self._stream_positions(plan)))

    def merged_rope(self, freqs: Any, dst: Tensor, num_tokens: int) -> Any:
        """The rotary argument ``freqs`` of the merged call: :func:`~tomerge.backbones._gather.gather_rope` with the
        site's layout, for the representatives ``dst`` in an image stream of ``num_tokens``."""
        rope = self.site.rope
        return gather_rope(freqs, dst, num_tokens, rope.layout, text_side=rope.text, lengths=self.info.lengths)

    def _stream_positions(self, plan: MergePlan) -> tuple[Tensor, int]:
        """``(positions [B, before + M + after], before + N + after)``: the plan's representatives in the image
        stream (each context token its own), and the stream's length, for the gathers below."""
        context = self.around()
        return context.stream_positions(plan.dst, plan.num_tokens), plan.num_tokens + context.count


@dataclasses.dataclass(frozen=True, eq=False)
class SelfKVPoint(DeclaredPoint):
    """A self-attention called as ``attn(x, x)`` (Lumina 2, OmniGen): its ``encoder_hidden_states``, the keys' and
    values' input, gets the merged tokens too."""

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        if call_arg(args, kwargs, "encoder_hidden_states", 1) is not self._raw(args, kwargs):
            raise RuntimeError(f"tomerge: {type(self.module).__name__} is declared a self-attention called as "
                               "attn(x, x), but its encoder_hidden_states is another tensor than its tokens")
        args, kwargs = super().set_input(args, kwargs, x)
        return with_arg(args, kwargs, "encoder_hidden_states", 1, self._raw(args, kwargs))


@dataclasses.dataclass(frozen=True, eq=False)
class SharedPoint(DeclaredPoint):
    """A submodule the block calls again on its text stream after the image call (EasyAnimate's ``ff`` in the blocks
    without text projections, CogView4's one ``ff`` for both streams): only its first call in a block call reads
    image tokens, the others run as they are (:meth:`MergePoint.reads_tokens`)."""

    def reads_tokens(self, args: tuple, kwargs: dict) -> bool:
        first = id(self) not in self.info.called
        self.info.called.add(id(self))
        return first


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
                    points.append((site.point or DeclaredPoint)(site.sublayer, sub, arg=site.arg, output=site.output,
                                                                site=site, info=info, joint=kind.joint))
            specs.append((kind.block or DeclaredBlock)(
                module, layer=len(specs), kind=kind.name, points=tuple(points), arg=kind.arg, outputs=kind.outputs,
                decl=kind, info=info, joint_text=self.joint_text,
                stream_context=lambda stream, kind=kind: self.block_context(kind, stream)))
        return specs

    def block_context(self, kind: Kind, stream: Tensor) -> ContextTokens:
        """The context tokens of a ``kind`` block call's image stream ``[B, L, C]`` (default: the model call's,
        :meth:`call_layout`). Families whose blocks add tokens to the stream override it (FramePack's and Helios's
        history latents: :func:`~tomerge.backbones._context.beyond_grid`)."""
        return self.context

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
            handles = probe_self_attention(block, point, state, context=point.around)
            if site.mask is not None:
                handles.append(point.module.register_forward_pre_hook(_refuse_masked_probe(point, state),
                                                                      with_kwargs=True))
            return handles
        rope = site.rope
        inner = [s.path for s in kind.sites if s.path.startswith(site.path + ".")]  # merge points inside the attention
        return self.probe_joint(point.module, state, text_side=kind.joint, text_len=lambda: point.info.text,
                                rope=None if rope is None else (rope.arg, rope.index),
                                rope_layout="rows" if rope is None else rope.layout,
                                mask=(site.mask_arg, site.mask_index), context=lambda: point.info.context,
                                record_before=_submodule(block.module, inner[0]) if inner else None)

    def probe_joint(self, attention: nn.Module, state: MergeState, **options: Any) -> list[Any]:
        """The joint text-image probe of ``attention`` with the declaration's ``options``
        (:func:`~tomerge.backbones._diffusers.probe_joint_attention`); a family whose processor reads q/k otherwise
        adds its own (CogVideoX's and EasyAnimate's ``heads_first``, ``copies``)."""
        return probe_joint_attention(attention, state, **options)

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
