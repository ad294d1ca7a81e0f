"""Merging at gather cost on CUDA: at FLUX.1-dev width (N = 4,096 tokens, C = 3,072, batch 2, bf16 on fake ``cuda``)
the merge and unmerge of every hard plan (``tomesd``, ``ssm``, ``idm``) and of ToCa's fresh-token selection count no
FLOP (row gathers, an ``index_add_`` or ``index_copy_``), where the one-hot products they ran as on CUDA before cost
``2 * B * M * N * C`` each (133-135% of a 3,072 x 3,072 linear layer, merge and unmerge together); and the slot sums
of a bf16 merge run in float32 on the device. Counted by the one FLOP counter, which runs under the fake mode."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from helpers import fake_cuda as harness
import tomerge
from tomerge.experiments.measure.flops import count_flops
from tomerge.strategies.toca import FreshTokens

pytestmark = pytest.mark.fake_cuda

B, H, W, C = 2, 64, 64, 3072  # FLUX.1-dev at 1024 x 1024: 64 x 64 image tokens of width 3,072


class Ops(TorchDispatchMode):
    """The aten ops a call runs, with their first tensor argument's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype | None]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = next((a for a in args if isinstance(a, torch.Tensor)), None)
        self.seen.append((func.overloadpacket.__name__, None if first is None else first.dtype))
        return func(*args, **(kwargs or {}))


def plan_of(name: str, x: torch.Tensor) -> tomerge.MergePlan:
    N = x.shape[1]
    ctx = tomerge.MergeContext(grid=(H, W), ratio=0.5, step=3, num_steps=10,
                               received_attention=torch.rand(B, N), streak=torch.zeros(B, N),
                               removal=torch.empty(N // 2, 0))
    if name == "fresh_tokens":
        return FreshTokens().plan(x, ctx)
    strategy = tomerge.get_strategy(name, **({"use_rand": False} if name == "tomesd" else {}))
    return strategy.plan(x, ctx)


@pytest.mark.parametrize("name", ["tomesd", "ssm", "idm", "fresh_tokens"])
def test_hard_plans_and_selections_merge_with_gathers_on_cuda(name):
    with harness.cpu_generators(), FakeTensorMode(), torch.device("cuda"):
        x = torch.randn(B, H * W, C, dtype=torch.bfloat16)  # [B, N, C]
        plan = plan_of(name, x)
        assert plan.num_removed > 0 and not plan.is_soft
        y = plan.merge(x)
        assert (y.device.type, y.dtype, y.shape[1]) == ("cuda", torch.bfloat16, plan.num_slots)
        assert count_flops(lambda: plan.unmerge(plan.merge(x))) == 0
        one_hot = 2 * (2 * B * plan.num_slots * H * W * C)  # what the dense backend costs: W @ x and U @ y
        assert count_flops(lambda: plan.with_backend("dense").unmerge(plan.with_backend("dense").merge(x))) == one_hot
        ops = Ops()
        with ops:
            plan.merge(x)
        if not plan.selects:  # slot means: the sums in float32
            assert ("index_add_", torch.float32) in ops.seen, ops.seen
