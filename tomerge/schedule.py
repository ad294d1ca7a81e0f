"""Schedules: which strategy, what ratio, which sublayers, for every block call.

A :class:`Schedule` maps the position of a block call (:class:`Where`) to a :class:`Decision`.
Applying a single strategy uses :class:`Constant`; composite schedules (``sdtm``, ``toma``) live in
``strategies/`` and register like strategies.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar

import torch
from torch import Tensor

from .context import check_ratio
from .options import check_number
from .strategy import SUBLAYERS, MergeStrategy


@dataclasses.dataclass(frozen=True)
class Where:
    """The position of one block call in the trajectory and in the model.

    ``layer`` counts every hooked block in execution order; ``kind_index`` counts only the blocks of
    this ``block_kind`` (Flux: the 3rd single-stream block has ``kind_index`` 2).
    """

    step: int
    num_steps: int | None
    progress: float
    layer: int
    num_layers: int
    block_kind: str = "block"
    kind_index: int | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do in one block call.

    Args:
        strategy: the strategy to plan with, or ``None`` to run the block unmerged.
        ratio: the ratio to ask the strategy for.
        sublayers: where the plan is applied: a subset of ``{"attn", "crossattn", "mlp"}``.
        cache_key: plans are cached under this key and reused by later calls with the same key
            (``None``: plan once per block call, shared by its sublayers).
        destinations_key: destinations are kept under this key and reused by later calls with the same key
            whose plan is not cached: only the merge matrix is recomputed (``strategy.plan(x, ctx,
            destinations=...)``; ToMA's separate refresh intervals). ``None``: destinations are not kept.
        label: a short name for records and figures (e.g. the phase).
        reset_streaks: clear the merge streaks (``ctx.streak``) of this call index (the n-th model call of the
            step) before the block runs, so the next merge decision starts counting from 0 (SDTM's protected
            layers, as the authors' code sets its counter to ``None`` there).
        cache_outputs: the sublayers (e.g. ``{"attn", "mlp"}``) whose full-length outputs this block call stores in the feature cache
            (one entry per merge point of the block and call index, replacing the previous one).
        cache_weight: ``w`` of the feature cache: where this call unmerges a sublayer's output, the tokens the
            strategy counts as merged (``strategy.merged_tokens``) get ``w * output + (1 - w) * cached``, the
            output this merge point stored last; other tokens keep their output. ``None``: no blending.
    """

    strategy: MergeStrategy | None
    ratio: float = 0.0
    sublayers: frozenset[str] = frozenset()
    cache_key: Hashable | None = None
    destinations_key: Hashable | None = None
    label: str = ""
    reset_streaks: bool = False
    cache_outputs: frozenset[str] = frozenset()
    cache_weight: float | None = None

    @property
    def merges(self) -> bool:
        return self.strategy is not None and bool(self.sublayers)


SKIP = Decision(strategy=None, label="skip")


class Schedule(abc.ABC):
    """Maps (progress, step, layer, block kind) to a :class:`Decision`.

    Subclasses are frozen dataclasses whose fields are their options; ``to_dict()`` is the config
    that experiments log.
    """

    name: ClassVar[str] = ""

    @abc.abstractmethod
    def decide(self, where: Where) -> Decision:
        """The decision for one block call."""

    @abc.abstractmethod
    def strategies(self) -> tuple[MergeStrategy, ...]:
        """Every strategy the schedule may pick (adapters record what they need)."""

    @property
    def needs(self) -> frozenset[str]:
        """What the adapter must record for the schedule: the :attr:`~MergeStrategy.needs` of its
        :meth:`strategies`, together."""
        return frozenset().union(*(s.needs for s in self.strategies()))

    # ------------------------------------------------------------------ extension: a text-key bias
    def prepare_text_labels(self, labels: Any) -> Any:
        """Validates the text-token labels a user gives (``tomerge.apply(..., text_labels=...)`` or
        ``handle.set_text_labels``) and returns what :meth:`text_key_bias` receives. Schedules that bias no text
        keys (the default) refuse labels.

        Raises:
            TypeError: this schedule takes no text labels.
        """
        raise TypeError(f"schedule {self.name!r} takes no text labels (it biases no text keys); "
                        "text labels are for e.g. sdtm with prompt_reweight=a_p")

    def text_key_bias(self, where: Where, labels: Any, batch: int, text_len: int,
                      device: torch.device) -> Tensor | None:
        """``[B, T]`` additive logit bias on the text keys of image queries in the joint attention of this block
        call (``labels``: what :meth:`prepare_text_labels` returned); ``None``: no bias (the default). The core
        applies it exactly and keeps the fused attention kernel (:mod:`tomerge.text_bias`)."""
        return None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schedule": self.name}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            out[f.name] = value.to_dict() if hasattr(value, "to_dict") else value
        return out


def resolve_sublayers(strategy: MergeStrategy, merge_attn: bool | None, merge_crossattn: bool | None,
                      merge_mlp: bool | None) -> frozenset[str]:
    """The strategy's default sublayers with the ``merge_*`` flags that were given applied on top."""
    chosen = set(strategy.default_sublayers)
    for kind, flag in zip(SUBLAYERS, (merge_attn, merge_crossattn, merge_mlp)):
        if flag is not None:
            chosen.discard(kind) if not flag else chosen.add(kind)
    return frozenset(chosen)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constant(Schedule):
    """One strategy at one ratio on every block call.

    Args:
        strategy: the strategy.
        ratio: fraction of tokens removed, in ``[0, 1)``.
        merge_attn, merge_crossattn, merge_mlp: override the strategy's default sublayers.
        merge_from, merge_until: merge only block calls with ``merge_from <= progress <= merge_until``
            (``progress = step / (num_steps - 1)``); the others run unmerged (label ``"skip_step"``).

    Example:
        >>> import tomerge
        >>> s = Constant(strategy=tomerge.get_strategy("tomesd"), ratio=0.5)
        >>> sorted(s.sublayers)
        ['attn']
    """

    name: ClassVar[str] = "constant"
    strategy: MergeStrategy
    ratio: float
    merge_attn: bool | None = None
    merge_crossattn: bool | None = None
    merge_mlp: bool | None = None
    merge_from: float = 0.0
    merge_until: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, MergeStrategy):
            raise TypeError(f"strategy must be a MergeStrategy, got {type(self.strategy).__name__}")
        check_ratio(self.ratio)
        for name in ("merge_from", "merge_until"):
            check_number(getattr(self, name), name, self.name, low=0.0, high=1.0, note="a progress")
        if self.merge_from > self.merge_until:
            raise ValueError(f"merge_from ({self.merge_from}) is after merge_until ({self.merge_until}): "
                             "no call would merge")

    @property
    def sublayers(self) -> frozenset[str]:
        return resolve_sublayers(self.strategy, self.merge_attn, self.merge_crossattn, self.merge_mlp)

    def decide(self, where: Where) -> Decision:
        if not self.merge_from <= where.progress <= self.merge_until:
            return Decision(strategy=None, label="skip_step")
        return Decision(self.strategy, self.ratio, self.sublayers, label=self.strategy.name)

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return (self.strategy,)
