"""The exact text-key bias: an additive logit bias on the text keys of a joint attention, image queries only.

A schedule that wants one (:meth:`tomerge.Schedule.text_key_bias`, e.g. SDTM's prompt reweighting) gets it
through these hooks. The bias keeps a fused attention kernel (:func:`key_bias_attention`): every query gets
extra head channels, every key its bias there, and ``scale`` is passed explicitly, so each image-query logit
to text key ``j`` gains exactly ``b_j`` and no attention mask is built. :func:`bias_text_keys` applies it to
one attention module by intercepting the ``torch.nn.functional.scaled_dot_product_attention`` call inside
the module's forward only (a ``TorchFunctionMode`` entered by a forward pre-hook and left by an
``always_call`` forward hook): the processor is neither copied nor replaced. :class:`TextLabels` holds the labels
the schedule's bias reads. Attention backends that do not
call torch's SDPA (e.g. a ``flash_attn`` backend in diffusers' dispatcher) raise instead of silently
skipping the bias.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .adapter import TextKeys
from .technique import TechniqueState


# ---------------------------------------------------------------------- the exact key bias
def key_bias_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, query_mask: Tensor | None = None,
                       attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` through a fused SDPA kernel, without an attention mask.

    Two channels are appended to every head: ``1`` (``0`` where ``query_mask`` is false) to the query and
    ``b_j / scale`` split into a high and a low part in the query's dtype to key ``j``, and the head is
    padded with zeros to a multiple of 8 (values too); with ``scale`` passed explicitly every logit to key
    ``j`` gains exactly ``b_j`` (in bf16/fp16 up to the kernel's fp32 accumulation).

    Args:
        query, key, value: ``[B, h, Lq, d]``, ``[B, hk, Lk, d]``, ``[B, hk, Lk, dv]`` (SDPA layout).
        bias: ``[B, Lk]`` additive logit bias per key.
        query_mask: ``[Lq]`` or ``[B, Lq]``, true for the queries that get the bias (``None``: all).
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as in ``F.scaled_dot_product_attention``.

    Returns:
        ``[B, h, Lq, dv]``.
    """
    B, _, Lq, d = query.shape
    dv = value.shape[-1]
    s = scale if scale is not None else d ** -0.5
    width = -(-(max(d, dv) + 2) // 8) * 8  # padded head size the fused kernels accept
    qm = torch.ones(Lq, device=query.device) if query_mask is None else query_mask.to(query.device)
    qm = qm.to(query.dtype).expand(B, Lq)  # [B, Lq]
    kb = bias.to(key.device, torch.float32) / s  # [B, Lk]
    hi = kb.to(key.dtype)
    lo = (kb - hi.float()).to(key.dtype)
    q_extra = query.new_zeros(*query.shape[:-1], width - d)  # [B, h, Lq, width - d]
    q_extra[..., 0] = qm[:, None]
    q_extra[..., 1] = qm[:, None]
    k_extra = key.new_zeros(*key.shape[:-1], width - d)  # [B, hk, Lk, width - d]
    k_extra[..., 0] = hi[:, None]
    k_extra[..., 1] = lo[:, None]
    v_extra = value.new_zeros(*value.shape[:-1], width - dv)  # [B, hk, Lk, width - dv]
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(
        torch.cat([query, q_extra], -1), torch.cat([key, k_extra], -1), torch.cat([value, v_extra], -1),
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=s, **kwargs)  # [B, h, Lq, width]
    return out[..., :dv]


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class _TextKeyBias(TorchFunctionMode):
    """Routes the SDPA calls of one attention forward through :func:`key_bias_attention`."""

    def __init__(self, bias: Tensor, text_len: int, text_first: bool) -> None:
        super().__init__()
        self.bias, self.text_len, self.text_first = bias, text_len, text_first  # [B, T]
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k = call["query"], call["key"]
        T, (B, Lq), Lk = self.text_len, (q.shape[0], q.shape[-2]), k.shape[-2]
        if Lq != Lk or Lk < T or self.bias.shape != (B, T):
            raise RuntimeError(
                f"tomerge text-key bias: expected a joint self-attention over {T} text + image tokens with batch "
                f"{self.bias.shape[0]}, got query {tuple(q.shape)} and key {tuple(k.shape)}")
        self.calls += 1
        span = slice(0, T) if self.text_first else slice(Lk - T, Lk)  # the text keys: one contiguous run
        text = torch.zeros(Lk, dtype=torch.bool, device=q.device)
        text[span] = True  # [Lk]
        full = self.bias.new_zeros(B, Lk)
        full[:, span] = self.bias.to(full.device)  # [B, Lk]: a slice, not a boolean mask (a host sync on CUDA)
        return key_bias_attention(bias=full, query_mask=~text, **call)


def bias_text_keys(keys: TextKeys, bias_for: Callable[[int, int, torch.device], Tensor | None]) -> list[Any]:
    """Hooks that add a per-call text-key bias to one joint attention module (for image queries only).

    Args:
        keys: the module and where its text tokens are (from the backbone adapter).
        bias_for: ``(batch, text_len, device) -> [B, T] bias or None`` (``None``: run the module unchanged).

    Returns:
        The hook handles (a forward pre-hook and a prepended ``always_call`` forward hook).

    Raises:
        RuntimeError: (from the forward) when the module ran without calling torch's SDPA, e.g. with an
            attention backend that calls a flash-attention library directly.
    """
    active: list[_TextKeyBias] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, N, C]
        T = keys.text_len(args, kwargs)
        bias = bias_for(x.shape[0], T, x.device) if T > 0 else None
        if bias is not None:
            mode = _TextKeyBias(bias, T, keys.text_first)
            mode.__enter__()
            active.append(mode)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if not active:
            return
        mode = active.pop()
        mode.__exit__(None, None, None)
        if output is not None and mode.calls == 0:  # output None: the forward raised; that error propagates
            raise RuntimeError(
                f"tomerge text-key bias (e.g. SDTM prompt reweighting): {type(module).__name__} ran without calling "
                "torch.nn.functional.scaled_dot_product_attention (an attention backend or processor that calls "
                "another kernel); use diffusers' native attention backend or drop the text labels")

    return [keys.module.register_forward_pre_hook(enter, with_kwargs=True),
            keys.module.register_forward_hook(leave, prepend=True, always_call=True)]


class TextLabels(TechniqueState):
    """The text-token labels of one application (what ``Schedule.prepare_text_labels`` returned, e.g. SDTM's prompt
    categories; ``None``: no bias), set by ``MergeHandle.set_text_labels``. The user's, so a new trajectory keeps
    them (``reset`` forgets nothing). Memory: no tensor."""

    def __init__(self) -> None:
        self.labels: Any = None
