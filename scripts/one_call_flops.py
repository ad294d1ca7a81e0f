"""FLOP-ideal speed-up of one denoiser call of a bundled reference DiT under a strategy: the unmerged call's counted
FLOPs over the merged one's (``tomerge.experiments.measure.flops``, planning included), batch 2 (a guided call).
For settings too slow to sample, e.g. one global facility-location tile at 1,024 tokens (docs/claims.md):

    python3 scripts/one_call_flops.py --reference bundled-1024 facility_location ratio=0.5 num_tiles=1
"""

from __future__ import annotations

import argparse

import torch

import tomerge
from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.config.load import parse_override
from tomerge.experiments.measure.flops import count_flops
from tomerge.experiments.sources.reference_model import reference_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", default="bundled", help="bundled (256 tokens) or bundled-1024")
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

    def call() -> None:
        with torch.no_grad():
            model(x, t, y)

    unmerged = count_flops(call)
    with tomerge.merging(model, args.strategy, num_steps=1, **options):
        merged = count_flops(call)
    print(f"unmerged {unmerged / 1e9:.2f} GFLOP, {args.strategy} {options}: {merged / 1e9:.2f} GFLOP, "
          f"FLOP-ideal {unmerged / merged:.2f}x")


if __name__ == "__main__":
    main()
