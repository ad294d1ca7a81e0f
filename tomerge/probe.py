"""Received attention: how much attention each image token gets, measured cheaply.

IDM ranks tokens by the attention they receive. The adapter captures the queries and keys that the
block's attention already computed (hooks on the projection submodules, so the attention itself keeps
its fused kernel) and this module turns them into ``a [B, N]``: the softmax attention to every key,
averaged over heads and over a probe set of queries (at most ``max_queries`` strided image queries of a
self-attention; the text queries of a joint text-image attention, the image keys' share renormalised; strided
image queries of a joint attention whose text never attends to the image, the image keys' share renormalised).
:func:`received_linear_attention` is tomerge's counterpart for linear (kernel) attention, which has no softmax.

:func:`attention_probe` installs those hooks for any adapter: it captures the named projection outputs
during the block's merged calls and, after the attention ran, stores what the adapter's ``compute``
makes of them. :func:`received_self_attention` is that ``compute`` for a plain self-attention.
:class:`ReceivedAttention` keeps each layer's latest record for the next plans (``ctx.received_attention``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from .context import Grid
from .technique import TechniqueState

if TYPE_CHECKING:
    from .state import BlockCall, MergeState

#: ``(name, module, pick)``: a forward hook on ``module`` captures ``pick(output)`` (the output itself when
#: ``pick`` is ``None``) as ``name``; a ``None`` module is skipped.
Source = tuple[str, nn.Module | None, Callable[[Any], Tensor] | None]


def split_heads(t: Tensor, heads: int) -> Tensor:
    """``[B, N, H*d] -> [B, H, N, d]``; a tensor already ``[B, H, N, d]`` is returned as is."""
    if t.dim() == 4:
        return t
    B, N, HD = t.shape
    return t.view(B, N, heads, HD // heads).transpose(1, 2)  # [B, H, N, d]


def strided_rows(count: int, max_queries: int = 64) -> slice:
    """At most ``max_queries`` evenly strided positions among ``count``: the probe's queries.

    Example:
        >>> strided_rows(200)
        slice(None, None, 4)
    """
    return slice(None, None, max(1, -(-count // max_queries)))


def strided_queries(q: Tensor, max_queries: int = 64) -> Tensor:
    """At most ``max_queries`` evenly strided queries of ``q [B, H, Nq, d]`` (:func:`strided_rows`)."""
    return q[:, :, strided_rows(q.shape[2], max_queries)]  # [B, H, <=max_queries, d]


#: Logits held at once by :func:`received_attention`, eager on CPU: 2**19 fp32 (2 MiB) of one head, so the
#: softmax and the sum over queries read a chunk from cache, not from memory.
#: Measured in docs/benchmarks.md ("Received-attention probe"): 2**18 and 2**20 read the same.
CPU_CHUNK_ELEMENTS = 1 << 19
#: Elsewhere at most 2**26 logits (256 MiB fp32) in a chunk: one chunk per head for image models when compiling
#: on CPU, one chunk of all heads on CUDA; it bounds long video sequences.
CHUNK_ELEMENTS = 1 << 26
_EPS = 1e-12  # a share of attention of at most this is taken as none (no division by 0)


def chunk_shape(q: Tensor, num_keys: int) -> tuple[int, int]:
    """``(heads, queries)`` per chunk of :func:`received_attention` for the probe queries ``q [B, H, Q, d]``.

    * Eager on CPU: one head and at most :data:`CPU_CHUNK_ELEMENTS` logits (cache-sized).
    * Compiling on CPU: one head and at most :data:`CHUNK_ELEMENTS` logits, so a graph holds a few dozen chunks
      (cache-sized queries would unroll into hundreds for Flux). Per head, inductor's fused softmax and sum
      run from cache as well (docs/benchmarks.md, "Received-attention probe").
    * CUDA: all heads, at most :data:`CHUNK_ELEMENTS` logits (one chunk for image models).
    """
    B, H, _, _ = q.shape
    heads = 1 if q.device.type == "cpu" else H
    eager_cpu = q.device.type == "cpu" and not torch.compiler.is_compiling()
    budget = CPU_CHUNK_ELEMENTS if eager_cpu else CHUNK_ELEMENTS
    return heads, max(1, budget // (B * heads * num_keys))


def received_attention(q: Tensor, k: Tensor, scale: float, keys: slice | None = None,
                       key_bias: Tensor | None = None, query_mask: Tensor | None = None) -> Tensor:
    """Mean over heads and queries of ``softmax(q k^T * scale + key_bias)``, in chunks of queries.

    Args:
        q: ``[B, H, Q, d]`` probe queries.
        k: ``[B, H, N, d]`` keys (all keys of the attention, so the softmax is the model's own).
        scale: the attention's logit scale (usually ``d ** -0.5``).
        keys: only these keys (e.g. the image part of a joint text-image attention), their share of the
            attention renormalised to sum to 1 per sample; ``None``: all keys.
        key_bias: ``[B, N]`` added to every query's logits (``-inf``: a masked key), as the attention's mask;
            ``[B, Q, N]``: a row per query (a query-by-key mask).
        query_mask: ``[B, Q]``, false for queries not counted (padding); ``None``: all.

    Returns:
        ``[B, N]`` (``keys``: ``[B, n]``) fp32 attention received by every key; each row sums to 1.

    The ``[B, H, Q, N]`` logits are never held at once; :func:`chunk_shape` sets the chunks (otherwise the probe
    is a memory-bound few percent of an SD3 forward on CPU that FLOPs do not count). Every chunk's sum is kept
    and they are added at the end: a running ``total +=`` compiles to slower code on CPU (docs/benchmarks.md).

    Example:
        >>> q, k = torch.zeros(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
        >>> received_attention(q, k, 8 ** -0.5)   # zero queries attend uniformly
        tensor([[0.2000, 0.2000, 0.2000, 0.2000, 0.2000]])
    """
    B, H, Q, _ = q.shape
    N = k.shape[2]
    q = q.float() * scale  # [B, H, Q, d]: the scale goes on the small side
    k = k.float().transpose(-1, -2)  # [B, H, d, N]
    if key_bias is None:
        bias = None
    elif key_bias.dim() == 2:
        bias = key_bias.float()[:, None, None, :]  # [B, 1, 1, N]: one row for every query
    else:
        bias = key_bias.float()[:, None]  # [B, 1, Q, N]: a row per query
    weight = None if query_mask is None else query_mask.float()[:, None, :, None]  # [B, 1, Q, 1]
    heads, rows = chunk_shape(q, N)
    sums = []
    for h in range(0, H, heads):
        for start in range(0, Q, rows):
            logits = q[:, h:h + heads, start:start + rows] @ k[:, h:h + heads]  # [B, heads, rows, N]
            if bias is not None:
                logits = logits + (bias if bias.shape[2] == 1 else bias[:, :, start:start + rows])
            p = logits.softmax(dim=-1)
            if weight is not None:
                p = p * weight[:, :, start:start + rows]
            sums.append(p.sum(dim=(1, 2)))  # [B, N]
    total = torch.stack(sums).sum(0) if len(sums) > 1 else sums[0]  # [B, N]
    if keys is None:
        counted = H * (Q if query_mask is None else query_mask.sum(-1, keepdim=True).float())  # [] or [B, 1]
        return total.div_(counted)
    part = total[:, keys]  # [B, n]
    return part / part.sum(-1, keepdim=True).clamp_min(_EPS)


def received_linear_attention(phi_q: Tensor, phi_k: Tensor, eps: float = 1e-15) -> Tensor:
    """Mean over heads and queries of the normalised weights of a linear (kernel) attention, in ``O(N d)``.

    A linear attention ``out_i = sum_j (phi(q_i) . phi(k_j)) v_j / (sum_j phi(q_i) . phi(k_j) + eps)`` (SANA:
    ``phi = ReLU``) weighs key ``j`` for query ``i`` by ``w_ij = phi(q_i) . phi(k_j) / (D_i + eps)``, ``D_i =
    phi(q_i) . sum_j phi(k_j)``. The attention key ``j`` receives is ``sum_i w_ij = (sum_i phi(q_i) / (D_i +
    eps)) . phi(k_j)``: one ``[d]`` vector per head, dotted with every key, never the ``N x N`` weights. The
    result is averaged over heads and renormalised to sum to 1 per sample (a query whose features are all zero
    weighs nothing and counts for nothing). This is tomerge's definition for IDM on linear attention; the SDTM
    paper defines received attention for softmax attention only.

    Args:
        phi_q, phi_k: ``[B, H, N, d]`` non-negative query and key features (after the kernel).
        eps: the attention's own guard in its denominator (SANA's processor adds ``1e-15``).

    Returns:
        ``[B, N]`` fp32; each row sums to 1.

    Example:
        >>> phi = torch.tensor([[[[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]]])    # [1, 1, 3, 2]
        >>> received_linear_attention(phi, phi)   # rows of w: (1/2, 0, 1/2), (0, 1/2, 1/2), (1/4, 1/4, 1/2)
        tensor([[0.2500, 0.2500, 0.5000]])
    """
    q, k = phi_q.float(), phi_k.float()  # [B, H, N, d]
    denominators = q @ k.sum(dim=2).unsqueeze(-1)  # [B, H, N, 1]: D_i
    spread = (q / (denominators + eps)).sum(dim=2)  # [B, H, d]: sum_i phi(q_i) / (D_i + eps)
    received = (k @ spread.unsqueeze(-1)).squeeze(-1).sum(dim=1)  # [B, N]: summed over heads
    return received / received.sum(-1, keepdim=True).clamp_min(_EPS)


class ReceivedAttention(TechniqueState):
    """The received attention the probes recorded (``BlockCall.attention``), kept for the plans of later calls
    (``ctx.received_attention``): ``by_size[(layer, B, N)]`` ``[B, N]``, the layer's latest call of that batch and
    length, oldest first (a step whose model calls differ in batch, a doubled guidance batch then single ones, keeps
    each size's attention for the next step).

    Memory: one ``[B, N]`` tensor per layer and call size: bounded by the model, not by the step count.
    """

    kind = "attention"

    def __init__(self) -> None:
        self.by_size: dict[tuple[int, int, int], Tensor] = {}

    def reset(self) -> None:
        self.by_size.clear()

    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return ((self.kind, received) for received in self.by_size.values())

    def store(self, layer: int, received: Tensor) -> None:
        """Keeps ``received [B, N]`` (a copy) as the layer's latest received attention of its size (moved to the
        end: the newest)."""
        key = (layer, *received.shape[:2])
        self.by_size.pop(key, None)
        self.by_size[key] = received

    def latest(self, layer: int, batch: int, num_tokens: int) -> Tensor | None:
        """The received attention the layer recorded last in a call of ``batch`` samples of ``num_tokens`` tokens
        (``None`` if no call of that size recorded one in this trajectory)."""
        return self.by_size.get((layer, batch, num_tokens))

    def by_layer(self) -> dict[int, Tensor]:
        """layer -> ``[B, N]`` the received attention of the layer's latest call, whatever its size."""
        return {layer: a for (layer, _, _), a in self.by_size.items()}

    def end_block(self, call: BlockCall, state: MergeState) -> None:
        if call.attention is not None:
            self.store(call.where.layer, state.keep(call.attention))


def attention_probe(state: MergeState, attn: nn.Module, sources: Iterable[Source],
                    compute: Callable[[dict[str, Any], Grid], Tensor | None],
                    before: Callable[[tuple, dict], dict[str, Any]] | None = None,
                    record_before: nn.Module | None = None) -> list[Any]:
    """Hooks recording the attention the image tokens of a block receive in its attention ``attn``.

    Only the block's calls that merge and run their attention are recorded (``state.call.records_attention``: the
    hooks are on the block's own modules, so the call in progress is the block's). In those, the forward hooks of
    ``sources`` capture the q/k the attention computes anyway (a name captured twice keeps the later output:
    a norm after its projection); after ``attn`` ran, ``compute(captured, grid)`` turns them into
    ``a [B, N]`` for ``state.call.attention`` (stored for the block's layer when the call ends,
    :class:`ReceivedAttention`), or returns ``None`` to record nothing (the attention ran
    on merged slots, or a capture is missing).
    The captures are cleared after every call of ``attn``.

    Args:
        state: the merge state (``state.call``: the block call in progress).
        attn: the attention module; its forward hook computes the record.
        sources: ``(name, module, pick)`` captures (see :data:`Source`).
        compute: ``(captured, grid) -> [B, N] or None``.
        before: optional ``(args, kwargs) -> {name: value}``, a forward pre-hook of ``attn`` capturing
            from its call's arguments (e.g. a rotary table or the text length).
        record_before: a submodule of ``attn`` that a merge point reads after the attention (FLUX.2's fused
            ``to_out`` inside its parallel attention): the record is computed just before it runs (its first
            forward pre-hook), so the block call's plan, made there, sees it; ``None``: after ``attn`` ran.

    A source that is a child of ``attn`` is followed when the child is replaced after the hooks were installed
    (peft wraps a projection in a LoRA layer on ``load_lora_weights`` and unwraps it on ``unload_lora_weights``):
    before a recorded call, the capture moves to the module now in the child's place, so the q/k are the ones
    the attention computes with (the wrapper's, LoRA included), not the wrapped base layer's, nor nothing.

    Returns:
        The hook handles: the pre-hook following replaced sources, the source hooks, ``before``'s pre-hook (if
        any), the hook that records.
    """
    captured: dict[str, Any] = {}

    def wanted() -> bool:  # the hooks are on this block's modules: the call in progress is this block's
        call = state.call
        return call is not None and call.records_attention

    def keep(name: str, pick: Callable[[Any], Tensor] | None):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            if wanted():
                captured[name] = output if pick is None else pick(output)
        return hook

    def read_call(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if wanted():
            captured.update(before(args, kwargs))

    def record(*hook_args: Any) -> None:  # (module, args, output) or, before record_before, (module, args)
        got = dict(captured)
        captured.clear()
        if not wanted():
            return
        a = compute(got, state.call.grid)
        if a is not None:
            state.call.attention = a  # stored for the block's layer when the call ends

    captures = _FollowedCaptures(attn, [(module, keep(name, pick)) for name, module, pick in sources
                                        if module is not None])
    handles = [attn.register_forward_pre_hook(lambda module, args: captures.follow() if wanted() else None), captures]
    if before is not None:
        handles.append(attn.register_forward_pre_hook(read_call, with_kwargs=True))
    if record_before is None:
        handles.append(attn.register_forward_hook(record))
    else:
        handles.append(record_before.register_forward_pre_hook(record, prepend=True))
        handles.append(attn.register_forward_hook(lambda *hook_args: captured.clear()))  # a call that never reached it
    return handles


class _FollowedCaptures:
    """The forward hooks of :func:`attention_probe`'s sources, one per ``(module, hook)``; a source that is a child of
    ``attn`` is found by its attribute name and, when another module has taken that name since (a LoRA wrapper,
    or the base layer back), :meth:`follow` moves its hook there. ``remove()`` removes them all."""

    def __init__(self, attn: nn.Module, sources: list[tuple[nn.Module, Callable[..., None]]]) -> None:
        self.attn = attn
        self.entries: list[list[Any]] = []  # [child name or None, module, hook, handle]
        for module, hook in sources:
            child = next((name for name, m in attn.named_children() if m is module), None)
            self.entries.append([child, module, hook, module.register_forward_hook(hook)])

    def follow(self) -> None:
        """Moves the hook of each replaced child to the module now in its place (eager calls only: under
        ``torch.compile`` the hooks stay where they are, as registering one inside a traced call would break the
        graph)."""
        if torch.compiler.is_compiling():
            return
        for entry in self.entries:
            child, module, hook, handle = entry
            current = None if child is None else self.attn._modules.get(child)
            if current is not None and current is not module:
                handle.remove()
                entry[1], entry[3] = current, current.register_forward_hook(hook)

    def remove(self) -> None:
        for entry in self.entries:
            entry[3].remove()


def received_self_attention(captured: dict[str, Any], grid: Grid, heads: int, scale: float,
                            max_queries: int = 64, context: tuple[int, int] = (0, 0)) -> Tensor | None:
    """The ``compute`` of :func:`attention_probe` for a self-attention: ``received_attention`` of at most
    ``max_queries`` strided queries ``captured["q"]`` of the image tokens against all keys ``captured["k"]``.

    Args:
        captured: ``"q"`` and ``"k"``, each ``[B, L, H*d]`` or ``[B, H, L, d]``.
        grid: ``(H, W)`` or ``(T, H, W)`` of the block call's ``N`` image tokens; keys of another length than
            ``L`` (merged slots) give ``None``.
        heads: attention heads; ``scale``: the logit scale.
        context: context tokens before and after the image tokens in the sequence (``L = before + N + after``):
            keys the image queries attend to, not among the recorded keys (their share renormalised).

    Returns:
        ``[B, N]`` fp32, or ``None`` when a capture is missing or the attention ran merged.
    """
    q, k = captured.get("q"), captured.get("k")
    if q is None or k is None:
        return None
    before, after = context
    N = math.prod(grid)
    k = split_heads(k, heads)  # [B, H, L, d]
    if k.shape[2] != before + N + after:  # the attention ran on merged slots
        return None
    q = strided_queries(split_heads(q, heads)[:, :, before:before + N], max_queries)  # [B, H, Q, d]: image queries
    return received_attention(q, k, scale, keys=None if k.shape[2] == N else slice(before, before + N))
