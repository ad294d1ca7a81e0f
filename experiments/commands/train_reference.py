"""`tomerge train-reference`: its arguments and its flow (load Fashion-MNIST, train or export). The training
itself is :func:`tomerge.experiments.sources.training.train`; checkpoints, exports and resuming:
docs/reference-model.md, "Retrain or continue".

Examples:
    # train (continues from OUT_DIR/last.ckpt when it exists and --resume is given)
    python -m tomerge.experiments.commands.train_reference --out-dir checkpoints/reference --max-steps 100000 --resume
    # export the EMA weights of the newest checkpoint (no training)
    python -m tomerge.experiments.commands.train_reference --out-dir checkpoints/reference \\
        --export checkpoints/reference/dit_reference.safetensors
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import module_main, user_input
from ..sources import training
from ..sources.training import EMA_EXPORT_NAME, TrainingOptions, checkpoint_to_resume, export_checkpoint, \
    reference_dit_config, train

if TYPE_CHECKING:
    from tomerge.backbones.timm_dit import DiTConfig

__all__ = ["add_arguments", "run", "main"]

DEFAULTS = TrainingOptions()  # the defaults of the flags that are TrainingOptions fields


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
    parser.add_argument("--max-steps", type=int, default=DEFAULTS.max_steps,
                        help="optimizer steps in total (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=DEFAULTS.batch_size, help="(default: %(default)s)")
    parser.add_argument("--lr", type=float, default=DEFAULTS.lr, help="AdamW learning rate (default: %(default)s)")
    parser.add_argument("--weight-decay", type=float, default=DEFAULTS.weight_decay, help="(default: %(default)s)")
    parser.add_argument("--warmup-steps", type=int, default=DEFAULTS.warmup_steps,
                        help="linear LR warm-up (default: %(default)s)")
    parser.add_argument("--grad-clip", type=float, default=DEFAULTS.grad_clip,
                        help="gradient-norm clip, 0 = off (default: %(default)s)")
    parser.add_argument("--ema-decay", type=float, default=DEFAULTS.ema_decay,
                        help="EMA decay (warmed up) (default: %(default)s)")
    parser.add_argument("--t-sampling", choices=("logit-normal", "uniform"), default=DEFAULTS.t_sampling,
                        help="training time distribution (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (default: %(default)s)")
    parser.add_argument("--accelerator", default=DEFAULTS.accelerator, choices=("auto", "cpu", "gpu"),
                        help="Lightning accelerator: a GPU when one is present (default: %(default)s)")
    parser.add_argument("--init-from", default=DEFAULTS.init_from, metavar="SAFETENSORS",
                        help="warm-start model and EMA from exported weights (e.g. the committed reference "
                             "model) when there is no checkpoint to resume; the optimizer starts fresh")
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed, help="(default: %(default)s)")
    parser.add_argument("--limit-images", type=int, default=None, help="use only the first N training images (smoke tests)")
    parser.add_argument("--ckpt-minutes", type=float, default=DEFAULTS.ckpt_minutes,
                        help="save a checkpoint every this many minutes of training (default: %(default)s)")
    parser.add_argument("--ckpt-every-steps", type=int, default=DEFAULTS.ckpt_every_steps,
                        help="save every N steps instead of by time (0 = by time) (default: %(default)s)")
    parser.add_argument("--export-every", type=int, default=DEFAULTS.export_every,
                        help=f"write the EMA weights to OUT_DIR/{EMA_EXPORT_NAME} every N steps, 0 = off (default: %(default)s)")
    parser.add_argument("--resume", nargs="?", const="last", default=None, metavar="CKPT",
                        help="continue from CKPT, or from OUT_DIR/last.ckpt when given without a value (a fresh start if it does not exist)")
    parser.add_argument("--export", default=None, metavar="PATH",
                        help="do not train: write the EMA weights of the checkpoint (--resume CKPT or OUT_DIR/last.ckpt) to PATH (.safetensors) plus PATH.json")
    parser.add_argument("--wandb", choices=("auto", "online", "offline", "disabled"), default="auto",
                        help="W&B mode; auto = online with an API key, else offline (default: %(default)s)")
    parser.add_argument("--wandb-project", default="tomerge-reference", help="(default: %(default)s)")
    parser.add_argument("--log-every", type=int, default=DEFAULTS.log_every,
                        help="log a line every N steps (default: %(default)s)")
    parser.add_argument("--progress-refresh", type=int, default=DEFAULTS.progress_refresh,
                        help="progress-bar refresh every N steps, 0 = no bar (default: %(default)s)")
    return parser


def _config_from_args(args: argparse.Namespace) -> DiTConfig:
    overrides = {k: v for k, v in (("input_size", args.image_size), ("patch_size", args.patch_size),
                                   ("hidden_size", args.hidden_size), ("depth", args.depth),
                                   ("num_heads", args.num_heads)) if v is not None}
    return reference_dit_config(args.preset, **overrides)


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
    """Train (or, with ``--export``, export) as docs/reference-model.md, "Retrain or continue", says. Returns 0."""
    import torch

    torch.set_num_threads(max(1, args.threads))
    out_dir = Path(args.out_dir)
    if args.export:
        ckpt = checkpoint_to_resume(out_dir, args.resume or "last")
        if ckpt is None:
            raise FileNotFoundError(f"no checkpoint to export: {out_dir / 'last.ckpt'} does not exist")
        info = export_checkpoint(ckpt, args.export)
        print(f"exported EMA weights of {ckpt} (step {info['steps']}, loss {info['final_loss']}) to {args.export}")
        return 0

    from ..sources.data import DEFAULT_FASHION_MNIST_ROOT, FashionMNIST

    with user_input():
        config = _config_from_args(args)
        data_root = args.data_root or DEFAULT_FASHION_MNIST_ROOT
        dataset = FashionMNIST(data_root, split="train", limit=args.limit_images, size=config.image_hw[0],
                               root_hint="pass --data-root DIR")
        if len(dataset) < args.batch_size:
            raise ValueError(f"{len(dataset)} images are fewer than --batch-size {args.batch_size}")
    # every TrainingOptions field is the flag of the same name
    options = TrainingOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(TrainingOptions)})
    train(config, dataset, data_root, out_dir, options, resume=args.resume,
          wandb_logger=functools.partial(_wandb_logger, args))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tomerge.experiments.commands.train_reference",
        description=training.__doc__.split("\n\n")[0],
        epilog="example: python -m tomerge.experiments.commands.train_reference --out-dir checkpoints/reference "
               "--resume",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("train-reference", main)
