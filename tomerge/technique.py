"""What a technique (a cache, merge streaks, received attention) plugs into the core with: its own state and options.

The core (:mod:`tomerge.state`, :mod:`tomerge.attach`) keeps the block-call protocol, the step clock, the plans and
the hooks; every technique keeps its own :class:`TechniqueState` in its own module (the block cache in
:mod:`tomerge.block_cache`, the feature cache in :mod:`tomerge.feature_cache`, merge streaks in
:mod:`tomerge.streaks`, received attention in :mod:`tomerge.probe`), and a schedule asks for it with the
technique's :class:`TechniqueOptions` in a :class:`~tomerge.schedule.Decision`. This module imports nothing of
tomerge, so the techniques and the core can both import it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar

from torch import Tensor

if TYPE_CHECKING:
    from .adapter import BlockSpec, MergePoint
    from .plan import MergePlan
    from .schedule import Decision, Schedule
    from .state import BlockCall, MergeState

TECHNIQUES: list[type[TechniqueState]] = []
"""Every technique state class, in definition order: the hooks of :mod:`tomerge.attach` ask each whether a schedule
needs it to wrap forwards (:meth:`TechniqueState.wraps_blocks`, :meth:`TechniqueState.wrapped_sublayers`)."""

Streams = tuple[Tensor | None, ...]
"""The token streams of one block call in the order of the block's output (``BlockSpec.streams``): the image
tokens, and e.g. the text tokens of a joint block; ``None`` where the block returns no tensor."""


class TechniqueState:
    """What one technique keeps across the calls of one application, and its hooks in the block-call protocol.

    :meth:`MergeState.technique <tomerge.state.MergeState.technique>` holds one instance per class, created
    (:meth:`create`) at first use; from then on the state's hooks run eagerly around every block call, outside
    compiled graphs. What a call's merge points need from it goes into ``call.scratch[type(self)]`` (the hooks
    inside compiled graphs read only the block call). Tensors kept across calls are copied with
    ``state.keep(...)`` in :meth:`end_block` (never a tensor a compiled block returned: CUDA graphs overwrite it).

    A subclass documents its memory bound in its docstring (e.g. "one residual per block and call index").
    """

    kind: ClassVar[str] = ""  #: what keeps its tensors, in :meth:`MergeState.kept_bytes` (the growing kind)

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        TECHNIQUES.append(cls)

    @classmethod
    def create(cls, state: MergeState) -> TechniqueState:
        """The state of one application (``state``: to read e.g. its schedule once)."""
        return cls()

    def reset(self) -> None:
        """Forgets what was kept for the trajectory (a new one starts: a noisier timestep)."""

    def kept_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """Every tensor kept across model calls, with the kind that keeps it."""
        return iter(())

    def capacity(self) -> tuple[int, str] | None:
        """What the kept tensors of :attr:`kind` grow to: their bytes once full, and a note saying what grows
        (``""``: nothing to say); ``None``: they do not grow beyond what is kept now."""
        return None

    def begin_block(self, call: BlockCall, state: MergeState) -> None:
        """Prepares a block call (after the schedule decided it, before its plan and context)."""

    def end_block(self, call: BlockCall, state: MergeState) -> None:
        """Commits what the block call produced (copied with ``state.keep``)."""

    # The hook points in the model's forwards (tomerge.attach). They run inside compiled graphs, so they read only
    # the block call and tensors. The point hooks run for the techniques with per-call data (``call.scratch``).
    @classmethod
    def wraps_blocks(cls, schedule: Schedule) -> bool:
        """Whether the hooks wrap every block's ``forward`` with :meth:`block_forward` for ``schedule`` (a
        technique that skips whole block calls)."""
        return False

    @classmethod
    def block_forward(cls, call: BlockCall, block: BlockSpec, forward: Callable[..., Any], args: tuple,
                      kwargs: dict) -> Any:
        """Runs the block call (``forward(*args, **kwargs)``) or returns what replaces it."""
        return forward(*args, **kwargs)

    @classmethod
    def wrapped_sublayers(cls, schedule: Schedule) -> frozenset[str]:
        """The sublayers whose merge points' ``forward`` the hooks wrap with :meth:`point_forward` for ``schedule``
        (a technique that skips sublayers)."""
        return frozenset()

    @classmethod
    def point_forward(cls, call: BlockCall, point: MergePoint, index: int, forward: Callable[..., Any],
                      args: tuple, kwargs: dict) -> Any:
        """Runs merge point ``index``'s module or returns what replaces its output."""
        return forward(*args, **kwargs)

    @classmethod
    def point_input(cls, call: BlockCall, point: MergePoint, index: int, args: tuple, kwargs: dict) -> None:
        """Sees merge point ``index``'s input before it is merged."""

    @classmethod
    def point_ran(cls, call: BlockCall, point: MergePoint, index: int, output: Any) -> None:
        """Sees the module output of a merge point that ran at full length."""

    @classmethod
    def point_unmerged(cls, call: BlockCall, point: MergePoint, index: int, output: Tensor, plan: MergePlan) -> Tensor:
        """The unmerged output ``[B, N, C']`` of a merging point, changed as the technique says (default: as is)."""
        return output


class TechniqueOptions:
    """A technique's part of a :class:`~tomerge.schedule.Decision` (a frozen dataclass in the technique's module,
    one per class in ``Decision.techniques``); ``State`` is the state it needs, which the core creates for the first
    decision carrying it."""

    State: ClassVar[type[TechniqueState]]

    @property
    def skips(self) -> frozenset[str]:
        """The sublayers that do not run in a call with these options (their output comes from the technique)."""
        return frozenset()

    def check(self, decision: Decision) -> None:
        """Raises ``ValueError`` when ``decision`` cannot carry these options."""
