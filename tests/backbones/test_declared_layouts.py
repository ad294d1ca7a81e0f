"""The declaration language's token layouts (``backbones/_declared.py``): context tokens around the target tokens
(``DeclaredAdapter.block_context``, as :class:`~tomerge.backbones._context.ContextTokens`), self-attention masks
over queries and keys (:class:`Site` ``mask="pairs"`` without text) and per-head rotary tables (``"batched"``
``[B, H, N, d]``, ``gather_rope(heads=True)``: LTX-2's ``SplitRopePoint``), on hand-built tables and on a small
declared model whose image stream is ``[target, context]`` or ``[context, target]``; per-sample text lengths (Lumina 2)
and ``SelfKVPoint`` sites. FramePack (context first, in real use), LTX-2 (per-head RoPE) and SkyReels-V2 (square
masks) are in test_framepack.py, test_ltx2.py and test_skyreels_v2.py.
"""

from __future__ import annotations

import types
from typing import ClassVar

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import tomerge
from tomerge import registry
from tomerge.backbones._context import NO_CONTEXT, ContextTokens, beyond_grid
from tomerge.backbones._declared import DeclaredAdapter, DeclaredCall, DeclaredPoint, Kind, Rope, SelfKVPoint, Site
from tomerge.backbones._gather import BatchedRotaryTable, gather_key_mask, gather_pair_mask, gather_rope
from helpers import no_hooks_left
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, run


# ---------------------------------------------------------------------- the gathers
def test_stream_positions_keep_the_context_tokens_around_the_representatives():
    dst = torch.tensor([[2, 0], [1, 1]])  # [B=2, M=2] of N = 3 image tokens
    assert NO_CONTEXT.stream_positions(dst, 3).tolist() == [[2, 0], [1, 1]]
    # [2 context, 3 image, 1 context]: the context positions stay, the slots read 2 + dst
    assert ContextTokens(before=2, after=1).stream_positions(dst, 3).tolist() == [[0, 1, 4, 2, 5], [0, 1, 3, 3, 5]]
    with pytest.raises(ValueError, match="must be >= 0"):
        ContextTokens(before=-1)


def test_gather_rope_keeps_the_rows_of_context_tokens():
    dst = torch.tensor([[2, 0], [1, 1]])  # N = 3
    around = ContextTokens(before=2, after=1)
    rows = torch.arange(7.0)[:, None].expand(7, 2)  # [1 text, 2 context, 3 image, 1 context]
    c, _ = gather_rope((rows, rows), around.stream_positions(dst, 3), 6, "rows")
    assert isinstance(c, BatchedRotaryTable)
    assert c.table[:, :, 0].tolist() == [[0, 1, 2, 5, 3, 6], [0, 1, 2, 4, 4, 6]]
    shared, _ = gather_rope((rows, rows), around.stream_positions(dst[:1], 3), 6, "rows")  # one row of slots
    assert shared[:, 0].tolist() == [0, 1, 2, 5, 3, 6]
    wan = torch.arange(5.0).view(1, 5, 1, 1)  # [1, 2 context + 3 image, 1, d]
    c, _ = gather_rope((wan, wan), ContextTokens(before=2).stream_positions(dst, 3), 5, "wan")
    assert c.flatten(1).tolist() == [[0, 1, 4, 2], [0, 1, 3, 3]]
    after = ContextTokens(after=1).stream_positions(dst, 3)
    per_head = torch.arange(2 * 2 * 4.0).view(2, 2, 4, 1)  # [B, H, 3 image + 1 context, d]: tokens on axis 2
    c, _ = gather_rope((per_head, per_head), after, 4, "batched", heads=True)
    assert c.shape == (2, 2, 3, 1)
    assert c[..., 0].tolist() == [[[2, 0, 3], [6, 4, 7]], [[9, 9, 11], [13, 13, 15]]]
    flat, _ = gather_rope((per_head[:, 0], per_head[:, 0]), after, 4, "batched", heads=True)  # [B, N + 1, d]
    assert flat[..., 0].tolist() == [[2, 0, 3], [9, 9, 11]]
    one = gather_rope(per_head[:, 0], after, 4, "batched")  # one table, not (cos, sin): Helios
    assert isinstance(one, Tensor) and torch.equal(one, flat)
    with pytest.raises(ValueError, match="rotary table must be"):
        gather_rope((per_head, per_head), ContextTokens(1, 1).stream_positions(dst, 3), 5, "batched", heads=True)


def test_gather_key_mask_and_pair_mask_gather_the_image_span():
    dst = torch.tensor([[2, 0], [1, 1]])
    keys = torch.tensor([[1, 0, 1, 1, 0, 1], [0, 1, 1, 0, 1, 1]]).bool()  # [B, 1 context + 3 image + 2 text]
    positions = ContextTokens(before=1).stream_positions(dst, 3)
    assert gather_key_mask(keys, positions, 4, "last").int().tolist() == [[1, 1, 0, 0, 1], [0, 1, 1, 1, 1]]
    # A self-attention mask [1, 1, L, L] over [3 image, 1 context]: entry (q, k) = 10 q + k.
    square = (10 * torch.arange(4)[:, None] + torch.arange(4)[None, :]).view(1, 1, 4, 4)
    after = ContextTokens(after=1)
    out = gather_pair_mask(square, after.stream_positions(dst, 3), 4, "first")
    assert out.shape == (2, 1, 3, 3)
    assert out[0, 0].tolist() == [[22, 20, 23], [2, 0, 3], [32, 30, 33]]
    assert out[1, 0].tolist() == [[11, 11, 13], [11, 11, 13], [31, 31, 33]]
    shared = gather_pair_mask(square[0], after.stream_positions(dst[:1], 3), 4, "first")  # [1, L, L], one row
    assert shared.tolist() == [out[0, 0].tolist()]
    with pytest.raises(ValueError, match="query-by-key mask"):
        gather_pair_mask(square[..., :3], after.stream_positions(dst, 3), 4, "first")


# ---------------------------------------------------------------------- a declared model with context tokens
class ToyAttention(nn.Module):
    """Softmax self-attention with rotary ``(cos, sin)`` tables ``[1, L, 1, d]`` (Wan's layout) and an optional
    boolean mask ``[B or 1, 1, L, L]``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, hidden_states: Tensor, rotary_emb: tuple[Tensor, Tensor], attention_mask: Tensor | None = None):
        cos, sin = rotary_emb

        def rotate(x: Tensor) -> Tensor:  # [B, L, h*d] -> [B, h, L, d], rotated pairwise
            x = x.unflatten(2, (self.heads, -1))
            pairs = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
            return (x * cos + pairs * sin).transpose(1, 2)

        q, k = rotate(self.to_q(hidden_states)), rotate(self.to_k(hidden_states))
        v = self.to_v(hidden_states).unflatten(2, (self.heads, -1)).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask)  # [B, h, L, d]
        return self.to_out(out.transpose(1, 2).flatten(2))


class ToyBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = ToyAttention(dim, heads=2)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, hidden_states: Tensor, rotary_emb, attention_mask=None) -> Tensor:
        x = hidden_states + self.attn(self.norm1(hidden_states), rotary_emb, attention_mask)
        return x + self.ff(self.norm2(x))


class ToyContextModel(nn.Module):
    """A video latent ``[B, C, F, H, W]`` (patch 1) as target tokens, with ``P`` context tokens of its own on one side
    of them in the image stream; every token has its own rotary position and the attention a fixed random mask (each
    token sees itself). Returns the target tokens' output."""

    def __init__(self, side: str, dim: int = 16, channels: int = 4) -> None:
        super().__init__()
        self.side = side
        self.config = types.SimpleNamespace(patch_size=(1, 1, 1))
        self.proj_in = nn.Linear(channels, dim)
        self.blocks = nn.ModuleList(ToyBlock(dim) for _ in range(2))
        self.proj_out = nn.Linear(dim, channels)

    def forward(self, hidden_states: Tensor, context: Tensor, timestep: Tensor, masked: bool = True):
        B, C, T, H, W = hidden_states.shape
        N, P = T * H * W, context.shape[1]
        target = self.proj_in(hidden_states.flatten(2).transpose(1, 2))  # [B, N, dim]
        stream = torch.cat([target, context] if self.side == "last" else [context, target], dim=1)  # [B, N + P, dim]
        L, d = N + P, stream.shape[-1] // 2
        angles = torch.arange(L, dtype=torch.float32)[:, None] * (1.7 ** -torch.arange(d // 2).repeat_interleave(2))
        rope = (angles.cos()[None, :, None], angles.sin()[None, :, None])  # [1, L, 1, d]
        g = torch.Generator().manual_seed(L)
        mask = ((torch.rand(L, L, generator=g) < 0.7) | torch.eye(L, dtype=torch.bool))[None, None] if masked else None
        for block in self.blocks:
            stream = block(stream, rope, mask)
        target = stream[:, :N] if self.side == "last" else stream[:, P:]
        out = self.proj_out(target).transpose(1, 2).unflatten(2, (T, H, W))
        return types.SimpleNamespace(sample=out)


class ToyContextFirstAdapter(DeclaredAdapter):
    """The stream's tokens beyond the grid are context, first (FramePack's and Helios's history) or last."""

    name: ClassVar[str] = "test_toy_context_first"
    model_class: ClassVar[str] = "ToyContextModel"
    timestep_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (Kind("toy", "blocks", ("ToyBlock",), (
        Site("attn", "attn", rope=Rope("rotary_emb", 1, "wan"), mask="pairs", mask_index=2),
        Site("mlp", "ff"),
    )),)
    side: ClassVar[str] = "first"

    def block_context(self, kind: Kind, stream: Tensor) -> ContextTokens:
        return beyond_grid(stream, self.grid_size, self.side)


class ToyContextLastAdapter(ToyContextFirstAdapter):
    name: ClassVar[str] = "test_toy_context_last"
    side: ClassVar[str] = "last"


@pytest.fixture
def toy_backbones(monkeypatch) -> dict[str, str]:
    """The two toy adapters registered for one test: side -> backbone name."""
    adapters = {"first": ToyContextFirstAdapter, "last": ToyContextLastAdapter}
    for cls in adapters.values():
        monkeypatch.setitem(registry._backbones._classes, cls.name, cls)
    return {side: cls.name for side, cls in adapters.items()}


def toy_inputs(grid=(2, 3, 4), context: int = 5, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(2, 4, *grid, generator=g), context=torch.randn(2, context, 16, generator=g),
                timestep=torch.full((2,), 500.0))


def _first_attention_call(model: nn.Module, inputs: dict) -> tuple[Tensor, Tensor]:
    """``(tokens, mask)`` the first block's attention gets (after tomerge's hooks, when merging)."""
    seen = []
    hook = model.blocks[0].attn.register_forward_pre_hook(lambda module, args: seen.append((args[0], args[2])))
    try:
        run(model, inputs)
    finally:
        hook.remove()
    return seen[0]


@pytest.mark.parametrize("side", ["first", "last"])
def test_context_tokens_are_kept_and_the_target_tokens_merged(toy_backbones, side):
    torch.manual_seed(0)
    model = ToyContextModel(side).eval()
    backbone = toy_backbones[side]
    inputs = toy_inputs()
    N, P, M = 24, 5, 12
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.0, backbone=backbone):
        assert torch.equal(run(model, inputs), before)
    # A per-sample permutation of the target tokens is exact only if the context tokens, their rotary rows and
    # their mask rows and columns stay where they are and the target's follow their tokens.
    check_permutation_is_exact(model, inputs, None, N, backbone=backbone)
    plain, plain_mask = _first_attention_call(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, backbone=backbone, **ALL_SUBLAYERS) as handle:
        merged, merged_mask = _first_attention_call(model, inputs)
        out = run(model, inputs)
        assert handle.adapter.grid_size == (2, 3, 4)
        assert [r.num_tokens for r in handle.state.records] == [N, N] * 2
        assert all(r.num_removed == N - M for r in handle.state.records)
    context = slice(0, P) if side == "first" else slice(N, None)
    merged_context = slice(0, P) if side == "first" else slice(M, None)
    assert merged.shape == (2, P + M, 16) and merged_mask.shape == (2, 1, P + M, P + M)
    assert torch.equal(merged[:, merged_context], plain[:, context])  # the context tokens as they are
    assert torch.equal(merged_mask[:, :, merged_context, merged_context],  # the context's own rows and columns
                       plain_mask[:, :, context, context].expand(2, -1, -1, -1))
    assert out.shape == before.shape and torch.isfinite(out).all() and not torch.equal(out, before)
    assert no_hooks_left(model)


def test_a_stream_shorter_than_the_grid_is_not_merged(toy_backbones):
    """The block input is the whole stream when the model call's grid does not fit in it: nothing is merged (the
    block's grid check fails), with the core's warning."""
    torch.manual_seed(0)
    model = ToyContextModel("last").eval()
    inputs = toy_inputs()
    before = run(model, inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, backbone=toy_backbones["last"]) as handle:
        handle.adapter.call_grid = lambda args, kwargs: (4, 4, 4)  # 64 tokens > the stream's 29
        with pytest.warns(UserWarning, match="no block"):
            out = run(model, inputs)
        assert handle.stats["tokens_removed"] == 0 and handle.stats["block_calls"] == 2
    assert torch.equal(out, before)


def test_a_conv_site_refuses_context_tokens():
    """A channels-first grid holds the target alone: a ``"conv"`` site of a block call with context tokens raises."""
    point = DeclaredPoint("mlp", nn.Identity(), site=Site("mlp", "ff", tokens="conv"),
                          info=DeclaredCall(batch=1, context=ContextTokens(before=1)))
    with pytest.raises(RuntimeError, match="channels-first grid"):
        point.get_input((torch.zeros(1, 4, 2, 2),), {})


# ---------------------------------------------------------------------- ragged text, self key/value sites
def test_ragged_gathers_follow_each_samples_text_length():
    """Per-sample text lengths (Lumina 2): sample b is [text_b, image, padding]; tokens, rotary rows and the key mask
    of the merged call keep each sample's text and padding and take the slots' rows at that sample's offset."""
    lengths, dst = torch.tensor([2, 1]), torch.tensor([[1, 0], [2, 2]])  # T = 2 (the longest), N = 3 -> M = 2
    table = torch.arange(10.0).view(2, 5, 1)  # sample 0: t t i i i; sample 1: t i i i p
    out = gather_rope(table, dst, 3, "batched", lengths=lengths)
    assert out[..., 0].tolist() == [[0.0, 1, 3, 2], [5, 8, 8, 9]]
    mask = torch.tensor([[True] * 5, [True] * 4 + [False]])
    assert gather_key_mask(mask, dst, 3, "first", lengths=lengths).tolist() == [[True] * 4, [True] * 3 + [False]]
    call = DeclaredCall()
    call.set_text(lengths)
    assert (call.text, call.lengths.tolist()) == (2, [2, 1])
    joint = torch.arange(10.0).view(2, 5, 1)
    assert call.stream(joint, "first", "test")[..., 0].tolist() == [[2.0, 3, 4], [6, 7, 8]]
    merged = call.with_stream(joint, torch.tensor([[[-1.0], [-2.0]], [[-3.0], [-4.0]]]), "first", "test")
    assert merged[..., 0].tolist() == [[0.0, 1, -1, -2], [5, -3, -4, 9]]  # sample 1 keeps its padding row last
    call.set_text(torch.tensor([3, 3]))
    assert (call.text, call.lengths) == (3, None)  # equal lengths: one text length
    with pytest.raises(ValueError, match="text first"):
        call.set_text(lengths)
        call.stream(joint, "last", "test")


def test_a_self_kv_site_refuses_keys_from_another_tensor():
    """A ``SelfKVPoint`` site (``attn(x, x)``) merges both arguments; if the keys' input is another tensor the
    declaration is wrong for this call: it raises instead of attending merged queries to unmerged keys."""
    point = SelfKVPoint("attn", nn.Identity(), site=Site("attn", "attn", point=SelfKVPoint), info=DeclaredCall())
    x = torch.zeros(1, 4, 2)
    args, kwargs = point.set_input((), {"hidden_states": x, "encoder_hidden_states": x}, x[:, :2])
    assert kwargs["hidden_states"] is kwargs["encoder_hidden_states"] and kwargs["hidden_states"].shape[1] == 2
    with pytest.raises(RuntimeError, match="another tensor"):
        point.set_input((), {"hidden_states": x, "encoder_hidden_states": x.clone()}, x[:, :2])
