"""`MergeContext` is what a strategy may know and nothing else: a frozen dataclass (derived contexts come from
``dataclasses.replace``), with no channel between a strategy's stages (a strategy whose stages share work passes it between them in
its own ``plan``)."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path

import pytest
import torch
import torch._dynamo.testing

import tomerge
from tomerge import MergeContext, MergePlan, MergeStrategy
from tomerge.experiments.plugins import load_plugins

# A one-file plugin whose stages take no ``shared`` parameter: destinations are the even positions, every odd
# token merges into the most similar destination (so the plan depends on the data).
OLD_STYLE_PLUGIN = '''\
from __future__ import annotations

import dataclasses

import torch

import tomerge


@tomerge.register_strategy({name!r})
@dataclasses.dataclass(frozen=True, kw_only=True)
class NearestEven(tomerge.MergeStrategy):
    calls: list = dataclasses.field(default_factory=list, compare=False)

    def select_destinations(self, x, ctx):
        self.calls.append(("select_destinations", ctx))
        return torch.arange(0, x.shape[1], 2, device=x.device).expand(x.shape[0], -1)

    def merge_matrix(self, x, dst, ctx):
        self.calls.append(("merge_matrix", ctx))
        B, N, _ = x.shape
        unit = torch.nn.functional.normalize(x.float(), dim=-1)
        similarity = unit @ unit.gather(1, dst.unsqueeze(-1).expand(-1, -1, x.shape[-1])).transpose(1, 2)
        slot = similarity.argmax(-1)  # [B, N]
        slot = slot.scatter(1, dst, torch.arange(dst.shape[1], device=x.device).expand(B, -1))  # dst: own slot
        return tomerge.MergePlan.hard(slot, dst)
'''


def _tokens(seed: int = 0, shape: tuple[int, int, int] = (2, 16, 8)) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def _even_columns_plan(x: torch.Tensor, ctx: MergeContext) -> MergePlan:
    """Each token of an odd column merges into its left neighbour (``ctx.grid`` is ``(H, W)``, ``W`` even)."""
    H, W = ctx.grid
    dst = torch.arange(H * W).view(H, W)[:, 0::2].flatten().expand(x.shape[0], -1)  # [B, M]
    slot = torch.arange(H * W) // 2  # [N]
    return MergePlan.hard(slot.expand(x.shape[0], -1), dst)


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Columns(MergeStrategy):
    """A strategy whose stages give :func:`_even_columns_plan`."""

    def select_destinations(self, x, ctx):
        return _even_columns_plan(x, ctx).dst

    def merge_matrix(self, x, dst, ctx):
        return _even_columns_plan(x, ctx)


# ---------------------------------------------------------------------------------------- frozen context
def test_assigning_a_field_raises():
    ctx = MergeContext(grid=(4, 4), ratio=0.5)
    for field, value in (("ratio", 0.25), ("received_attention", torch.zeros(1, 16)), ("draws", None)):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(ctx, field, value)
    assert ctx.ratio == 0.5 and ctx.received_attention is None


def test_replace_derives_a_validated_context():
    ctx = MergeContext(grid=(4, 4), ratio=0.5)
    attention = torch.rand(1, 16)
    derived = dataclasses.replace(ctx, received_attention=attention, grid=[1, 4, 4])
    assert derived.received_attention is attention and derived.grid == (1, 4, 4)  # the grid normalised to a tuple
    assert ctx.received_attention is None and ctx.grid == (4, 4)
    with pytest.raises(ValueError, match="ratio"):
        dataclasses.replace(ctx, ratio=1.0)


def test_replace_compiles_without_a_graph_break_or_a_recompile():
    """Deriving a context inside a compiled function (what the merge state does with received attention
    recorded in the block call) is traced: ``fullgraph=True`` would raise at a graph break. The derived context
    is not validated inside the graph, so the graph does not guard on the per-step ``progress``: one graph for
    every step."""

    def merged(x: torch.Tensor, ctx: MergeContext, attention: torch.Tensor) -> torch.Tensor:
        derived = dataclasses.replace(ctx, received_attention=attention)
        return _Columns().plan(x, derived).merge(x) * derived.received_attention.sum()

    x, attention = _tokens(), torch.rand(2, 16, dtype=torch.float64)
    counter = torch._dynamo.testing.CompileCounter()
    torch._dynamo.reset()
    try:
        compiled = torch.compile(merged, backend=counter, fullgraph=True)
        for step, progress in enumerate((0.0, 0.25, 0.5)):
            ctx = MergeContext(grid=(4, 4), ratio=0.5, progress=progress, step=step, num_steps=3)
            torch.testing.assert_close(compiled(x, ctx, attention), merged(x, ctx, attention), rtol=0, atol=0)
    finally:
        torch._dynamo.reset()
    assert counter.frame_count == 1


# ---------------------------------------------------------------------------------------- shared work
def test_stages_without_shared_plan_as_their_stages_called_by_hand(tmp_path: Path):
    """A one-file plugin written without ``shared``: ``plan`` calls its stages as ``(x, ctx)`` and
    ``(x, dst, ctx)``, with the context it was given, and gives the plan of those stages called by hand."""
    name = f"nearest_even_{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(OLD_STYLE_PLUGIN.format(name=name))
    load_plugins([str(plugin)])
    strategy = tomerge.get_strategy(name)
    x, ctx = _tokens(1), MergeContext(grid=(4, 4), ratio=0.5)

    plan = strategy.plan(x, ctx)
    assert strategy.calls == [("select_destinations", ctx), ("merge_matrix", ctx)]
    assert all(seen is ctx for _, seen in strategy.calls)
    by_hand = strategy.merge_matrix(x, strategy.select_destinations(x, ctx), ctx)
    assert torch.equal(plan.dst, by_hand.dst) and torch.equal(plan.merge(x), by_hand.merge(x))
    assert plan.num_removed == 8

    strategy.calls.clear()
    kept = strategy.plan(x, ctx, destinations=plan.dst)  # a schedule's kept destinations: merge_matrix only
    assert [stage for stage, _ in strategy.calls] == ["merge_matrix"]
    assert torch.equal(kept.merge(x), by_hand.merge(x))


def test_identity_plan_validates_and_is_the_plan_of_a_context_that_removes_nothing():
    """What a strategy that overrides ``plan`` (to share work between its stages) validates with."""
    x = _tokens(2)
    identity = _Columns().identity_plan(x, MergeContext(grid=(4, 4), ratio=0.0))
    assert identity is not None and identity.is_identity and identity.num_tokens == 16
    assert _Columns().identity_plan(x, MergeContext(grid=(4, 4), ratio=0.5)) is None
    with pytest.raises(ValueError):
        _Columns().identity_plan(x, MergeContext(grid=(4, 5), ratio=0.5))  # 16 tokens on a 20-token grid
    with pytest.raises(TypeError, match="identity_plan"):
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Hiding(_Columns):
            identity_plan: bool = True
