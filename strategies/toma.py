"""``toma``: the ToMA schedule (Lu et al., ICML 2025): facility-location merging with skipped blocks and plan reuse.

A :class:`~tomerge.Schedule` around :class:`~tomerge.strategies.facility_location.FacilityLocation` that leaves the
first blocks of each kind unmerged, merges every ``merge_every``-th step and shares one plan across a group of
blocks and a window of steps; preset ``toma_release`` (the authors' Flux run). The rules: docs/schedules.md, "toma".

Example:
    >>> from tomerge.schedule import Where
    >>> s = ToMA(skip_first=1, merge_every=2, recompute_every=4, group_size=2)
    >>> [s.decide(Where(step=t, num_steps=10, progress=t / 9, layer=l, num_layers=4)).label
    ...  for t, l in [(0, 0), (1, 1), (2, 1)]]
    ['skip_block', 'skip_step', 'merge']
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Iterable
from typing import Any, ClassVar

from tomerge.options import check_int, check_ratio_option, check_sublayers
from tomerge.schedule import Decision, Schedule, Where
from tomerge.strategy import MergeStrategy

from .facility_location import FacilityLocation

MERGE, SKIP_BLOCK, SKIP_STEP = "merge", "skip_block", "skip_step"


def kind_position(where: Where) -> int:
    """The position of the block among the blocks of its kind.

    Args:
        where: the block call.

    Returns:
        ``where.kind_index`` when the core provides it, else ``where.layer`` (docs/schedules.md, "toma").
    """
    index = getattr(where, "kind_index", None)
    return where.layer if index is None else int(index)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ToMA(Schedule):
    """ToMA schedule (the rules: docs/schedules.md, "toma").

    Args:
        ratio: fraction of tokens removed on merged calls, in ``[0, 1)``.
        skip_first: the first ``k`` blocks of each block kind run unmerged.
        merge_every: merge only on steps with ``step % merge_every == 0``.
        recompute_every: merge matrices (and destinations, unless ``destinations_every``) are recomputed every
            this many steps.
        destinations_every: destinations are recomputed every this many steps (a multiple of
            ``recompute_every``); ``None``: with the matrices.
        group_size: consecutive merged blocks of one kind sharing one plan; ``None``: every merged block of the
            kind shares one.
        sublayers: where the plan is applied (default attention and MLP).
        kind_sublayers: ``((block_kind, sublayers), ...)`` overriding ``sublayers`` for those block kinds
            (the authors' Flux run merges only the attention of double-stream blocks: ``(("double", ("attn",)),)``).
        locality, num_tiles, tile_size, tile_frames, temperature, mask_selected, shared_destinations, unmerge_matrix,
        max_tile_tokens:
            :class:`~tomerge.strategies.facility_location.FacilityLocation` options.

    Example:
        >>> ToMA(num_tiles=256, skip_first=5, merge_every=3).facility.num_tiles
        256
    """

    name: ClassVar[str] = "toma"

    ratio: float = 0.5
    skip_first: int = 0
    merge_every: int = 1
    recompute_every: int = 1
    destinations_every: int | None = None
    group_size: int | None = None
    sublayers: tuple[str, ...] = ("attn", "mlp")
    kind_sublayers: tuple[tuple[str, tuple[str, ...]], ...] = ()
    locality: str = "tiles"
    num_tiles: int = 64
    tile_size: int | None = None
    tile_frames: int = 1
    temperature: float = 1e-3
    mask_selected: bool = True
    shared_destinations: bool = False
    unmerge_matrix: str = "transpose"
    max_tile_tokens: int = 4096

    _facility: FacilityLocation = dataclasses.field(init=False, repr=False, compare=False)
    _sublayers: frozenset[str] = dataclasses.field(init=False, repr=False, compare=False)
    _by_kind: dict[str, frozenset[str]] = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        what = "toma"
        check_ratio_option(self.ratio, what)
        check_int(self.skip_first, "skip_first", what, low=0)
        check_int(self.merge_every, "merge_every", what, low=1)
        check_int(self.recompute_every, "recompute_every", what, low=1)
        check_int(self.group_size, "group_size", what, low=1, optional=True)
        check_int(self.destinations_every, "destinations_every", what, low=1, optional=True)
        if self.destinations_every is not None and self.destinations_every % self.recompute_every != 0:
            raise ValueError(f"{what}: destinations_every ({self.destinations_every}) must be a multiple of "
                             f"recompute_every ({self.recompute_every}): new destinations need new matrices")
        set_ = object.__setattr__  # frozen: derived fields are built once, here
        set_(self, "sublayers", check_sublayers(self.sublayers, "sublayers", what))
        set_(self, "_sublayers", frozenset(self.sublayers))
        pairs = self.kind_sublayers.items() if isinstance(self.kind_sublayers, dict) else self.kind_sublayers
        if (isinstance(pairs, (str, bytes)) or not isinstance(pairs, Iterable)
                or not all(isinstance(p, (tuple, list)) and len(p) == 2 and isinstance(p[0], str) for p in pairs)):
            raise ValueError(f"{what}: kind_sublayers must be pairs (block_kind, sublayers), got "
                             f"{self.kind_sublayers!r}")
        by_kind = {kind: check_sublayers(names, f"kind_sublayers[{kind!r}]", what) for kind, names in pairs}
        set_(self, "kind_sublayers", tuple(sorted(by_kind.items())))
        set_(self, "_by_kind", {kind: frozenset(names) for kind, names in by_kind.items()})
        set_(self, "_facility", FacilityLocation(  # validates the forwarded options ("facility_location: ...")
            locality=self.locality, num_tiles=self.num_tiles, tile_size=self.tile_size, tile_frames=self.tile_frames,
            temperature=self.temperature, mask_selected=self.mask_selected,
            shared_destinations=self.shared_destinations, unmerge_matrix=self.unmerge_matrix,
            max_tile_tokens=self.max_tile_tokens))

    @property
    def facility(self) -> FacilityLocation:
        """The facility-location strategy (built once)."""
        return self._facility

    def group(self, where: Where) -> int:
        """The plan-sharing group of a merged block call: ``(i - skip_first) // group_size``, or 0 when
        ``group_size`` is ``None``."""
        return 0 if self.group_size is None else (kind_position(where) - self.skip_first) // self.group_size

    def cache_key(self, where: Where) -> tuple[Hashable, int]:
        """``(("toma", kind, group), step // recompute_every)`` (scope, window) for a merged block call.

        Args:
            where: a block call that merges (its block is not among the first ``skip_first``).

        Returns:
            The key the plan of this call is cached under.
        """
        return ("toma", where.block_kind, self.group(where)), where.step // self.recompute_every

    def destinations_key(self, where: Where) -> tuple[Hashable, int] | None:
        """``(("toma", kind, group, "destinations"), step // destinations_every)``, or ``None`` when destinations
        are recomputed with the matrices."""
        if self.destinations_every is None:
            return None
        return ("toma", where.block_kind, self.group(where), "destinations"), where.step // self.destinations_every

    # ------------------------------------------------------------------ Schedule
    def decide(self, where: Where) -> Decision:
        """The decision for one block call.

        Args:
            where: the block call's step, layer and block kind.

        Returns:
            ``"skip_block"`` / ``"skip_step"``: unmerged; ``"merge"``: facility location at ``ratio``
            on ``sublayers`` with the cache key of :meth:`cache_key`.
        """
        if kind_position(where) < self.skip_first:
            return Decision(strategy=None, label=SKIP_BLOCK)
        if where.step % self.merge_every != 0:
            return Decision(strategy=None, label=SKIP_STEP)
        sublayers = self._by_kind.get(where.block_kind, self._sublayers)
        return Decision(self._facility, self.ratio, sublayers, cache_key=self.cache_key(where),
                        destinations_key=self.destinations_key(where), label=MERGE)

    def strategies(self) -> tuple[MergeStrategy, ...]:
        return (self._facility,)

    def to_dict(self) -> dict[str, Any]:
        """The schedule's name and options (flat; the built strategy is derived, not logged)."""
        return {k: v for k, v in super().to_dict().items() if not k.startswith("_")}


# ---------------------------------------------------------------------- presets
@dataclasses.dataclass(frozen=True, kw_only=True)
class ToMARelease(ToMA):
    """``toma_release``: ToMA as the authors' ``run_flux.py`` runs it on Flux; its settings: docs/schedules.md,
    "Presets"."""

    name: ClassVar[str] = "toma_release"

    skip_first: int = 5
    merge_every: int = 3
    group_size: int | None = None
    num_tiles: int = 256
    mask_selected: bool = False
    shared_destinations: bool = True
    kind_sublayers: tuple[tuple[str, tuple[str, ...]], ...] = (("double", ("attn",)),)
