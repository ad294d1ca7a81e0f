"""``cached_detail``: token merging whose merged steps keep each token's detail from the last full step.

Merging loses what made the tokens of a slot differ (their detail); caching keeps it but misses how the output
changed since. On full steps every merge point stores its unmerged output; on the merged steps in between each
token's output is the merged output combined with that cache (``detail``). tomerge's own method; the rules and
costs: docs/schedules.md, "cached_detail".

Example:
    >>> from tomerge.schedule import Where
    >>> s = CachedDetail(merge="tomesd", ratio=0.5, refresh_every=3)
    >>> [s.decide(Where(step=t, num_steps=8, progress=t / 7, layer=0, num_layers=2)).label for t in range(5)]
    ['full', 'tomesd', 'tomesd', 'full', 'tomesd']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar

import torch
from torch import Tensor

from tomerge.feature_cache import FeatureCaching
from tomerge.options import check_choice, check_int
from tomerge.schedule import Decision, Schedule, Where
from tomerge.strategy import MergeStrategy

FULL = "full"  # the label of a full step's block calls
DETAIL_MODES = ("merged_change", "slot_offset")


@dataclasses.dataclass(frozen=True, kw_only=True)
class CachedDetail(Schedule):
    """Merging with each token's detail restored from the last full step (docs/schedules.md, "cached_detail").

    Args:
        merge: the merging strategy or schedule of the steps in between: a registered name, a
            :class:`~tomerge.MergeStrategy` or a :class:`~tomerge.Schedule` (not a caching one).
        merge_options: options of ``merge`` when it is a name, as ``tomerge.apply`` takes them.
        ratio: the ratio of ``merge`` (``None``: its own default, for a schedule that has one).
        refresh_every: the steps from one full step to the next (1: every step is full, the unmerged model).
        warmup: the first ``warmup`` steps are full (at least 1: the cache is empty before step 0 ran).
        detail: how a merged step combines its output with the cached one: ``"merged_change"`` or
            ``"slot_offset"`` (docs/schedules.md, "cached_detail").
    """

    name: ClassVar[str] = "cached_detail"

    merge: str | MergeStrategy | Schedule = "tomesd"
    merge_options: Mapping[str, Any] = dataclasses.field(default_factory=dict, hash=False)
    ratio: float | None = 0.5
    refresh_every: int = 3
    warmup: int = 1
    detail: str = "merged_change"

    _inner: Schedule = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        from tomerge.attach import make_schedule  # attach imports the registry that loads this module

        what = self.name
        check_int(self.refresh_every, "refresh_every", what, low=1)
        check_int(self.warmup, "warmup", what, low=1, note="the feature cache is empty before step 0 ran")
        check_choice(self.detail, "detail", what, DETAIL_MODES)
        if not isinstance(self.merge_options, Mapping):
            raise ValueError(f"{what}: merge_options must be a mapping of option names to values, "
                             f"got {self.merge_options!r}")
        if not isinstance(self.merge, (str, MergeStrategy, Schedule)):
            raise ValueError(f"{what}: merge must be a strategy or schedule name, a MergeStrategy or a Schedule, "
                             f"got {self.merge!r}")
        if isinstance(self.merge, Schedule) and self.ratio is not None:
            raise ValueError(f"{what}: ratio goes into the Schedule given as merge when you build it")
        try:
            inner = make_schedule(self.merge, None if isinstance(self.merge, Schedule) else self.ratio,
                                  dict(self.merge_options))
        except (KeyError, TypeError, ValueError) as err:  # KeyError: an unknown name (its message is its one argument)
            name = self.merge if isinstance(self.merge, str) else type(self.merge).__name__
            message = err.args[0] if isinstance(err, KeyError) and err.args else err
            raise ValueError(f"{what}: merge={name!r}: {message}") from err
        if inner.caches_blocks:
            raise ValueError(f"{what}: merge={inner.name!r} is a caching schedule; merge names a merging strategy "
                             "or schedule (compose the other way round: block_cache(merge='cached_detail'))")
        object.__setattr__(self, "_inner", inner)

    def is_full(self, step: int) -> bool:
        """Whether ``step`` runs every block unmerged and refreshes the feature cache."""
        return step < self.warmup or (step - (self.warmup - 1)) % self.refresh_every == 0

    def decide(self, where: Where) -> Decision:
        """A full step: unmerged, storing the outputs of the sublayers ``merge`` would merge; otherwise
        ``merge``'s decision with the detail restored from those outputs."""
        inner = self._inner.decide(where)
        if self.is_full(where.step):
            return Decision(strategy=None, label=FULL,
                            techniques=(FeatureCaching(store=inner.sublayers),) if inner.merges else ())
        if not inner.merges:
            return inner
        if self.detail == "slot_offset":
            return inner.using(_restoring(inner, "slot_offset"))
        last_full = where.step - (where.step - (self.warmup - 1)) % self.refresh_every
        # one plan per layer from the first merged step to the next full step: the reference stays comparable
        return dataclasses.replace(inner.using(_restoring(inner, "merged_change")),
                                   cache_key=((self.name, where.layer), last_full))

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return self._inner.strategies()

    # ------------------------------------------------------------------ the inner schedule's text-key bias
    def prepare_text_labels(self, labels: Any) -> Any:
        return self._inner.prepare_text_labels(labels)

    def text_key_bias(self, where: Where, labels: Any, batch: int, text_len: int,
                      device: torch.device) -> Tensor | None:
        return self._inner.text_key_bias(where, labels, batch, text_len, device)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (the built inner schedule is derived, not logged)."""
        out = {k: v for k, v in super().to_dict().items() if not k.startswith("_")}
        out["merge_options"] = dict(self.merge_options)
        return out


def _restoring(inner: Decision, detail: str) -> FeatureCaching:
    """The inner decision's feature cache restoring the detail by ``detail`` (its blending off)."""
    return dataclasses.replace(inner.technique(FeatureCaching) or FeatureCaching(), weight=None, detail=detail)
