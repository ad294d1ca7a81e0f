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


def _on_cuda_rule(real):
    """``chunk_shape`` as it decides for a non-CPU tensor (a meta copy of the shape), for the loop on CPU."""
    return lambda q, num_keys: real(q.to("meta"), num_keys)


@pytest.mark.parametrize("path", ["cpu-eager", "cpu-compiling", "cuda"])
@pytest.mark.parametrize("budget, Q", [(1, 5), (80, 5), (240, 7), (10_000, 7)])
def test_chunks_average_like_one_softmax(monkeypatch, path, budget, Q):
    """Queries per chunk (B = 2, H = 3, N = 20; one head per chunk on CPU, all three on CUDA):
    1 and 1; 2 (a partial last chunk) and 1; 6 (partial) and 2 (partial); all queries in one chunk."""
    monkeypatch.setattr(probe, "CPU_CHUNK_ELEMENTS", budget)
    monkeypatch.setattr(probe, "CHUNK_ELEMENTS", budget)
    if path == "cpu-compiling":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    if path == "cuda":
        monkeypatch.setattr(probe, "chunk_shape", _on_cuda_rule(probe.chunk_shape))
    q, k, scale = _inputs(Q)
    a = probe.received_attention(q, k, scale)
    assert a.dtype == torch.float32 and a.shape == (2, 20)
    torch.testing.assert_close(a.double(), _reference(q, k, scale), rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(a.sum(-1), torch.ones(2))


def test_chunk_shape_per_device_and_mode(monkeypatch):
    """One head per chunk on CPU (cache-sized eager, up to CHUNK_ELEMENTS compiling), all heads elsewhere."""
    q = torch.empty(2, 24, 333, 64)  # [B, H, Q, d]
    N = 4429
    assert probe.chunk_shape(q, N) == (1, probe.CPU_CHUNK_ELEMENTS // (2 * N))
    assert probe.chunk_shape(q.to("meta"), N) == (24, probe.CHUNK_ELEMENTS // (2 * 24 * N))
    assert probe.chunk_shape(q, 10**9) == (1, 1)  # never zero queries
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    assert probe.chunk_shape(q, N) == (1, probe.CHUNK_ELEMENTS // (2 * N))


def test_default_chunks_at_a_real_size():
    """SD3-like text probe (more logits than one CPU chunk): the same values as one softmax."""
    q, k, scale = _inputs(Q=160, N=4000, B=1, H=2, d=16)
    assert 160 * 4000 > probe.CPU_CHUNK_ELEMENTS  # two chunks per head
    torch.testing.assert_close(probe.received_attention(q, k, scale).double(), _reference(q, k, scale),
                               rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("keys", [slice(0, 12), slice(8, None)], ids=["image-first (SD3)", "text-first (Flux)"])
def test_a_slice_of_the_keys_gets_its_renormalised_share(keys):
    """The softmax runs over all keys (the model's own); the slice's share is renormalised to sum to 1."""
    q, k, scale = _inputs(Q=5)
    share = _reference(q, k, scale)[:, keys]  # [B, 12]
    a = probe.received_attention(q, k, scale, keys=keys)
    assert a.shape == (2, 12)
    torch.testing.assert_close(a.double(), share / share.sum(-1, keepdim=True), rtol=1e-5, atol=1e-7)


def test_a_slice_that_receives_nothing_gives_zeros_not_nan():
    q = torch.ones(1, 1, 2, 4)
    k = torch.cat([torch.ones(1, 1, 3, 4), -torch.full((1, 1, 2, 4), 1e4)], dim=2)  # the last 2 keys: exp underflows
    a = probe.received_attention(q, k, 1.0, keys=slice(3, None))
    assert torch.equal(a, torch.zeros(1, 2))
