"""`MergeContext` is what a strategy may know and nothing else: a frozen dataclass (derived contexts come from
``dataclasses.replace``), with no channel between a strategy's stages; the work both stages share is passed to
them as ``shared=`` by ``MergeStrategy.plan``, and stages written without that parameter plan as they did."""

from __future__ import annotations

import dataclasses
import uuid
from pathlib import Path
from typing import Any, ClassVar

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

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Columns(MergeStrategy):
        def select_destinations(self, x, ctx):
            return _even_columns_plan(x, ctx).dst

        def merge_matrix(self, x, dst, ctx):
            return _even_columns_plan(x, ctx)

    def merged(x: torch.Tensor, ctx: MergeContext, attention: torch.Tensor) -> torch.Tensor:
        derived = dataclasses.replace(ctx, received_attention=attention)
        return Columns().plan(x, derived).merge(x) * derived.received_attention.sum()

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


@dataclasses.dataclass(frozen=True, kw_only=True)
class SharesWork(MergeStrategy):
    """Hands a fresh object from ``shared_work`` to both stages and records what each stage received."""

    seen: list = dataclasses.field(default_factory=list, compare=False)
    made: list = dataclasses.field(default_factory=list, compare=False)

    def shared_work(self, x, ctx):
        work = {"tokens": x.shape[1]}  # a new object every plan: identity tells it apart
        self.made.append(work)
        return work

    def select_destinations(self, x, ctx, shared=None):
        self.seen.append(("select_destinations", shared))
        return _even_columns_plan(x, ctx).dst

    def merge_matrix(self, x, dst, ctx, shared=None):
        self.seen.append(("merge_matrix", shared))
        return _even_columns_plan(x, ctx)


def test_both_stages_get_the_object_shared_work_returned():
    strategy = SharesWork()
    x, ctx = _tokens(2), MergeContext(grid=(4, 4), ratio=0.5)
    for _ in range(2):
        strategy.plan(x, ctx)
    assert len(strategy.made) == 2  # once per plan
    for plan_index, work in enumerate(strategy.made):
        stages = strategy.seen[2 * plan_index: 2 * plan_index + 2]
        assert [stage for stage, _ in stages] == ["select_destinations", "merge_matrix"]
        assert all(shared is work for _, shared in stages)
    assert strategy.made[0] is not strategy.made[1]

    strategy.seen.clear()
    strategy.merge_matrix(x, strategy.select_destinations(x, ctx), ctx)  # called on their own: nothing shared
    assert [shared for _, shared in strategy.seen] == [None, None]


def test_a_stage_taking_keywords_gets_shared_and_one_without_does_not():
    received: dict[str, Any] = {}

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Mixed(MergeStrategy):
        def select_destinations(self, x, ctx):  # no shared: called without it
            received["select_destinations"] = "called"
            return _even_columns_plan(x, ctx).dst

        def merge_matrix(self, x, dst, ctx, **options):
            received["merge_matrix"] = options
            return _even_columns_plan(x, ctx)

    Mixed().plan(_tokens(3), MergeContext(grid=(4, 4), ratio=0.5))
    assert received == {"select_destinations": "called", "merge_matrix": {"shared": None}}


def test_shared_work_with_stages_lacking_shared_is_refused_at_class_definition():
    with pytest.raises(TypeError, match=r"add shared=None to the stages") as raised:
        @dataclasses.dataclass(frozen=True, kw_only=True)
        class Forgetful(MergeStrategy):
            name: ClassVar[str] = "forgetful"

            def shared_work(self, x, ctx):
                return x.float()

            def select_destinations(self, x, ctx, shared=None):
                return _even_columns_plan(x, ctx).dst

            def merge_matrix(self, x, dst, ctx):
                return _even_columns_plan(x, ctx)
    assert "merge_matrix" in str(raised.value) and "select_destinations" not in str(raised.value)

    with pytest.raises(TypeError, match=r"add shared=None to the stages"):
        class Inherits(SharesWork):  # inherits shared_work, overrides a stage without shared
            def select_destinations(self, x, ctx):
                return _even_columns_plan(x, ctx).dst
