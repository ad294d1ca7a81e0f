"""`flux`: FLUX.1 (diffusers `FluxTransformer2DModel`), double- and single-stream blocks.

Merges the image tokens of both block kinds (the text and FLUX.1 Kontext's reference tokens pass at full length),
gathers the RoPE rows of the merged slots and records the joint attention's text-to-image part for ``idm``. What is
merged where, the positions, the grid and the limits: docs/backbones/flux.md (facts from diffusers 0.42.1,
``models/transformers/transformer_flux.py``).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, KindSummary, MergePoint, TextKeys, class_names
from tomerge.plan import MergePlan
from tomerge.state import MergeState

from ._context import NO_CONTEXT, ContextTokens
from ._diffusers import call_arg, probe_joint_attention, submodel
from ._gather import gather_rotary, with_arg
from ._grid import split_ids
from ._host import HostFacts


# ---------------------------------------------------------------------- blocks and merge points
@dataclasses.dataclass
class CallLengths:
    """The block call in progress (reset by :meth:`FluxBlockSpec.block_input`): text and target image lengths,
    the model call's context (reference-image) tokens in the image stream, and the last merge of the joint
    input (a single-stream block's ``proj_mlp`` and ``attn`` read the same tensor)."""

    text: int | None = None
    image: int | None = None
    context: ContextTokens = NO_CONTEXT
    merged: tuple[Tensor, MergePlan, Tensor] | None = None  # (joint input, plan, merged image part)


@dataclasses.dataclass(frozen=True, eq=False)
class FluxBlockSpec(BlockSpec):
    """A Flux block; reading its input also records the call's text and image lengths and the model call's
    context tokens for its points. Its input is the target part of the image stream."""

    lengths: CallLengths = dataclasses.field(default_factory=CallLengths, kw_only=True)
    model_context: Callable[[], ContextTokens] = dataclasses.field(default=lambda: NO_CONTEXT, kw_only=True)

    def block_input(self, args: tuple, kwargs: dict) -> Tensor:
        stream = call_arg(args, kwargs, "hidden_states", 0)  # [B, before + N + after, C] image stream
        text = call_arg(args, kwargs, "encoder_hidden_states", 1)  # [B, T, C]
        context = self.model_context()
        context.check(stream, type(self.module).__name__)
        x = context.target(stream)  # [B, N, C]
        self.lengths.text = int(text.shape[1]) if text is not None else 0
        self.lengths.image = int(x.shape[1])
        self.lengths.context = context
        self.lengths.merged = None
        return x


@dataclasses.dataclass(frozen=True, eq=False)
class ImageStreamPoint(MergePoint):
    """A submodule of a double-stream block that reads the image stream (``ff``; ``attn`` is
    :class:`DoubleAttentionPoint`): its target part is merged and unmerged, the context tokens pass through."""

    lengths: CallLengths = dataclasses.field(default_factory=CallLengths, kw_only=True)

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        return self.lengths.context.target(super().get_input(args, kwargs))  # [B, N, C]

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        stream = super().get_input(args, kwargs)  # [B, before + N + after, C]
        return super().set_input(args, kwargs, self.lengths.context.with_target(stream, x))

    def get_output(self, out: Any) -> Tensor:
        return self.lengths.context.target(super().get_output(out))  # [B, M, C']

    def set_output(self, out: Any, y: Tensor) -> Any:
        return super().set_output(out, self.lengths.context.with_target(super().get_output(out), y))


@dataclasses.dataclass(frozen=True, eq=False)
class DoubleAttentionPoint(ImageStreamPoint):
    """``attn`` of a double-stream block: merges the target part of the image ``hidden_states`` and gathers
    their RoPE rows (text and context rows kept).

    Its output is ``(image, text)`` or ``(image, text, ip)``; both image parts are unmerged.
    """

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        _check_no_mask(args, kwargs)
        text = call_arg(args, kwargs, "encoder_hidden_states", 1)  # [B, T, C]
        args, kwargs = super().merge_input(args, kwargs, x, plan)
        return _merge_rotary(args, kwargs, plan, 0 if text is None else int(text.shape[1]), self.lengths.context)

    def get_output(self, out: Any) -> Tensor:
        context = self.lengths.context
        if len(out) == 3:  # IP-adapter: (image, text, ip image output), both image outputs unmerged together
            return torch.cat([context.target(out[0]), context.target(out[2])], dim=-1)  # [B, M, 2C]
        return context.target(out[0])

    def set_output(self, out: Any, y: Tensor) -> Any:
        context = self.lengths.context
        if len(out) == 3:
            image, ip = y.split([out[0].shape[-1], out[2].shape[-1]], dim=-1)  # [B, N, C] each
            return (context.with_target(out[0], image), out[1], context.with_target(out[2], ip))
        return (context.with_target(out[0], y), *out[1:])


@dataclasses.dataclass(frozen=True, eq=False)
class SingleStreamPoint(MergePoint):
    """A submodule of a single-stream block that reads the normalised joint ``[text, image stream]`` sequence
    (``proj_mlp``; ``attn`` is :class:`SingleAttentionPoint`): the target part of the image stream (after the
    call's ``T`` text tokens, within the context tokens) is merged on the way in. When the block call also
    merges ``"mlp"`` (``proj_out``), the output stays merged: the activation, the concatenation and
    ``proj_out`` run on the merged sequence and :class:`SingleOutputPoint` unmerges once. Otherwise the target
    part of the output is unmerged here."""

    lengths: CallLengths = dataclasses.field(kw_only=True)

    def _split(self, joint: Tensor) -> int:
        T, N, context = self.lengths.text, self.lengths.image, self.lengths.context
        if T is None or N is None or joint.shape[1] != T + N + context.count:
            raise RuntimeError(
                f"tomerge flux: {type(self.module).__name__} got {tuple(joint.shape)}, expected [B, T + N, C] with "
                f"T={T} text and N={N} image tokens of this block call"
                + (f" and {context.count} context tokens" if context else ""))
        return T

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        joint = super().get_input(args, kwargs)  # [B, T + before + N + after, C]
        return self.lengths.context.target(joint[:, self._split(joint):])  # [B, N, C]

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        joint = super().get_input(args, kwargs)  # [B, T + before + N + after, C]
        cached = self.lengths.merged
        if cached is not None and cached[0] is joint and cached[1] is plan:
            merged = cached[2]  # proj_mlp and attn read the same normalised tokens: merge them once
        else:
            merged = plan.merge(x)  # [B, M, C]
            self.lengths.merged = (joint, plan, merged)
        return self.set_input(args, kwargs, merged)

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        joint = super().get_input(args, kwargs)  # [B, T + before + N + after, C]
        T = self.lengths.text
        merged = torch.cat([joint[:, :T], self.lengths.context.with_target(joint[:, T:], x)], dim=1)  # [.., T + M ..]
        return super().set_input(args, kwargs, merged)

    def keeps_merged(self, sublayers: frozenset[str]) -> bool:
        return "mlp" in sublayers  # proj_out reads this output and unmerges

    def get_output(self, out: Tensor) -> Tensor:
        return self.lengths.context.target(out[:, self.lengths.text:])  # [B, M, C']

    def set_output(self, out: Tensor, y: Tensor) -> Tensor:
        T = self.lengths.text
        return torch.cat([out[:, :T], self.lengths.context.with_target(out[:, T:], y)], dim=1)  # [B, T + .. N .., C']


@dataclasses.dataclass(frozen=True, eq=False)
class SingleOutputPoint(SingleStreamPoint):
    """``proj_out`` of a single-stream block (``"mlp"``): reads ``cat([attn_out, mlp_out], -1)``, already
    merged when the block call merged ``"attn"`` too (``[B, T + M, C']``, context tokens within), else full
    length (merged here); the target part of its output is unmerged."""

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        joint = MergePoint.get_input(self, args, kwargs)  # [B, T + .. N .., C'] or [B, T + .. M .., C']
        return self.lengths.context.target(joint[:, self.lengths.text or 0:])

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        if x.shape[1] == plan.num_slots:
            return args, kwargs  # the parallel branch ran merged: nothing to merge
        self._split(MergePoint.get_input(self, args, kwargs))
        return self.set_input(args, kwargs, plan.merge(x))

    def keeps_merged(self, sublayers: frozenset[str]) -> bool:
        return False


@dataclasses.dataclass(frozen=True, eq=False)
class SingleAttentionPoint(SingleStreamPoint):
    """``attn`` of a single-stream block: the joint sequence's target part is merged, its RoPE rows gathered."""

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        _check_no_mask(args, kwargs)
        args, kwargs = super().merge_input(args, kwargs, x, plan)
        return _merge_rotary(args, kwargs, plan, self.lengths.text, self.lengths.context)


def _check_no_mask(args: tuple, kwargs: dict) -> None:
    if call_arg(args, kwargs, "attention_mask", 2) is not None:
        raise ValueError("tomerge flux: an attention_mask over the full sequence cannot be used with merged image "
                         "tokens; drop it from joint_attention_kwargs or run without merging")


def _merge_rotary(args: tuple, kwargs: dict, plan: MergePlan, text_len: int,
                  context: ContextTokens = NO_CONTEXT) -> tuple[tuple, dict]:
    """Replaces the attention call's ``image_rotary_emb`` by the table of the merged sequence (text and context
    rows kept, the target's gathered)."""
    freqs = call_arg(args, kwargs, "image_rotary_emb", 3)
    if freqs is None:
        return args, kwargs
    if freqs[0].shape[0] != text_len + plan.num_tokens + context.count:
        raise ValueError(
            f"tomerge flux: image_rotary_emb has {freqs[0].shape[0]} rows, expected {text_len} text + "
            f"{plan.num_tokens} image positions" + (f" + {context.count} context positions" if context else ""))
    dst = context.stream_positions(plan.dst, plan.num_tokens)  # [B, before + M + after]
    return with_arg(args, kwargs, "image_rotary_emb", 3, gather_rotary(freqs, dst, text_len))


# ---------------------------------------------------------------------- the adapter
class FluxAdapter(BackboneAdapter):
    """Adapter for diffusers `FluxTransformer2DModel` (see the module docstring).

    Example:
        >>> import tomerge                                                   # doctest: +SKIP
        >>> with tomerge.merging(pipe, "tomesd", ratio=0.5, use_rand=False):  # doctest: +SKIP
        ...     image = pipe("a cat", num_inference_steps=4).images[0]
    """

    name: ClassVar[str] = "flux"
    model_class: ClassVar[str] = "FluxTransformer2DModel"
    block_names: ClassVar[tuple[str, ...]] = ("FluxTransformerBlock", "FluxSingleTransformerBlock")
    t_max: ClassVar[float] = 1.0  # Flux is called with t in [0, 1] (it multiplies by 1000 inside)

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.grid_size: tuple[int, int] | None = None
        self.context = NO_CONTEXT  # reference-image tokens of the model call in progress
        self._warned_ids = False
        self._layout = HostFacts(split_ids)  # read once per img_ids tensor (pipelines pass the same one every step)

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The transformer: ``obj`` itself or a pipeline's ``obj.transformer``."""
        return submodel(obj, "transformer", cls.model_class)

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return tuple(KindSummary(kind, ("attn", "mlp"), context="joint attention, text first", rope="rows")
                     for kind in ("double", "single"))

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({"double", "single"})

    def blocks(self) -> list[BlockSpec]:
        specs: list[BlockSpec] = []
        for module in self.model.modules():  # registration order = execution order: double, then single
            names = class_names(module)
            lengths = CallLengths()
            if "FluxTransformerBlock" in names:
                points = (DoubleAttentionPoint("attn", module.attn, lengths=lengths),
                          ImageStreamPoint("mlp", module.ff, lengths=lengths))
                kind = "double"
            elif "FluxSingleTransformerBlock" in names:
                points = (SingleStreamPoint("attn", module.proj_mlp, arg="input", lengths=lengths),
                          SingleAttentionPoint("attn", module.attn, lengths=lengths),
                          SingleOutputPoint("mlp", module.proj_out, arg="input", lengths=lengths))
                kind = "single"
            else:
                continue
            specs.append(FluxBlockSpec(module, layer=len(specs), kind=kind, points=points, lengths=lengths,
                                       model_context=lambda: self.context,
                                       outputs=("encoder_hidden_states", "hidden_states")))
        return specs

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        x = call_arg(args, kwargs, "hidden_states", 0)  # [B, N, C_in] packed latent
        img_ids = call_arg(args, kwargs, "img_ids", 4)
        self.grid_size, self.context = self._layout(img_ids) if img_ids is not None else (None, NO_CONTEXT)
        if self.grid_size is None and not self._warned_ids:
            self._warned_ids = True
            warnings.warn(
                f"tomerge flux: the img_ids of this call ({x.shape[1]} image tokens) hold no raster-ordered "
                "H x W grid of the generated image; its blocks are not merged", stacklevel=2)
        return call_arg(args, kwargs, "timestep", 3)

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, int] | None:
        if self.grid_size is None or self.grid_size[0] * self.grid_size[1] != num_tokens:
            return None
        return self.grid_size

    def text_keys(self, block: BlockSpec, point: MergePoint) -> TextKeys | None:
        if isinstance(point, DoubleAttentionPoint):
            def text_len(args: tuple, kwargs: dict) -> int:
                text = call_arg(args, kwargs, "encoder_hidden_states", 1)  # [B, T, C]
                return 0 if text is None else int(text.shape[1])
        elif isinstance(point, SingleAttentionPoint):
            def text_len(args: tuple, kwargs: dict) -> int:
                return point.lengths.text or 0  # the joint sequence's text part, from the block call
        else:
            return None
        return TextKeys(point.module, text_len=text_len, text_first=True)  # [text, image] in the processor

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        if not isinstance(point, (DoubleAttentionPoint, SingleAttentionPoint)):
            return []  # proj_mlp: the attention's own point records
        lengths = getattr(block, "lengths", CallLengths())
        return probe_joint_attention(point.module, state, text_side="first", text_len=lambda: lengths.text,
                                     rope=("image_rotary_emb", 3), mask=("attention_mask", 2),
                                     context=lambda: lengths.context)


def text_tokens(pipe: Any, prompt: str, max_sequence_length: int = 512) -> list[str]:
    """The text tokens a `FluxPipeline` gives the transformer for ``prompt``: its T5 tokens (``tokenizer_2``),
    padded to ``max_sequence_length`` (the pipeline call's), as strings for a prompt categorizer."""
    t5 = pipe.tokenizer_2
    ids = t5(prompt, padding="max_length", max_length=max_sequence_length, truncation=True).input_ids
    return list(t5.convert_ids_to_tokens(ids))
