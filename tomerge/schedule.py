"""Schedules: which strategy, what ratio, which sublayers, for every block call.

A :class:`Schedule` maps the position of a block call (:class:`Where`) to a :class:`Decision`.
Applying a single strategy uses :class:`Constant`; composite schedules (``sdtm``, ``toma``) live in
``strategies/`` and register like strategies.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Hashable
from typing import Any, ClassVar, TypeVar

import torch
from torch import Tensor

from .context import check_ratio
from .options import check_number
from .strategy import SUBLAYERS, MergeStrategy
from .technique import TechniqueOptions

O = TypeVar("O", bound=TechniqueOptions)


@dataclasses.dataclass(frozen=True)
class Where:
    """The position of one block call in the trajectory and in the model.

    ``layer`` counts every hooked block in execution order; ``kind_index`` counts only the blocks of
    this ``block_kind`` (Flux: the 3rd single-stream block has ``kind_index`` 2). ``change`` is the change a block
    call of this model call measured (``MergeState.change``; the block cache's ``measure_change``, adaptive caching:
    ``first_block_cache``), ``None`` until one has.
    """

    step: int
    num_steps: int | None
    progress: float
    layer: int
    num_layers: int
    block_kind: str = "block"
    kind_index: int | None = None
    change: float | None = None


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do in one block call: the merge the core plans, and the techniques the call uses.

    Args:
        strategy: the strategy to plan with, or ``None`` to run the block unmerged.
        ratio: the ratio to ask the strategy for.
        sublayers: where the plan is applied: a subset of ``{"attn", "crossattn", "mlp"}``.
        cache_key: ``(scope, window)``: the plan is cached under this key and reused by later calls with the same
            key (``None``: plan once per block call, shared by its sublayers). The state keeps one plan per scope
            (and call index): a plan of a new window replaces the scope's earlier one, so a schedule's windows
            must only grow along a trajectory (e.g. ``step // recompute_every``) and its memory stays bounded by
            its scopes, whatever the step count.
        destinations_key: ``(scope, window)``: destinations are kept under this key and reused by later calls
            with the same key whose plan is not cached: only the merge matrix is recomputed (``strategy.plan(x,
            ctx, destinations=...)``; ToMA's separate refresh intervals); one per scope, as ``cache_key``.
            ``None``: destinations are not kept.
        label: a short name for records and figures (e.g. the phase).
        techniques: the options of the techniques the call uses, at most one per class
            (:class:`~tomerge.technique.TechniqueOptions`; e.g. :class:`~tomerge.block_cache.BlockCaching`,
            :class:`~tomerge.feature_cache.FeatureCaching`, :class:`~tomerge.streaks.Streaks`): the core creates
            each one's state for the first decision carrying it and runs its hooks around every later block call.
    """

    strategy: MergeStrategy | None
    ratio: float = 0.0
    sublayers: frozenset[str] = frozenset()
    cache_key: Hashable | None = None
    destinations_key: Hashable | None = None
    label: str = ""
    techniques: tuple[TechniqueOptions, ...] = ()

    def __post_init__(self) -> None:
        for name in ("cache_key", "destinations_key"):
            key = getattr(self, name)
            if key is not None and not (isinstance(key, tuple) and len(key) == 2):
                raise ValueError(f"Decision.{name} must be a (scope, window) pair or None, got {key!r}")
        classes = [type(options) for options in self.techniques]
        if not all(isinstance(options, TechniqueOptions) for options in self.techniques) \
                or len(set(classes)) != len(classes):
            raise ValueError(f"Decision.techniques takes at most one TechniqueOptions per class, got {self.techniques!r}")
        if self.skipped & self.sublayers:
            raise ValueError(f"the sublayers {sorted(self.skipped & self.sublayers)} do not run in this call "
                             f"({', '.join(type(o).__name__ for o in self.techniques if o.skips)}): they merge nothing")
        for options in self.techniques:
            options.check(self)

    @property
    def merges(self) -> bool:
        return self.strategy is not None and bool(self.sublayers)

    @property
    def skipped(self) -> frozenset[str]:
        """The sublayers that do not run in this call (a technique returns their output)."""
        return frozenset().union(*(options.skips for options in self.techniques))

    def technique(self, cls: type[O]) -> O | None:
        """This call's options of technique ``cls``, or ``None`` when it does not use it."""
        for options in self.techniques:
            if type(options) is cls:
                return options
        return None

    def using(self, *options: TechniqueOptions) -> Decision:
        """This decision with ``options`` replacing those of the same classes."""
        replaced = {type(o) for o in options}
        return dataclasses.replace(self, techniques=tuple(o for o in self.techniques if type(o) not in replaced) + options)


SKIP = Decision(strategy=None, label="skip")


class Schedule(abc.ABC):
    """Maps (progress, step, layer, block kind) to a :class:`Decision`.

    Subclasses are frozen dataclasses whose fields are their options; ``to_dict()`` is the config
    that experiments log.
    """

    name: ClassVar[str] = ""

    @property
    def caches_blocks(self) -> bool:
        """Whether its decisions use the block cache (:class:`~tomerge.block_cache.BlockCaching`): the hooks then wrap
        every block's ``forward`` so that a reusing call can skip the block (default: no)."""
        return False

    @property
    def reused_sublayers(self) -> frozenset[str]:
        """The sublayers its decisions may reuse (``FeatureCaching.reuse``): the hooks then wrap those merge
        points' ``forward`` so that a reusing call can skip them (default: none)."""
        return frozenset()

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


def check_attention_runs_before_its_merge(strategy: MergeStrategy, sublayers: frozenset[str] | tuple[str, ...],
                                          fix: str, where: str = "") -> None:
    """Raises ``ValueError`` when ``strategy`` needs received attention (:attr:`MergeStrategy.needs`) and
    ``sublayers`` include the attention (``"attn"``): a block records the attention its tokens receive when its
    attention has run at full length, and the attention's merge is planned before it runs, so that plan never
    has it. ``where`` follows the strategy's name in the message (e.g. which schedule merges there); ``fix``
    ends it (what to change).

    Example:
        >>> import tomerge
        >>> check_attention_runs_before_its_merge(tomerge.get_strategy("idm"), ("attn",), "merge the MLP alone")
        Traceback (most recent call last):
        ...
        ValueError: strategy 'idm' needs received attention and merges the attention sublayer ('attn'): ...
    """
    if "attn" in sublayers and "received_attention" in strategy.needs:
        raise ValueError(
            f"strategy {strategy.name!r}{where} needs received attention and merges the attention sublayer "
            "('attn'): the attention's merge is planned before the block's attention runs, and received attention "
            f"is recorded only from an attention that ran at full length, so that plan would have none; {fix}")


#: The end of :func:`check_attention_runs_before_its_merge`'s message for a strategy applied alone.
MERGE_AFTER_THE_ATTENTION = (
    "merge only sublayers that run after the attention (merge_attn=False, or a strategy whose default_sublayers "
    "is {'mlp'}, as idm's), or do not list 'received_attention' in the strategy's needs")


@dataclasses.dataclass(frozen=True, kw_only=True)
class Constant(Schedule):
    """One strategy at one ratio on every block call.

    Args:
        strategy: the strategy.
        ratio: fraction of tokens removed, in ``[0, 1)``.
        merge_attn, merge_crossattn, merge_mlp: override the strategy's default sublayers.
        merge_from, merge_until: merge only block calls with ``merge_from <= progress <= merge_until``
            (``progress = step / (num_steps - 1)``); the others run unmerged (label ``"skip_step"``).

    A strategy that needs received attention may not merge ``"attn"`` (its merge is planned before the attention
    runs and is recorded): :func:`check_attention_runs_before_its_merge` raises ``ValueError``.

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
        check_attention_runs_before_its_merge(self.strategy, self.sublayers, MERGE_AFTER_THE_ATTENTION)

    @property
    def sublayers(self) -> frozenset[str]:
        return resolve_sublayers(self.strategy, self.merge_attn, self.merge_crossattn, self.merge_mlp)

    def decide(self, where: Where) -> Decision:
        if not self.merge_from <= where.progress <= self.merge_until:
            return Decision(strategy=None, label="skip_step")
        return Decision(self.strategy, self.ratio, self.sublayers, label=self.strategy.name)

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return (self.strategy,)
