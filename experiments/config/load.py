"""Loading a config: a YAML file with ``--set KEY=VALUE`` overrides (dotted keys into mappings, YAML values),
its plugins loaded, its keys checked (an unknown key is told the closest valid one) and its values validated,
every problem reported at once (:func:`load_config`, :func:`load_config_sections`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

from ..errors import ConfigError, did_you_mean
from ..sources.models import CALL_DEFAULTS, ModelSpec
from .help import as_written, yaml_value
from .schema import DEFAULT_CONFIG, AblationConfig, MetricsConfig

__all__ = ["SECTION_COMMANDS", "parse_override", "apply_override", "load_config", "load_config_sections"]


def parse_override(text: str, option: str | None = None) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, yaml value)``; ``KEY`` may be dotted (``model.call.height``). ``option``
    (``"--set"``) is the command-line option the text came from, named in the error messages."""
    given = f"{option} {text}" if option else repr(text)
    if "=" not in text:
        raise ValueError(f"{option} wants KEY=VALUE, got {text!r}" if option else f"{given}: wanted KEY=VALUE")
    key, value = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ValueError(f"{given}: the value is not valid YAML ({_yaml_problem(err)})") from err


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line (its own message spans several, with a caret under the column)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None:
        return str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def apply_override(values: dict[str, Any], key: str, value: Any, option: str | None = None) -> None:
    """Sets ``values[a][b][c] = value`` for ``key = "a.b.c"``, creating mappings on the way (``option``: as
    for :func:`parse_override`).

    Setting ``model.pipeline`` on a reference model (or ``model.reference`` on a pipeline) starts a new
    ``model`` mapping: the other source's call arguments do not carry over (set ``model.call`` after it).

    Example:
        >>> v = {"model": {"reference": "bundled", "call": {"num_steps": 20}}}
        >>> apply_override(v, "model.pipeline", "/m/sd3"); v
        {'model': {'pipeline': '/m/sd3'}}
        >>> apply_override(v, "model.call.height", 512); v
        {'model': {'pipeline': '/m/sd3', 'call': {'height': 512}}}
    """
    *parents, last = key.split(".")
    if parents == ["model"] and last in ("reference", "pipeline"):
        model = values.get("model")
        other = "pipeline" if last == "reference" else "reference"
        if model == other or (isinstance(model, dict) and (other in model or model.get("kind") == other)):
            values["model"] = {}  # another model source: its call arguments do not carry over
        elif isinstance(model, dict) and "kind" in model:  # a run folder's config.yaml: the source named anew
            values["model"] = {k: v for k, v in model.items() if k not in ("kind", "path")}
    node = values
    for part in parents:
        child = node.get(part)
        if child == "reference" and part == "model":
            child = {}  # `model: reference` is the mapping-less default
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ValueError(f"{option + ' ' if option else ''}{key}: {part!r} is {child!r}, not a mapping")
        node[part] = child = dict(child)
        node = child
    node[last] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                plugins: list[str] | None = None, check_inputs: bool = False) -> AblationConfig:
    """The :class:`AblationConfig` of a YAML file (see :func:`load_config_sections`, which this is without
    sections)."""
    return load_config_sections(path, overrides, plugins, check_inputs)[0]


# Top-level config sections that a command other than `tomerge ablate` reads, and that command.
SECTION_COMMANDS = {"search": "tomerge search"}


def load_config_sections(path: str | Path | None = None, overrides: list[str] | None = None,
                         plugins: list[str] | None = None, check_inputs: bool = False,
                         sections: tuple[str, ...] = ()) -> tuple[AblationConfig, dict[str, Any]]:
    """Reads a YAML config (default: the reference grid), applies ``KEY=VALUE`` overrides, loads the
    config's plugins (and ``plugins``, e.g. from ``--plugin``), validates.

    Every problem is reported at once, in one :class:`ConfigError` (one line each): unknown keys, at the
    top and in ``model``, ``metrics`` and ``prompts`` (with the closest valid key), and then what
    :class:`AblationConfig` checks (values, files, the model's call arguments, every grid entry).
    ``check_inputs`` (``tomerge ablate``) adds the inputs of the quality metrics
    (:meth:`AblationConfig.input_problems`). A file that is not YAML, a malformed ``--set`` and a plugin that
    fails to import are reported alone. Relative plugin paths in a config file are looked up next to the file
    first.

    ``sections`` (e.g. ``("search",)`` for ``tomerge search``) are top-level keys that the calling command
    reads itself: they are returned raw (``--set search.trials=5`` applied) beside the config, the config
    is validated without them; a section of :data:`SECTION_COMMANDS` in a config of another command is a
    problem that names its command.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"config {path} not found")
    try:
        values = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ValueError(f"config {path} is not valid YAML: {_yaml_problem(err)}") from err
    if not isinstance(values, dict):
        raise ValueError(f"config {path} must be a mapping of keys to values, got {type(values).__name__}")
    set_keys = set()
    for text in overrides or []:
        key, value = parse_override(text, option="--set")
        apply_override(values, key, value, option="--set")
        set_keys.add(key.split(".")[0])
    problems: list[str] = []
    found = {name: values.pop(name) for name in sections if name in values}
    for name in [k for k in SECTION_COMMANDS if k in values]:
        values.pop(name)
        problems.append(f"the config has a {name}: section, which `{SECTION_COMMANDS[name]} --config FILE` runs "
                        f"(this command reads the other keys only)")
    valid = [f.name for f in dataclasses.fields(AblationConfig)]
    raw_model = values.get("model")
    for key in [k for k in values if k not in valid]:
        problems.append(_unknown_key(key, values.pop(key), valid, from_set=key in set_keys))
    from ..plugins import load_plugins, resolve_specs

    listed = values.get("plugins") or []
    if not isinstance(listed, (list, tuple)):
        problems.append(f"plugins must be a list of modules or .py files, got {listed!r} (plugins: [{listed}])")
        listed = []
    config_plugins = resolve_specs(list(listed), base_dir=path.parent)
    extra = resolve_specs(list(plugins or []))
    load_plugins(config_plugins)
    load_plugins(extra)
    values["plugins"] = tuple(dict.fromkeys(config_plugins + extra))  # absolute: worker processes load them too
    for key in ("classes", "grid", "map_steps"):
        if key in values:
            if isinstance(values[key], (list, tuple)):
                values[key] = tuple(values[key])
            else:
                problems.append(f"{key} must be a list, got {values[key]!r}")
                del values[key]
    model, model_problems = ModelSpec.parse(raw_model)
    problems += model_problems
    if model is None:  # what depends on the kind of model is not checked against a guess
        model = ModelSpec()
        values.pop("prompts", None)
    values["model"] = model
    metrics = values.get("metrics") or {}
    if not isinstance(metrics, dict):
        problems.append(f"metrics must be a mapping, got {metrics!r}")
        metrics = {}
    metrics_keys = [f.name for f in dataclasses.fields(MetricsConfig)]
    for key in [k for k in metrics if k not in metrics_keys]:
        hint = (f": it is a top-level key, {key}" if key in valid else
                did_you_mean(f"metrics.{key}", [f"metrics.{k}" for k in metrics_keys], quote=repr)
                or f"; valid: {', '.join(metrics_keys)}")
        problems.append(f"unknown key 'metrics.{key}'{hint}")
    metrics = {k: v for k, v in metrics.items() if k in metrics_keys}
    try:
        values["metrics"] = MetricsConfig(**metrics)
    except ConfigError as err:
        problems += err.problems
        values["metrics"] = MetricsConfig()
    config = None
    try:
        config = AblationConfig(**values)
    except ConfigError as err:
        problems += err.problems
    if check_inputs:
        stand_in = config or _unchecked(AblationConfig, {**values, "metrics": _unchecked(MetricsConfig, metrics)})
        problems += stand_in.input_problems()
    if problems:
        raise ConfigError(problems)
    return config, found


def _unchecked(cls: type, values: dict[str, Any]) -> Any:
    """A ``cls`` (a frozen config dataclass) of ``values`` without its checks, whose problems are listed
    already: for :meth:`AblationConfig.input_problems`, which reads a few fields and checks their types."""
    instance = object.__new__(cls)
    for f in dataclasses.fields(cls):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        object.__setattr__(instance, f.name, values.get(f.name, default))
    return instance


def _unknown_key(key: Any, value: Any, valid: list[str], from_set: bool) -> str:
    """The problem of an unknown top-level key: the mapping it belongs in (``dtype`` -> ``model.dtype``,
    ``clip_model`` -> ``metrics.clip_model``), written as the user gave it (``--set`` or the file), or the
    closest valid key."""
    name = str(key)
    nested = _nested_keys()
    if name in nested:
        return f"unknown key {name!r}: it is {nested[name]} ({_written(nested[name], value, from_set)})"
    import difflib

    close = difflib.get_close_matches(name, [*valid, *nested], n=1)
    if not close:
        return f"unknown key {name!r}; valid keys: {valid}"
    target = close[0] if close[0] in valid else nested[close[0]]
    return f"unknown key {name!r}; did you mean {target!r}?"


def _written(dotted: str, value: Any, from_set: bool) -> str:
    """``--set a.b=VALUE`` or ``a: {b: VALUE}``: how ``dotted`` is written on the command line or in a file."""
    if from_set:
        import shlex

        return f"--set {shlex.quote(f'{dotted}={yaml_value(value)}')}"
    nested: Any = as_written(value)
    for part in reversed(dotted.split(".")):
        nested = {part: nested}
    text = yaml.safe_dump(nested, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text[1:-1] if text.startswith("{") and text.endswith("}") else text


def _nested_keys() -> dict[str, str]:
    """Keys of the nested mappings that a config may write at the top by mistake -> their dotted path."""
    from ..sources.prompt_sets import PromptSet

    out = {k: f"model.{k}" for k in ("reference", "pipeline", "dtype", "device", "offload", "call")}
    out |= {k: f"model.call.{k}" for k in [*ModelSpec.REFERENCE_CALL, *(a for d in CALL_DEFAULTS.values() for a in d)]}
    out |= {f.name: f"metrics.{f.name}" for f in dataclasses.fields(MetricsConfig)}
    out |= {k: f"prompts.{k}" for k in ("file", "format", "field", "template", "coco_caption", "image_field")
            if k in {f.name for f in dataclasses.fields(PromptSet)}}
    top = {f.name for f in dataclasses.fields(AblationConfig)}
    return {k: v for k, v in out.items() if k not in top}
