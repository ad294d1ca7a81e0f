"""FLOP-ideal speed-up of one denoiser call of a bundled reference DiT under a strategy: the unmerged call's counted
FLOPs over the merged one's (``tomerge.experiments.measure.flops``, planning included), batch 2 (a guided call).
For settings too slow to sample, e.g. one global facility-location tile at 1,024 tokens (docs/claims.md):

    python3 scripts/one_call_flops.py --reference bundled-1024 facility_location ratio=0.5 num_tiles=1

With ``--steps N`` it counts every denoiser call of an N-step Euler sampling of one image with guidance 2, as
``tomerge ablate`` does, for schedules whose calls differ from step to step (a FLOP count needs no images):

    python3 scripts/one_call_flops.py --steps 20 toca interval=6
"""

from __future__ import annotations

import argparse

import torch

import tomerge
from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.config.load import parse_override
from tomerge.experiments.measure.flops import count_denoiser_flops, count_flops
from tomerge.experiments.sources.reference_model import reference_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default="bundled", help="bundled (256 tokens) or bundled-1024")
    parser.add_argument("--steps", type=int, default=None, help="count an N-step sampling instead of one call")
    parser.add_argument("strategy")
    parser.add_argument("options", nargs="*", help="KEY=VALUE (YAML values), ratio included")
    args = parser.parse_args()
    try:
        options = dict(parse_override(text) for text in args.options)
    except ValueError as err:
        parser.error(str(err))
    model = load_dit(reference_checkpoint(args.reference)).eval()
    config = model.config
    x = torch.randn(2, config.in_channels, *config.image_hw, generator=torch.Generator().manual_seed(0))  # [2, C, H, W]
    t, y = torch.full((2,), 0.5), torch.tensor([3, config.num_classes])  # mid-trajectory; a label and the null label

    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")

    def call() -> None:
        with torch.no_grad():
            model(x, t, y)

    def count() -> int:
        if args.steps is None:
            return count_flops(call)
        from tomerge.experiments.sources.sampling import sample

        generator = torch.Generator().manual_seed(0)
        return count_denoiser_flops(model, lambda: sample(model, [3], args.steps, 2.0, generator)).flops

    unmerged = count()
    with tomerge.merging(model, args.strategy, num_steps=args.steps or 1, **options):
        merged = count()
    print(f"unmerged {unmerged / 1e9:.2f} GFLOP, {args.strategy} {options}: {merged / 1e9:.2f} GFLOP, "
          f"FLOP-ideal {unmerged / merged:.2f}x")


if __name__ == "__main__":
    main()
