"""Helpers shared by the adapters of diffusers models: finding the model in a pipeline, call
arguments (:func:`call_arg`, also used by the ``native_dit`` adapter), patch grids, the merge point of
feed-forwards that chunk (:class:`FeedForwardPoint`), the base adapter of patchified transformers, and
the received-attention probes of their attention modules: :func:`probe_self_attention` (image tokens alone),
:func:`probe_joint_attention` (joint text-image attention, from the q/k projections: SD3, FLUX.1/2, Qwen-Image,
HunyuanVideo, AuraFlow; fused q/k/v projections: :func:`fused_part`) and :func:`probe_sdpa_attention` (either, from
the processor's SDPA call: CogView4, GLM-Image, CogView3-Plus, HiDream, Lumina 2, ERNIE-Image; from the image
queries where no text query sees the image: OmniGen, Qwen-Image 2.1, Z-Image's noise refiner)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from tomerge.adapter import BackboneAdapter, BlockSpec, MergePoint, class_names
from tomerge.context import Grid
from tomerge.probe import _EPS, attention_probe, received_attention, received_self_attention, strided_rows
from tomerge.state import MergeState

from ._context import NO_CONTEXT, ContextTokens


def submodel(obj: Any, attr: str, class_name: str) -> nn.Module | None:
    """``obj`` itself if one of its classes is named ``class_name``, else ``obj.<attr>`` if that is."""
    if isinstance(obj, nn.Module) and class_name in class_names(obj):
        return obj
    sub = getattr(obj, attr, None)
    if isinstance(sub, nn.Module) and class_name in class_names(sub):
        return sub
    return None


def probe_self_attention(block: BlockSpec, point: MergePoint, state: MergeState, max_queries: int = 64,
                         heads_first: bool = True, context: Callable[[], ContextTokens] | None = None) -> list[Any]:
    """Records the attention each image token receives in a diffusers self-attention ``Attention``.

    Hooks the query/key projections (``to_q``/``to_k``, or ``to_qkv`` after
    ``fuse_qkv_projections()``) and the q/k norms, which run after them and so overwrite the capture,
    to keep what the processor computes anyway; after the attention runs at full length, stores
    ``received_attention`` for the block's layer (:func:`~tomerge.probe.attention_probe`). Calls where
    the attention itself was merged are not recorded (the keys are slots, not tokens).

    ``heads_first``: a per-head q/k norm's output is ``[B, heads, N, d]`` (diffusers' ``AttnProcessor2_0``);
    ``False``: ``[B, N, heads, d]`` (processors that unflatten the heads before the norm, e.g. FLUX.3's).
    ``context``: ``() -> ContextTokens`` of the call in progress, the context tokens around the target's in the
    image stream (:func:`~tomerge.probe.received_self_attention`).
    """
    attn = point.module
    fused = getattr(attn, "to_qkv", None)
    norm_pick = None if heads_first else _heads_first
    sources = [("q", attn.to_q, None), ("k", attn.to_k, None),
               ("q", fused, fused_part(0)), ("k", fused, fused_part(1)),
               ("q", getattr(attn, "norm_q", None), norm_pick), ("k", getattr(attn, "norm_k", None), norm_pick)]
    # diffusers' Attention keeps its logit scale; WanAttention, LTXAttention do not: 1 / sqrt(head size).
    scale = getattr(attn, "scale", None) or (attn.to_q.out_features // attn.heads) ** -0.5
    return attention_probe(state, attn, sources, lambda captured, grid: received_self_attention(
        captured, grid, attn.heads, scale, max_queries, _around(context)))


def _around(context: Callable[[], ContextTokens] | None) -> tuple[int, int]:
    """``(before, after)`` of the call's context tokens (``None``: none)."""
    tokens = NO_CONTEXT if context is None else context()
    return tokens.before, tokens.after


def _heads_first(t: Tensor) -> Tensor:
    """``[B, N, heads, d] -> [B, heads, N, d]`` (a q/k norm output captured by :func:`probe_self_attention`)."""
    return t.transpose(1, 2)


def probe_joint_attention(attn: nn.Module, state: MergeState, *, text_side: str,
                          text_len: Callable[[], int | None] | None = None, rope: tuple[str, int] | None = None,
                          rope_layout: str = "rows", mask: tuple[str, int] | None = None,
                          record_before: nn.Module | None = None, heads_first: bool = False,
                          copies: bool = False, context: Callable[[], ContextTokens] | None = None) -> list[Any]:
    """Records the attention each image token receives in a joint text-image attention (MMDiT style).

    The rule (every joint attention of tomerge's adapters): all text queries of the call against all keys
    (text and image) with the model's own logits (its q/k norms, its rotary rotation, its attention mask, the
    SDPA scale ``d ** -0.5``), averaged over heads and text queries, then restricted to the image keys and
    renormalised to sum to 1 per sample (:func:`~tomerge.probe.received_attention` with ``keys=``). A text
    token that the attention mask masks out (padding) is neither a key nor a counted query. Context tokens of the
    image stream (reference images, :mod:`tomerge.backbones._context`) are keys like the text; the record is the
    share of the target's keys.

    The q/k are the ones the processor computes, captured by forward hooks (:func:`~tomerge.probe.attention_probe`;
    a norm runs after its projection and overwrites the capture), in one of two layouts:

    * separate text projections (``add_k_proj`` or ``to_added_qkv``: SD3, FLUX.1/2 double blocks, Qwen-Image,
      HunyuanVideo double blocks): image keys from ``to_k`` (``to_qkv``), then ``norm_k``; text queries and
      keys from ``add_q_proj``/``add_k_proj`` (``to_added_qkv``), then ``norm_added_q``/``norm_added_k``.
    * one projection of the joint sequence (FLUX.1/2 single blocks, HunyuanVideo single blocks): queries and
      keys of all ``T + N`` tokens from ``to_q``/``to_k`` (``to_qkv``), then ``norm_q``/``norm_k``.

    Captures are ``[B, L, heads, d]`` (norms after the processor's ``unflatten``; ``heads_first``: ``[B, heads,
    L, d]``, the norms after its ``transpose(1, 2)``: SD3, CogVideoX, EasyAnimate) or ``[B, L, heads * d]``
    (projections without a norm after them).

    Args:
        attn: the attention module.
        state: receives ``a [B, N]`` for the block call in progress.
        text_side: ``"first"`` or ``"last"``: where text is in the joint sequence the processor attends over.
        text_len: ``() -> T`` of the call in progress; needed by the joint-projection layout only.
        rope: ``(keyword, position)`` of the call's rotary argument; ``None``: no rotation.
        rope_layout: ``"rows"``: ``(cos, sin)``, each ``[T + N, d]`` in the joint order or ``[N, d]`` for the
            image tokens alone, applied with diffusers' ``apply_rotary_emb(..., sequence_dim=1)``; ``"qwen"``:
            complex ``(image [N, d/2], text [T, d/2])`` tables applied with ``apply_rotary_emb_qwen``;
            ``"broadcast"``: ``(cos, sin)``, each ``[N, heads, d/2]``, rotating the adjacent (even, odd) channel
            pairs of the image tokens alone (Mochi).
        mask: ``(keyword, position)`` of the call's attention mask (see :func:`joint_key_mask`); ``None``: none.
        record_before: see :func:`~tomerge.probe.attention_probe`.
        heads_first: the q/k norms see ``[B, heads, L, d]``.
        copies: capture copies of the q/k (one more key tensor, and the joint queries, in memory during a probed
            call): for processors that modify them in place after the norms (CogVideoX and EasyAnimate rotate
            the image rows in place).
        context: ``() -> ContextTokens`` of the call in progress (the image stream is ``[before, target,
            after]``); ``None``: none.

    Returns:
        The hook handles. Calls without text, or whose attention ran on merged slots, are not recorded.
    """
    if rope_layout not in ("rows", "qwen", "broadcast"):
        raise ValueError(f"tomerge: the joint-attention probe applies 'rows', 'qwen' or 'broadcast' rotary tables, "
                         f"not {rope_layout!r}")
    separate = getattr(attn, "add_k_proj", None) is not None or getattr(attn, "to_added_qkv", None) is not None
    if not separate and text_len is None:
        raise ValueError(f"tomerge: {type(attn).__name__} projects the joint sequence at once: the probe needs "
                         "text_len")

    def captures(name: str, projection: str, fused: str, part: int, norm: str) -> list:
        fused_module = getattr(attn, fused, None)
        return [(name, getattr(attn, projection, None), None), (name, fused_module, fused_part(part)),
                (name, getattr(attn, norm, None), None)]  # in execution order: the norm's output wins

    sources = captures("k", "to_k", "to_qkv", 1, "norm_k")
    if separate:  # image keys; text queries and keys
        sources += (captures("q_txt", "add_q_proj", "to_added_qkv", 0, "norm_added_q")
                    + captures("k_txt", "add_k_proj", "to_added_qkv", 1, "norm_added_k"))
    else:  # queries and keys of the joint sequence
        sources += captures("q", "to_q", "to_qkv", 0, "norm_q")
    if copies:
        sources = [(name, module, _copied(pick)) for name, module, pick in sources]

    def before(args: tuple, kwargs: dict) -> dict[str, Any]:
        return {"rope": None if rope is None else call_arg(args, kwargs, *rope),
                "mask": None if mask is None else call_arg(args, kwargs, *mask)}

    def heads(t: Tensor) -> Tensor:
        if t.dim() == 3:
            return t.unflatten(-1, (attn.heads, -1))  # [B, L, H*d] -> [B, L, heads, d]
        return t.transpose(1, 2) if heads_first else t  # [B, L, heads, d]

    def compute(got: dict[str, Any], grid: Grid) -> Tensor | None:
        around = NO_CONTEXT if context is None else context()
        N = math.prod(grid)
        S = N + around.count  # the image stream: [before, target N, after]
        if separate:
            if not all(name in got for name in ("k", "q_txt", "k_txt")):
                return None  # no text in this call
            k_img, q_txt, k_txt = heads(got["k"]), heads(got["q_txt"]), heads(got["k_txt"])  # [B, S|T, h, d]
            T = q_txt.shape[1]
        else:
            if "q" not in got or "k" not in got:
                return None
            T = text_len() or 0
            q, k = heads(got["q"]), heads(got["k"])  # [B, T + S, h, d]
            if k.shape[1] != T + S:
                return None  # the attention ran on merged slots
            text, image = _joint_parts(T, S, text_side)
            k_img, q_txt, k_txt = k[:, image], q[:, text], k[:, text]
        if T == 0 or k_img.shape[1] != S:
            return None  # no text queries, or the attention ran on merged slots
        if got.get("rope") is not None:
            q_txt, k_txt, k_img = _rotate_joint(got["rope"], rope_layout, q_txt, k_txt, k_img, text_side)
        key_bias, text_valid = joint_key_mask(got.get("mask"), k_img.shape[0], T, S, text_side)
        k_txt = k_txt.to(k_img.dtype)
        k = torch.cat((k_txt, k_img) if text_side == "first" else (k_img, k_txt), dim=1)  # [B, T + S, h, d]
        start = _joint_parts(T, S, text_side)[1].start + around.before
        return received_attention(q_txt.transpose(1, 2), k.transpose(1, 2), q_txt.shape[-1] ** -0.5,
                                  keys=slice(start, start + N), key_bias=key_bias,
                                  query_mask=text_valid)  # [B, N]: the target's keys

    return attention_probe(state, attn, sources, compute, before=before, record_before=record_before)


def _copied(pick: Callable[[Any], Tensor] | None) -> Callable[[Any], Tensor]:
    """A capture ``pick`` that keeps a copy (the processor may change the tensor in place afterwards)."""
    return lambda output: (output if pick is None else pick(output)).clone()


def _joint_parts(T: int, N: int, text_side: str) -> tuple[slice, slice]:
    """``(text, image)`` positions in a joint sequence of ``T`` text and ``N`` image tokens."""
    return (slice(0, T), slice(T, T + N)) if text_side == "first" else (slice(N, N + T), slice(0, N))


def _rotate_joint(freqs: Any, layout: str, q_txt: Tensor, k_txt: Tensor, k_img: Tensor,
                  text_side: str) -> tuple[Tensor, Tensor, Tensor]:
    """The text queries, text keys and image keys ``[B, T|N, h, d]`` rotated as the processor rotates them."""
    T, N = k_txt.shape[1], k_img.shape[1]
    if layout == "qwen":
        from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen

        image, text = freqs  # [N, d/2], [T, d/2] complex
        return (apply_rotary_emb_qwen(q_txt, text, use_real=False), apply_rotary_emb_qwen(k_txt, text, use_real=False),
                apply_rotary_emb_qwen(k_img, image, use_real=False))
    cos, sin = freqs
    rows = cos.shape[0]
    if layout == "broadcast":  # the image tokens alone; pairs (x[2i], x[2i+1]) rotated by cos/sin [N, heads, d/2]
        if rows != N:
            raise ValueError(f"tomerge: a 'broadcast' rotary table of {rows} rows for {N} image tokens")
        even, odd = k_img[..., 0::2].float(), k_img[..., 1::2].float()  # [B, N, h, d/2]
        rotated = torch.stack([even * cos - odd * sin, even * sin + odd * cos], dim=-1).flatten(-2)  # [B, N, h, d]
        return q_txt, k_txt, rotated.to(k_img.dtype)
    from diffusers.models.embeddings import apply_rotary_emb

    if rows == N:  # the image tokens alone are rotated (HunyuanVideo)
        return q_txt, k_txt, apply_rotary_emb(k_img, (cos, sin), sequence_dim=1)
    if rows != T + N:
        raise ValueError(f"tomerge: a rotary table of {rows} rows for {T} text and {N} image tokens")
    text, image = _joint_parts(T, N, text_side)
    text_rows = (cos[text], sin[text])  # [T, d] each
    return (apply_rotary_emb(q_txt, text_rows, sequence_dim=1), apply_rotary_emb(k_txt, text_rows, sequence_dim=1),
            apply_rotary_emb(k_img, (cos[image], sin[image]), sequence_dim=1))


def joint_key_mask(mask: Tensor | None, batch: int, T: int, N: int, text_side: str,
                   queries: Literal["text", "image"] = "text") -> tuple[Tensor | None, Tensor | None]:
    """An attention mask of a joint attention as the probe's ``(key_bias [B, T + N], valid)``, for the probe's
    queries: the ``T`` text queries (``valid [B, T]``) or the ``N`` image queries (``queries="image"``,
    ``valid [B, N]``).

    Args:
        mask: ``None``; boolean (or 0/1 integer: true is attended) or additive float, of shape ``[B, L]`` or
            ``[B, 1, 1, L]`` (one row for every query) with ``L = T + N`` (text on ``text_side``) or ``L = T``
            (the text alone; the image keys are all attended); or a query-by-key mask ``[B, 1, L, L]`` over the
            joint sequence (Chroma, OmniGen), whose rows of the probe's queries are the bias, ``[B, T or N, T + N]``.

    Returns:
        ``(None, None)`` without a mask; a boolean mask gives ``-inf`` on masked keys and the probe's queries
        that are attended (the counted queries: a token masked out as a key counts as no query; with a query-by-key
        mask, those whose row attends a key); a float mask is the bias itself and every query counts.

    Example:
        >>> bias, valid = joint_key_mask(torch.tensor([[1, 1, 0]]), 1, 3, 2, "last")   # a text mask
        >>> bias.tolist(), valid.tolist()
        ([[0.0, 0.0, 0.0, 0.0, -inf]], [[True, True, False]])
    """
    if mask is None:
        return None, None
    probed = _joint_parts(T, N, text_side)[0 if queries == "text" else 1]  # the probe's queries in the sequence
    if mask.dim() == 4 and mask.shape[1] == 1 and mask.shape[2] == mask.shape[3] == T + N:
        return _query_key_mask(mask[:, 0, probed].expand(batch, -1, -1))
    if any(size != 1 for size in mask.shape[1:-1]) or mask.dim() < 2:
        raise ValueError(f"tomerge: the received-attention probe takes a key mask [B, L] or [B, 1, 1, L], got "
                         f"{tuple(mask.shape)}")
    flat = mask.reshape(mask.shape[0], mask.shape[-1]).expand(batch, -1)  # [B, L]
    L = flat.shape[1]
    if L not in (T, T + N):
        raise ValueError(f"tomerge: an attention mask over {L} keys for {T} text and {N} image tokens")
    if flat.is_floating_point():
        bias = flat.float()
        if L == T:
            image = bias.new_zeros(batch, N)
            bias = torch.cat([bias, image] if text_side == "first" else [image, bias], dim=1)
        return bias, None
    attended = flat.bool()  # [B, L]
    if L == T:
        image = attended.new_ones(batch, N)
        attended = torch.cat([attended, image] if text_side == "first" else [image, attended], dim=1)
    bias = torch.zeros(attended.shape, dtype=torch.float32, device=attended.device).masked_fill_(~attended, -math.inf)
    return bias, attended[:, probed]  # [B, T + N], [B, T or N]


def _query_key_mask(rows: Tensor) -> tuple[Tensor, Tensor | None]:
    """:func:`joint_key_mask` of the probe queries' rows ``[B, Q, L]`` of a query-by-key mask."""
    if rows.is_floating_point():
        return rows.float(), None
    attended = rows.bool()
    counted = attended.any(dim=-1)  # [B, Q]: a query whose row attends nothing is not counted
    bias = torch.zeros(attended.shape, dtype=torch.float32, device=attended.device)
    bias.masked_fill_(~attended & counted[..., None], -math.inf)  # an uncounted row stays finite (no NaN)
    return bias, counted


def probe_sdpa_attention(attn: nn.Module, state: MergeState, *, text_side: str, text_len: Callable[[], int | None],
                         lengths: Callable[[], Tensor | None] = lambda: None, max_queries: int = 64,
                         queries: Literal["text", "image"] = "text") -> list[Any]:
    """Records the attention each image token receives in ``attn`` from the ``scaled_dot_product_attention`` call
    inside it: the query, key, mask and scale the model attends with, after everything its processor does (its
    projections and q/k norms in any layout, grouped-query heads repeated, its own rotary rotation, per-sample
    text offsets). For processors whose q/k :func:`probe_joint_attention` cannot read at the projections
    (CogView4's norms over ``[B, heads, L, d]``, HiDream's own projections, Lumina 2's grouped-query heads and
    complex rotary tables, ERNIE-Image's rotary function, Z-Image's and Qwen-Image 2.1's complex rotary tables
    over the joint sequence, OmniGen's query-by-key mask).

    Two rules (:func:`received_from_sdpa`), both averaged over heads and the counted queries, restricted to the
    image keys and renormalised per sample:

    * ``queries="text"``: :func:`probe_joint_attention`'s rule. With text in the call (``text_len() > 0``), the
      text queries' softmax over all keys with the model's mask and scale, over the text queries the mask keeps;
      without text, the image-query rule.
    * ``queries="image"``: at most ``max_queries`` strided image queries' softmax over all keys (text and
      image, with the model's mask rows for those queries), for attentions where no text query sees the image
      (OmniGen's causal condition tokens, Qwen-Image 2.1's block-causal prompt, Z-Image's noise refiner, which
      has no text). The image queries' call is the one over the most keys: Qwen-Image 2.1's prefill attends
      segment by segment, every prefix segment over the keys up to its end and the target image over all keys.

    Args:
        attn: the attention module; its processor must call torch's SDPA once (``queries="image"``: once over
            the most keys; diffusers' native attention backend), else the call raises.
        state: receives ``a [B, N]`` for the block call in progress.
        text_side: ``"first"`` or ``"last"``: where text is in the attended sequence.
        text_len: ``() -> T`` of the call in progress (the longest, with per-sample ``lengths``; 0 or ``None``:
            no text).
        lengths: ``() -> [B]`` per-sample text lengths of a ragged joint sequence (text first, then the image,
            then padding; :func:`~tomerge.backbones._gather.ragged_index`), or ``None``; text queries only.
        max_queries: the image-query rule's queries: at most this many, strided.
        queries: ``"text"`` or ``"image"``, the rule.

    Returns:
        The hook handles (a forward pre-hook and an ``always_call`` forward hook). Calls whose attention ran on
        merged slots are not recorded.
    """
    if queries not in ("text", "image"):
        raise ValueError(f"tomerge: the SDPA probe's queries are 'text' or 'image', not {queries!r}")
    active: list[_SDPACalls] = []

    def wanted() -> bool:  # the hooks are on this block's attention: the call in progress is this block's
        call = state.call
        return call is not None and call.records_attention

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if wanted():
            mode = _SDPACalls()
            mode.__enter__()
            active.append(mode)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if not active:
            return
        mode = active.pop()
        mode.__exit__(None, None, None)
        if output is None:  # the forward raised; that error propagates
            return
        calls = mode.calls
        if queries == "image" and calls:  # the image queries' call: over the most keys
            most = max(key.shape[-2] for _, key, _, _ in calls)
            calls = [call for call in calls if call[1].shape[-2] == most]
        if len(calls) != 1:
            raise RuntimeError(
                f"tomerge: the received-attention probe of {type(module).__name__} expected one call of "
                f"torch.nn.functional.scaled_dot_product_attention{' over the most keys' if queries == 'image' else ''}"
                f", got {len(calls)} (an attention backend or processor that calls another kernel); use diffusers' "
                "native attention backend or a strategy that needs no received attention")
        a = received_from_sdpa(*calls[0], num_tokens=math.prod(state.call.grid), text_len=text_len() or 0,
                               text_side=text_side, lengths=lengths(), max_queries=max_queries, queries=queries)
        if a is not None:
            state.call.attention = a  # stored for the block's layer when the call ends

    return [attn.register_forward_pre_hook(enter, with_kwargs=True),
            attn.register_forward_hook(leave, always_call=True)]


class _SDPACalls(TorchFunctionMode):
    """Records ``(query, key, attn_mask, scale)`` of every ``scaled_dot_product_attention`` call while entered."""

    _NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[Tensor, Tensor, Tensor | None, float | None]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            call = {**dict(zip(self._NAMES, args)), **kwargs}
            self.calls.append((call["query"], call["key"], call.get("attn_mask"), call.get("scale")))
        return func(*args, **kwargs)


def received_from_sdpa(query: Tensor, key: Tensor, mask: Tensor | None, scale: float | None, *, num_tokens: int,
                       text_len: int, text_side: str, lengths: Tensor | None = None, max_queries: int = 64,
                       queries: Literal["text", "image"] = "text") -> Tensor | None:
    """:func:`probe_sdpa_attention`'s rule on one SDPA call's inputs.

    Args:
        query, key: ``[B, h, Lq, d]`` and ``[B, h_kv, Lk, d]`` (``h_kv`` dividing ``h``: grouped-query heads).
        mask: ``None``, a key mask ``[B, Lk]`` / ``[B, 1, 1, Lk]`` (boolean, or an additive float bias), or a
            query-by-key mask ``[B, 1, L, L]`` (:func:`joint_key_mask`).
        scale: the SDPA scale (``None``: ``d ** -0.5``).
        num_tokens: ``N``; text_len: ``T`` (the longest with ``lengths``). The call attends over the joint
            sequence, ``Lq = Lk = T + N``; with the image-query rule also ``Lq = N < Lk``: the image queries alone
            over more keys, the other ``Lk - N`` on the text side (Qwen-Image 2.1's target over its prefix, which
            its cached steps pass as keys alone). Other lengths: the call ran on merged slots and nothing is
            recorded (``None``).
        text_side, lengths, max_queries, queries: as :func:`probe_sdpa_attention`.

    Returns:
        ``[B, N]`` fp32, each row summing to 1, or ``None``.
    """
    B, h, Lq, d = query.shape
    N, T, Lk = num_tokens, text_len, key.shape[-2]
    if key.shape[1] != h:
        key = key.repeat_interleave(h // key.shape[1], dim=1)  # grouped-query heads, as SDPA's enable_gqa
    s = d ** -0.5 if scale is None else scale
    if queries == "image" or T == 0:
        if lengths is not None:
            raise ValueError("tomerge: the image-query rule takes no per-sample text lengths (a ragged joint sequence)")
        if not (Lq == Lk == T + N or (queries == "image" and Lq == N < Lk)):
            return None  # the attention ran on merged slots
        other = Lk - N  # the keys besides the image's: the text (Qwen-Image 2.1's prefix)
        key_bias, valid = joint_key_mask(mask, B, other, N, text_side, queries="image")  # [B, Lk] or [B, N, Lk]
        image = _joint_parts(other, N, text_side)[1]  # the image keys, and queries when the call has every query
        probed = strided_rows(N, max_queries)
        q = query[:, :, image if Lq == Lk else slice(None)][:, :, probed]  # [B, h, Q, d]
        if key_bias is not None and key_bias.dim() == 3:
            key_bias = key_bias[:, probed]  # [B, Q, Lk]: the probed queries' rows
        return received_attention(q, key, s, keys=image, key_bias=key_bias,
                                  query_mask=None if valid is None else valid[:, probed])
    if Lq != Lk or Lq != T + N:
        return None  # the attention ran on merged slots
    key_bias, text_valid = joint_key_mask(mask, B, T, N, text_side)  # [B, L], [B, T] or None
    text, image = _joint_parts(T, N, text_side)
    if lengths is None:
        return received_attention(query[:, :, text], key, s, keys=image, key_bias=key_bias, query_mask=text_valid)
    real = torch.arange(T, device=query.device)[None] < lengths.to(query.device)[:, None]  # [B, T]: sample b's text
    valid = real if text_valid is None else real & text_valid
    mean = received_attention(query[:, :, text], key, s, key_bias=key_bias, query_mask=valid)  # [B, L]
    image = lengths.to(query.device)[:, None] + torch.arange(N, device=query.device)  # [B, N]: sample b's image rows
    part = mean.gather(1, image)
    return part / part.sum(-1, keepdim=True).clamp_min(_EPS)


def fused_part(part: int):
    """``pick`` of a fused ``[B, L, 3 H*d]`` q/k/v projection output for :func:`~tomerge.probe.attention_probe`:
    its ``part``-th third (0: q, 1: k)."""
    return lambda output: output.chunk(3, dim=-1)[part]  # [B, L, H*d]


def call_arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    """The argument ``name`` of a call, given by keyword or as positional ``index`` (``None`` if absent)."""
    if name in kwargs:
        return kwargs[name]
    return args[index] if len(args) > index else None


def patch_grid(latent_size: tuple[int, int] | None, patch_size: int, num_tokens: int) -> tuple[int, int] | None:
    """The token grid of a patchified latent, or ``None`` when it does not account for ``num_tokens``.

    Args:
        latent_size: ``(H0, W0)`` of the latent the model was called with (``None``: not seen yet).
        patch_size: the patch side ``p`` (patches are ``p x p``, stride ``p``: ``floor`` division).
        num_tokens: ``N``, the image tokens entering the block.

    Returns:
        ``(H0 // p, W0 // p)`` if its product is ``N``, else ``None`` (then the block is not merged).

    Example:
        >>> patch_grid((12, 20), 2, 60)
        (6, 10)
    """
    if latent_size is None:
        return None
    H, W = latent_size[0] // patch_size, latent_size[1] // patch_size
    return (H, W) if H * W == num_tokens else None


_ABSENT = object()  # a module without an instance-level ``forward`` (the class's is used)


@dataclasses.dataclass(frozen=True, eq=False)
class FeedForwardPoint(MergePoint):
    """The feed-forward merge point of a diffusers block that can chunk its feed-forward.

    A diffusers block with chunking enabled (``block.set_chunk_feed_forward(size, dim)``,
    ``model.enable_forward_chunking(...)``: the block's ``_chunk_size`` / ``_chunk_dim``) calls ``ff`` once
    per chunk of the batch (``dim=0``) or of the sequence (``dim=1``), so a merge point on ``ff`` would see
    chunks. In a block call that merges this point's sublayer, :meth:`enter_block` therefore moves the
    chunking into the feed-forwards: it suspends the block's chunking (``_chunk_size = None``: the block
    calls ``ff`` once, its hooks merge and unmerge the whole sequence) and gives each of
    ``feed_forwards`` an instance ``forward`` that runs the module's own ``forward`` on chunks of
    ``_chunk_size`` along ``_chunk_dim`` of what it receives, the merged sequence for ``ff`` (its last
    chunk is shorter when the merged length is not a multiple). Memory stays bounded as chunking meant
    it; at ratio 0 (an identity plan) the chunks and so the result are bit-identical to diffusers'.
    :meth:`exit_block` restores ``_chunk_size``, ``_chunk_dim`` and the modules' ``forward`` exactly. Calls
    that do not merge this sublayer, and blocks without chunking, are left alone; chunking enabled after
    :func:`tomerge.apply` works the same (it is read at every block call). See "Feed-forward chunking" in
    docs/backbones/unet.md (the same for pixart, dit and sd3).

    Args:
        block: the block module (holds ``_chunk_size`` / ``_chunk_dim``).
        feed_forwards: names of the block's feed-forwards its chunking applies to (``ff`` first, the merge
            point's module; e.g. ``("ff", "ff_context")`` for SD3's joint blocks); a name whose attribute is
            ``None`` (SD3's last block has no ``ff_context``) is skipped.
    """

    block: nn.Module = dataclasses.field(kw_only=True)
    feed_forwards: tuple[str, ...] = dataclasses.field(default=("ff",), kw_only=True)
    _suspended: dict[str, Any] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _chunked_forwards: dict[str, Callable] = dataclasses.field(default_factory=dict, init=False, repr=False)

    def enter_block(self, merges: bool) -> None:
        self.exit_block()  # never stack two suspensions (the core calls exit_block after every block call)
        if merges and getattr(self.block, "_chunk_size", None) is not None:
            self._suspend_chunking()

    def exit_block(self) -> None:
        if self._suspended:
            self._restore_chunking()

    # Run eagerly when the block hooks are traced by torch.compile (dynamo replays a set-then-deleted
    # instance attribute as a deletion of one that is absent); blocks without chunking stay traceable.
    @torch.compiler.disable
    def _suspend_chunking(self) -> None:
        forwards = {}
        for name in self.feed_forwards:
            module = getattr(self.block, name, None)
            if module is not None:
                forwards[name] = module.__dict__.get("forward", _ABSENT)
                module.forward = self._chunked_forward(name)
        self._suspended.update(size=self.block._chunk_size, dim=getattr(self.block, "_chunk_dim", 0),
                               forwards=forwards)
        self.block._chunk_size = None

    @torch.compiler.disable
    def _restore_chunking(self) -> None:
        saved = dict(self._suspended)
        self._suspended.clear()
        self.block._chunk_size, self.block._chunk_dim = saved["size"], saved["dim"]
        for name, forward in saved["forwards"].items():
            module = getattr(self.block, name)
            if forward is _ABSENT:
                del module.forward  # the instance attribute: the class's forward again
            else:
                module.forward = forward

    def _chunked_forward(self, name: str) -> Callable:
        """The ``forward`` of feed-forward ``name`` while the block's chunking is suspended (one function per
        name, kept, so that a compiled block sees the same object at every merged call)."""
        if name not in self._chunked_forwards:
            def forward(hidden_states: Tensor, *args: Any, **kwargs: Any) -> Tensor:
                module, saved = getattr(self.block, name), self._suspended
                inner = saved["forwards"][name]
                if inner is _ABSENT:
                    inner = type(module).forward.__get__(module)
                size, dim = saved["size"], saved["dim"]
                # [B, M, C] -> chunks [b, M, C] (dim 0) or [B, m, C] (dim 1), as diffusers' _chunked_feed_forward
                # cuts the full sequence (torch.chunk into N // size equal parts is split(size) when N divides)
                pieces = hidden_states.split(size, dim=dim)
                return torch.cat([inner(piece, *args, **kwargs) for piece in pieces], dim=dim)  # [B, M, C']
            self._chunked_forwards[name] = forward
        return self._chunked_forwards[name]


def check_ff_chunking(blocks: list[nn.Module]) -> None:
    """Raises if any block has feed-forward chunking enabled (``ff`` would get chunks, not the merged sequence).

    Only for adapters whose feed-forward merge point is a plain :class:`MergePoint` (today
    ``backbones/_declared.py``, until its feed-forward sites use :class:`FeedForwardPoint`, which merges with
    chunking instead; then this function goes). The adapters of this module's families do not call it.

    Args:
        blocks: the block modules (diffusers blocks keep the setting in ``_chunk_size``).
    """
    for block in blocks:
        if getattr(block, "_chunk_size", None) is not None:
            raise ValueError(
                f"feed-forward chunking is enabled on a {type(block).__name__} (chunk size {block._chunk_size}, "
                f"dim {getattr(block, '_chunk_dim', 0)}): the feed-forward then runs once per chunk and cannot "
                "take the merged sequence. Call model.disable_forward_chunking() (or "
                "block.set_chunk_feed_forward(None)) before tomerge.apply; merging already saves the memory "
                "chunking would")


class PatchifiedAdapter(BackboneAdapter):
    """Base of the adapters of patchified diffusers transformers with ``transformer_blocks`` of one class.

    Subclasses set ``model_class`` (class name of the transformer), ``block_names`` (the block class),
    ``block_kind``, ``timestep_index`` (position of ``timestep`` in the model's forward), ``block_outputs`` (the
    blocks' ``BlockSpec.outputs``, when they return a tuple), and implement :meth:`merge_points`.
    """

    block_kind: ClassVar[str] = "basic"
    timestep_index: ClassVar[int] = 1
    block_outputs: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.latent_size: tuple[int, int] | None = None
        self.patch_size = int(model.config.patch_size)

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The transformer: ``obj`` itself or a pipeline's ``obj.transformer``."""
        return submodel(obj, "transformer", cls.model_class)

    def _block_modules(self) -> list[nn.Module]:
        blocks = getattr(self.model, "transformer_blocks", None)
        if blocks is None:
            return []
        return [m for m in blocks if any(name in class_names(m) for name in self.block_names)]

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        """The merge points of one block module."""
        raise NotImplementedError

    def blocks(self) -> list[BlockSpec]:
        return [BlockSpec(module, layer=i, kind=self.block_kind, points=self.merge_points(module),
                          outputs=self.block_outputs) for i, module in enumerate(self._block_modules())]

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        sample = call_arg(args, kwargs, "hidden_states", 0)  # [B, C, H0, W0]
        if sample.dim() != 4:
            raise ValueError(f"{type(self.model).__name__} expects a latent [B, C, H, W], got {tuple(sample.shape)}")
        self.latent_size = (int(sample.shape[-2]), int(sample.shape[-1]))
        return call_arg(args, kwargs, "timestep", self.timestep_index)

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, int] | None:
        return patch_grid(self.latent_size, self.patch_size, num_tokens)
