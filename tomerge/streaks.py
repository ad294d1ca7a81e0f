"""Merge streaks (``ctx.streak``): how many consecutive merge decisions counted each token as merged.

SDTM's IDM ranks tokens by them (the authors' ``last_independent``), ToCa by how long a token was not recomputed.
A merge decision that removes tokens extends the streak of every token its plan counts as merged by 1 and zeros
the others (:func:`next_streak`, in ``MergeState.plan_for``); a schedule resets them or keeps them under its own
key with :class:`Streaks` in a decision. :class:`StreakState` keeps them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .technique import TechniqueOptions, TechniqueState

if TYPE_CHECKING:
    from .state import BlockCall, MergeState


@dataclasses.dataclass
class StreakCall:
    """The streaks of one block call: ``before [B, N]`` (``ctx.streak``) and ``after`` its merge decision."""

    before: Tensor
    after: Tensor | None = None


def next_streak(streak: Tensor, merged: Tensor) -> Tensor:
    """``[B, N]`` streaks after one merge decision: every token the plan counts as merged (``merged [B or 1, N]``)
    extends its streak by 1, every other token's streak drops to 0 (the authors' last_independent: add 1 to all,
    zero the independent ones). Tensor work only: runs inside compiled graphs."""
    return (streak + 1) * merged.expand_as(streak)  # [B, N]


class StreakState(TechniqueState):
    """The merge streaks of one application: ``streaks[(call index, Streaks.key, N)]`` ``[B, N]``.

    Kept only when a strategy of the schedule reads them (:attr:`~tomerge.MergeStrategy.uses_streak`). Memory: one
    ``[B, N]`` tensor per call index, key and token count (a schedule's keys are bounded by its blocks, e.g. ToCa's
    one per layer): bounded by the model, not by the step count.
    """

    kind = "streaks"

    def __init__(self, keep: bool = False) -> None:
        self.keep = keep  # a strategy of the schedule reads them: they are counted
        self.streaks: dict[tuple[int, Hashable, int], Tensor] = {}

    @classmethod
    def create(cls, state: MergeState) -> StreakState:
        return cls(keep=any(s.uses_streak for s in state.schedule.strategies()))

    def reset(self) -> None:
        self.streaks.clear()

    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        return ((self.kind, streak) for streak in self.streaks.values())

    def current(self, call: BlockCall, state: MergeState) -> Tensor:
        """``[B, N]`` the streaks of a merging call before its merge decision (zeros at first), handed to its plan
        (``call.scratch[StreakState]``)."""
        streak = self._get(state.call_index, _key(call), call.block_input)
        call.scratch[StreakState] = StreakCall(streak)
        return streak

    def begin_block(self, call: BlockCall, state: MergeState) -> None:
        """Resets the call index's streaks when the decision says so; a call that selects no token grows every
        streak of its key by 1 (ToCa's counter)."""
        options = call.decision.technique(Streaks)
        if options is not None and options.reset:
            for key in [k for k in self.streaks if k[0] == state.call_index]:
                del self.streaks[key]
        if not self.keep or call.reused is not None or call.block_input is None:
            return
        call.wants_merged = True
        if call.decision.strategy is None and options is not None and options.key is not None:
            B, N = call.block_input.shape[:2]
            self.streaks[(state.call_index, options.key, N)] = self._get(state.call_index, options.key,
                                                                        call.block_input) + 1

    def end_block(self, call: BlockCall, state: MergeState) -> None:
        counted = call.scratch.get(StreakState)
        if call.computed and counted is not None and counted.after is not None:
            self.streaks[(state.call_index, _key(call), call.plan.num_tokens)] = state.keep(counted.after)

    def _get(self, call_index: int, key: Hashable | None, tokens: Tensor) -> Tensor:
        B, N = tokens.shape[:2]
        s = self.streaks.get((call_index, key, N))
        if s is None or s.shape[0] != B:
            s = torch.zeros(B, N, device=tokens.device)
            self.streaks[(call_index, key, N)] = s
        return s


@dataclasses.dataclass(frozen=True)
class Streaks(TechniqueOptions):
    """A decision's use of the merge streaks.

    Args:
        key: the streaks of this call are kept under this key (``None``: one streak per token count, shared by every
            block, as SDTM counts; ToCa counts per block: ``("toca", layer)``). With no ``strategy`` (a call that
            selects no token) every streak of the key grows by 1, as ToCa's counter does on a step with no fresh
            token.
        reset: clear the streaks of this call index (the n-th model call of the step) before the block runs, so the
            next merge decision starts counting from 0 (SDTM's protected layers, as the authors' code sets its
            counter to ``None`` there).
    """

    State = StreakState

    key: Hashable | None = None
    reset: bool = False


def _key(call: BlockCall) -> Hashable | None:
    """The key of the call's streaks (:attr:`Streaks.key`; ``None`` without :class:`Streaks`)."""
    options = call.decision.technique(Streaks)
    return options.key if options is not None else None
