"""The gathers of the declared adapters (backbones/_gather.py) on hand-built tables: rotary tables in every layout
(rows, batched, Qwen's image table, complex tables, Mochi's broadcast table, Allegro's position ids), key masks and
query-by-key masks follow the slots and keep the text.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from tomerge.backbones._declared import Rope
from tomerge.backbones._gather import BatchedComplexTable, gather_key_mask, gather_pair_mask, gather_rope


def test_gather_rope_layouts_match_hand_built_tables():
    dst = torch.tensor([[2, 0], [1, 1]])  # [B=2, M=2]
    rows = torch.arange(5.0)[:, None].expand(5, 3)  # 2 text rows, then N = 3 image rows
    c, _ = gather_rope((rows, rows), dst, 3, "rows")
    assert torch.equal(c.table[:, :, 0], torch.tensor([[0.0, 1, 4, 2], [0, 1, 3, 3]]))
    batched = torch.arange(6.0).view(2, 3, 1)  # [B, N, d]
    c, _ = gather_rope((batched, batched), dst, 3, "batched")
    assert torch.equal(c[..., 0], torch.tensor([[2.0, 0], [4, 4]]))
    shared, _ = gather_rope((batched[:1], batched[:1]), dst, 3, "batched")
    assert torch.equal(shared[..., 0], torch.tensor([[2.0, 0], [1, 1]]))
    image = torch.arange(3.0).to(torch.complex64)[:, None]  # [N, d/2]
    text = torch.zeros(4, 1, dtype=torch.complex64)
    gathered, kept = gather_rope((image, text), dst, 3, "qwen")
    assert isinstance(gathered, BatchedComplexTable) and kept is text
    assert torch.equal(gathered.unsqueeze(1)[:, :, 0, 0].real, torch.tensor([[2.0, 0], [1, 1]]))
    one, _ = gather_rope((image, text), dst[:1], 3, "qwen")
    assert torch.equal(one[:, 0].real, torch.tensor([2.0, 0]))
    with pytest.raises(TypeError, match="unsqueeze"):
        gathered.unsqueeze(0)


def test_gather_key_mask_keeps_text_and_follows_the_slots():
    mask = torch.tensor([[1, 1, 0, 1, 0], [0, 1, 1, 1, 1]]).bool()[:, None, None]  # [B, 1, 1, 3 image + 2 text]
    out = gather_key_mask(mask, torch.tensor([[2, 1], [0, 0]]), 3, "last")
    assert out[:, 0, 0].tolist() == [[False, True, True, False], [False, False, True, True]]
    first = gather_key_mask(mask, torch.tensor([[0, 2]]), 3, "first")  # text first: columns 0-1 text
    assert first[:, 0, 0].tolist() == [[True, True, False, False], [False, True, True, True]]


def test_gather_pair_mask_follows_the_slots_on_both_axes():
    m = torch.tensor([[1.0, 0, 2, 3, 4]])  # 2 text, then 3 image tokens: distinct values
    pairs = (m[:, :, None] * 10 + m[:, None, :])[:, None]  # [1, 1, 5, 5]: entry (q, k) = 10 m_q + m_k
    out = gather_pair_mask(pairs, torch.tensor([[2, 0]]), 3, "first")[0, 0]  # slots: image tokens 2, 0
    kept = torch.tensor([1.0, 0, 4, 2])  # text, then the slots' tokens
    assert torch.equal(out, kept[:, None] * 10 + kept[None, :])
    last = gather_pair_mask(pairs, torch.tensor([[1]]), 3, "last")[0, 0]  # image first: tokens 0-2, text 3-4
    kept = torch.tensor([0.0, 3, 4])
    assert torch.equal(last, kept[:, None] * 10 + kept[None, :])


def test_gather_rope_complex_tables_keep_their_other_rows():
    table = torch.arange(5.0).to(torch.complex64)[:, None]  # [L = 2 other + 3 image, 1]
    dst = torch.tensor([[2, 0], [1, 1]])
    shared = gather_rope(table, dst[:1], 3, "complex")  # prefix first (Qwen-Image 2.1)
    assert torch.equal(shared[:, 0].real, torch.tensor([0.0, 1, 4, 2]))
    per_sample = gather_rope(table, dst, 3, "complex")
    assert isinstance(per_sample, BatchedComplexTable)
    assert torch.equal(per_sample.unsqueeze(1)[:, :, 0, 0].real, torch.tensor([[0.0, 1, 4, 2], [0, 1, 3, 3]]))
    batched = torch.stack([table, table + 10])  # [B, L, 1], image first (Z-Image): tokens 0-2, then 2 others
    out = gather_rope(batched, dst, 3, "complex", text_side="last")
    assert torch.equal(out[..., 0].real, torch.tensor([[2.0, 0, 3, 4], [11, 11, 13, 14]]))


def test_batched_rotary_tables_keep_text_rows_on_their_side():
    """HiDream's one table [B, N + T, ...] (image first), ERNIE's likewise, Lumina 2's [B, T + N, ...] (text first):
    the image rows gathered per slot, the text rows kept; a tensor stays a tensor, a tuple a tuple."""
    dst = torch.tensor([[2, 0], [1, 1]])  # [B, M]
    image_first = torch.arange(5.0).view(1, 5, 1)  # N = 3 image rows, then 2 text rows
    out = gather_rope(image_first, dst, 3, "batched", text_side="last")
    assert isinstance(out, Tensor) and out[..., 0].tolist() == [[2.0, 0, 3, 4], [1, 1, 3, 4]]
    text_first = torch.arange(10.0).view(2, 5, 1)  # per sample: 2 text rows, then N = 3
    cos, sin = gather_rope((text_first, text_first), dst, 3, "batched")
    assert cos[..., 0].tolist() == [[0.0, 1, 4, 2], [5, 6, 8, 8]] and torch.equal(cos, sin)
    with pytest.raises(ValueError, match="R \\+ N"):
        gather_rope(torch.zeros(1, 2, 1), dst, 3, "batched")
    with pytest.raises(ValueError, match="text rows first"):
        Rope(layout="rows", text="last")


def test_gather_rope_broadcast_and_allegro_layouts_match_hand_built_tables():
    dst = torch.tensor([[2, 0], [1, 1]])  # [B=2, M=2]
    table = torch.arange(3.0).view(3, 1, 1).expand(3, 2, 4)  # Mochi's [N=3, heads, d/2], no batch axis
    cos, _ = gather_rope((table, table), dst, 3, "broadcast")
    assert cos.shape == (2, 2, 2, 4) and torch.equal(cos[..., 0, 0], torch.tensor([[2.0, 0], [1, 1]]))
    shared, _ = gather_rope((table, table), dst[:1], 3, "broadcast")
    assert shared.shape == (2, 2, 4) and torch.equal(shared[:, 0, 0], torch.tensor([2.0, 0]))
    single = torch.arange(3.0).view(3, 1, 1, 1, 1).expand(3, 1, 4, 2, 2)  # Kandinsky 6's one [N, 1, d/2, 2, 2] table
    rotations = gather_rope(single, dst, 3, "broadcast")
    assert rotations.shape == (2, 2, 1, 4, 2, 2)  # [B, M, 1, d/2, 2, 2]
    assert torch.equal(rotations[:, :, 0, 0, 0, 0], torch.tensor([[2.0, 0], [1, 1]]))
    assert gather_rope(single, dst[:1], 3, "broadcast").shape == (2, 1, 4, 2, 2)
    tables = ((torch.zeros(5, 2),) * 2,) * 3  # per-axis (cos, sin), kept as they are
    ids = (torch.tensor([[0, 0, 1]]), torch.tensor([[0, 1, 0]]), torch.tensor([[4, 5, 6]]))  # (t, h, w) [1, N]
    kept, (t, h, w) = gather_rope((tables, ids), dst, 3, "allegro")
    assert kept is tables
    assert (t.tolist(), h.tolist(), w.tolist()) == ([[1, 0], [0, 0]], [[0, 0], [1, 1]], [[6, 4], [5, 5]])
    _, (t1, _, w1) = gather_rope((tables, ids), dst[:1], 3, "allegro")
    assert (t1.tolist(), w1.tolist()) == ([[1, 0]], [[6, 4]])
    with pytest.raises(ValueError, match="broadcast"):
        gather_rope((table[:2], table[:2]), dst, 3, "broadcast")
    with pytest.raises(ValueError, match="position ids"):
        gather_rope((tables, tuple(i[:, :2] for i in ids)), dst, 3, "allegro")
