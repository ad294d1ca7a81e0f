"""Images and videos for a list of items, in one process (:func:`generate_local`), and the output folder they
are written to; :mod:`~tomerge.experiments.generation.distributed` runs the same batches over several processes.

The list is cut into fixed batches of ``batch_size`` consecutive items (:func:`make_batches`), item ``i``'s noise
comes from its own seed and random merge choices are seeded per batch, so an image depends only on its index, seed,
the batch size and the settings (a :class:`GenerateSpec`, recorded in ``OUT/generate.json``), never on the number
of processes or on what was generated before; a rerun skips the batches whose files all exist. The file names and
the resume rules: docs/experiments.md, "Images at scale" and "Video pipelines".
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomerge

from ..errors import UsageError
from ..sources.items import Item
from ..sources.models import ModelSpec
from .files import append_line, atomic_path, lock_folder, output_complete, remove_temp_files, \
    repair_jsonl_tail, write_text_atomic

if TYPE_CHECKING:
    from torch import Tensor
# torch (and PIL, tqdm) are imported in the functions that run a model, so that `tomerge generate --help` and the
# configs load without them.

__all__ = ["GenerateSpec", "SETTINGS_FILE", "INDEX_FILE", "LOG_FILE", "make_batches", "shard", "item_output",
           "write_index", "read_index", "generate_batch", "save_image", "save_video", "process_batch", "prepare",
           "lock_output", "generate_local"]

SETTINGS_FILE = "generate.json"
INDEX_FILE = "prompts.jsonl"  # the index of an image folder: read by run folders and figures
LOG_FILE = "generated.jsonl"


# ---------------------------------------------------------------------------------------- batches
def make_batches(items: Sequence[Item], batch_size: int) -> list[list[Item]]:
    """Fixed consecutive batches (the unit of work, resume and sharding).

    Example:
        >>> [[i.index for i in b] for b in make_batches([Item(i, i) for i in range(5)], 2)]
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
    """Everything that changes the pixels of an image besides its index, seed and condition.

    Args:
        model: the model source (reference DiT or a pipeline folder, with its call arguments).
        strategy: a registered strategy/schedule name, or ``"none"`` for the unmerged model.
        ratio: the merge ratio (ignored for ``"none"``).
        options: strategy/adapter/state options passed to :func:`tomerge.merging`.
        batch_size: images per generation call.
        plugins: modules or files imported before the strategy is built (also in every worker).
    """

    model: ModelSpec = dataclasses.field(default_factory=ModelSpec)
    strategy: str = "none"
    ratio: float = 0.5
    options: dict[str, Any] = dataclasses.field(default_factory=dict)
    batch_size: int = 16
    plugins: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.strategy != "none" and self.strategy not in tomerge.list_strategies():
            raise ValueError(f"unknown strategy {self.strategy!r}; choose none or one of {tomerge.list_strategies()}")
        if self.strategy == "none" and self.options:
            raise ValueError(f"--set {sorted(self.options)} needs a --strategy")
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {self.batch_size}")

    def to_dict(self) -> dict[str, Any]:
        """The recorded settings (``plugins`` are where code comes from, not a setting)."""
        out = dataclasses.asdict(self)
        del out["plugins"]
        return out


def check_settings(out: Path, spec: GenerateSpec) -> None:
    """Writes ``OUT/generate.json``, or refuses when the folder holds images made with other settings."""
    file = out / SETTINGS_FILE
    current = json.loads(json.dumps(spec.to_dict()))
    if file.exists():
        try:
            previous = json.loads(file.read_text())
        except ValueError as err:
            from .files import DamagedFileError

            raise DamagedFileError(f"{file} is damaged ({err}); if the images in {out} were made with these "
                                   "settings, delete it and rerun, else use another --out") from err
        if previous != current:
            changed = sorted(k for k in set(previous) | set(current) if previous.get(k) != current.get(k))
            raise UsageError(f"{out} holds images generated with other settings (changed: {changed}); "
                             "use another --out or delete the folder")
        return
    write_text_atomic(file, json.dumps(current, indent=2, sort_keys=True))


def item_output(out: Path, item: Item, video: bool = False) -> Path:
    """Where an item is written: ``OUT/<file>.png``, or for a video the folder of its frames
    (:meth:`~tomerge.experiments.sources.models.Item.output_name`)."""
    return out / item.output_name(video)


def write_index(out: Path, items: Sequence[Item], video: bool = False) -> None:
    """``OUT/prompts.jsonl``: one line per item (index, seed, file, prompt or label, and the input image of an
    editing pipeline's item), rewritten whole; for a video ``file`` is the item's folder of frames."""
    lines = [json.dumps({"index": i.index, "seed": i.seed, "file": i.output_name(video),
                         **({"prompt": i.prompt} if i.prompt is not None else {"label": i.label}),
                         **({"image": i.image} if i.image is not None else {})})
             for i in items]
    write_text_atomic(out / INDEX_FILE, "\n".join(lines) + "\n")


def read_index(out: Path) -> list[Item]:
    """The items of a generation folder, from its ``prompts.jsonl``."""
    file = out / INDEX_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{out} has no {INDEX_FILE}")
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [Item(r["index"], r["seed"], label=r.get("label"), prompt=r.get("prompt"), image=r.get("image"))
            for r in rows]


# ---------------------------------------------------------------------------------------- work
def generate_batch(source: Any, batch: Sequence[Item], spec: GenerateSpec) -> Tensor:
    """Images ``[B, C, H, W]`` (video pipelines: ``[B, T, C, H, W]``) in ``[-1, 1]`` (float32, CPU) of one
    batch, with the spec's merging.

    Random merge choices are made inside a forked RNG seeded from the batch's first seed, so they
    do not depend on what ran before in the process.
    """
    import torch

    device = torch.device(source.spec.device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(batch[0].seed)
        if spec.strategy == "none":
            return source.generate(batch)
        with merging(source, spec):
            return source.generate(batch)


def merging(source: Any, spec: Any):
    """``tomerge.merging`` for one run spec on ``source`` (its flat config options sorted into apply's keyword
    groups; the reference DiT also gets the sampler's step count)."""
    from tomerge.attach import apply_arguments

    return tomerge.merging(source.target, spec.strategy, ratio=spec.ratio,
                           **apply_arguments({**source.merge_options(), **spec.options}))


def save_image(image: Tensor, path: Path) -> None:
    """``[C, H, W]`` in ``[-1, 1]`` (C = 1 or 3) -> PNG, written atomically (no half files on resume)."""
    import torch
    from PIL import Image

    array = ((image.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)  # [C, H, W]
    if array.shape[0] == 1:
        pil = Image.fromarray(array[0].numpy(), mode="L")
    elif array.shape[0] == 3:
        pil = Image.fromarray(array.permute(1, 2, 0).contiguous().numpy(), mode="RGB")
    else:
        raise ValueError(f"can write 1- or 3-channel images, got {array.shape[0]} channels")
    with atomic_path(path) as tmp:  # a full disk: DiskFullError naming the file, no half file left
        pil.save(tmp, format="PNG")


def save_video(frames: Tensor, folder: Path) -> None:
    """``[T, C, H, W]`` in ``[-1, 1]`` -> ``folder/frame_000.png``, ... (one PNG per frame), written into a
    temporary folder that is renamed to ``folder`` once complete (no half videos on resume)."""
    if frames.ndim != 4:
        raise ValueError(f"a video is [T, C, H, W], got shape {tuple(frames.shape)}")
    if folder.is_dir():  # a damaged video (process_batch regenerates it): os.replace cannot replace a folder
        import shutil

        shutil.rmtree(folder)
    with atomic_path(folder) as tmp:
        tmp.mkdir()
        for t, frame in enumerate(frames):  # frame: [C, H, W]
            save_image(frame, tmp / f"frame_{t:03d}.png")


def process_batch(source: Any, batch: Sequence[Item], spec: GenerateSpec, out: Path, rank: int = 0) -> int:
    """Generates a batch unless all its files (video: frame folders) exist whole; writes only the missing
    ones (a truncated PNG counts as missing: :func:`~tomerge.experiments.generation.files.output_complete`); returns
    how many."""
    import warnings

    video = bool(getattr(source, "video", False))
    missing = [k for k, item in enumerate(batch) if not output_complete(item_output(out, item, video))]
    if not missing:
        return 0
    damaged = [item_output(out, batch[k], video) for k in missing if item_output(out, batch[k], video).exists()]
    if damaged:
        warnings.warn(f"{', '.join(map(str, damaged))}: truncated or damaged, written again", stacklevel=2)
    outputs = generate_batch(source, batch, spec)  # [B, C, H, W] or [B, T, C, H, W]
    for k in missing:
        target = item_output(out, batch[k], video)
        (save_video if video else save_image)(outputs[k], target)
        append_line(out / LOG_FILE, json.dumps({"file": target.name, "rank": rank}), sync=False)
    return len(missing)


def prepare(out: Path, items: Sequence[Item], spec: GenerateSpec) -> None:
    """Creates ``out``, checks/records the settings and writes the item index."""
    out.mkdir(parents=True, exist_ok=True)
    check_settings(out, spec)
    write_index(out, items, video=spec.model.is_video)


def tidy(out: Path) -> None:
    """What killed writers left in ``out``: their temporary files go, and an unfinished last line of
    ``generated.jsonl`` is cut off. Only for the holder of the folder's lock (:func:`lock_output`)."""
    remove_temp_files(out, depth=1)
    repair_jsonl_tail(out / LOG_FILE)


def lock_output(out: Path, command: str = "tomerge generate"):
    """Locks the output folder for this process (one writer per folder; see
    :func:`~tomerge.experiments.generation.files.lock_folder`) and tidies it (:func:`tidy`); returns the lock to
    ``release()`` (or use in ``with``)."""
    out.mkdir(parents=True, exist_ok=True)
    lock = lock_folder(out, command)
    try:
        tidy(out)
    except BaseException:
        lock.release()
        raise
    return lock


def generate_local(items: Sequence[Item], spec: GenerateSpec, out: Path, source: Any = None,
                   progress: bool = True) -> int:
    """One process: every batch in order (``source``: an already loaded model source, reused).
    Returns the number of images written."""
    from tqdm import tqdm

    source = source if source is not None else spec.model.load()
    source.check_items(items)
    prepare(out, items, spec)
    written = 0
    for batch in tqdm(make_batches(items, spec.batch_size), desc=f"generate {out.name}", unit="batch",
                      disable=not progress):
        written += process_batch(source, batch, spec, out)
    return written
