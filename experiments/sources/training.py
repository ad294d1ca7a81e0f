"""Train the bundled reference model: a small class-conditional native DiT on Fashion-MNIST.

Objective: rectified flow as in SD3. ``x_t = (1 - t) * x0 + t * noise``, the model predicts the
velocity ``noise - x0`` (MSE loss); ``t`` is drawn logit-normal (``sigmoid(N(0, 1))``, SD3's default)
or uniform (``--t-sampling uniform``). Labels are replaced by the null class with probability
``class_dropout_prob`` (0.1) so the model supports classifier-free guidance. AdamW with a linear
warm-up, gradient clipping, and an EMA of the weights (the EMA is what gets exported).

Checkpoints (``last.ckpt`` + the newest periodic one, Lightning format, with optimizer and EMA state)
go to ``--out-dir`` every ``--ckpt-minutes`` minutes (or every ``--ckpt-every-steps`` steps); a
stopped run continues with ``--resume``. Every ``--export-every`` steps the EMA weights are also
written to ``OUT_DIR/dit_reference_ema.safetensors`` (+ ``.json``) while training runs.

Examples:
    # train (continues from OUT_DIR/last.ckpt when it exists and --resume is given)
    python -m tomerge.experiments.sources.training --out-dir checkpoints/reference --max-steps 100000 --resume
    # export the EMA weights of the newest checkpoint (no training)
    python -m tomerge.experiments.sources.training --out-dir checkpoints/reference \\
        --export checkpoints/reference/dit_reference.safetensors   # then copy it to experiments/reference/ to ship it
    # smoke test on a handful of images
    python -m tomerge.experiments.sources.training --out-dir /tmp/ref --limit-images 64 --max-steps 5 --wandb disabled
"""

from __future__ import annotations

import argparse
import copy
import datetime as _dt
import json
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tomerge.experiments.errors import user_input

if TYPE_CHECKING:
    import torch
    from torch import Tensor

    from tomerge.backbones.timm_dit import DiT, DiTConfig
# torch, the model (timm), the data and Lightning are imported where they are used: `--help` needs none.

__all__ = ["add_arguments", "run", "main", "export_checkpoint", "build_module", "EpochPermutations"]

EMA_EXPORT_NAME = "dit_reference_ema.safetensors"


# ------------------------------------------------------------------------------------ arguments
def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``train-reference`` options to ``parser`` (used by ``tomerge train-reference``)."""
    parser.add_argument("--data-root", default=None,
                        help="folder with the Fashion-MNIST IDX files (gzipped or raw) (default: where the Debian "
                             "package dataset-fashion-mnist installs them, tomerge.experiments.sources.data."
                             "DEFAULT_FASHION_MNIST_ROOT)")
    parser.add_argument("--out-dir", default="checkpoints/reference",
                        help="checkpoints, logs and exports go here (default: %(default)s)")
    parser.add_argument("--preset", default="reference",
                        help="DiTConfig preset: 'reference' (32 x 32, 256 tokens) or 'reference-1024' (64 x 64, "
                             "1,024 tokens) or any of tomerge.backbones.timm_dit.DIT_PRESETS (default: %(default)s)")
    parser.add_argument("--image-size", type=int, default=None,
                        help="override the preset's image side (a multiple of 32: Fashion-MNIST is upsampled to it)")
    parser.add_argument("--patch-size", type=int, default=None, help="override the preset's patch side")
    parser.add_argument("--hidden-size", type=int, default=None, help="override the preset's width")
    parser.add_argument("--depth", type=int, default=None, help="override the preset's depth")
    parser.add_argument("--num-heads", type=int, default=None, help="override the preset's heads")
    parser.add_argument("--max-steps", type=int, default=200_000, help="optimizer steps in total (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=3e-4, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=0.0, help="(default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=200, help="linear LR warm-up (default: %(default)s)")
    parser.add_argument("--grad-clip", type=float, default=1.0, help="gradient-norm clip, 0 = off (default: %(default)s)")
    parser.add_argument("--ema-decay", type=float, default=0.999, help="EMA decay (warmed up) (default: %(default)s)")
    parser.add_argument("--t-sampling", choices=("logit-normal", "uniform"), default="logit-normal",
                        help="training time distribution (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--accelerator", default="auto", choices=("auto", "cpu", "gpu"),
                        help="Lightning accelerator: a GPU when one is present (default: %(default)s)")
    parser.add_argument("--init-from", default=None, metavar="SAFETENSORS",
                        help="warm-start model and EMA from exported weights (e.g. the committed reference "
                             "model) when there is no checkpoint to resume; the optimizer starts fresh")
    parser.add_argument("--seed", type=int, default=0, help="(default: %(default)s)")
    parser.add_argument("--limit-images", type=int, default=None, help="use only the first N training images (smoke tests)")
    parser.add_argument("--ckpt-minutes", type=float, default=5.0,
                        help="save a checkpoint every this many minutes of training (default: %(default)s)")
    parser.add_argument("--ckpt-every-steps", type=int, default=0,
                        help="save every N steps instead of by time (0 = by time) (default: %(default)s)")
    parser.add_argument("--export-every", type=int, default=500,
                        help=f"write the EMA weights to OUT_DIR/{EMA_EXPORT_NAME} every N steps, 0 = off (default: %(default)s)")
    parser.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                        help="continue from CKPT, or from OUT_DIR/last.ckpt when given without a value (a fresh start if it does not exist)")
    parser.add_argument("--export", default=None, metavar="PATH",
                        help="do not train: write the EMA weights of the checkpoint (--resume CKPT or OUT_DIR/last.ckpt) to PATH (.safetensors) plus PATH.json")
    parser.add_argument("--wandb", choices=("auto", "online", "offline", "disabled"), default="auto",
                        help="W&B mode; auto = online with an API key, else offline (default: %(default)s)")
    parser.add_argument("--wandb-project", default="tomerge-reference", help="(default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=50, help="log a line every N steps (default: %(default)s)")
    parser.add_argument("--progress-refresh", type=int, default=10,
                        help="progress-bar refresh every N steps, 0 = no bar (default: %(default)s)")
    return parser


def _config_from_args(args: argparse.Namespace) -> DiTConfig:
    from tomerge.backbones.timm_dit import DiTConfig

    overrides = {k: v for k, v in (("input_size", args.image_size), ("patch_size", args.patch_size),
                                   ("hidden_size", args.hidden_size), ("depth", args.depth),
                                   ("num_heads", args.num_heads)) if v is not None}
    config = DiTConfig.preset(args.preset, **overrides)
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


def _resolve_checkpoint(args: argparse.Namespace) -> Path | None:
    if args.resume in (None, "last"):
        last = Path(args.out_dir) / "last.ckpt"
        return last if last.is_file() else None
    path = Path(args.resume)
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


# ------------------------------------------------------------------------------------------- run
def _wandb_logger(args: argparse.Namespace, out_dir: Path, config: DiTConfig):
    if args.wandb == "disabled":
        return None
    mode = args.wandb
    if mode == "auto":
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
    os.environ["WANDB_MODE"] = mode
    from pytorch_lightning.loggers import WandbLogger

    logger = WandbLogger(project=args.wandb_project, save_dir=str(out_dir), offline=(mode == "offline"),
                         name=f"reference-{_dt.datetime.now():%Y%m%d-%H%M%S}")
    logger.experiment.config.update({"dit": config.to_dict(), **{k: v for k, v in vars(args).items()
                                                                 if isinstance(v, (int, float, str, bool, type(None)))}},
                                    allow_val_change=True)
    return logger


def run(args: argparse.Namespace) -> int:
    """Train (or, with ``--export``, export) as described in the module docstring. Returns 0."""
    import torch

    torch.set_num_threads(max(1, args.threads))
    out_dir = Path(args.out_dir)
    if args.export:
        ckpt = _resolve_checkpoint(argparse.Namespace(**{**vars(args), "resume": args.resume or "last"}))
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint to export: {out_dir / 'last.ckpt'} does not exist")
        info = export_checkpoint(ckpt, args.export)
        print(f"exported EMA weights of {ckpt} (step {info['steps']}, loss {info['final_loss']}) to {args.export}")
        return 0

    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint, TQDMProgressBar
    from pytorch_lightning.loggers import CSVLogger
    from torch.utils.data import DataLoader

    from tomerge.experiments.sources.data import DEFAULT_FASHION_MNIST_ROOT, FashionMNIST

    with user_input():
        config = _config_from_args(args)
        data_root = args.data_root or DEFAULT_FASHION_MNIST_ROOT
        size = config.image_hw[0]
        dataset = FashionMNIST(data_root, split="train", limit=args.limit_images, size=size,
                               root_hint="pass --data-root DIR")
        if len(dataset) < args.batch_size:
            raise ValueError(f"{len(dataset)} images are fewer than --batch-size {args.batch_size}")
    pl.seed_everything(args.seed, workers=True)
    ckpt = _resolve_checkpoint(args)
    done = _checkpoint_steps(ckpt) if ckpt is not None else 0
    sampler = EpochPermutations(len(dataset), args.batch_size, seed=args.seed, start_batch=done)
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=0)
    out_dir.mkdir(parents=True, exist_ok=True)
    shown = "28x28 padded to 32x32" if size == 32 else f"28x28 upsampled to {28 * size // 32} and padded to {size}x{size}"
    data = f"Fashion-MNIST train ({len(dataset)} images, {shown}) from {data_root}"
    module = build_module(config, lr=args.lr, weight_decay=args.weight_decay, warmup_steps=args.warmup_steps,
                          ema_decay=args.ema_decay, t_sampling=args.t_sampling, data=data, seed=args.seed)

    trigger = ({"every_n_train_steps": args.ckpt_every_steps} if args.ckpt_every_steps > 0
               else {"train_time_interval": _dt.timedelta(minutes=args.ckpt_minutes)})
    # enable_version_counter=False: a run resumed in a copied or moved folder overwrites last.ckpt,
    # which --resume reads, instead of writing last-v1.ckpt beside it
    periodic = ModelCheckpoint(dirpath=out_dir, filename="step{step:07d}", auto_insert_metric_name=False,
                               save_last=True, save_top_k=1, enable_version_counter=False, **trigger)
    cls = _module_class()
    callbacks = [periodic, cls.LogLine(args.log_every),
                 cls.ExportEMA(out_dir / EMA_EXPORT_NAME, args.export_every, data)]
    if args.progress_refresh > 0:
        callbacks.append(TQDMProgressBar(refresh_rate=args.progress_refresh))
    loggers = [CSVLogger(str(out_dir), name="csv")]
    wb = _wandb_logger(args, out_dir, config)
    if wb is not None:
        loggers.append(wb)

    trainer = pl.Trainer(
        accelerator=args.accelerator, devices=1, precision="32-true", max_steps=args.max_steps, max_epochs=-1,
        logger=loggers, callbacks=callbacks, log_every_n_steps=max(1, args.log_every),
        gradient_clip_val=args.grad_clip or None, enable_progress_bar=args.progress_refresh > 0,
        default_root_dir=str(out_dir), num_sanity_val_steps=0, enable_model_summary=True,
    )
    if ckpt is not None:
        print(f"resuming from {ckpt} (step {done}; the data order continues where it stopped)", flush=True)
    elif args.init_from:
        from tomerge.backbones.timm_dit import load_dit

        weights = load_dit(args.init_from, config=config).state_dict()
        module.model.load_state_dict(weights)
        module.ema.load_state_dict(weights)
        print(f"warm start from {args.init_from} (fresh optimizer)", flush=True)
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
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tomerge.experiments.sources.training",
        description=__doc__.split("\n\n")[0],
        epilog="example: python -m tomerge.experiments.sources.training --out-dir checkpoints/reference --resume",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    from tomerge.experiments.errors import module_main

    module_main("train-reference", main)
