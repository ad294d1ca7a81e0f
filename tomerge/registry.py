"""Registries of strategies (and schedules) and backbone adapters.

Built-ins register through the entry-point groups ``tomerge.strategies`` and ``tomerge.backbones``
declared in ``setup.cfg``, exactly as a third-party package would (loaded lazily, on first use); classes
defined in a script or notebook register with the decorators. A name belongs to one class; the same
registration arriving twice is harmless. The rules: docs/writing-a-strategy.md, "Use it in experiments without
packaging".
"""

from __future__ import annotations

import dataclasses
import sys
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from collections.abc import Iterable
from typing import Any, Callable, TypeVar

T = TypeVar("T", bound=type)


class _Registry:
    """Name -> class, fed by an entry-point group and by decorators."""

    def __init__(self, group: str, what: str) -> None:
        self.group, self.what = group, what
        self._classes: dict[str, type] = {}
        self._entry_points: dict[str, EntryPoint] | None = None
        self._unverified: dict[str, EntryPoint] = {}  # decorated while their entry point's module was mid-import

    def _eps(self) -> dict[str, EntryPoint]:
        if self._entry_points is None:
            self._entry_points = {ep.name: ep for ep in entry_points(group=self.group)}
        return self._entry_points

    def names(self) -> list[str]:
        return sorted(set(self._eps()) | set(self._classes))

    def add(self, name: str, cls: type) -> None:
        known = self._classes.get(name)
        if known is None and name in self._eps():
            known = self._entry_point_target(self._eps()[name], cls)
            if known is None:  # its module is mid-import: compare when it is first looked up
                self._unverified[name] = self._eps()[name]
        if known is not None and not same_definition(known, cls):
            raise ValueError(self._clash(name, known, cls))
        cls.name = name
        self._classes[name] = cls

    def get(self, name: str) -> type:
        if name in self._unverified:
            self._verify(name)
        if name in self._classes:
            return self._classes[name]
        ep = self._eps().get(name)
        if ep is None:
            raise KeyError(f"unknown {self.what} {name!r}; registered: {', '.join(self.names())}")
        try:
            cls = ep.load()
        except Exception as err:  # a broken plugin must say which one it is
            raise ImportError(f"could not load {self.what} {name!r} from entry point {ep.value}: {err}") from err
        registered = self._classes.get(name)  # its module's decorator may have registered it meanwhile
        self._unverified.pop(name, None)
        if registered is not None and not same_definition(registered, cls):
            raise ValueError(self._clash(name, cls, registered))
        if getattr(cls, "name", name) not in ("", name):
            raise ValueError(f"entry point {name!r} loads {cls.__qualname__} named {cls.name!r}")
        cls.name = name
        self._classes[name] = cls
        return cls

    def _entry_point_target(self, ep: EntryPoint, cls: type) -> type | None:
        """The class ``ep`` names, without importing a module that is being imported (None: unknown yet)."""
        if ep.attr is not None and (ep.module, ep.attr) == (cls.__module__, cls.__qualname__):
            return cls  # the decorator of the entry point's own class
        module = sys.modules.get(ep.module)
        if module is not None:
            target: Any = module
            for part in ep.attr.split(".") if ep.attr else ():
                target = getattr(target, part, None)
            return target if isinstance(target, type) else None
        try:
            return ep.load()
        except Exception:  # e.g. it imports the module being imported now; checked at first lookup
            return None

    def _verify(self, name: str) -> None:
        try:
            target = self._unverified[name].load()
        except Exception:  # still mid-import (or broken): the registered class stands for now
            return
        del self._unverified[name]
        if not same_definition(target, self._classes[name]):
            raise ValueError(self._clash(name, target, self._classes[name]))

    def _clash(self, name: str, known: type, cls: type) -> str:
        by, origin = "", ""
        ep = self._eps().get(name)
        if ep is not None:
            dist = getattr(ep, "dist", None)
            package = dist.name if dist is not None else None
            if package == "tomerge":
                by = "the built-in "
            else:
                origin = f" (entry point {ep.value}{f' of package {package}' if package else ''})"
        return (f"a {self.what} named {name!r} is already registered by {by}{describe(known)}{origin}; "
                f"cannot register {describe(cls)} under the same name: choose another name")


def _source(cls: type) -> str | None:
    file = getattr(sys.modules.get(cls.__module__), "__file__", None)
    try:
        return str(Path(file).resolve()) if file else None
    except (OSError, RuntimeError):
        return None


def same_definition(a: type, b: type) -> bool:
    """Whether ``a`` and ``b`` are one registration: the same class, or the same class statement run
    again (same qualified name, and the same module or the same source file)."""
    if a is b:
        return True
    if a.__qualname__ != b.__qualname__:
        return False
    return a.__module__ == b.__module__ or (_source(a) is not None and _source(a) == _source(b))


def describe(cls: type) -> str:
    """``module.QualName`` of a class, with its source file for a plugin loaded from a file."""
    text = f"{cls.__module__}.{cls.__qualname__}"
    file = _source(cls)
    if file is not None and cls.__module__.startswith("tomerge_plugin_"):
        text += f" from {file}"
    return text


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


def build(cls: type, options: dict[str, Any], what: str, also_valid: Iterable[str] = ()) -> Any:
    """``cls(**options)`` for a dataclass, with an error naming unknown options and the valid ones (``also_valid``:
    names the caller takes itself, listed with them, e.g. ``apply()``'s own options); a close valid name is
    suggested (``(did you mean 'use_rand'?)``)."""
    fields = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(options) - fields)
    if unknown:
        valid = sorted(fields | set(also_valid))
        hint = _did_you_mean(unknown, valid)
        raise TypeError(f"unknown option(s) {unknown} for {what}{hint}; valid options: {valid}")
    return cls(**options)


def _did_you_mean(unknown: list[str], valid: list[str]) -> str:
    """`` (did you mean 'a'?)`` (one unknown name) or `` (did you mean 'a' for 'x', 'b' for 'y'?)``; ``""``
    when no valid name is close."""
    import difflib

    close = {u: m[0] for u in unknown if (m := difflib.get_close_matches(str(u), valid, n=1))}
    if not close:
        return ""
    if len(unknown) == 1:
        return f" (did you mean {next(iter(close.values()))!r}?)"
    return f" (did you mean {', '.join(f'{m!r} for {u!r}' for u, m in close.items())}?)"
