"""Margins of discrete choices, for tests that compare argmaxes, sorts or greedy picks exactly.

The strategies choose in float32. Where two candidates' scores are equal (ties by symmetry) or closer
than float32 rounding (near ties), which one wins depends on how the kernels round: on the machine's
vector width (``ATEN_CPU_CAPABILITY``), the thread count, the batch size, compiled or eager. A test that
compares such a choice exactly (with a plain float64 computation, or batched with per-sample) must
show that its inputs have no such ties: these helpers give the gap between the chosen candidate and
the next one in float64, and :func:`assert_clear` requires it to exceed :data:`MARGIN`.

float32 scores here are sums of at most a few dozen terms of size <= 1, so their rounding error is
below 1e-5; a gap above ``MARGIN = 1e-4`` cannot be closed by rounding.
"""

from __future__ import annotations

import torch
from torch import Tensor

MARGIN = 1e-4


def kth_gap(scores: Tensor, k: int) -> Tensor:
    """Gap between the ``k``-th and the ``(k + 1)``-th largest score along the last dim.

    Args:
        scores: ``[..., n]`` scores (``-inf`` for candidates that may not be chosen), ``n > k``.
        k: how many are chosen (``1`` for an argmax).

    Returns:
        ``[...]`` float64 gaps (``inf`` when fewer than ``k + 1`` candidates are allowed).
    """
    top = scores.double().topk(k + 1, dim=-1).values  # [..., k + 1], descending
    return top[..., k - 1] - top[..., k]


def assert_clear(gaps: Tensor, what: str, margin: float = MARGIN) -> None:
    """Asserts every gap exceeds ``margin``: no choice of ``what`` depends on float32 rounding."""
    smallest = float(gaps.min())
    assert smallest > margin, (
        f"{what}: a choice is within {smallest:.3g} of a tie (needs > {margin:g}), so float32 rounding "
        "could decide it; use inputs without near ties"
    )


def greedy_facility_location(X: Tensor, follow: list[int], tol: float = MARGIN) -> list[float]:
    """Greedy facility location on one tile as the spec states it, in float64, tie-aware.

    ``S = X X^T``; the first pick maximises the row sum, every later pick the coverage gain
    ``sum_i relu(S[v, i] - m_i)`` with ``m_i = max_{j chosen} S[j, i]``, among unchosen members.

    Args:
        X: ``[s, C]`` unit features of the tile's members.
        follow: the ``d`` picks of the implementation under test (member indices, in pick order). At every
            step the followed pick must be one of the best candidates (gain within ``tol`` of the maximum);
            the greedy then continues from it, so exact ties may break either way and the rest is still
            checked.
        tol: how close to the maximum gain a candidate counts as tied.

    Returns:
        Per step, the gap between the best and the second-best gain (small where the step was a tie).
    """
    S = X.double() @ X.double().T  # [s, s]
    chosen: list[int] = []
    gaps: list[float] = []
    for k, pick in enumerate(follow):
        if k == 0:
            gain = S.sum(-1)  # [s] row sums
        else:
            m = S[chosen].max(0).values  # [s] coverage of every member
            gain = (S - m).clamp_min(0).sum(-1)  # [s]
        gain[chosen] = -torch.inf
        best = float(gain.max())
        gaps.append(float(kth_gap(gain, 1)))  # inf when one candidate is left
        tied = (gain >= best - tol).nonzero().flatten().tolist()
        assert pick in tied, (f"greedy step {k}: picked member {pick} (gain {float(gain[pick]):.7f}) but the "
                              f"best gain is {best:.7f} (members {tied})")
        chosen.append(pick)
    return gaps
