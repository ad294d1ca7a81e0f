"""Experiment configs: a frozen dataclass read from YAML, overridable with ``--set key=value``.

One config describes what ``tomerge ablate`` runs, and ``tomerge generate --config`` reads its
``model``, prompt/class, seed and batch keys. ``--set`` takes dotted keys into mappings
(``--set model.pipeline=/models/sd3 --set model.call.num_inference_steps=28``) and YAML values.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import textwrap
from pathlib import Path
from typing import Any

import yaml

from .cli import UsageError
from .sources import REFERENCE_CHECKPOINT, Item, ModelSpec

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "ablate.yaml"
__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "REFERENCE_CHECKPOINT", "ConfigError", "RunSpec", "MetricsConfig", "AblationConfig",
           "parse_override", "apply_override", "load_config"]


class ConfigError(UsageError):
    """Everything wrong with a config, one problem per line (``problems``); a ``ValueError``, reported by
    the command line without a traceback."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"the config has {len(self.problems)} problem(s):\n{lines}")


def _check_run(strategy: str, ratio: Any, options: dict[str, Any], backbones: list[str] | None) -> None:
    import tomerge
    from tomerge.attach import check_options

    if strategy not in tomerge.list_strategies():
        raise ValueError(f"unknown strategy {strategy!r}; registered: {tomerge.list_strategies()} "
                         "(a strategy in your own file: plugins: [FILE] or --plugin FILE)")
    check_options(strategy, ratio=ratio, backbones=backbones, **options)


def valid_ratios(strategy: str, options: dict[str, Any], backbones: list[str] | None = None) -> tuple[float, float]:
    """The smallest and largest of the ratios 0, 0.05, ..., 0.95 that the strategy accepts with ``options``
    (e.g. ``sdtm`` with a deviation needs ``ratio < 1 - deviation``; a centre ratio below the deviation is
    accepted, its curve clipped at 0); raises the strategy's own error at ratio 0.5 when it accepts none."""
    accepted = []
    for i in range(20):
        try:
            _check_run(strategy, i / 20, options, backbones)
            accepted.append(i / 20)
        except ValueError:
            pass
    if not accepted:
        _check_run(strategy, 0.5, options, backbones)
        raise ValueError(f"{strategy} accepts no ratio in [0, 0.95] with options {options}")
    return accepted[0], accepted[-1]


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a strategy (or schedule) at one ratio with its options.

    A cell of a ``flop_speedups`` entry names its FLOP-ideal speed-up target (``flop_target``) and has
    ``ratio=None`` until :func:`~tomerge.experiments.ablate.match_flop_speedups` finds the ratio; its
    run id names the target, so a resumed grid knows the run without searching again.
    """

    strategy: str
    ratio: float | None
    options: dict[str, Any]
    flop_target: float | None = None

    @property
    def run_id(self) -> str:
        opts = "".join(f"-{k}={v}" for k, v in sorted(self.options.items()))
        amount = f"r{self.ratio:g}" if self.flop_target is None else f"flops{self.flop_target:g}x"
        return f"{self.strategy}-{amount}{opts}".replace("/", "_").replace(" ", "")


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
    """Optional metrics and where their local weights are (nothing is ever downloaded).

    Args:
        clip_model: a local ``transformers`` CLIP folder: CLIP score of every image with its prompt.
        fid_weights: the torch-fidelity Inception-v3 state dict: FID against ``reference_images``.
        dino_model: a local ``transformers`` DINO/DINOv2 folder (e.g. facebook/dinov2-base saved with
            ``save_pretrained``): ``dino_dist``, ToMA's DINO distance (1 - cosine of the CLS embeddings) of
            every image to the baseline image of the same item; lower is better.
        reference_images: a folder of real images (PNG/JPEG): FD-EffNetLite0 (and FID) against it.
        reference_limit: at most this many reference images (sorted by name).
        batch_size: images per feature-extractor forward.
    """

    clip_model: str | None = None
    fid_weights: str | None = None
    dino_model: str | None = None
    reference_images: str | None = None
    reference_limit: int | None = None
    batch_size: int = 32

    def __post_init__(self) -> None:
        for key, what in (("clip_model", "CLIP model folder"), ("fid_weights", "Inception weights"),
                          ("dino_model", "DINO model folder"), ("reference_images", "reference image folder")):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                from .metrics import MissingWeightsError  # imports torch: only when it is raised

                raise MissingWeightsError(f"metrics.{key}: {what} {value} not found (local paths only; "
                                          "nothing is downloaded)")
        if self.dino_model is not None:  # a folder that will not load fails here, before any image is made
            from .metrics import check_dino_model

            check_dino_model(self.dino_model)
        if self.fid_weights is not None and self.reference_images is None:
            raise ValueError("metrics.fid_weights needs metrics.reference_images (FID compares with real images)")
        if self.batch_size < 1:
            raise ValueError(f"metrics.batch_size must be >= 1, got {self.batch_size}")


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """Everything an ablation needs; ``to_dict()`` is what W&B logs and ``config.yaml`` holds.

    Args:
        name: run folder name under ``out_dir``.
        model: the model source (:class:`~tomerge.experiments.sources.ModelSpec`): ``reference`` or
            ``{pipeline: FOLDER, dtype, device, call}``.
        classes, per_class: the reference model's labels (each class ``per_class`` times).
        prompts: a text-to-image pipeline's prompt set: a file (``.txt``, ``.jsonl``, COCO captions
            ``.json``, PartiPrompts ``.tsv``, class names) or a mapping (see
            :class:`~tomerge.experiments.prompt_sets.PromptSet`).
        num_prompts, prompt_offset, images_per_prompt: which prompts, and images per prompt.
        seed: noise of item ``i`` comes from ``seed + i``.
        batch_size: images per generation call.
        grid: entries ``{strategy, ratios, options}``; every strategy x ratio is a run. An entry with
            ``flop_speedups: [1.5, ...]`` instead of ``ratios`` runs the strategy at the ratio whose
            FLOP-ideal speed-up is closest to each target (found by bisection on FLOP counts of one
            item; for comparisons at matched FLOPs).
        timing_batch, warmup, repeats: the timed generation call and its alternating repeats.
        fd_reference_images, data_root: Fashion-MNIST test images for the reference model's
            FD-EffNetLite0 (0 disables it) and their IDX folder (default: the Debian package's).
        metrics: optional metrics (:class:`MetricsConfig`).
        devices, launcher: generation processes (Lightning DDP when ``devices > 1``); ``launcher``
            ``auto`` forks on CPU and spawns on GPU.
        plugins: modules or ``.py`` files imported first (strategies registered in one file).
        wandb: ``"auto"`` (offline unless an API key is configured), ``"offline"``, ``"online"``, ``"disabled"``.
        out_dir: parent folder of run folders.
        map_steps: denoising steps whose merge maps are kept (negative counts from the end).
    """

    name: str = "reference"
    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    classes: tuple[int, ...] = tuple(range(10))
    per_class: int = 4
    prompts: Any = None
    num_prompts: int | None = None
    prompt_offset: int = 0
    images_per_prompt: int = 1
    seed: int = 0
    batch_size: int = 20
    grid: tuple[dict[str, Any], ...] = ()
    timing_batch: int = 8
    warmup: int = 1
    repeats: int = 3
    fd_reference_images: int = 1000
    data_root: str | None = None
    metrics: MetricsConfig = dataclasses.field(default_factory=MetricsConfig)
    devices: int = 1
    launcher: str = "auto"
    plugins: tuple[str, ...] = ()
    wandb: str = "auto"
    out_dir: str = "runs"
    map_steps: tuple[int, ...] = (0, -1)

    def __post_init__(self) -> None:
        """Checks the whole config before any work, and reports every problem at once (:class:`ConfigError`):
        counts, modes, the model source (files exist, call arguments), the prompts (read), and every run
        of the grid (strategy name, ratio, options: what ``tomerge.apply`` would refuse)."""
        problems: list[str] = []

        def check(what: str, fn) -> None:
            try:
                fn()
            except (ValueError, TypeError, KeyError, FileNotFoundError, ImportError) as err:
                message = err.args[0] if isinstance(err, KeyError) and err.args else err
                problems.append(f"{what}: {message}")

        for key in ("per_class", "batch_size", "timing_batch", "repeats", "images_per_prompt", "devices"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                problems.append(f"{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if not isinstance(self.warmup, int) or self.warmup < 0:
            problems.append(f"warmup must be an integer >= 0, got {self.warmup!r}")
        if self.wandb not in ("auto", "offline", "online", "disabled"):
            problems.append(f"wandb must be auto, offline, online or disabled, got {self.wandb!r}")
        if self.launcher not in ("auto", "ddp", "ddp_spawn", "ddp_fork"):
            problems.append(f"launcher must be auto, ddp, ddp_spawn or ddp_fork, got {self.launcher!r}")
        check("model", self.model.check)
        if self.model.conditioning == "prompt" and self.prompts is None:
            problems.append("a pipeline model generates from prompts: set prompts: FILE (txt, jsonl, COCO json, "
                            "PartiPrompts tsv or class names)")
        elif self.model.conditioning == "class" and self.prompts is not None:
            problems.append("prompts: is for text-to-image pipelines; the reference DiT takes classes/per_class")
        elif self.model.conditioning == "prompt":
            check("prompts", self.items)
        for i, entry in enumerate(self.grid):
            extra = set(entry) - {"strategy", "ratios", "flop_speedups", "options"} if isinstance(entry, dict) \
                else {"?"}
            if extra or "strategy" not in entry or ("ratios" in entry) == ("flop_speedups" in entry):
                problems.append(f"grid[{i}]: entries are {{strategy, ratios or flop_speedups, options}}; got {entry}")
                continue
            key = "ratios" if "ratios" in entry else "flop_speedups"
            if not isinstance(entry[key], (list, tuple)) or not entry[key]:
                problems.append(f"grid[{i}] ({entry['strategy']}): {key} must be a non-empty list, got {entry[key]!r}")
                continue
            backbones = ["native_dit"] if self.model.kind == "reference" else None
            options = dict(entry.get("options") or {})
            if key == "flop_speedups":
                bad = [t for t in entry[key] if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 1]
                if bad:
                    problems.append(f"grid[{i}] ({entry['strategy']}): flop_speedups are FLOP-ideal speed-up "
                                    f"targets > 1, got {bad}")
                check(f"grid[{i}] ({entry['strategy']})", lambda: valid_ratios(entry["strategy"], options, backbones))
                continue
            for ratio in entry["ratios"]:
                check(f"grid[{i}] ({entry['strategy']} at ratio {ratio})",
                      lambda: _check_run(entry["strategy"], ratio, options, backbones))
        if problems:
            raise ConfigError(problems)

    # ------------------------------------------------------------------ items
    def prompt_set(self):
        from .prompt_sets import PromptSet

        return PromptSet.from_config(self.prompts, num_prompts=self.num_prompts, prompt_offset=self.prompt_offset,
                                     images_per_prompt=self.images_per_prompt)

    def items(self) -> list[Item]:
        """Every image of the config, item ``i`` with seed ``seed + i``: each class ``per_class`` times
        (reference model), or each prompt ``images_per_prompt`` times (pipelines), in order."""
        if self.model.conditioning == "class":
            labels = [int(c) for c in self.classes for _ in range(self.per_class)]
            return [Item(i, self.seed + i, label=c) for i, c in enumerate(labels)]
        prompts = self.prompt_set().prompts()
        if not prompts:
            raise ValueError(f"the prompt set {self.prompts!r} holds no prompts")
        expanded = [p for p in prompts for _ in range(self.images_per_prompt)]
        return [Item(i, self.seed + i, prompt=p) for i, p in enumerate(expanded)]

    def runs(self) -> list[RunSpec]:
        """Every cell of the grid, in order; those of ``flop_speedups`` entries with ``ratio=None``."""
        runs = []
        for e in self.grid:
            options = dict(e.get("options") or {})
            if "ratios" in e:
                runs += [RunSpec(e["strategy"], float(r), options) for r in e["ratios"]]
            else:
                runs += [RunSpec(e["strategy"], None, options, flop_target=float(t)) for t in e["flop_speedups"]]
        return runs

    def map_steps_for(self, num_steps: int) -> set[int]:
        return {s % num_steps for s in self.map_steps}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ------------------------------------------------------------------------------ `ablate --help`
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


def _yaml_value(value: Any, limit: int = 60) -> str:
    """``value`` as it is written in YAML, in one line (a long list as its length)."""
    value = _plain(value)
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6, sort_keys=False).strip()
    text = text[:-4].strip() if text.endswith("\n...") else text
    if len(text) > limit and isinstance(value, list):
        return f"[{len(value)} entries]"
    return text


def _defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING
            or f.default_factory is not dataclasses.MISSING}


def config_keys() -> list[tuple[list[str], dict[str, Any], str]]:
    """Every config key: ``([keys], {key: default}, meaning)``, from the docstrings and defaults of
    :class:`AblationConfig` and of its nested ``model``, ``prompts`` and ``metrics`` mappings (what
    ``tomerge ablate --help`` lists)."""
    from .prompt_sets import PromptSet

    nested = {
        "model": [
            (["reference"], {"reference": "bundled"},
             "a native DiT checkpoint (.safetensors or .pt; bundled: the shipped reference model), sampled with "
             "tomerge's Euler sampler; items are class labels."),
            (["pipeline"], {}, "instead of reference: a local diffusers pipeline folder (never downloaded); "
             "items are prompts."),
            *[(names, {n: ModelSpec.REFERENCE_CALL if n == "call" else _defaults(ModelSpec)[n] for n in names}, text)
              for names, text in docstring_args(ModelSpec) if names[0] in ("dtype", "device", "call")],
        ],
        "prompts": [(names, {n: _defaults(PromptSet)[n] for n in names if n in _defaults(PromptSet)}, text)
                    for names, text in docstring_args(PromptSet)
                    if names[0] in ("file", "format", "field", "template", "coco_caption")],
        "metrics": [(names, {n: _defaults(MetricsConfig)[n] for n in names}, text)
                    for names, text in docstring_args(MetricsConfig)],
    }
    defaults = _defaults(AblationConfig)
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
        head = ", ".join(f"{n} = {_yaml_value(defaults[n])}" if n in defaults else n for n in names)
        set_here = {n: default_file[n] for n in names if n in default_file and n in defaults
                    and _plain(default_file[n]) != _plain(defaults[n])}
        if set_here:
            head += f"  [ablate.yaml: {', '.join(f'{n}: {_yaml_value(v)}' for n, v in set_here.items())}]"
        lines.append(f"  {head}")
        lines += textwrap.wrap(text, width, initial_indent="      ", subsequent_indent="      ")
    return "\n".join(lines)


def _plain(value: Any) -> Any:
    """A default as a config writes it: the default model is ``reference``, a nested mapping of defaults
    (``metrics``) is ``{}`` (its keys are listed below it), tuples are lists."""
    if isinstance(value, ModelSpec) and value == ModelSpec():
        return "reference"
    if dataclasses.is_dataclass(value):
        return {}
    return list(value) if isinstance(value, tuple) else value


def parse_override(text: str) -> tuple[str, Any]:
    """``KEY=VALUE`` -> ``(KEY, yaml value)``; ``KEY`` may be dotted (``model.call.height``)."""
    if "=" not in text:
        raise ValueError(f"--set wants KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    try:
        return key.strip(), yaml.safe_load(value)
    except yaml.YAMLError as err:
        raise ValueError(f"--set {text}: the value is not valid YAML ({_yaml_problem(err)})") from err


def _yaml_problem(err: yaml.YAMLError) -> str:
    """A YAML error in one line (its own message spans several, with a caret under the column)."""
    problem = getattr(err, "problem", None)
    mark = getattr(err, "problem_mark", None)
    if problem is None:
        return str(err).splitlines()[0]
    return f"{problem} at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else problem


def apply_override(values: dict[str, Any], key: str, value: Any) -> None:
    """Sets ``values[a][b][c] = value`` for ``key = "a.b.c"``, creating mappings on the way.

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
        if model == other or (isinstance(model, dict) and other in model):
            values["model"] = {}  # another model source: its call arguments do not carry over
    node = values
    for part in parents:
        child = node.get(part)
        if child == "reference" and part == "model":
            child = {}  # `model: reference` is the mapping-less default
        if child is None:
            child = {}
        if not isinstance(child, dict):
            raise ValueError(f"--set {key}: {part!r} is {child!r}, not a mapping")
        node[part] = child = dict(child)
        node = child
    node[last] = value


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                plugins: list[str] | None = None) -> AblationConfig:
    """Reads a YAML config (default: the reference grid), applies ``KEY=VALUE`` overrides, loads the
    config's plugins (and ``plugins``, e.g. from ``--plugin``), validates.

    Unknown keys raise, naming the valid ones. Relative plugin paths in a config file are looked up
    next to the file first.
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
    for text in overrides or []:
        apply_override(values, *parse_override(text))
    valid = {f.name for f in dataclasses.fields(AblationConfig)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys: {sorted(valid)}")
    from .plugins import load_plugins, resolve_specs

    config_plugins = resolve_specs(list(values.get("plugins") or []), base_dir=path.parent)
    extra = resolve_specs(list(plugins or []))
    load_plugins(config_plugins)
    load_plugins(extra)
    values["plugins"] = tuple(dict.fromkeys(config_plugins + extra))  # absolute: worker processes load them too
    for key in ("classes", "grid", "map_steps"):
        if key in values:
            values[key] = tuple(values[key])
    values["model"] = ModelSpec.from_config(values.get("model"))
    metrics = values.get("metrics") or {}
    if not isinstance(metrics, dict):
        raise ValueError(f"metrics must be a mapping, got {metrics!r}")
    unknown = sorted(set(metrics) - {f.name for f in dataclasses.fields(MetricsConfig)})
    if unknown:
        raise ValueError(f"unknown metrics key(s) {unknown}; valid: "
                         f"{sorted(f.name for f in dataclasses.fields(MetricsConfig))}")
    values["metrics"] = MetricsConfig(**metrics)
    return AblationConfig(**values)
