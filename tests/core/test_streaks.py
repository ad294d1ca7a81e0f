"""Merge streaks (``ctx.streak``) kept by ``MergeState`` across block calls, against the authors' counter.

The authors' ``last_independent`` (``TR_SDTM.py``): every block call that merges adds 1 to every token
and zeros the independent ones (``update_last_independent``, lines 188-202 in ``SSM`` and 400-414 in
``FIDM``); not independent are all ``K`` tokens of a merged SSM window (line 201) and, in ``FIDM``, every
window destination with the merged sources (line 413). ``compute_ratio`` sets the counter to ``None`` at a
protected layer (lines 546-548), protected steps never reach it (lines 717-743), and a call whose ratio
asks for no token returns before counting (lines 589-591). Each test drives the state call by call as
the hooks do (``begin_model_call``, ``begin_block``, ``plan_for``, ``end_block``) with hand-made tokens whose
merge choices have no near ties.
"""

from __future__ import annotations

import dataclasses

import torch

from tomerge import MergeContext
from tomerge.schedule import Decision, Schedule, Where
from tomerge.state import MergeState, TrajectoryClock
from tomerge.streaks import Streaks, StreakState
from tomerge.strategies.idm import IDM
from tomerge.strategies.sdtm import SDTM
from tomerge.strategies.ssm import SSM
from helpers.ties import assert_clear, kth_gap

GRID, N = (4, 4), 16
# 4x4 grid, 2x2 windows: w0 = {0,1,4,5}, w1 = {2,3,6,7}, w2 = {8,9,12,13}, w3 = {10,11,14,15}.
W0, W3 = [0, 1, 4, 5], [10, 11, 14, 15]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Scripted(Schedule):
    """Returns ``script[(step, layer)]``, or runs ``strategy`` at ``ratio`` on the MLP."""

    name = "scripted"
    strategy: object
    ratio: float
    script: dict = dataclasses.field(default_factory=dict)

    def decide(self, where: Where) -> Decision:
        default = Decision(self.strategy, self.ratio, frozenset({"mlp"}), label="merge")
        return self.script.get((where.step, where.layer), default)

    def strategies(self):
        return (self.strategy,)


def block_call(state: MergeState, layer: int, x: torch.Tensor) -> None:
    """One block call as the hooks make it: decide, plan from ``x`` when the decision merges, record."""
    call = state.begin_block(layer, "block", GRID, x)
    if call.decision.merges:
        state.plan_for(call, x)
    state.end_block()


def streak(state: MergeState) -> list[int]:
    """The counter of sample 0 (an absent counter is all zeros: the next call starts from 0)."""
    s = state.technique(StreakState).streaks.get((state.call_index, None, N))
    return [0] * N if s is None else [int(v) for v in s[0].tolist()]


def flat_window(window: list[int]) -> torch.Tensor:
    """``[1, 16, 16]`` one-hot tokens, except the tokens of ``window``, which are identical: that window
    scores 1 (mean cosine similarity), every other window 0."""
    x = torch.eye(N).unsqueeze(0).clone()
    x[0, window] = torch.ones(N) / 4
    return x


def expected(counts: dict[int, int]) -> list[int]:
    return [counts.get(t, 0) for t in range(N)]


def test_every_member_of_a_merged_ssm_window_counts_its_destination_included() -> None:
    strategy = SSM(round_windows=1, alpha_s=0.0)
    state = MergeState(Scripted(strategy=strategy, ratio=3 / 16), num_layers=1)  # r = 3: one 2x2 window
    state.begin_model_call(1.0)
    block_call(state, 0, flat_window(W0))
    assert streak(state) == expected({t: 1 for t in W0})  # token 0 (the slot's destination) counts
    block_call(state, 0, flat_window(W0))
    assert streak(state) == expected({t: 2 for t in W0})
    block_call(state, 0, flat_window(W3))  # another window: w0's streaks drop to 0
    assert streak(state) == expected({t: 1 for t in W3})


def idm_tokens() -> torch.Tensor:
    """``[1, 16, 20]`` tokens for the streak IDM with top-left destinations 0, 2, 8, 10 (all streaks 0):
    destinations 0 and 2 are ``e0``, ``e1``; sources 15 and 6 are close to ``e0`` (cosine 0.99, 0.98), 13 and 5
    close to ``e1`` (0.97, 0.96); every other token is its own direction. With r = 4 those four merge and
    destinations 8 and 10 receive nothing."""
    x = torch.zeros(1, N, 4 + N, dtype=torch.float64)
    x[0, 0, 0] = x[0, 2, 1] = 1.0
    x[0, 8, 2] = x[0, 10, 3] = 1.0
    targets = {15: (0, 0.99), 6: (0, 0.98), 13: (1, 0.97), 5: (1, 0.96)}
    for t in range(N):
        if t in (0, 2, 8, 10):
            continue
        j, c = targets.get(t, (0, 0.0))
        x[0, t, j] = c
        x[0, t, 4 + t] = (1 - c * c) ** 0.5
    return x


def test_every_idm_destination_counts_and_the_streak_picks_the_next_destinations() -> None:
    x = idm_tokens()
    X = torch.nn.functional.normalize(x[0], dim=-1)
    sources = [t for t in range(N) if t not in (0, 2, 8, 10)]
    best = (X[sources] @ X[[0, 2, 8, 10]].T).max(-1).values
    assert_clear(kth_gap(best, 4), "the 4th most similar source")  # 0.96 vs 0: no near tie
    strategy = IDM(variant="streak")
    state = MergeState(Scripted(strategy=strategy, ratio=0.25), num_layers=1)  # r = 4 (kept unrounded)
    state.begin_model_call(1.0)
    block_call(state, 0, x)
    # All four window destinations count, 8 and 10 although nothing merged into them (FIDM line 413).
    assert streak(state) == expected({0: 1, 2: 1, 8: 1, 10: 1, 15: 1, 6: 1, 13: 1, 5: 1})
    # Next call: each window's destination is its longest streak, ties to the first: w0 = {0, 1, 4, 5}
    # has 0 and 5 at 1 -> 0; w3 = {10, 11, 14, 15} has 10 and 15 at 1 -> 10 (had the destination not
    # counted, 15 would be the destination of w3 and 5 of w0).
    ctx_streak = state.technique(StreakState).streaks[(0, None, N)]
    dst = strategy.select_destinations(x.float(), MergeContext(grid=GRID, ratio=0.25, streak=ctx_streak))
    assert dst.tolist() == [[0, 2, 8, 10]]
    block_call(state, 0, x)
    assert streak(state) == expected({0: 2, 2: 2, 8: 2, 10: 2, 15: 2, 6: 2, 13: 2, 5: 2})


def test_a_call_that_asks_for_no_token_leaves_the_counter_alone() -> None:
    strategy = SSM(round_windows=1, alpha_s=0.0)
    none = Decision(strategy, 0.05, frozenset({"mlp"}), label="merge")  # int(16 * 0.05) = 0
    tiny = Decision(strategy, 2 / 16, frozenset({"mlp"}), label="merge")  # r = 2 < K - 1: no window
    state = MergeState(Scripted(strategy=strategy, ratio=3 / 16, script={(0, 1): none, (0, 3): tiny}),
                       num_layers=4)
    state.begin_model_call(1.0)
    block_call(state, 0, flat_window(W0))
    assert streak(state) == expected({t: 1 for t in W0})
    block_call(state, 1, flat_window(W0))  # r = 0: the authors return before counting
    assert streak(state)[1] == 1  # a source of w0 (token 0, its destination, is checked next)
    assert streak(state) == expected({t: 1 for t in W0})
    block_call(state, 2, flat_window(W0))
    assert streak(state) == expected({t: 2 for t in W0})
    block_call(state, 3, flat_window(W0))  # r = 2 > 0 merges no window: every token is independent
    assert streak(state) == [0] * N


def test_sdtm_resets_at_protected_layers_and_keeps_the_counter_on_protected_steps() -> None:
    # Always the structure phase (switch_step), one window per merged call, layer 1 protected, every 3rd
    # step protected: step 0 protected, steps 1, 2 merge layers 0 and 2, step 3 protected.
    sdtm = SDTM(ratio=3 / 16, switch_step=100, round_windows=1, alpha_s=0.0, protect_layers=(1,),
                protect_every=3)
    state = MergeState(sdtm, num_layers=3, clock=TrajectoryClock(num_steps=4))
    seen: list[tuple[int, int, list[int]]] = []
    for step in range(4):
        state.begin_model_call(1.0 - step / 4)
        for layer in range(3):
            block_call(state, layer, flat_window(W0))
            seen.append((step, layer, streak(state)[1], streak(state)[0]))
    labels = [(r.step, r.layer, r.label) for r in state.records]
    assert [lab for *_, lab in labels] == ["protected"] * 3 + ["structure", "protected", "structure"] * 2 \
        + ["protected"] * 3
    # Every token of w0: +1 per merged call, back to 0 at the protected layer 1 of a merged step, untouched
    # on the protected step 3 (its layer 1 included). Token 1 is a source of the window, token 0 its slot's
    # destination: both count.
    counts = [(0, 0, 0), (0, 1, 0), (0, 2, 0),
              (1, 0, 1), (1, 1, 0), (1, 2, 1),
              (2, 0, 2), (2, 1, 0), (2, 2, 1),
              (3, 0, 1), (3, 1, 1), (3, 2, 1)]
    assert [(step, layer, source) for step, layer, source, _ in seen] == counts
    assert [(step, layer, destination) for step, layer, _, destination in seen] == counts


def test_sdtm_decisions_flag_the_reset_only_for_protected_layers() -> None:
    s = SDTM(protect_every=3, protect_layers=(1,), protect_layers_every=4)
    flags = {(step, layer): (o := s.decide(Where(step, 10, step / 9, layer, 6)).technique(Streaks)) is not None
             and o.reset for step in range(4) for layer in range(6)}
    # protected layers: 1 (listed), 0 and 4 (layer % 4 == 0), 5 (the last); protected steps 0 and 3.
    assert {k for k, v in flags.items() if v} == {(step, layer) for step in (1, 2) for layer in (0, 1, 4, 5)}
