"""The received-attention probe: chunked, it equals the mean softmax written out in float64."""

from __future__ import annotations

import pytest
import torch

from tomerge import probe


def _reference(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(q k^T * scale)`` averaged over heads and queries, all at once in float64."""
    p = (q.double() @ k.double().transpose(-1, -2) * scale).softmax(-1)  # [B, H, Q, N]
    return p.mean(dim=(1, 2))  # [B, N]


def _inputs(Q: int, N: int = 20, B: int = 2, H: int = 3, d: int = 8):
    g = torch.Generator().manual_seed(Q)
    q = torch.randn(B, Q, H, d, generator=g).transpose(1, 2)  # [B, H, Q, d], a strided view as the hooks give
    k = torch.randn(B, N, H, d, generator=g).transpose(1, 2)  # [B, H, N, d]
    return q, k, d ** -0.5


@pytest.mark.parametrize("compiling", [False, True], ids=["cpu-eager", "compiling"])
@pytest.mark.parametrize("budget, Q", [(1, 5), (80, 5), (240, 7), (10_000, 7)])
def test_chunks_average_like_one_softmax(monkeypatch, compiling, budget, Q):
    """Queries per chunk (B = 2, H = 3, N = 20; one head per chunk eager on CPU, all three when compiling):
    1 and 1; 2 (a partial last chunk) and 1; 6 (partial) and 2 (partial); all queries in one chunk."""
    monkeypatch.setattr(probe, "CPU_CHUNK_ELEMENTS", budget)
    monkeypatch.setattr(probe, "CHUNK_ELEMENTS", budget)
    if compiling:  # the path CUDA and torch.compile take: all heads in a chunk
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    q, k, scale = _inputs(Q)
    a = probe.received_attention(q, k, scale)
    assert a.dtype == torch.float32 and a.shape == (2, 20)
    torch.testing.assert_close(a.double(), _reference(q, k, scale), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(a.sum(-1), torch.ones(2))


def test_default_chunks_at_a_real_size():
    """SD3-like text probe (more logits than one CPU chunk): the same values as one softmax."""
    q, k, scale = _inputs(Q=160, N=4000, B=1, H=2, d=16)
    assert 160 * 4000 > probe.CPU_CHUNK_ELEMENTS  # two chunks per head
    torch.testing.assert_close(probe.received_attention(q, k, scale).double(), _reference(q, k, scale),
                               rtol=1e-5, atol=1e-9)
