"""Generation over several processes: PyTorch Lightning's ``Trainer.predict`` with DDP (gloo on CPU, NCCL on
GPU) over ``devices x num_nodes`` ranks (:func:`generate_distributed`). Rank ``r`` of ``W`` takes the batches
``r, r + W, r + 2W, ...`` (:func:`~tomerge.experiments.generation.generate.shard`) and loads the model itself on
its device. ``launcher="ddp"`` re-executes the command once per extra rank (Lightning's default, also right
under SLURM/torchrun); ``ddp_spawn`` / ``ddp_fork`` start them with ``multiprocessing`` spawn / fork (fork: CPU
only, or before CUDA is initialised; the cheapest start, used by the tests).

A rank that dies, fails or hangs stops the others with a :class:`RankFailedError` naming it
(:func:`generate_distributed` says how); what was written is kept (:data:`RESUME`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import RankFailedError, UserError
from ..sources.items import Item
from .generate import GenerateSpec, make_batches, process_batch, shard

__all__ = ["DEFAULT_TIMEOUT_S", "RESUME", "generate_distributed"]

DEFAULT_TIMEOUT_S = 1800.0  # PyTorch's default process-group timeout


RESUME = "the images written so far are kept: rerun the same command to resume"


LOST_RANK = re.compile(r"failed to pass monitoredBarrier|Connection (closed|reset) by peer|[Tt]imed out")


@functools.cache
def _lightning_module_class() -> type:
    """The ``LightningModule`` for ``Trainer.predict``, defined on first use (Lightning is imported lazily).

    Reachable as ``tomerge.experiments.generation.distributed.GenerateModule`` (module ``__getattr__``), so
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
    GenerateModule.__module__ = "tomerge.experiments.generation.distributed"
    return GenerateModule


def __getattr__(name: str) -> Any:
    if name == "GenerateModule":
        return _lightning_module_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    (CPU) or ``"ddp_spawn"``. The caller prepares ``out``
    (:func:`~tomerge.experiments.generation.generate.prepare`) on one rank first.

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
