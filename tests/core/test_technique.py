"""A technique defined outside the core (here, in a test file) plugs in through :class:`TechniqueState` and
:class:`TechniqueOptions` alone: its options in ``Decision.techniques``, its state created at first use, its hook
points (a wrapped block, a wrapped merge point, the point hooks) run by tomerge.attach."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

import tomerge
from tomerge.schedule import Decision, Schedule, Where
from tomerge.technique import TechniqueOptions, TechniqueState
from helpers.compiled import build, call, inputs, times


class SkipState(TechniqueState):
    """Skips whole blocks and replaces attention outputs by zeros, as its options say; counts the merge points
    that ran at full length."""

    def __init__(self) -> None:
        self.points_ran = 0
        self.resets = 0

    def reset(self) -> None:
        self.resets += 1

    @classmethod
    def wraps_blocks(cls, schedule: Schedule) -> bool:
        return isinstance(schedule, Skipping)

    @classmethod
    def block_forward(cls, call: Any, block: Any, forward: Any, args: tuple, kwargs: dict) -> Any:
        if call.decision.technique(Skip).block:
            return block.output_of(call.streams)  # the block's input, as its output
        return forward(*args, **kwargs)

    @classmethod
    def wrapped_sublayers(cls, schedule: Schedule) -> frozenset[str]:
        return frozenset({"attn"}) if isinstance(schedule, Skipping) else frozenset()

    @classmethod
    def point_forward(cls, call: Any, point: Any, index: int, forward: Any, args: tuple, kwargs: dict) -> Any:
        if call.decision.technique(Skip).zero_attention:
            return torch.zeros_like(point.get_input(args, kwargs))
        return forward(*args, **kwargs)

    def begin_block(self, call: Any, state: Any) -> None:
        if call.decision.technique(Skip) is not None:
            call.scratch[SkipState] = self

    @classmethod
    def point_ran(cls, call: Any, point: Any, index: int, output: Any) -> None:
        call.scratch[SkipState].points_ran += 1


@dataclasses.dataclass(frozen=True)
class Skip(TechniqueOptions):
    State = SkipState

    block: bool = False
    zero_attention: bool = False


@dataclasses.dataclass(frozen=True)
class Skipping(Schedule):
    """Block 0 skipped, block 1's attention zeroed, nothing merged."""

    name = "skipping"

    def decide(self, where: Where) -> Decision:
        return Decision(None, label="skip", techniques=(Skip(block=where.layer == 0, zero_attention=where.layer == 1),))

    def strategies(self) -> tuple:
        return ()


def test_a_technique_outside_the_core_wraps_blocks_and_points_and_keeps_its_own_state():
    model = build("native_dit")
    reference = copy.deepcopy(model)
    reference.blocks[0].forward = lambda x, c: x
    reference.blocks[1].attn.forward = lambda x: torch.zeros_like(x)
    calls = [inputs("native_dit", t) for t in times(3)]
    expected = [call(reference, kwargs) for kwargs in calls]
    unpatched = [call(model, kwargs) for kwargs in calls]
    assert all(not torch.equal(a, b) for a, b in zip(expected, unpatched))  # the technique changes every output
    with tomerge.merging(model, Skipping(), num_steps=len(calls)) as handle:
        got = [call(model, kwargs) for kwargs in calls + calls]  # two trajectories
        state = handle.state.technique(SkipState)
    assert all(torch.equal(a, b) for a, b in zip(got, expected + expected))
    # created at the first block call; reset when the second trajectory starts
    # block 1's two merge points (attention, MLP) ran at full length in each of the 6 model calls; block 0's none
    assert state.points_ran == 2 * 2 * len(calls) and state.resets == 1
    assert all(torch.equal(call(model, kwargs), b) for kwargs, b in zip(calls, unpatched))  # remove() left no trace
    assert not [name for name, m in model.named_modules() if "forward" in vars(m)]  # no wrapped forward left
