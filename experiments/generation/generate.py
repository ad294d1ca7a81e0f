"""`tomerge generate`: images for a class list or a prompt set with a chosen strategy, for metrics at scale.

    tomerge generate --classes 0 1 2 --per-class 100 --out runs/gen/base                     # reference DiT, unmerged
    tomerge generate --pipeline /models/sd3-medium --dtype fp16 --prompts captions_val2017.json \\
        --num-prompts 1000 --call num_inference_steps=28 --strategy sdtm --out runs/gen/sdtm --devices 4
    tomerge generate --config experiments/configs/papers/sdtm_sd3_medium.yaml \\
        --set model.pipeline=/models/sd3-medium --strategy tomesd --ratio 0.5 --out runs/gen/tomesd

Item ``i`` (classes repeated ``--per-class`` times, or prompts repeated ``--images-per-prompt``
times, in order) gets the seed ``--seed + i``; its initial noise comes from
``torch.Generator("cpu").manual_seed(seed)`` exactly as in ``tomerge ablate``, and it is written to
``OUT/{i:05d}_class{c}_seed{seed}.png`` (classes) or ``OUT/{i:05d}_seed{seed}.png`` (prompts), listed
with its prompt in ``OUT/prompts.jsonl``. Each image written is also logged in
``OUT/generated.jsonl`` with the rank that wrote it.

Video pipelines (Wan, HunyuanVideo, LTX-Video, Latte: a ``__call__`` taking ``num_frames`` or ``video_length``,
``sources.VIDEO_CALL_ARGS``) write each item as a folder ``OUT/{i:05d}_seed{seed}/`` of one PNG per frame
(``frame_000.png``, ``frame_001.png``, ...), made whole under a temporary name and renamed into place, so a
folder that exists is complete.

Resume: the list is cut into fixed batches of ``--batch-size`` consecutive items; a batch whose files
all exist is skipped, and a partly finished one is recomputed whole but only its missing files are
written. Batches never change composition, and random merge choices are seeded per batch, so an
image depends only on its index, seed, the batch size and the settings (recorded in
``OUT/generate.json``; a rerun with other settings into the same folder is refused), never on the
number of processes or on what was generated before.

Several processes: ``--devices N`` (and ``--num-nodes``) run PyTorch Lightning's ``Trainer.predict``
with DDP (gloo on CPU, NCCL on GPU); rank ``r`` of ``W`` takes batches ``r, r + W, r + 2W, ...`` and
loads the model itself on its device. ``--launcher ddp`` re-executes the command once per extra rank
(Lightning's default, also right under SLURM/torchrun); ``ddp_spawn`` / ``ddp_fork`` start them with
``multiprocessing`` spawn / fork (fork: CPU only, or before CUDA is initialised; the cheapest start,
used by the tests).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import tomerge

from ..errors import RankFailedError, UsageError, UserError, user_input
from ..config.schema import apply_override, parse_override
from .files import append_line, atomic_path, lock_folder, output_complete, remove_temp_files, \
    repair_jsonl_tail, write_text_atomic
from ..sources.models import REFERENCE_CHECKPOINT, Item, ModelSpec

if TYPE_CHECKING:
    from torch import Tensor
# torch (and Lightning, PIL, tqdm) are imported in the functions that run a model, so that `tomerge
# generate --help` and the configs load without them.

__all__ = ["Item", "GenerateSpec", "read_class_file", "build_items", "make_batches", "shard", "write_index",
           "generate_batch", "process_batch", "generate_local", "generate_distributed", "item_output", "save_video",
           "add_arguments", "run"]

SETTINGS_FILE = "generate.json"
INDEX_FILE = "prompts.jsonl"
LOG_FILE = "generated.jsonl"


# ---------------------------------------------------------------------------------------- items
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
    """Every class ``per_class`` times, in order (as ``AblationConfig.items``); item ``i`` has seed ``seed + i``.

    Example:
        >>> [(i.index, i.label, i.seed) for i in build_items([4, 2], per_class=2, seed=10)]
        [(0, 4, 10), (1, 4, 11), (2, 2, 12), (3, 2, 13)]
    """
    if per_class < 1:
        raise ValueError(f"--per-class must be >= 1, got {per_class}")
    labels = [int(c) for c in classes for _ in range(per_class)]
    return [Item(i, seed + i, label=c) for i, c in enumerate(labels)]


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
    _write_atomic(file, json.dumps(current, indent=2, sort_keys=True))


def item_output(out: Path, item: Item, video: bool = False) -> Path:
    """Where an item is written: ``OUT/<file>.png``, or for a video the folder of its frames
    (:meth:`Item.output_name`)."""
    return out / item.output_name(video)


def write_index(out: Path, items: Sequence[Item], video: bool = False) -> None:
    """``OUT/prompts.jsonl``: one line per item (index, seed, file, prompt or label, and the input image of an
    editing pipeline's item), rewritten whole; for a video ``file`` is the item's folder of frames."""
    lines = [json.dumps({"index": i.index, "seed": i.seed, "file": i.output_name(video),
                         **({"prompt": i.prompt} if i.prompt is not None else {"label": i.label}),
                         **({"image": i.image} if i.image is not None else {})})
             for i in items]
    _write_atomic(out / INDEX_FILE, "\n".join(lines) + "\n")


def read_index(out: Path) -> list[Item]:
    """The items of a generation folder, from its ``prompts.jsonl``."""
    file = out / INDEX_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{out} has no {INDEX_FILE}")
    rows = [json.loads(line) for line in file.read_text().splitlines() if line.strip()]
    return [Item(r["index"], r["seed"], label=r.get("label"), prompt=r.get("prompt"), image=r.get("image"))
            for r in rows]


def _write_atomic(path: Path, text: str) -> None:
    write_text_atomic(path, text)


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
        with tomerge.merging(source.target, spec.strategy, ratio=spec.ratio,
                             **{**source.merge_options(), **spec.options}):
            return source.generate(batch)


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


@functools.cache
def _lightning_module_class() -> type:
    """The ``LightningModule`` for ``Trainer.predict``, defined on first use (Lightning is imported lazily).

    Reachable as ``tomerge.experiments.generation.generate.GenerateModule`` (module ``__getattr__``), so
    ``ddp_spawn`` can pickle it.
    """
    import pytorch_lightning as pl

    class GenerateModule(pl.LightningModule):
        """Loads the model on its rank's device in ``setup``, generates this rank's shard of batches in
        ``predict_step`` and writes the PNGs."""

        def __init__(self, items: list[Item], spec: GenerateSpec, out: str, threads: int | None = None,
                     timeout: float = DEFAULT_TIMEOUT_S) -> None:
            super().__init__()
            self.items, self.spec, self.out, self.threads, self.timeout = items, spec, out, threads, timeout
            self.source = None

        def setup(self, stage: str) -> None:
            import torch

            from ..plugins import load_plugins

            if self.threads:
                torch.set_num_threads(self.threads)
            load_plugins(self.spec.plugins)  # a spawned rank starts with the built-ins only
            device = self.trainer.strategy.root_device
            model = dataclasses.replace(self.spec.model, device=str(device))
            self.source = model.load()

        def predict_dataloader(self):
            from torch.utils.data import DataLoader

            batches = make_batches(self.items, self.spec.batch_size)
            mine = shard(len(batches), self.trainer.global_rank, self.trainer.world_size)
            work = [{"batch_index": b, "items": [dataclasses.astuple(i) for i in batches[b]]} for b in mine]
            # Lightning refuses a rank with nothing to do (fewer batches than ranks): give it an empty batch.
            return DataLoader(work or [{"batch_index": -1, "items": []}], batch_size=None, collate_fn=lambda x: x)

        def predict_step(self, batch: dict[str, Any], batch_idx: int) -> int:
            items = [Item(*t) for t in batch["items"]]
            if not items:
                return 0
            return process_batch(self.source, items, self.spec, Path(self.out), rank=self.trainer.global_rank)

        def on_predict_end(self) -> None:
            """Every rank waits here for the others to finish their shares, at most ``timeout`` seconds: a rank
            that hangs (or died unnoticed) stops the job with an error naming it instead of blocking it."""
            import datetime

            import torch.distributed as dist

            if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
                return
            if dist.get_backend() == "gloo":  # names the late ranks
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=self.timeout), wait_all_ranks=True)
            else:  # NCCL: its watchdog enforces the process-group timeout
                dist.barrier()

    GenerateModule.__qualname__ = "GenerateModule"
    GenerateModule.__module__ = "tomerge.experiments.generation.generate"
    return GenerateModule


def __getattr__(name: str) -> Any:
    if name == "GenerateModule":
        return _lightning_module_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


DEFAULT_TIMEOUT_S = 1800.0  # PyTorch's default process-group timeout


RESUME = "the images written so far are kept: rerun the same command to resume"


LOST_RANK = re.compile(r"failed to pass monitoredBarrier|Connection (closed|reset) by peer|[Tt]imed out")


def _rank_failure(err: BaseException, world_size: int, rank: int, timeout: float) -> RankFailedError | None:
    """The :class:`RankFailedError` for a fault of a rank: what ``torch.multiprocessing`` raised when a rank of
    ``ddp_spawn`` / ``ddp_fork`` was killed, exited with a code, raised a tomerge user error (a full disk, ...)
    or lost the others (:data:`LOST_RANK`: a rank that waited ``timeout`` seconds for them at the end, a
    connection closed); or that error raised in this process (rank ``rank``: ``ddp``, torchrun, SLURM).
    ``None`` for another exception (a bug: its traceback is shown)."""
    import importlib

    from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

    lost = (f"the other ranks did not all reach the end within --timeout {timeout:g} s, or a connection to one "
            "closed (a rank hangs, died or lost its node)")
    if not isinstance(err, ProcessException):  # raised in this process
        detail = next((line for line in str(err).splitlines() if LOST_RANK.search(line)), None)
        if isinstance(err, RuntimeError) and detail is not None:
            return RankFailedError(f"rank {rank} of {world_size}: {lost}: {_short(detail)}; {RESUME}")
        return None
    who = f"rank {err.error_index} of {world_size} (pid {err.error_pid})"
    if isinstance(err, ProcessExitedException):
        how = (f"was killed by {err.signal_name}" if err.signal_name else f"exited with code {err.exit_code}")
        return RankFailedError(f"{who} {how} (out of memory? killed?); the other ranks were stopped; {RESUME}")
    last = next((line for line in reversed(str(err).splitlines()) if line.strip()), "")
    name, _, message = last.partition(": ")
    module, _, cls = name.rpartition(".")
    try:
        raised = getattr(importlib.import_module(module), cls) if module else None
    except (ImportError, ValueError):
        raised = None
    if isinstance(raised, type) and issubclass(raised, UserError):
        return RankFailedError(f"{who}: {message}")
    if re.match(r"(OSError|\w+Error): \[Errno (28|122)\]", last):  # ENOSPC, EDQUOT, as errors.is_user_error
        return RankFailedError(f"{who}: {message}; {RESUME}")
    if LOST_RANK.search(last):
        return RankFailedError(f"{who}: {lost}: {_short(message)}; the other ranks were stopped; {RESUME}")
    return None


def _short(detail: str) -> str:
    """A gloo message without its source location and advice: ``Connection closed by peer [127.0.0.1]:39059``."""
    detail = re.sub(r"\[[^\]]*\.(cc|cpp|h):\d+\]\s*", "", detail.strip())
    return detail.split(". ")[0].rstrip(".")


@functools.cache
def _report_dead_children() -> None:
    """With ``launcher="ddp"`` Lightning's observer thread in rank 0 kills every rank (rank 0 too, with
    SIGKILL) a few seconds after a rank it started died: say which rank and how first, as a one-line
    error, instead of dying silently."""
    try:
        from lightning_fabric.strategies.launchers import subprocess_script as launchers
        observer = launchers._ChildProcessObserver
        original = observer._terminate_all
    except (ImportError, AttributeError):  # another Lightning: its own message stays
        return
    import signal
    import sys

    def terminate_all(self) -> None:
        try:
            children = self._child_processes
            world = len(children) + 1
            for i, proc in enumerate(children, 1):
                if proc.returncode:
                    code = proc.returncode
                    how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
                    print(f"tomerge generate: error: rank {i} of {world} on this node (pid {proc.pid}) {how}; "
                          f"the other ranks are stopped; {RESUME}", file=sys.stderr, flush=True)
                    break
        except Exception:  # noqa: BLE001 - never keep Lightning from stopping the ranks
            pass
        original(self)

    observer._terminate_all = terminate_all


def generate_distributed(items: Sequence[Item], spec: GenerateSpec, out: Path, devices: int = 2,
                         accelerator: str = "cpu", num_nodes: int = 1, launcher: str = "ddp",
                         threads: int | None = None, progress: bool = True,
                         timeout: float = DEFAULT_TIMEOUT_S) -> bool:
    """``Trainer.predict`` with DDP over ``devices x num_nodes`` ranks; returns True on global rank 0.

    Every rank loads the model itself (``spec.model`` on its own device). With ``launcher="ddp"``
    Lightning re-executes the current command for the other local ranks, so call this from a script
    or console entry point; from Python (notebooks, tests, ``tomerge ablate``) use ``"ddp_fork"``
    (CPU) or ``"ddp_spawn"``. The caller prepares ``out`` (:func:`prepare`) on one rank first.

    Faults: a rank that dies (killed, out of memory) or fails with a user error stops the others and
    raises :class:`RankFailedError` (``ddp_fork`` / ``ddp_spawn``: at once; ``ddp``: Lightning stops every
    rank of the node within about 5 s, after a one-line error naming the rank). A rank waiting for the
    others in a collective (start-up, the end) longer than ``timeout`` seconds fails (the process-group
    timeout; a node that vanished, a rank that hangs).
    """
    import datetime

    import pytorch_lightning as pl
    from pytorch_lightning.strategies import DDPStrategy

    backend = "gloo" if accelerator == "cpu" else "nccl"
    start = {"ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork"}
    if launcher not in start:
        raise ValueError(f"launcher must be one of {sorted(start)}, got {launcher!r}")
    if launcher == "ddp":
        _report_dead_children()
    strategy = DDPStrategy(process_group_backend=backend, start_method=start[launcher],
                           timeout=datetime.timedelta(seconds=timeout))
    trainer = pl.Trainer(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy=strategy,
                         logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=progress, use_distributed_sampler=False, default_root_dir=str(out))
    module = _lightning_module_class()(list(items), spec, str(out), threads, timeout)
    try:
        trainer.predict(module, return_predictions=False)
    except Exception as err:
        failure = _rank_failure(err, devices * num_nodes, trainer.global_rank, timeout)
        if failure is None:
            raise
        launcher = getattr(trainer.strategy, "launcher", None)
        if hasattr(launcher, "kill"):  # ddp: the ranks this process started, which may hang (forked: stopped)
            import signal

            with contextlib.suppress(Exception):
                launcher.kill(signal.SIGKILL)
        raise failure from err
    return trainer.is_global_zero


# ---------------------------------------------------------------------------------------- CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to generate (classes for the reference DiT, prompts for a pipeline)")
    what.add_argument("--config", type=Path, default=None,
                      help="an experiment config (as for `tomerge ablate`): its model, classes/prompts, seed and "
                           "batch_size keys are used; flags below override them")
    what.add_argument("--classes", type=int, nargs="+", default=None, metavar="C", help="class ids")
    what.add_argument("--class-file", type=Path, default=None,
                      help="class ids from a file (JSON list, or text separated by spaces/commas/newlines)")
    what.add_argument("--per-class", type=int, default=None, help="images per listed class id (default: 1)")
    what.add_argument("--prompts", default=None, metavar="FILE",
                      help="prompt set: .txt, .jsonl, COCO captions .json, PartiPrompts .tsv")
    what.add_argument("--num-prompts", type=int, default=None, help="use the first N prompts (after the offset)")
    what.add_argument("--prompt-offset", type=int, default=None, help="skip the first K prompts")
    what.add_argument("--images-per-prompt", type=int, default=None, help="images per prompt (default: 1)")
    what.add_argument("--seed", type=int, default=None, help="item i uses seed SEED + i (default: 0)")
    what.add_argument("--out", type=Path, required=True, help="output folder (created; reruns resume)")
    merge = parser.add_argument_group("merging")
    merge.add_argument("--strategy", default="none", choices=["none", *tomerge.list_strategies()],
                       help="strategy or schedule (default: none, the unmerged model)")
    merge.add_argument("--ratio", type=float, default=0.5, help="merge ratio (default: %(default)s)")
    merge.add_argument("--set", dest="options", action="append", default=[], metavar="OPTION=VALUE",
                       help="strategy/adapter option, YAML value, e.g. --set use_rand=false (repeatable); "
                            "with --config, dotted config keys too (--set model.pipeline=DIR)")
    model = parser.add_argument_group("model")
    model.add_argument("--pipeline", type=Path, default=None,
                       help="a local diffusers pipeline folder (default: the reference DiT)")
    model.add_argument("--checkpoint", type=Path, default=None,
                       help="native DiT weights (default: the bundled reference model)")
    model.add_argument("--dtype", choices=["fp32", "fp16", "bf16"], default=None, help="(default: fp32)")
    model.add_argument("--call", dest="call", action="append", default=[], metavar="KEY=VALUE",
                       help="generation-call argument: for a pipeline e.g. num_inference_steps=28 height=512; "
                            "for the reference DiT num_steps, cfg_scale, shift (repeatable)")
    model.add_argument("--batch-size", type=int, default=None,
                       help="images per generation call; part of the settings (default: 16)")
    procs = parser.add_argument_group("processes")
    procs.add_argument("--devices", type=int, default=1, help="processes per node; > 1 uses Lightning DDP")
    procs.add_argument("--num-nodes", type=int, default=1, help="nodes (Lightning DDP)")
    procs.add_argument("--accelerator", choices=["cpu", "gpu", "auto"], default="auto",
                       help="(default: gpu when CUDA is available, else cpu)")
    procs.add_argument("--launcher", choices=["ddp", "ddp_spawn", "ddp_fork"], default="ddp",
                       help="how Lightning starts the extra ranks (default: %(default)s)")
    procs.add_argument("--threads", type=int, default=None, help="torch CPU threads per process")
    procs.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                       help="with --devices/--num-nodes: a rank waiting longer than this for the others (at "
                            "start-up, at the end) stops with an error (default: %(default)g)")
    procs.add_argument("--no-progress", action="store_true", help="no progress bar")


def _config_values(args: argparse.Namespace) -> dict[str, Any]:
    """Model, items, seed and batch size from ``--config`` (dotted ``--set`` keys applied), then the flags."""
    from ..config.schema import load_config

    config_overrides = [o for o in args.options if "." in o.split("=", 1)[0]]
    if args.config is None:
        if config_overrides:
            raise UsageError(f"{config_overrides} set config keys, which need --config FILE")
        return {}
    config = load_config(args.config, config_overrides, plugins=list(getattr(args, "plugins", None) or []))
    return {"model": config.model, "config": config}


def _model_spec(args: argparse.Namespace, base: ModelSpec | None) -> ModelSpec:
    values = base.to_dict() if base is not None else ModelSpec().to_dict()
    if args.pipeline is not None and args.checkpoint is not None:
        raise UsageError("give --pipeline or --checkpoint, not both")
    if args.pipeline is not None:
        values.update(kind="pipeline", path=str(args.pipeline.expanduser().resolve()), call={})
    elif args.checkpoint is not None:
        values.update(kind="reference", path=str(Path(args.checkpoint).resolve()), call={})
    elif values["kind"] == "reference" and values["path"] is None:
        values["path"] = str(REFERENCE_CHECKPOINT)
    if args.dtype is not None:
        values["dtype"] = args.dtype
    call = dict(values["call"])
    for text in args.call:
        apply_override(call, *parse_override(text))
    values["call"] = call
    accelerator = _accelerator(args)
    if accelerator == "gpu" and values["device"] == "cpu":
        values["device"] = "cuda"
    return ModelSpec(**values)


def _accelerator(args: argparse.Namespace) -> str:
    if args.accelerator == "auto":
        import torch

        return "gpu" if torch.cuda.is_available() else "cpu"
    return args.accelerator


def _items(args: argparse.Namespace, model: ModelSpec, config: Any) -> list[Item]:
    if model.conditioning == "class":
        if args.prompts is not None:
            raise UsageError("--prompts needs a text-to-image --pipeline")
        if args.classes is not None and args.class_file is not None:
            raise UsageError("give --classes or --class-file, not both")
        classes = args.classes if args.classes is not None else (
            read_class_file(args.class_file) if args.class_file is not None else
            (list(config.classes) if config is not None else None))
        if classes is None:
            raise UsageError("give --classes C [C ...] or --class-file FILE")
        if not classes:
            raise UsageError("the class list is empty")
        per_class = args.per_class or (config.per_class if config is not None else 1)
        seed = args.seed if args.seed is not None else (config.seed if config is not None else 0)
        return build_items(classes, per_class, seed)
    if args.classes is not None or args.class_file is not None:
        raise UsageError("a text-to-image pipeline takes --prompts, not class ids")
    from ..config.schema import AblationConfig

    keys = {"prompts": args.prompts, "num_prompts": args.num_prompts, "prompt_offset": args.prompt_offset,
            "images_per_prompt": args.images_per_prompt, "seed": args.seed}
    values = {k: getattr(config, k) for k in keys} if config is not None else {}
    values.update({k: v for k, v in keys.items() if v is not None})
    if values.get("prompts") is None:
        raise UsageError("a text-to-image pipeline needs --prompts FILE")
    return AblationConfig(model=model, **values).items()


def run(args: argparse.Namespace) -> int:
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    with user_input():
        from_config = _config_values(args)
        config = from_config.get("config")
        model = _model_spec(args, from_config.get("model"))
        items = _items(args, model, config)
        options = dict(parse_override(text) for text in args.options if "." not in text.split("=", 1)[0])
        batch_size = args.batch_size or (config.batch_size if config is not None else 16)
        plugins = tuple(config.plugins) if config is not None else tuple(getattr(args, "plugins", None) or ())
        spec = GenerateSpec(model=model, strategy=args.strategy, ratio=args.ratio, options=options,
                            batch_size=batch_size, plugins=plugins)
        if spec.strategy != "none":
            from tomerge.attach import check_options

            backbones = ["native_dit"] if model.kind == "reference" else None  # as the config checks a grid
            check_options(spec.strategy, ratio=spec.ratio, backbones=backbones, **spec.options)  # before any work
    out = Path(args.out)
    accelerator = _accelerator(args)
    # One writer per folder: the first process of the job locks it (the ranks it starts, or torchrun's /
    # SLURM's other ranks, share its work); a second `tomerge generate` on the folder is refused.
    lock = lock_output(out) if _first_process() else None
    try:
        if args.devices * args.num_nodes > 1:
            if int(os.environ.get("LOCAL_RANK", "0")) == 0 and int(os.environ.get("NODE_RANK", "0")) == 0:
                prepare(out, items, spec)
            is_zero = generate_distributed(items, spec, out, args.devices, accelerator, args.num_nodes,
                                           args.launcher, args.threads, progress=not args.no_progress,
                                           timeout=args.timeout)
            if not is_zero:
                return 0
        else:
            generate_local(items, spec, out, progress=not args.no_progress)
    finally:
        if lock is not None:
            lock.release()
    video = model.is_video
    done = sum(output_complete(item_output(out, i, video)) for i in items)
    kind = "videos" if video else "images"
    print(f"{done}/{len(items)} {kind} in {out}")
    if done < len(items) and args.devices * args.num_nodes > 1:  # ddp: the end barrier passed a dead rank
        raise RankFailedError(f"{len(items) - done} of {len(items)} {kind} were not written: a rank stopped before "
                              f"finishing its share (killed? out of memory? see above); {RESUME}")
    return 0 if done == len(items) else 1


def _first_process() -> bool:
    """Whether this is the job's first process (global rank 0, or no distributed launcher around)."""
    return all(int(os.environ.get(key) or 0) == 0 for key in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.generation.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    # Run through the package module, so Lightning (ddp_spawn pickling) sees one GenerateModule class.
    from tomerge.experiments.errors import module_main
    from tomerge.experiments.generation.generate import main as _main

    module_main("generate", _main)
