"""Registries of strategies (and schedules) and backbone adapters.

Built-ins register through the entry-point groups ``tomerge.strategies`` and ``tomerge.backbones``
declared in ``setup.cfg``, exactly as a third-party package would; entry points are loaded lazily,
on first use. Classes defined in a script or notebook register with the decorators.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Callable, TypeVar

T = TypeVar("T", bound=type)


class _Registry:
    """Name -> class, fed by an entry-point group and by decorators."""

    def __init__(self, group: str, what: str) -> None:
        self.group, self.what = group, what
        self._classes: dict[str, type] = {}
        self._entry_points: dict[str, EntryPoint] | None = None

    def _eps(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in entry_points(group=self.group)}
        return self._entry_points

    def names(self) -> list[str]:
        return sorted(set(self._eps()) | set(self._classes))

    def add(self, name: str, cls: type) -> None:
        known = self._classes.get(name)
        if known is None and name in self._eps():
            known = self.get(name)
        if known is not None and known is not cls:
            raise ValueError(
                f"a {self.what} named {name!r} is already registered ({known.__module__}.{known.__qualname__}); "
                "choose another name"
            )
        cls.name = name
        self._classes[name] = cls

    def get(self, name: str) -> type:
        if name in self._classes:
            return self._classes[name]
        ep = self._eps().get(name)
        if ep is None:
            raise KeyError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}")
        try:
            cls = ep.load()
        except Exception as err:  # a broken plugin must say which one it is
            raise ImportError(f"could not load {self.what} {name!r} from entry point {ep.value}: {err}") from err
        if getattr(cls, "name", name) not in ("", name):
            raise ValueError(f"entry point {name!r} loads {cls.__qualname__} named {cls.name!r}")
        cls.name = name
        self._classes[name] = cls
        return cls


_strategies = _Registry("tomerge.strategies", "strategy")
_backbones = _Registry("tomerge.backbones", "backbone")


def register_strategy(name: str) -> Callable[[T], T]:
    """Class decorator registering a :class:`MergeStrategy` or :class:`Schedule` under ``name``.

    Example:
        >>> import tomerge
        >>> @tomerge.register_strategy("my_strategy")
        ... class Mine(tomerge.MergeStrategy): ...
    """
    def decorate(cls: T) -> T:
        _strategies.add(name, cls)
        return cls

    return decorate


def register_backbone(name: str) -> Callable[[T], T]:
    """Class decorator registering a :class:`~tomerge.adapter.BackboneAdapter` under ``name``."""
    def decorate(cls: T) -> T:
        _backbones.add(name, cls)
        return cls

    return decorate


def list_strategies() -> list[str]:
    """Names of every registered strategy and schedule, sorted."""
    return _strategies.names()


def list_backbones() -> list[str]:
    """Names of every registered backbone adapter, sorted."""
    return _backbones.names()


def strategy_class(name: str) -> type:
    """The class registered as ``name`` (a strategy or a schedule); raises listing valid names."""
    return _strategies.get(name)


def backbone_class(name: str) -> type:
    """The adapter class registered as ``name``; raises listing valid names."""
    return _backbones.get(name)


def get_strategy(name: str, **options: Any) -> Any:
    """An instance of the strategy or schedule registered as ``name``, built with ``options``.

    Example:
        >>> import tomerge
        >>> tomerge.get_strategy("ssm", window=2).window
        2
    """
    cls = strategy_class(name)
    return build(cls, options, what=f"strategy {name!r}")


def build(cls: type, options: dict[str, Any], what: str) -> Any:
    """``cls(**options)`` for a dataclass, with an error naming unknown options and the valid ones."""
    valid = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(options) - valid)
    if unknown:
        raise TypeError(f"unknown option(s) {unknown} for {what}; valid options: {sorted(valid)}")
    return cls(**options)
