"""Backbone adapters: where, in one model family, merging happens.

An adapter lists the model's blocks (:class:`BlockSpec`) and, in each, the merge points
(:class:`MergePoint`): submodules whose image-token input is merged by a forward pre-hook and whose
output is unmerged by a forward hook, before the block's gated residual. The hook logic itself lives
in :mod:`tomerge.attach`; an adapter only answers questions about its model.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import inspect
from collections.abc import Callable
from typing import Any, ClassVar

from torch import Tensor, nn

from .context import Grid
from .plan import MergePlan
from .state import MergeState


def class_names(module: nn.Module) -> set[str]:
    """Names of the module's class and its bases (matching by name needs no import of the library)."""
    return {cls.__name__ for cls in type(module).__mro__}


@dataclasses.dataclass(frozen=True, eq=False)
class MergePoint:
    """A submodule whose image-token input is merged and whose output is unmerged.

    Args:
        sublayer: ``"attn"``, ``"crossattn"`` or ``"mlp"`` (the sublayer a :class:`Decision` names).
        module: the submodule.
        arg: keyword of the image tokens in the submodule's call (also found as first positional).
        output: index of the image tokens in a tuple output, or ``None`` for a tensor output.
    """

    sublayer: str
    module: nn.Module
    arg: str = "hidden_states"
    output: int | None = None

    def get_input(self, args: tuple, kwargs: dict) -> Tensor:
        return kwargs[self.arg] if self.arg in kwargs else args[0]

    def set_input(self, args: tuple, kwargs: dict, x: Tensor) -> tuple[tuple, dict]:
        if self.arg in kwargs:
            return args, {**kwargs, self.arg: x}
        return (x, *args[1:]), kwargs

    def get_output(self, out: Any) -> Tensor:
        """The image tokens of the submodule's output (merged ``[B, M, C']`` or full length ``[B, N, C']``)."""
        return out if self.output is None else out[self.output]

    def reads_tokens(self, args: tuple, kwargs: dict) -> bool:
        """Whether this call of the submodule reads the block's image tokens (default: every call does). A
        submodule that the block also calls on other tokens (EasyAnimate's shared ``ff`` runs on the text stream
        too) answers ``False`` for those calls: they run as they are, neither merged nor cached."""
        return True

    def merge_input(self, args: tuple, kwargs: dict, x: Tensor, plan: MergePlan) -> tuple[tuple, dict]:
        """The call's arguments with the image tokens ``x`` replaced by ``plan.merge(x)``; override to
        adjust other arguments that follow the tokens (e.g. gather rotary tables with ``plan.dst``)."""
        return self.set_input(args, kwargs, plan.merge(x))

    def keeps_merged(self, sublayers: frozenset[str]) -> bool:
        """Whether this point leaves its output merged because a later point of the same block, merged in
        the same block call (its decision merges ``sublayers``), consumes it and unmerges (the default:
        no, every point unmerges its own output). The later point then receives merged tokens."""
        return False

    def enter_block(self, merges: bool) -> None:
        """Called before every call of this point's block; ``merges``: the call's decision merges this
        point's sublayer. Override to adjust the block for a merged call (e.g. suspend feed-forward
        chunking, which would hand this point chunks instead of the whole sequence); the default does
        nothing."""

    def exit_block(self) -> None:
        """Called after every call of this point's block (also when it raised): undo what
        :meth:`enter_block` changed."""

    def set_output(self, out: Any, y: Tensor) -> Any:
        if self.output is None:
            return y
        items = list(out)
        items[self.output] = y
        return type(out)(items)


@dataclasses.dataclass(frozen=True, eq=False)
class BlockSpec:
    """One block: its module, position, block kind (the adapter's name for its type) and merge points.

    ``outputs`` describes the block's return value for the block cache (caching schedules keep output minus
    input and may skip a block call, returning its input plus that residual): ``None``, one tensor, the new
    value of the token input ``arg``; else a tuple whose ``i``-th element is the new value of the block's
    argument named ``outputs[i]`` (SD3/Flux joint blocks: ``("encoder_hidden_states", "hidden_states")``), or
    ``None`` there where the block may return ``None``.
    """

    module: nn.Module
    layer: int
    kind: str
    points: tuple[MergePoint, ...]
    arg: str = "hidden_states"  # keyword of the block's image-token input (else first positional)
    outputs: tuple[str, ...] | None = None

    def block_input(self, args: tuple, kwargs: dict) -> Tensor:
        return kwargs[self.arg] if self.arg in kwargs else args[0]

    # ------------------------------------------------------------------ the block cache
    @property
    def image_stream(self) -> int:
        """The index of the image tokens in :meth:`streams`."""
        return 0 if self.outputs is None else self.outputs.index(self.arg)

    def streams(self, args: tuple, kwargs: dict) -> tuple[Tensor | None, ...]:
        """The arguments of a block call that its output replaces, in the order of the output (``outputs``)."""
        names = (self.arg,) if self.outputs is None else self.outputs
        return tuple(self._argument(args, kwargs, name) for name in names)

    def output_streams(self, output: Any) -> tuple[Tensor | None, ...]:
        """The tensors of a block call's return value, in the order of :meth:`streams`.

        Raises:
            TypeError: the return value is not what ``outputs`` declares (e.g. a tuple from a block declared as
                returning one tensor): the adapter must declare ``outputs`` for the block cache to run.
        """
        if self.outputs is None and isinstance(output, Tensor):
            return (output,)
        if self.outputs is not None and isinstance(output, tuple) and len(output) == len(self.outputs):
            return tuple(output)
        declared = "one tensor" if self.outputs is None else f"a tuple {self.outputs}"
        raise TypeError(
            f"tomerge: the {self.kind!r} block ({type(self.module).__name__}) returned "
            f"{type(output).__name__}{'' if not isinstance(output, tuple) else f' of {len(output)}'}, where its "
            f"adapter declares {declared}; the block cache cannot run on it (declare BlockSpec.outputs, "
            "docs/backbones/adding-a-family.md)")

    def output_of(self, streams: tuple[Tensor | None, ...]) -> Any:
        """The return value of a block call with these tensors (the inverse of :meth:`output_streams`)."""
        return streams[0] if self.outputs is None else tuple(streams)

    def _argument(self, args: tuple, kwargs: dict, name: str) -> Tensor | None:
        if name in kwargs:
            return kwargs[name]
        position = self._positions.get(name)
        if position is None:
            raise TypeError(f"tomerge: the {self.kind!r} block ({type(self.module).__name__}) has no argument {name!r} "
                            "in its forward signature; the block cache needs it passed by keyword")
        return args[position] if position < len(args) else None

    @functools.cached_property
    def _positions(self) -> dict[str, int]:
        """Argument name -> position in the block's ``forward`` (read once, before any hook wraps it)."""
        parameters = inspect.signature(type(self.module).forward).parameters
        return {name: i - 1 for i, name in enumerate(parameters) if i > 0}


@dataclasses.dataclass(frozen=True, eq=False)
class TextKeys:
    """Where the text tokens are in a joint (text + image) attention module, for prompt reweighting.

    Args:
        module: the attention module whose ``scaled_dot_product_attention`` call gets the text-key bias.
        text_len: ``(args, kwargs) -> T``: the text length of one call of ``module``.
        text_first: the joint sequence is ``[text, image]`` (Flux) rather than ``[image, text]`` (SD3).
    """

    module: nn.Module
    text_len: Callable[[tuple, dict], int]
    text_first: bool


@dataclasses.dataclass(frozen=True)
class KindSummary:
    """What an adapter merges in one block kind, as ``tomerge backbones`` lists it (no model is built).

    Args:
        kind: the block kind (``BlockSpec.kind``).
        sublayers: the sublayers of its merge points, in block order, each once (``"attn"``, ``"crossattn"``,
            ``"mlp"``).
        context: how the text (or other context) tokens meet the image tokens in these blocks, e.g. ``"joint
            attention, text first"``, ``"cross-attention"``.
        rope: the layout of the rotary table gathered for merged tokens (``Rope.layout`` of declared
            adapters); ``None``: the blocks get no rotary table.
    """

    kind: str
    sublayers: tuple[str, ...]
    context: str
    rope: str | None = None


@dataclasses.dataclass(frozen=True)
class NoOptions:
    """Adapters without options use this."""


class BackboneAdapter(abc.ABC):
    """Teaches tomerge one model family (see the module docstring).

    Class attributes:
        name: registry name.
        model_class: class name of the diffusers model it patches (``""``: not a diffusers model class); the
            key of ``tomerge backbones``' coverage table.
        block_names: class names of the blocks it looks for (named in the error when none match).
        Options: frozen dataclass of the adapter's options (accepted by :func:`tomerge.apply`).
        t_max: largest timestep value the model is called with (for progress without a step count).
        grid_dims: 2 for an ``(H, W)`` image token grid, 3 for a ``(T, H, W)`` video grid (what :meth:`grid`
            returns).
    """

    name: ClassVar[str] = ""
    model_class: ClassVar[str] = ""
    block_names: ClassVar[tuple[str, ...]] = ()
    Options: ClassVar[type] = NoOptions
    t_max: ClassVar[float] = 1000.0
    grid_dims: ClassVar[int] = 2

    def __init__(self, model: nn.Module, options: Any) -> None:
        self.model = model
        self.options = options

    @classmethod
    @abc.abstractmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        """The module this adapter patches inside ``obj`` (a model or a pipeline), or ``None``."""

    @abc.abstractmethod
    def blocks(self) -> list[BlockSpec]:
        """The blocks to hook, in execution order."""

    @abc.abstractmethod
    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        """Called before every model forward: record sizes; return the call's timestep."""

    @abc.abstractmethod
    def grid(self, block: BlockSpec, num_tokens: int) -> Grid | None:
        """The ``(H, W)`` (image) or ``(T, H, W)`` (video) token grid of ``block`` for ``num_tokens`` tokens;
        ``None``: do not merge it."""

    def scheduler_timesteps(self, timesteps: Tensor) -> Tensor | None:
        """A pipeline scheduler's ``timesteps`` (diffusers' ``[0, 1000]`` scale) in the units of the timesteps
        :meth:`on_model_call` returns, so that the trajectory clock finds the step of a call in the schedule.
        Default: scaled by ``t_max / 1000`` (pipelines of models called with ``t`` in ``[0, t_max]`` pass
        ``timestep * t_max / 1000``; Flux: ``t_max = 1``). ``None``: the calls' timesteps are not the
        scheduler's, the clock counts the steps in call order."""
        return timesteps if self.t_max == 1000.0 else timesteps.float() * (self.t_max / 1000.0)

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        """Installs hooks recording the attention each image token receives in ``point`` (an
        ``"attn"`` point) into ``state.call.attention``; returns the hook handles. Adapters whose
        attention cannot be probed raise."""
        raise NotImplementedError(f"backbone {self.name!r} cannot record received attention")

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        """The block kinds in whose ``"attn"`` points :meth:`probe` records received attention (strategies that
        need it run when every kind of :meth:`kind_summaries` is one); the default: none."""
        return frozenset()

    @classmethod
    def uncached_kinds(cls) -> dict[str, str]:
        """Block kind -> why the block cache (caching schedules that skip whole block calls,
        :attr:`~tomerge.schedule.Schedule.caches_blocks`) cannot run on its blocks: their output is not the new value
        of their inputs, so no residual is defined (e.g. Wan VACE's control blocks return a new hint). Read by
        :func:`tomerge.attach.block_cache_refusal`; the default: none."""
        return {}

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        """What it merges in each block kind, in execution order, for ``tomerge backbones`` (read from the
        class, no model built); the default ``()``: not declared."""
        return ()

    def text_keys(self, block: BlockSpec, point: MergePoint) -> TextKeys | None:
        """The joint text-image attention of ``point`` (prompt reweighting), or ``None``: no text keys there."""
        return None

    def check(self) -> None:
        """Raises when the model is in a configuration the adapter cannot merge correctly."""
