"""Ablation configs: a frozen dataclass read from YAML, overridable with ``--set key=value``."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import yaml

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "ablate.yaml"
REFERENCE_CHECKPOINT = Path(__file__).parent / "reference" / "dit_reference.safetensors"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One cell of the grid: a strategy (or schedule) at one ratio with its options."""

    strategy: str
    ratio: float
    options: dict[str, Any]

    @property
    def run_id(self) -> str:
        opts = "".join(f"-{k}={v}" for k, v in sorted(self.options.items()))
        return f"{self.strategy}-r{self.ratio:g}{opts}".replace("/", "_").replace(" ", "")


@dataclasses.dataclass(frozen=True)
class AblationConfig:
    """Everything an ablation needs; ``to_dict()`` is what W&B logs.

    Args:
        name: run folder name under ``out_dir``.
        checkpoint: DiT weights (``None``: the bundled reference model).
        device: ``"cpu"`` or ``"cuda"``.
        num_steps, cfg_scale: Euler steps and guidance scale of the sampler.
        classes, per_class: the labels generated (each class ``per_class`` times).
        seed: noise of image ``i`` comes from ``seed + i``.
        batch_size: images per sampling call.
        grid: entries ``{strategy, ratios, options}``; every strategy x ratio is a run.
        timing_batch, warmup, repeats: the timed sampling call and its alternating repeats.
        fd_reference_images: real test images for FD-EffNetLite0 (0 disables it).
        data_root: Fashion-MNIST IDX folder (default: the Debian package's).
        wandb: ``"auto"`` (offline unless an API key is configured), ``"offline"``, ``"online"``, ``"disabled"``.
        out_dir: parent folder of run folders.
        map_steps: denoising steps whose merge maps are kept (negative counts from the end).
    """

    name: str = "reference"
    checkpoint: str | None = None
    device: str = "cpu"
    num_steps: int = 20
    cfg_scale: float = 2.0
    classes: tuple[int, ...] = tuple(range(10))
    per_class: int = 4
    seed: int = 0
    batch_size: int = 20
    grid: tuple[dict[str, Any], ...] = ()
    timing_batch: int = 8
    warmup: int = 1
    repeats: int = 3
    fd_reference_images: int = 1000
    data_root: str | None = None
    wandb: str = "auto"
    out_dir: str = "runs"
    map_steps: tuple[int, ...] = (0, -1)

    def __post_init__(self) -> None:
        import tomerge

        for key in ("num_steps", "per_class", "batch_size", "timing_batch", "repeats"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.wandb not in ("auto", "offline", "online", "disabled"):
            raise ValueError(f"wandb must be auto, offline, online or disabled, got {self.wandb!r}")
        known = set(tomerge.list_strategies())
        for entry in self.grid:
            extra = set(entry) - {"strategy", "ratios", "options"}
            if extra or "strategy" not in entry or "ratios" not in entry:
                raise ValueError(f"grid entries are {{strategy, ratios, options}}; got {entry}")
            if entry["strategy"] not in known:
                raise ValueError(f"unknown strategy {entry['strategy']!r} in grid; registered: {sorted(known)}")

    def labels(self) -> list[int]:
        return [c for c in self.classes for _ in range(self.per_class)]

    def runs(self) -> list[RunSpec]:
        return [RunSpec(e["strategy"], float(r), dict(e.get("options") or {})) for e in self.grid for r in e["ratios"]]

    def checkpoint_path(self) -> Path:
        path = Path(self.checkpoint) if self.checkpoint else REFERENCE_CHECKPOINT
        if not path.is_file():
            raise FileNotFoundError(f"checkpoint {path} not found; set checkpoint=PATH (local weights only)")
        return path

    def map_steps_for(self, num_steps: int | None) -> set[int]:
        n = num_steps or self.num_steps
        return {s % n for s in self.map_steps}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parse_override(text: str) -> tuple[str, Any]:
    if "=" not in text:
        raise ValueError(f"--set wants KEY=VALUE, got {text!r}")
    key, value = text.split("=", 1)
    return key.strip(), yaml.safe_load(value)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> AblationConfig:
    """Reads a YAML config (default: the reference grid), applies ``KEY=VALUE`` overrides, validates.

    Unknown keys raise, naming the valid ones.
    """
    path = Path(path) if path is not None else DEFAULT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"config {path} not found")
    values = yaml.safe_load(path.read_text()) or {}
    for text in overrides or []:
        key, value = parse_override(text)
        values[key] = value
    valid = {f.name for f in dataclasses.fields(AblationConfig)}
    unknown = sorted(set(values) - valid)
    if unknown:
        raise ValueError(f"unknown config key(s) {unknown}; valid keys: {sorted(valid)}")
    for key in ("classes", "grid", "map_steps"):
        if key in values:
            values[key] = tuple(values[key])
    return AblationConfig(**values)
