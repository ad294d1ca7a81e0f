"""The config keys as ``tomerge ablate --help`` lists them (:func:`config_help`): each key with its default and
its meaning, read from the ``Args:`` sections of the config dataclasses' docstrings; and how a value is
written in a config (:func:`yaml_value`, :func:`as_written`), which the messages about keys use too."""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from typing import Any

import yaml

from ..sources.models import ModelSpec
from .schema import DEFAULT_CONFIG, AblationConfig, MetricsConfig

__all__ = ["docstring_args", "config_keys", "config_help", "yaml_value", "as_written", "dataclass_defaults"]


def docstring_args(cls: type) -> list[tuple[list[str], str]]:
    """The ``Args:`` section of a class docstring: ``([names], meaning)`` per entry, in order; an entry
    ``a, b: text`` names several keys. Sphinx roles and double backquotes are reduced to plain text.

    Example:
        >>> docstring_args(MetricsConfig)[-1]
        (['batch_size'], 'images per feature-extractor forward.')
    """
    lines = inspect.getdoc(cls).splitlines()
    entries: list[tuple[list[str], str]] = []
    for line in lines[lines.index("Args:") + 1:]:
        if line.startswith("        ") and entries:
            entries[-1] = (entries[-1][0], f"{entries[-1][1]} {line.strip()}")
        elif line.startswith("    ") and ": " in line:
            names, text = line.strip().split(": ", 1)
            entries.append(([n.strip() for n in names.split(",")], text))
        else:
            break
    return [(names, _plain_text(text)) for names, text in entries]


def _plain_text(text: str) -> str:
    text = re.sub(r":\w+:`~([\w.]+)`", lambda m: m.group(1).rsplit(".", 1)[-1], text)
    text = re.sub(r":\w+:`([^`]+)`", r"\1", text)
    return re.sub(r"``([^`]+)``", r"\1", text)


def yaml_value(value: Any, limit: int = 60) -> str:
    """``value`` as it is written in YAML, in one line (a long list as its length)."""
    value = as_written(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False).strip()
    text = text[:-4].strip() if text.endswith("\n...") else text
    if len(text) > limit and isinstance(value, list):
        return f"[{len(value)} entries]"
    return text


def dataclass_defaults(cls: type) -> dict[str, Any]:
    """Each field of the dataclass ``cls`` that has a default, with that default (a factory's value)."""
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
            or f.default_factory is not dataclasses.MISSING}


def config_keys() -> list[tuple[list[str], dict[str, Any], str]]:
    """Every config key: ``([keys], {key: default}, meaning)``, from the docstrings and defaults of
    :class:`AblationConfig` and of its nested ``model``, ``prompts`` and ``metrics`` mappings (what
    ``tomerge ablate --help`` lists)."""
    from ..sources.prompt_sets import PromptSet

    nested = {
        "model": [
            (["reference"], {"reference": "bundled"},
             "a native DiT checkpoint (.safetensors or .pt; bundled: the shipped reference model), sampled with "
             "tomerge's Euler sampler; items are class labels."),
            (["pipeline"], {}, "instead of reference: a local diffusers pipeline folder (never downloaded); "
             "items are prompts."),
            *[(names, {n: ModelSpec.REFERENCE_CALL if n == "call" else dataclass_defaults(ModelSpec)[n]
                       for n in names}, text)
              for names, text in docstring_args(ModelSpec) if names[0] in ("dtype", "device", "offload", "call")],
        ],
        "prompts": [(names, {n: dataclass_defaults(PromptSet)[n] for n in names
                             if n in dataclass_defaults(PromptSet)}, text)
                    for names, text in docstring_args(PromptSet)
                    if names[0] in ("file", "format", "field", "template", "coco_caption", "image_field")],
        "metrics": [(names, {n: dataclass_defaults(MetricsConfig)[n] for n in names}, text)
                    for names, text in docstring_args(MetricsConfig)],
    }
    defaults = dataclass_defaults(AblationConfig)
    out = []
    for names, text in docstring_args(AblationConfig):
        out.append((names, {n: defaults[n] for n in names}, text))
        for key in names:
            for sub, values, meaning in nested.get(key, []):
                out.append(([f"{key}.{n}" for n in sub], {f"{key}.{n}": v for n, v in values.items()}, meaning))
    return out


def config_help(width: int = 100) -> str:
    """The config keys with their defaults and meanings, for ``tomerge ablate --help``."""
    default_file = yaml.safe_load(DEFAULT_CONFIG.read_text()) or {}
    intro = ("config keys (a YAML mapping in --config FILE, or --set KEY=VALUE with dotted keys and YAML values). "
             "KEY = the default when a config leaves the key out; without --config, tomerge ablate reads "
             f"{DEFAULT_CONFIG.parent.parent.name}/{DEFAULT_CONFIG.parent.name}/{DEFAULT_CONFIG.name}, whose "
             "settings are shown as [ablate.yaml: ...]:")
    lines = [*textwrap.wrap(intro, width), ""]
    for names, defaults, text in config_keys():
        head = ", ".join(f"{n} = {yaml_value(defaults[n])}" if n in defaults else n for n in names)
        set_here = {n: default_file[n] for n in names if n in default_file and n in defaults
                    and as_written(default_file[n]) != as_written(defaults[n])}
        if set_here:
            head += f"  [ablate.yaml: {', '.join(f'{n}: {yaml_value(v)}' for n, v in set_here.items())}]"
        lines.append(f"  {head}")
        lines += textwrap.wrap(text, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def as_written(value: Any) -> Any:
    """A default as a config writes it: the default model is ``reference``, a nested mapping of defaults
    (``metrics``) is ``{}`` (its keys are listed below it), tuples are lists."""
    if isinstance(value, ModelSpec) and value == ModelSpec():
        return "reference"
    if dataclasses.is_dataclass(value):
        return {}
    return list(value) if isinstance(value, tuple) else value
