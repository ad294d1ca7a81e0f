"""`tomerge generate`: images for a class list with a chosen strategy, for metrics at scale.

    tomerge generate --classes 0 1 2 --per-class 100 --out runs/gen/base                     # unmerged
    tomerge generate --class-file classes.txt --strategy tomesd --ratio 0.5 --set use_rand=false --out runs/gen/tomesd
    tomerge generate --classes 0 1 2 3 --per-class 500 --strategy ssm --out runs/gen/ssm --devices 4 --accelerator gpu

Item ``i`` of the list (classes repeated ``--per-class`` times each, in order) gets the seed
``--seed + i``; its initial noise comes from ``torch.Generator().manual_seed(seed)`` exactly as in
``tomerge ablate``, and it is written to ``OUT/{i:05d}_class{c}_seed{seed}.png``.

Resume: the list is cut into fixed batches of ``--batch-size`` consecutive items; a batch whose files
all exist is skipped, and a partly finished one is recomputed whole but only its missing files are
written. Batches never change composition, and random merge choices are seeded per batch, so an
image depends only on its index, seed, the batch size and the settings (recorded in
``OUT/generate.json``; a rerun with other settings into the same folder is refused), never on the
number of processes or on what was generated before.

Several processes: ``--devices N`` (and ``--num-nodes``) run PyTorch Lightning's ``Trainer.predict``
with DDP (gloo on CPU, NCCL on GPU); rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...``.
``--launcher ddp`` re-executes the command once per extra rank (Lightning's default, also right
under SLURM/torchrun); ``ddp_spawn`` / ``ddp_fork`` start them with ``multiprocessing`` spawn / fork
(fork: CPU only, or before CUDA is initialised; the cheapest start, used by the tests).

Text-to-image models (prompt lists) are not supported yet: the generator drives class-conditional
native DiT checkpoints (pixel space, 1 or 3 channels).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

import tomerge

from .config import REFERENCE_CHECKPOINT, parse_override
from .sampling import sample

__all__ = ["Item", "GenerateSpec", "read_class_file", "build_items", "make_batches", "shard",
           "generate_batch", "process_batch", "generate_local", "generate_distributed", "add_arguments", "run"]

SETTINGS_FILE = "generate.json"


# ---------------------------------------------------------------------------------------- items
@dataclasses.dataclass(frozen=True)
class Item:
    """One image to produce: its global index, class label and noise seed.

    Example:
        >>> Item(7, 3, 107).filename
        '00007_class3_seed107.png'
    """

    index: int
    label: int
    seed: int

    @property
    def filename(self) -> str:
        return f"{self.index:05d}_class{self.label}_seed{self.seed}.png"


def read_class_file(path: str | os.PathLike) -> list[int]:
    """Class ids from a file: a JSON list (or ``{"classes": [...]}``), or text with ids separated by
    whitespace or commas (``#`` starts a comment). One id per image (``--per-class`` repeats them).

    Example:
        >>> import tempfile; f = tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False)
        >>> _ = f.write("0 1, 2  # shirts\\n7\\n"); f.close()
        >>> read_class_file(f.name)
        [0, 1, 2, 7]
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"class file {path} not found")
    text = path.read_text()
    stripped = text.lstrip()
    if stripped.startswith(("[", "{")):
        data = json.loads(text)
        values = data.get("classes") if isinstance(data, dict) else data
        if not isinstance(values, list):
            raise ValueError(f"{path}: JSON must be a list of class ids or {{\"classes\": [...]}}")
    else:
        values = [tok for line in text.splitlines() for tok in line.split("#", 1)[0].replace(",", " ").split()]
    try:
        return [int(v) for v in values]
    except (TypeError, ValueError) as err:
        raise ValueError(f"{path}: class ids must be integers ({err})") from err


def build_items(classes: Sequence[int], per_class: int = 1, seed: int = 0) -> list[Item]:
    """Every class ``per_class`` times, in order (as ``AblationConfig.labels``); item ``i`` has seed ``seed + i``.

    Example:
        >>> [(i.index, i.label, i.seed) for i in build_items([4, 2], per_class=2, seed=10)]
        [(0, 4, 10), (1, 4, 11), (2, 2, 12), (3, 2, 13)]
    """
    if per_class < 1:
        raise ValueError(f"--per-class must be >= 1, got {per_class}")
    labels = [int(c) for c in classes for _ in range(per_class)]
    return [Item(i, c, seed + i) for i, c in enumerate(labels)]


def make_batches(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """Fixed consecutive batches (the unit of work, resume and sharding).

    Example:
        >>> [[i.index for i in b] for b in make_batches(build_items([0], per_class=5), 2)]
        [[0, 1], [2, 3], [4]]
    """
    if batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
    return [list(items[s:s + batch_size]) for s in range(0, len(items), batch_size)]


def shard(num_batches: int, rank: int, world_size: int) -> list[int]:
    """Batch indices of one rank: ``rank, rank + world_size, ...`` (disjoint, together complete).

    Example:
        >>> shard(5, 0, 2), shard(5, 1, 2)
        ([0, 2, 4], [1, 3])
    """
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside world size {world_size}")
    return list(range(rank, num_batches, world_size))


# ---------------------------------------------------------------------------------------- settings
@dataclasses.dataclass(frozen=True)
class GenerateSpec:
    """Everything that changes the pixels of an image besides its index and seed.

    Args:
        checkpoint: the DiT weights (``.safetensors``).
        strategy: a registered strategy/schedule name, or ``"none"`` for the unmerged model.
        ratio: the merge ratio (ignored for ``"none"``).
        options: strategy/adapter/state options passed to :func:`tomerge.merging`.
        num_steps, cfg_scale, shift: sampler settings (see :func:`~tomerge.experiments.sampling.sample`).
        batch_size: images per sampling call.
    """

    checkpoint: str
    strategy: str = "none"
    ratio: float = 0.5
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    num_steps: int = 20
    cfg_scale: float = 2.0
    shift: float = 1.0
    batch_size: int = 16

    def __post_init__(self) -> None:
        if self.strategy != "none" and self.strategy not in tomerge.list_strategies():
            raise ValueError(f"unknown strategy {self.strategy!r}; choose none or one of {tomerge.list_strategies()}")
        if self.strategy == "none" and self.options:
            raise ValueError(f"--set {sorted(self.options)} needs a --strategy")
        if self.num_steps < 1 or self.batch_size < 1:
            raise ValueError("num_steps and batch_size must be >= 1")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def check_settings(out: Path, spec: GenerateSpec) -> None:
    """Writes ``OUT/generate.json``, or refuses when the folder holds images made with other settings."""
    file = out / SETTINGS_FILE
    current = json.loads(json.dumps(spec.to_dict()))
    if file.exists():
        previous = json.loads(file.read_text())
        if previous != current:
            changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise ValueError(f"{out} holds images generated with other settings (changed: {changed}); "
                             "use another --out or delete the folder")
        return
    tmp = file.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(current, indent=2, sort_keys=True))
    os.replace(tmp, file)


# ---------------------------------------------------------------------------------------- work
def item_noise(item: Item, model: nn.Module) -> Tensor:
    """``[C, H, W]`` initial noise of an item (the same draw as ``tomerge ablate``)."""
    c = model.config
    return torch.randn((c.in_channels, *c.image_hw), generator=torch.Generator().manual_seed(item.seed))


def generate_batch(model: nn.Module, batch: Sequence[Item], spec: GenerateSpec) -> Tensor:
    """Images ``[B, C, H, W]`` in ``[-1, 1]`` (CPU) of one batch, with the spec's merging.

    Random merge choices are made inside a forked RNG seeded from the batch's first seed, so they
    do not depend on what ran before in the process.
    """
    device = next(model.parameters()).device
    labels = torch.tensor([i.label for i in batch], dtype=torch.long)
    noise = torch.stack([item_noise(i, model) for i in batch])  # [B, C, H, W]
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(batch[0].seed)
        if spec.strategy == "none":
            images = sample(model, labels, num_steps=spec.num_steps, cfg_scale=spec.cfg_scale, shift=spec.shift,
                            noise=noise)
        else:
            with tomerge.merging(model, spec.strategy, ratio=spec.ratio, **spec.options):
                images = sample(model, labels, num_steps=spec.num_steps, cfg_scale=spec.cfg_scale,
                                shift=spec.shift, noise=noise)
    return images.cpu()


def save_image(image: Tensor, path: Path) -> None:
    """``[C, H, W]`` in ``[-1, 1]`` (C = 1 or 3) -> PNG, written atomically (no half files on resume)."""
    from PIL import Image

    array = ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [C, H, W]
    if array.shape[0] == 1:
        pil = Image.fromarray(array[0].numpy(), mode="L")
    elif array.shape[0] == 3:
        pil = Image.fromarray(array.permute(1, 2, 0).contiguous().numpy(), mode="RGB")
    else:
        raise ValueError(f"can write 1- or 3-channel images, got {array.shape[0]} channels "
                         "(latent models need a decoder, which generate does not have yet)")
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    pil.save(tmp, format="PNG")
    os.replace(tmp, path)


def process_batch(model: nn.Module, batch: Sequence[Item], spec: GenerateSpec, out: Path) -> int:
    """Generates a batch unless all its files exist; writes only the missing files; returns how many."""
    missing = [k for k, item in enumerate(batch) if not (out / item.filename).exists()]
    if not missing:
        return 0
    images = generate_batch(model, batch, spec)
    for k in missing:
        save_image(images[k], out / batch[k].filename)
    return len(missing)


def load_model(spec: GenerateSpec, device: str | torch.device = "cpu") -> nn.Module:
    from tomerge.backbones.native_dit import load_dit

    return load_dit(spec.checkpoint, map_location=device).eval()


def _check_labels(items: Sequence[Item], model: nn.Module) -> None:
    n = model.config.num_classes
    bad = sorted({i.label for i in items if not 0 <= i.label < n})
    if bad:
        raise ValueError(f"class ids {bad} outside the model's classes 0..{n - 1}")


def generate_local(items: Sequence[Item], spec: GenerateSpec, out: Path, device: str = "cpu",
                   progress: bool = True) -> int:
    """One process: every batch in order. Returns the number of images written."""
    from tqdm import tqdm

    model = load_model(spec, device)
    _check_labels(items, model)
    written = 0
    for batch in tqdm(make_batches(items, spec.batch_size), desc="generate", unit="batch", disable=not progress):
        written += process_batch(model, batch, spec, out)
    return written


@functools.cache
def _lightning_module_class() -> type:
    """The ``LightningModule`` for ``Trainer.predict``, defined on first use (Lightning is imported lazily).

    Reachable as ``tomerge.experiments.generate.GenerateModule`` (module ``__getattr__``), so
    ``ddp_spawn`` can pickle it.
    """
    import pytorch_lightning as pl

    class GenerateModule(pl.LightningModule):
        """Generates this rank's shard of batches in ``predict_step`` and writes the PNGs."""

        def __init__(self, items: list[Item], spec: GenerateSpec, out: str, threads: int | None = None) -> None:
            super().__init__()
            self.items, self.spec, self.out, self.threads = items, spec, out, threads
            self.model = load_model(spec)
            _check_labels(items, self.model)

        def on_predict_start(self) -> None:
            if self.threads:
                torch.set_num_threads(self.threads)

        def predict_dataloader(self):
            from torch.utils.data import DataLoader

            batches = make_batches(self.items, self.spec.batch_size)
            mine = shard(len(batches), self.trainer.global_rank, self.trainer.world_size)
            work = [{"batch_index": b, "items": [dataclasses.astuple(i) for i in batches[b]]} for b in mine]
            return DataLoader(work, batch_size=None, collate_fn=lambda x: x)

        def predict_step(self, batch: dict[str, Any], batch_idx: int) -> int:
            items = [Item(*t) for t in batch["items"]]
            return process_batch(self.model, items, self.spec, Path(self.out))

    GenerateModule.__qualname__ = "GenerateModule"
    GenerateModule.__module__ = "tomerge.experiments.generate"
    return GenerateModule


def __getattr__(name: str) -> Any:
    if name == "GenerateModule":
        return _lightning_module_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def generate_distributed(items: Sequence[Item], spec: GenerateSpec, out: Path, devices: int = 2,
                         accelerator: str = "cpu", num_nodes: int = 1, launcher: str = "ddp",
                         threads: int | None = None, progress: bool = True) -> bool:
    """``Trainer.predict`` with DDP over ``devices x num_nodes`` ranks; returns True on global rank 0.

    With ``launcher="ddp"`` Lightning re-executes the current command for the other local ranks, so
    call this from a script or console entry point; from Python (notebooks, tests) use ``"ddp_fork"``
    (CPU) or ``"ddp_spawn"``.
    """
    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    backend = "gloo" if accelerator == "cpu" else "nccl"
    start = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}
    if launcher not in start:
        raise ValueError(f"launcher must be one of {sorted(start)}, got {launcher!r}")
    strategy = DDPStrategy(process_group_backend=backend, start_method=start[launcher])
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=progress, use_distributed_sampler=False, default_root_dir=str(out))
    module = _lightning_module_class()(list(items), spec, str(out), threads)
    trainer.predict(module, return_predictions=False)
    return trainer.is_global_zero


# ---------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to generate")
    what.add_argument("--classes", type=int, nargs="+", default=None, metavar="C", help="class ids")
    what.add_argument("--class-file", type=Path, default=None,
                      help="class ids from a file (JSON list, or text separated by spaces/commas/newlines)")
    what.add_argument("--per-class", type=int, default=1, help="images per listed class id (default: %(default)s)")
    what.add_argument("--seed", type=int, default=0, help="item i uses seed SEED + i (default: %(default)s)")
    what.add_argument("--out", type=Path, required=True, help="output folder (created; reruns resume)")
    merge = parser.add_argument_group("merging")
    merge.add_argument("--strategy", default="none", choices=["none", *tomerge.list_strategies()],
                       help="strategy or schedule (default: none, the unmerged model)")
    merge.add_argument("--ratio", type=float, default=0.5, help="merge ratio (default: %(default)s)")
    merge.add_argument("--set", dest="options", action="append", default=[], metavar="OPTION=VALUE",
                       help="strategy/adapter option, YAML value, e.g. --set use_rand=false (repeatable)")
    model = parser.add_argument_group("model and sampler")
    model.add_argument("--checkpoint", type=Path, default=REFERENCE_CHECKPOINT,
                       help="native DiT weights (default: the bundled reference model)")
    model.add_argument("--num-steps", type=int, default=20, help="Euler steps (default: %(default)s)")
    model.add_argument("--cfg-scale", type=float, default=2.0, help="guidance scale (default: %(default)s)")
    model.add_argument("--shift", type=float, default=1.0, help="timestep shift (default: %(default)s)")
    model.add_argument("--batch-size", type=int, default=16,
                       help="images per sampling call; part of the settings (default: %(default)s)")
    procs = parser.add_argument_group("processes")
    procs.add_argument("--devices", type=int, default=1, help="processes per node; > 1 uses Lightning DDP")
    procs.add_argument("--num-nodes", type=int, default=1, help="nodes (Lightning DDP)")
    procs.add_argument("--accelerator", choices=["cpu", "gpu", "auto"], default="auto",
                       help="(default: gpu when CUDA is available, else cpu)")
    procs.add_argument("--launcher", choices=["ddp", "ddp_spawn", "ddp_fork"], default="ddp",
                       help="how Lightning starts the extra ranks (default: %(default)s)")
    procs.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    procs.add_argument("--no-progress", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    if (args.classes is None) == (args.class_file is None):
        raise SystemExit("tomerge generate: give exactly one of --classes C [C ...] or --class-file FILE")
    classes = args.classes if args.classes is not None else read_class_file(args.class_file)
    if not classes:
        raise SystemExit("tomerge generate: the class list is empty")
    options = dict(parse_override(text) for text in args.options)
    checkpoint = Path(args.checkpoint)
    if not checkpoint.is_file():
        raise SystemExit(f"tomerge generate: checkpoint {checkpoint} not found (local weights only)")
    spec = GenerateSpec(checkpoint=str(checkpoint.resolve()), strategy=args.strategy, ratio=args.ratio,
                        options=options, num_steps=args.num_steps, cfg_scale=args.cfg_scale, shift=args.shift,
                        batch_size=args.batch_size)
    items = build_items(classes, args.per_class, args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, spec)
    accelerator = args.accelerator
    if accelerator == "auto":
        accelerator = "gpu" if torch.cuda.is_available() else "cpu"
    if args.devices * args.num_nodes > 1:
        is_zero = generate_distributed(items, spec, out, args.devices, accelerator, args.num_nodes, args.launcher,
                                       args.threads, progress=not args.no_progress)
        if not is_zero:
            return 0
    else:
        generate_local(items, spec, out, "cuda" if accelerator == "gpu" else "cpu", progress=not args.no_progress)
    done = sum((out / i.filename).exists() for i in items)
    print(f"{done}/{len(items)} images in {out}")
    return 0 if done == len(items) else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    # Run through the package module, so Lightning (ddp_spawn pickling) sees one GenerateModule class.
    from tomerge.experiments.generate import main as _main

    sys.exit(_main())
