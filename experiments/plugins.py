"""Plugins without packaging: import a module or a ``.py`` file before a command runs, so the
strategies and backbones it registers (``@tomerge.register_strategy``, ``@tomerge.register_backbone``)
can be named in a grid, on the command line or in a figure.

    tomerge ablate --plugin my_strategy.py --set "grid=[{strategy: my_strategy, ratios: [0.5]}]"
    tomerge generate --plugin my_pkg.strategies --strategy mine ...

A spec is a ``.py`` file or a module name; loading is idempotent, and every failure is a :class:`PluginError`
naming the plugin. The rules: docs/writing-a-strategy.md, "Use it in experiments without packaging".
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import re
import sys
import traceback
import types
from collections.abc import Sequence
from pathlib import Path

from .errors import PluginError

__all__ = ["PluginError", "load_plugins", "load_plugin", "loaded_plugins", "resolve_specs", "is_path_spec",
           "module_name_for"]

_LOADED: dict[str, types.ModuleType] = {}  # resolved file path or module name -> module, in load order


def is_path_spec(spec: str) -> bool:
    """Whether ``spec`` names a file (contains ``/`` or the OS separator, or ends in ``.py``)."""
    return "/" in spec or os.sep in spec or spec.endswith(".py")


def module_name_for(path: Path) -> str:
    """The stable module name of a plugin file: ``tomerge_plugin_<stem>_<hash of the resolved path>``."""
    path = Path(path).resolve()
    stem = re.sub(r"\W", "_", path.stem)
    return f"tomerge_plugin_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"


def load_plugins(specs: Sequence[str] | str, base_dir: Path | str | None = None) -> list[types.ModuleType]:
    """Imports every plugin of ``specs`` in order (a single string is one spec); returns their modules.

    Relative file paths are looked up in ``base_dir`` first (a config's folder), then in the
    current directory. Raises :class:`PluginError` at the first plugin that fails.
    """
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    return [load_plugin(spec, base_dir) for spec in specs]


def load_plugin(spec: str, base_dir: Path | str | None = None) -> types.ModuleType:
    """Imports one plugin (a module name or a ``.py`` path); see :func:`load_plugins`."""
    if isinstance(spec, os.PathLike):
        spec = os.fspath(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise PluginError(f"a plugin must be a module name or a path to a .py file, got {spec!r}", str(spec))
    spec = spec.strip()
    if is_path_spec(spec):
        return _load_file(spec, base_dir)
    return _load_module(spec)


def loaded_plugins() -> list[str]:
    """What this process has loaded, as absolute specs (resolved paths, module names), in load order:
    pass it to :func:`load_plugins` in a worker process to register the same classes there."""
    return list(_LOADED)


def resolve_specs(specs: Sequence[str] | str, base_dir: Path | str | None = None) -> list[str]:
    """``specs`` with every file path made absolute as :func:`load_plugins` would find it (module names
    unchanged), without importing anything: what to hand to a process with another working directory
    (e.g. a config's relative plugin paths for worker processes). Raises :class:`PluginError` for a
    missing file."""
    if isinstance(specs, (str, os.PathLike)):
        specs = [specs]
    out = []
    for spec in specs:
        spec = os.fspath(spec) if isinstance(spec, os.PathLike) else spec
        out.append(str(_resolve(spec.strip(), base_dir)) if isinstance(spec, str) and is_path_spec(spec.strip())
                   else spec)
    return out


def _resolve(spec: str, base_dir: Path | str | None) -> Path:
    path = Path(spec).expanduser()
    if path.is_absolute():
        candidates = [path]
    else:
        candidates = [Path(base_dir) / path] if base_dir is not None else []
        candidates.append(Path.cwd() / path)
    for candidate in candidates:
        if candidate.is_file():
            return candidate.resolve()
    for candidate in candidates:
        if candidate.is_dir():
            raise PluginError(f"plugin {spec!r} is a folder, not a .py file (for a package, put its parent "
                              "folder on PYTHONPATH and give its module name)", spec)
    looked = " or ".join(str(c) for c in dict.fromkeys(candidates))
    raise PluginError(f"plugin file {spec!r} not found (looked for {looked})", spec)


def _already_imported(path: Path) -> types.ModuleType | None:
    """A module already in ``sys.modules`` whose source is ``path`` (e.g. ``import my_strategy``)."""
    target = str(path)
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and os.path.basename(file) == path.name and os.path.realpath(file) == target:
            return module
    return None


def _load_file(spec: str, base_dir: Path | str | None) -> types.ModuleType:
    path = _resolve(spec, base_dir)
    key = str(path)
    if key in _LOADED:
        return _LOADED[key]
    name = module_name_for(path)
    module = sys.modules.get(name) or _already_imported(path)
    if module is None:
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise PluginError(f"plugin {spec!r} ({path}) is not a Python source file (.py)", spec)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # before running it: dataclasses and pickle look classes up here
        try:
            module_spec.loader.exec_module(module)
        except Exception as err:
            sys.modules.pop(name, None)
            raise PluginError(_failure(spec, err, path), spec) from err
    _LOADED[key] = module
    return module


def _load_module(spec: str) -> types.ModuleType:
    if spec in _LOADED:
        return _LOADED[spec]
    if not all(part.isidentifier() for part in spec.split(".")):
        raise PluginError(f"plugin {spec!r} is neither a module name nor a path to a .py file", spec)
    try:
        module = importlib.import_module(spec)
    except ModuleNotFoundError as err:
        if err.name and (spec == err.name or spec.startswith(err.name + ".")):
            raise PluginError(f"plugin module {spec!r} not found (no module named {err.name!r}): give an "
                              "importable module name (installed, or its folder on PYTHONPATH) or a path to a "
                              ".py file", spec) from err
        raise PluginError(_failure(spec, err, None), spec) from err
    except Exception as err:
        raise PluginError(_failure(spec, err, None), spec) from err
    _LOADED[spec] = module
    return module


def _failure(spec: str, err: BaseException, path: Path | None) -> str:
    """``plugin 'x' failed to import (at FILE:LINE): Type: message`` with the plugin's own line."""
    where = ""
    if not isinstance(err, SyntaxError):  # a SyntaxError's message already says file and line
        frames = [f for f in traceback.extract_tb(err.__traceback__)
                  if not f.filename.startswith("<") and Path(f.filename).resolve() != Path(__file__).resolve()
                  and "importlib" not in Path(f.filename).parts]
        if path is not None:
            frames = [f for f in frames if Path(f.filename).resolve() == path]
            frame = frames[-1] if frames else None  # the plugin's line that raised
        else:
            frame = frames[0] if frames else None  # the module's top-level statement that raised
        if frame is not None:
            where = f" (at {frame.filename}:{frame.lineno})"
    hint = ""
    if isinstance(err, ModuleNotFoundError) and path is not None and err.name:
        top = err.name.split(".")[0]
        if (path.parent / f"{top}.py").is_file() or (path.parent / top).is_dir():
            hint = (f"; {top!r} is next to the plugin, but a plugin file's folder is not put on sys.path: "
                    f"add {path.parent} to PYTHONPATH")
    return f"plugin {spec!r} failed to import{where}: {type(err).__name__}: {err}{hint}"
