"""FLOPs of a call: the one counter of tomerge (``tomerge ablate``, ``tomerge bench``, the scripts, the tests).

torch's ``FlopCounterMode`` counts zero for kernels it does not know (CPU attention among them); this counter
prices every attention kernel torch may pick, raises :class:`UnpricedOpError` on an unpriced op that moves
FLOPs, and sums merging's own FLOPs apart (``merge_gflops``). What it counts, what it leaves out at zero (and
why that favours merging), and how merging's share is found: docs/experiments.md, "3. Run the ablation", FLOPs.

This module imports torch: the command line's modules import it in the functions that count.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

__all__ = ["COUNTER_VERSION", "UnpricedOpError", "FlopCounter", "DenoiserFlops", "count_flops", "count_flops_split",
           "count_denoiser_flops", "merge_code", "moves_flops"]

# Recorded with every result row (``flop_counter``). Counts of another version follow other rules (version 1
# priced no attention on CPU): a run folder re-measures such rows and figures refuse them.
COUNTER_VERSION = 2


class UnpricedOpError(RuntimeError):
    """A counted call ran an op that moves FLOPs and that no formula prices."""


# Op names (split at "_", "." and "::") whose words say the op moves FLOPs.
_FLOP_WORDS = re.compile(r"(?:[a-z]*mm|matmul|mv|addmv|dot|vdot|conv(?:olution|\d?d)?|attention|attn|sdpa|linear"
                         r"|einsum|gemm|gemv|addr)")


def moves_flops(op_name: str) -> bool:
    """Whether an op's qualified name (``"aten::mm"``) names a matrix product, convolution or attention."""
    words = re.split(r"[_.:]+", op_name.split("::")[-1].lower())
    return any(_FLOP_WORDS.fullmatch(word) for word in words)


def _sdpa(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value)  # 4 B H N_q N_k d (query @ key^T and weights @ value)


def _mv(matrix, vector, *args, out_shape=None, **kwargs) -> int:
    return 2 * matrix[0] * matrix[1]


def _addmv(bias, matrix, vector, *args, out_shape=None, **kwargs) -> int:
    return 2 * matrix[0] * matrix[1]


def _dot(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0]


def _addr(bias, a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * b[0]  # the outer product and the addition


def _addmm(bias, a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * b[1]  # a [n, m] @ b [m, p]


def _baddbmm(bias, a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * a[2] * b[2]  # a [B, n, m] @ b [B, m, p]


def _int_mm(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * a[0] * a[1] * b[1]


_addbmm = _baddbmm  # the same products, summed over B


def _native_multi_head_attention(query, key, value, embed_dim, num_heads, *args, out_shape=None, **kwargs) -> int:
    b, n, e = query  # nn.MultiheadAttention's fused inference path: [B, N, E] queries, [B, S, E] keys and values
    s = key[1]
    projections = 2 * b * n * e * e * 2 + 2 * b * s * e * e * 2  # q and output; k and v
    return projections + 4 * b * n * s * e


def _extra_formulas() -> dict[Any, Callable[..., int]]:
    aten = torch.ops.aten
    formulas = {
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa,
        aten._native_multi_head_attention: _native_multi_head_attention,
        aten.mv: _mv, aten.addmv: _addmv, aten.addmv_: _addmv, aten.dot: _dot, aten.vdot: _dot, aten.addr: _addr,
        aten._int_mm: _int_mm, aten._addmm_activation: _addmm, aten.addbmm: _addbmm, aten.addbmm_: _addbmm,
        aten.addmm_: _addmm, aten.baddbmm_: _baddbmm,  # in-place forms of products torch prices out of place
    }
    for name in ("_scaled_dot_product_fused_attention_overrideable", "_scaled_dot_product_attention_math_for_mps"):
        if hasattr(aten, name):  # kernels of other accelerators; their first three arguments are q, k, v
            formulas[getattr(aten, name)] = _sdpa
    return formulas


def merge_code() -> frozenset[Any]:
    """The code objects whose ops count as merging's own FLOPs: ``plan`` and ``unmerge`` of every
    :class:`~tomerge.MergeStrategy` class defined so far (plugins' included), ``MergeState.plan_for``,
    ``MergePlan.merge`` / ``unmerge``, and the received-attention probe (``tomerge.probe``: what ``idm``
    plans from). Ops called from inside them (a strategy's stages, a plan's internals) count too."""
    from tomerge import probe
    from tomerge.plan import MergePlan
    from tomerge.state import MergeState
    from tomerge.strategy import MergeStrategy

    functions = [MergePlan.merge, MergePlan.unmerge, MergeState.plan_for, probe.received_attention,
                 probe.received_linear_attention]
    classes, seen = [MergeStrategy], set()
    while classes:
        cls = classes.pop()
        if cls in seen:
            continue
        seen.add(cls)
        classes.extend(cls.__subclasses__())
        functions += [cls.__dict__[name] for name in ("plan", "unmerge") if name in cls.__dict__]
    return frozenset(code for f in functions if (code := getattr(f, "__code__", None)) is not None)


class FlopCounter(FlopCounterMode):
    """``FlopCounterMode`` (a context manager; ``get_total_flops()``, ``get_flop_counts()`` by module) with
    every attention kernel priced, raising :class:`UnpricedOpError` on an op that moves FLOPs unpriced;
    ``get_merge_flops()``: the part of the total spent planning, merging and unmerging (:func:`merge_code`)."""

    def __init__(self) -> None:
        super().__init__(display=False, custom_mapping=_extra_formulas())
        self._merge_code: frozenset[Any] = frozenset()
        self._merge_flops = 0

    def __enter__(self):
        self._merge_code = merge_code()  # strategies registered since the last count included
        self._merge_flops = 0  # cleared on entry, as the total is
        return super().__enter__()

    def get_merge_flops(self) -> int:
        """FLOPs of the ops that ran inside tomerge's planning, merging and unmerging (in the total too)."""
        return self._merge_flops

    def _in_merge_code(self) -> bool:
        frame = sys._getframe(2)
        while frame is not None:
            if frame.f_code in self._merge_code:
                return True
            frame = frame.f_back
        return False

    def _count_flops(self, func_packet, out, args, kwargs):
        if func_packet not in self.flop_registry:
            name = getattr(func_packet, "_qualified_op_name", str(func_packet))
            if moves_flops(name):
                raise UnpricedOpError(
                    f"the FLOP counter has no formula for {name}, which moves FLOPs; counting it as zero would "
                    "overstate every speed-up. Add a formula to tomerge.experiments.measure.flops, or run the model with "
                    "a kernel the counter prices (e.g. under torch.nn.attention.sdpa_kernel)")
        elif self._merge_code:
            flops = self.flop_registry[func_packet](*args, **kwargs, out_val=out)
            if flops and self._in_merge_code():
                self._merge_flops += flops
        return super()._count_flops(func_packet, out, args, kwargs)


def count_flops(fn: Callable[[], object]) -> int:
    """FLOPs of ``fn()``."""
    return count_flops_split(fn)[0]


def count_flops_split(fn: Callable[[], object]) -> tuple[int, int]:
    """FLOPs of ``fn()`` and the part of them spent planning, merging and unmerging
    (:meth:`FlopCounter.get_merge_flops`)."""
    counter = FlopCounter()
    with counter:
        fn()
    return counter.get_total_flops(), counter.get_merge_flops()


class DenoiserFlops(NamedTuple):
    """What :func:`count_denoiser_flops` counts."""

    flops: int  # every denoiser call made, merging's own included
    calls: int  # denoiser calls
    merge_flops: int  # of ``flops``, those spent planning, merging and unmerging


def count_denoiser_flops(denoiser: nn.Module, call: Callable[[], Any]) -> DenoiserFlops:
    """FLOPs of every denoiser call made by ``call()``, the number of calls, and the part of the FLOPs spent
    planning, merging and unmerging (:meth:`FlopCounter.get_merge_flops`).

    The counter is entered around each call of ``denoiser`` (forward hooks), so text encoders and the VAE
    are not counted and a schedule's per-step changes are.
    """
    from .timing import DenoiserProbe

    counter = FlopCounter()
    depth, total, merge = [0], [0], [0]

    def enter(module: nn.Module, args: tuple) -> None:
        if depth[0] == 0:
            counter.__enter__()  # clears the counts of the previous call
        depth[0] += 1

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        depth[0] -= 1
        if depth[0] == 0:
            counter.__exit__(None, None, None)
            total[0] += counter.get_total_flops()
            merge[0] += counter.get_merge_flops()

    handles = [denoiser.register_forward_pre_hook(enter), denoiser.register_forward_hook(leave)]
    try:
        with DenoiserProbe(denoiser) as probe:
            call()
    finally:
        for handle in handles:
            handle.remove()
        if depth[0]:
            counter.__exit__(None, None, None)
    return DenoiserFlops(int(total[0]), probe.calls, int(merge[0]))
