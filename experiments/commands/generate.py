"""`tomerge generate`: images for a class list or a prompt set with a chosen strategy, for metrics at scale.

    tomerge generate --classes 0 1 2 --per-class 100 --out runs/gen/base                     # reference DiT, unmerged
    tomerge generate --pipeline /models/sd3-medium --dtype fp16 --prompts captions_val2017.json \\
        --num-prompts 1000 --call num_inference_steps=28 --strategy sdtm --out runs/gen/sdtm --devices 4
    tomerge generate --config experiments/configs/papers/sdtm_sd3_medium.yaml \\
        --set model.pipeline=/models/sd3-medium --strategy tomesd --ratio 0.5 --out runs/gen/tomesd

Item ``i`` gets the seed ``--seed + i`` and the noise ``tomerge ablate`` gives it. Work is cut into fixed batches
of ``--batch-size`` items, so an image depends only on its index, seed, the batch size and the settings, never on
the number of processes (``--devices``: Lightning DDP) or on what was generated before; a rerun resumes. File
names, resume, launchers and failures: docs/experiments.md, "5. Images at scale".
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tomerge

from ..config.load import apply_override, load_config, parse_override
from ..errors import RankFailedError, UsageError, module_main, user_input
from ..generation.distributed import DEFAULT_TIMEOUT_S, RESUME, generate_distributed
from ..generation.files import output_complete
from ..generation.generate import GenerateSpec, generate_local, item_output, lock_output, prepare
from ..sources.items import Item, class_items, prompt_items, read_class_file
from ..sources.models import REFERENCE_CHECKPOINT, ModelSpec
from ..sources.prompt_sets import PromptSet

__all__ = ["add_arguments", "run", "main"]


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
    merge.add_argument("--strategy", default=None, choices=["none", *tomerge.list_strategies()],
                       help="strategy or schedule (default: the run of a --config whose grid is one run, such as "
                            "tomerge tune's recipe.yaml; else none, the unmerged model)")
    merge.add_argument("--ratio", type=float, default=None,
                       help="merge ratio (default: the one-run grid's, else 0.5)")
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
        if per_class < 1:
            raise UsageError(f"--per-class must be >= 1, got {per_class}")
        seed = args.seed if args.seed is not None else (config.seed if config is not None else 0)
        return class_items(classes, per_class, seed)
    if args.classes is not None or args.class_file is not None:
        raise UsageError("a text-to-image pipeline takes --prompts, not class ids")
    keys = {"prompts": args.prompts, "num_prompts": args.num_prompts, "prompt_offset": args.prompt_offset,
            "images_per_prompt": args.images_per_prompt, "seed": args.seed}
    values = {k: getattr(config, k) for k in keys} if config is not None else {}
    values.update({k: v for k, v in keys.items() if v is not None})
    if values.get("prompts") is None:
        raise UsageError("a text-to-image pipeline needs --prompts FILE")
    selection = {k: values[k] for k in ("num_prompts", "prompt_offset", "images_per_prompt") if k in values}
    prompt_set = PromptSet.from_config(values["prompts"], **selection)
    model.check()  # the pipeline folder and its call arguments, before the output folder is made
    return prompt_items(prompt_set, values.get("seed", 0))


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
        strategy, ratio = args.strategy or "none", args.ratio if args.ratio is not None else 0.5
        runs = config.runs() if config is not None and args.strategy is None else []
        if len(runs) == 1 and runs[0].ratio is not None:  # a recipe: its run, with --set options over its own
            strategy, options = runs[0].strategy, {**runs[0].options, **options}
            ratio = args.ratio if args.ratio is not None else runs[0].ratio
        spec = GenerateSpec(model=model, strategy=strategy, ratio=ratio, options=options,
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
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.commands.generate", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    module_main("generate", main)
