"""Train the bundled reference model: a small class-conditional native DiT on Fashion-MNIST.

Rectified flow as in SD3 (the model predicts the velocity ``noise - x0``), labels dropped to the null class for
classifier-free guidance, AdamW with warm-up and gradient clipping, and an EMA of the weights, which is what gets
exported. :func:`train` writes resumable checkpoints, and a stopped run continues bit for bit as the uninterrupted
run (:class:`EpochPermutations`); :func:`export_checkpoint` writes the EMA weights of any checkpoint. Its command
line is ``tomerge train-reference``; the model, its training and its files: docs/reference-model.md.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime as _dt
import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tomerge.backbones.timm_dit import DiT, DiTConfig

    from .data import FashionMNIST
# torch, the model (timm), the data and Lightning are imported where they are used: `--help` needs none.

__all__ = ["TrainingOptions", "reference_dit_config", "train", "checkpoint_to_resume", "export_checkpoint",
           "build_module", "EpochPermutations", "EMA_EXPORT_NAME"]

EMA_EXPORT_NAME = "dit_reference_ema.safetensors"


@dataclasses.dataclass(frozen=True)
class TrainingOptions:
    """How :func:`train` trains: the optimizer, the time distribution, checkpoints, exports and logging (each a
    ``tomerge train-reference`` flag of the same name, these its defaults).

    Args:
        max_steps: optimizer steps in total (a resumed run counts the steps done before).
        batch_size: images per step.
        lr, weight_decay: AdamW's, after ``warmup_steps`` steps of linear warm-up.
        grad_clip: the gradient-norm clip; 0: none.
        ema_decay: the EMA's decay (warmed up: ``min(ema_decay, (1 + n) / (10 + n))`` at step ``n``).
        t_sampling: ``"logit-normal"`` or ``"uniform"``.
        accelerator: Lightning's: ``"auto"`` (a GPU when one is present), ``"cpu"`` or ``"gpu"``.
        init_from: exported weights (safetensors) that model and EMA start from when there is no checkpoint to
            resume; the optimizer starts fresh.
        seed: the seed of the initial weights, the data order and each step's noise.
        ckpt_minutes: a checkpoint every this many minutes of training ...
        ckpt_every_steps: ... or, when > 0, every this many steps.
        export_every: the EMA weights to ``OUT_DIR/{EMA_EXPORT_NAME}`` every this many steps; 0: at the end only.
        log_every: a plain log line (and a logged loss) every this many steps.
        progress_refresh: the progress bar refreshes every this many steps; 0: no bar.
    """

    max_steps: int = 200_000
    batch_size: int = 32
    lr: float = 3e-4
    weight_decay: float = 0.0
    warmup_steps: int = 200
    grad_clip: float = 1.0
    ema_decay: float = 0.999
    t_sampling: str = "logit-normal"
    accelerator: str = "auto"
    init_from: str | None = None
    seed: int = 0
    ckpt_minutes: float = 5.0
    ckpt_every_steps: int = 0
    export_every: int = 500
    log_every: int = 50
    progress_refresh: int = 10


def reference_dit_config(preset: str, **overrides: Any) -> DiTConfig:
    """The DiT to train: ``DiTConfig.preset(preset, **overrides)`` (fields of :class:`DiTConfig`: ``input_size``,
    ``patch_size``, ``hidden_size``, ...), which must take square 1-channel images (Fashion-MNIST).

    Example:
        >>> reference_dit_config("reference-1024", depth=2).image_hw
        (64, 64)
        >>> reference_dit_config("reference", in_channels=3)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
            ...
        ValueError: the reference model trains on square 1-channel Fashion-MNIST images; the config has ...
    """
    from tomerge.backbones.timm_dit import DiTConfig

    config = DiTConfig.preset(preset, **overrides)
    h, w = config.image_hw
    if h != w or config.in_channels != 1:
        raise ValueError(f"the reference model trains on square 1-channel Fashion-MNIST images; the config has "
                         f"input_size {config.input_size} and in_channels {config.in_channels}")
    return config


# ------------------------------------------------------------------------------- lightning module
def build_module(config: DiTConfig, **hparams: Any):
    """The ``LightningModule`` (created lazily so importing this file does not import Lightning)."""
    return _module_class()(config.to_dict(), **hparams)


_MODULE_CLASS = None


def _module_class():
    global _MODULE_CLASS  # cache of a lazily defined class, not mutable state
    if _MODULE_CLASS is not None:
        return _MODULE_CLASS
    import pytorch_lightning as pl
    import torch

    from tomerge.backbones.timm_dit import DiT, DiTConfig

    class ReferenceDiT(pl.LightningModule):
        """Rectified-flow training of a native DiT with an EMA copy (``self.ema``)."""

        def __init__(self, config: dict, lr: float = 3e-4, weight_decay: float = 0.0, warmup_steps: int = 200,
                     ema_decay: float = 0.999, t_sampling: str = "logit-normal", data: str = "",
                     seed: int = 0) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.config = DiTConfig.from_dict(config)
            self.model = DiT(self.config)
            self.ema = copy.deepcopy(self.model).requires_grad_(False).eval()
            self.smoothed_loss = float("nan")

        def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
            return self.model(x, t, y)

        def sample_t(self, n: int, device: torch.device) -> Tensor:
            if self.hparams.t_sampling == "uniform":
                return torch.rand(n, device=device)
            return torch.sigmoid(torch.randn(n, device=device))  # logit-normal(0, 1), SD3

        def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
            # Step n draws its noise, times and label drops from the seed (seed, n): with the data order of
            # EpochPermutations, a resumed run continues exactly as the uninterrupted one would have.
            torch.manual_seed(self.hparams.seed * 1_000_003 + self.global_step)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x0, y = batch  # [B, 1, S, S] in [-1, 1] (S = config image side), [B]
            noise = torch.randn_like(x0)
            t = self.sample_t(x0.shape[0], x0.device)  # [B]
            tb = t.view(-1, 1, 1, 1)
            xt = (1 - tb) * x0 + tb * noise
            v = self.model(xt, t, y)[:, : x0.shape[1]]
            loss = torch.nn.functional.mse_loss(v, noise - x0)
            value = float(loss.detach())
            self.smoothed_loss = value if math.isnan(self.smoothed_loss) else 0.98 * self.smoothed_loss + 0.02 * value
            self.log("train/loss", loss, prog_bar=True, on_step=True)
            self.log("train/loss_smooth", self.smoothed_loss, prog_bar=True, on_step=True)
            return loss

        @torch.no_grad()
        def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
            n = self.global_step
            decay = min(self.hparams.ema_decay, (1 + n) / (10 + n))
            ema_p = list(self.ema.parameters())
            torch._foreach_lerp_(ema_p, [p.detach() for p in self.model.parameters()], 1.0 - decay)

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.model.parameters(), lr=self.hparams.lr,
                                    weight_decay=self.hparams.weight_decay, betas=(0.9, 0.999))
            warm = max(1, int(self.hparams.warmup_steps))
            sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

        def on_save_checkpoint(self, checkpoint: dict) -> None:
            checkpoint["smoothed_loss"] = self.smoothed_loss

        def on_load_checkpoint(self, checkpoint: dict) -> None:
            self.smoothed_loss = float(checkpoint.get("smoothed_loss", float("nan")))

    class LogLine(pl.Callback):
        """A plain line every N steps (readable in a nohup log next to the progress bar)."""

        def __init__(self, every: int) -> None:
            self.every, self.t0, self.s0 = every, None, 0

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            step = trainer.global_step
            if self.t0 is None:
                self.t0, self.s0 = time.time(), step
                return
            if self.every and step % self.every == 0:
                rate = (time.time() - self.t0) / max(1, step - self.s0)
                print(f"[{_dt.datetime.now():%H:%M:%S}] step {step} loss {float(outputs['loss']):.4f} "
                      f"smooth {module.smoothed_loss:.4f} lr {trainer.optimizers[0].param_groups[0]['lr']:.2e} "
                      f"{rate:.2f} s/step", flush=True)
                self.t0, self.s0 = time.time(), step

    class ExportEMA(pl.Callback):
        """Write the EMA weights to ``path`` every ``every`` steps and at the end of training."""

        def __init__(self, path: Path, every: int, data: str) -> None:
            self.path, self.every, self.data = path, every, data

        def _export(self, trainer, module) -> None:
            _write_export(module.ema, trainer.global_step, module.smoothed_loss, self.path,
                          dict(module.hparams), data=self.data, source="training run")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            if self.every and trainer.global_step % self.every == 0:
                self._export(trainer, module)

        def on_train_end(self, trainer, module) -> None:
            if trainer.global_step > 0:
                self._export(trainer, module)

    ReferenceDiT.LogLine, ReferenceDiT.ExportEMA = LogLine, ExportEMA
    _MODULE_CLASS = ReferenceDiT
    return ReferenceDiT


# ----------------------------------------------------------------------------------------- export
def _write_export(ema: DiT, steps: int, loss: float, path: Path, hparams: dict, data: str, source: str) -> dict:
    """EMA weights -> ``path`` (safetensors, config in the header) and ``path.with_suffix('.json')``."""
    from tomerge.backbones.timm_dit import save_dit

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    info = {
        "config": ema.config.to_dict(),
        "steps": int(steps),
        "final_loss": None if math.isnan(loss) else round(float(loss), 6),
        "loss_note": "exponential moving average (0.98) of the per-step rectified-flow MSE",
        "objective": "rectified flow (SD3): x_t = (1 - t) x0 + t noise, predicts noise - x0",
        "timestep": "forward(x, t, y) takes t in [0, 1] (1 = noise); scaled by config.timestep_scale inside",
        "t_sampling": hparams.get("t_sampling"),
        "lr": hparams.get("lr"),
        "ema_decay": hparams.get("ema_decay"),
        "data": data,
        "weights": "EMA",
        "source": source,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    tmp = path.with_name(path.name + ".tmp")
    save_dit(ema, tmp, extra_metadata={"steps": str(int(steps)), "info": json.dumps(info)})
    os.replace(tmp, path)  # atomic: a reader never sees a half-written file
    side = path.with_suffix(".json")
    side.write_text(json.dumps(info, indent=2) + "\n")
    return info



def checkpoint_to_resume(out_dir: str | os.PathLike, resume: str | os.PathLike | None) -> Path | None:
    """The checkpoint a run in ``out_dir`` continues from: for ``resume`` ``None`` or ``"last"``
    ``OUT_DIR/last.ckpt`` when it exists (``None``, a fresh start, when not); else the file ``resume`` names,
    which must exist."""
    if resume in (None, "last"):
        last = Path(out_dir) / "last.ckpt"
        return last if last.is_file() else None
    path = Path(resume)
    if not path.is_file():
        raise FileNotFoundError(f"--resume checkpoint {path} does not exist")
    return path


def export_checkpoint(ckpt: str | os.PathLike, out_path: str | os.PathLike) -> dict:
    """Write the EMA weights of a training checkpoint to ``out_path`` (safetensors) + ``.json``.

    Returns:
        The info dict written to the JSON file (config, steps, final loss, ...).
    """
    ckpt = Path(ckpt)
    if not ckpt.is_file():
        raise FileNotFoundError(f"checkpoint {ckpt} does not exist; train first or pass --resume CKPT")
    import torch

    from tomerge.backbones.timm_dit import DiT, DiTConfig

    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    hparams = dict(state["hyper_parameters"])
    config = DiTConfig.from_dict(hparams["config"])
    ema = DiT(config)
    ema_state = {k[len("ema."):]: v for k, v in state["state_dict"].items() if k.startswith("ema.")}
    ema.load_state_dict(ema_state, strict=True)
    return _write_export(ema, state["global_step"], float(state.get("smoothed_loss", float("nan"))),
                         Path(out_path), hparams, data=str(hparams.get("data", "Fashion-MNIST train")),
                         source=str(ckpt))


# ------------------------------------------------------------------------------------------ data
class EpochPermutations:
    """Batches of a fixed random permutation per epoch, resumable at any step.

    Epoch ``e`` visits the ``n`` images in the order ``randperm(n)`` of a generator seeded with
    ``seed + e`` (the last incomplete batch is dropped), so the order is a function of the step alone: a
    run resumed at step ``start_batch`` sees exactly the images that the uninterrupted run would have
    seen. The first iteration yields the rest of epoch ``start_batch // len(self)``; each further
    iteration one full epoch. ``len()`` is the number of batches per epoch (what Lightning counts on).
    """

    def __init__(self, n: int, batch_size: int, seed: int = 0, start_batch: int = 0) -> None:
        if batch_size < 1 or n < batch_size:
            raise ValueError(f"{n} images cannot fill a batch of {batch_size}")
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.epoch, self.skip = divmod(start_batch, len(self))

    def __len__(self) -> int:
        return self.n // self.batch_size

    def __iter__(self):
        import torch

        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        batches = order[: len(self) * self.batch_size].view(len(self), self.batch_size)  # [batches, B]
        skip, self.epoch, self.skip = self.skip, self.epoch + 1, 0
        for batch in batches[skip:]:
            yield batch.tolist()


def _checkpoint_steps(ckpt: Path) -> int:
    """The optimizer steps a Lightning checkpoint has done (read without loading the tensors' data)."""
    import torch

    return int(torch.load(ckpt, map_location="cpu", weights_only=True, mmap=True)["global_step"])



# ------------------------------------------------------------------------------------------- train
def train(config: DiTConfig, dataset: FashionMNIST, data_root: str | os.PathLike, out_dir: str | os.PathLike,
          options: TrainingOptions = TrainingOptions(), resume: str | os.PathLike | None = None,
          wandb_logger: Callable[[Path, DiTConfig], Any] | None = None) -> None:
    """Trains a DiT of ``config`` on ``dataset`` (Fashion-MNIST read from ``data_root``, which the checkpoints
    and exports record) as the module docstring says, writing checkpoints, logs (``OUT_DIR/csv``) and EMA
    exports to ``out_dir``.

    Args:
        resume: the checkpoint to continue from (:func:`checkpoint_to_resume`; ``"last"``: ``OUT_DIR/last.ckpt``
            when it exists); ``None``: a fresh start (from ``options.init_from`` when given).
        wandb_logger: called with ``(out_dir, config)`` once the model is built, a W&B Lightning logger or
            ``None``; a run it returns is finished (``wandb.finish()``) when training ends.
    """
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader

    out_dir = Path(out_dir)
    pl.seed_everything(options.seed, workers=True)
    ckpt = checkpoint_to_resume(out_dir, resume)
    done = _checkpoint_steps(ckpt) if ckpt is not None else 0
    sampler = EpochPermutations(len(dataset), options.batch_size, seed=options.seed, start_batch=done)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    size = config.image_hw[0]
    shown = "28x28 padded to 32x32" if size == 32 else f"28x28 upsampled to {28 * size // 32} and padded to {size}x{size}"
    data = f"Fashion-MNIST train ({len(dataset)} images, {shown}) from {data_root}"
    module = build_module(config, lr=options.lr, weight_decay=options.weight_decay, warmup_steps=options.warmup_steps,
                          ema_decay=options.ema_decay, t_sampling=options.t_sampling, data=data, seed=options.seed)

    trigger = ({"every_n_train_steps": options.ckpt_every_steps} if options.ckpt_every_steps > 0
               else {"train_time_interval": _dt.timedelta(minutes=options.ckpt_minutes)})
    # enable_version_counter=False: a run resumed in a copied or moved folder overwrites last.ckpt,
    # which resume="last" reads, instead of writing last-v1.ckpt beside it
    periodic = ModelCheckpoint(dirpath=out_dir, filename="step{step:07d}", auto_insert_metric_name=False,
                               save_last=True, save_top_k=1, enable_version_counter=False, **trigger)
    cls = _module_class()
    callbacks = [periodic, cls.LogLine(options.log_every),
                 cls.ExportEMA(out_dir / EMA_EXPORT_NAME, options.export_every, data)]
    if options.progress_refresh > 0:
        callbacks.append(TQDMProgressBar(refresh_rate=options.progress_refresh))
    loggers = [CSVLogger(str(out_dir), name="csv")]
    wb = wandb_logger(out_dir, config) if wandb_logger is not None else None
    if wb is not None:
        loggers.append(wb)

    trainer = pl.Trainer(
        accelerator=options.accelerator, devices=1, precision="32-true", max_steps=options.max_steps, max_epochs=-1,
        logger=loggers, callbacks=callbacks, log_every_n_steps=max(1, options.log_every),
        gradient_clip_val=options.grad_clip or None, enable_progress_bar=options.progress_refresh > 0,
        default_root_dir=str(out_dir), num_sanity_val_steps=0, enable_model_summary=True,
    )
    if ckpt is not None:
        print(f"resuming from {ckpt} (step {done}; the data order continues where it stopped)", flush=True)
    elif options.init_from:
        from tomerge.backbones.timm_dit import load_dit

        weights = load_dit(options.init_from, config=config).state_dict()
        module.model.load_state_dict(weights)
        module.ema.load_state_dict(weights)
        print(f"warm start from {options.init_from} (fresh optimizer)", flush=True)
    import warnings

    # EpochPermutations resumes the data order from the checkpoint's step itself (start_batch), which
    # Lightning cannot see: its "dataloader is not resumable" warning does not apply here.
    warnings.filterwarnings("ignore", message="You're resuming from a checkpoint that ended before the epoch ended")
    try:
        trainer.fit(module, train_dataloaders=loader, ckpt_path=str(ckpt) if ckpt else None, weights_only=True)
    finally:
        if trainer.global_step > 0:
            trainer.save_checkpoint(out_dir / "last.ckpt", weights_only=False)  # with optimizer state; also on Ctrl-C / SIGTERM
        if wb is not None:
            import wandb

            wandb.finish()
