"""What a technique (a cache, merge streaks, received attention) plugs into the core with: its own state and options.

The core (:mod:`tomerge.state`, :mod:`tomerge.attach`) keeps the block-call protocol, the step clock, the plans and
the hooks; every technique keeps its own :class:`TechniqueState` in its own module (the block cache in
:mod:`tomerge.block_cache`, the feature cache in :mod:`tomerge.feature_cache`, merge streaks in
:mod:`tomerge.streaks`, received attention in :mod:`tomerge.probe`), and a schedule asks for it with the
technique's :class:`TechniqueOptions` in a :class:`~tomerge.schedule.Decision`. This module imports nothing of
tomerge, so the techniques and the core can both import it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, ClassVar

from torch import Tensor

if TYPE_CHECKING:
    from .state import BlockCall, MergeState

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


class TechniqueOptions:
    """A technique's part of a :class:`~tomerge.schedule.Decision` (a frozen dataclass in the technique's module);
    ``State`` is the state it needs, which the core creates for the first decision carrying it."""

    State: ClassVar[type[TechniqueState]]
