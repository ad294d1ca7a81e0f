"""What the `wan_vace` adapter (backbones/wan_vace.py, Wan VACE) does beyond the family contract: the VACE blocks' hints
and control tokens at full length. The checks every declared family passes are in test_family_contract.py; these are the
family's own.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import tomerge
from helpers.family import ALL_SUBLAYERS, run_hooked
from helpers.video_families import wan_vace_inputs


def test_wan_vace_hints_leave_their_blocks_at_full_length(models):
    """The VACE blocks merge the control tokens inside (attn1 gets M slots) and return the hint and the control
    tokens at full length, so the hints are added to the full-length video tokens as the model consumes them."""
    model = models["wan_vace"]
    inputs = wan_vace_inputs(model)
    N, C = 32, 256
    seen: dict[str, list[tuple[int, ...]]] = {"attn1": [], "hint": [], "control": []}

    def outputs(module: nn.Module, args: tuple, out: tuple[Tensor, Tensor]) -> None:
        seen["hint"].append(tuple(out[0].shape))
        seen["control"].append(tuple(out[1].shape))

    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hooks = []
        for block in model.vace_blocks:  # registered after tomerge's hooks: they see what the model sees
            hooks.append(block.attn1.register_forward_pre_hook(lambda m, a: seen["attn1"].append(tuple(a[0].shape))))
            hooks.append(block.register_forward_hook(outputs))
        out = run_hooked(model, inputs, hooks)
    assert torch.isfinite(out).all()
    assert seen == {"attn1": [(2, N // 2, C)] * 2, "hint": [(2, N, C)] * 2, "control": [(2, N, C)] * 2}
