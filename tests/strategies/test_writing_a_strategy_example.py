"""The strategy of docs/writing-a-strategy.md registers, passes the contract and runs on a model."""

import importlib.util
import sys

import torch

import tomerge
from tomerge.contract import check_strategy
from helpers import ROOT
from helpers.models import tiny_unet, unet_inputs

EXAMPLE = ROOT / "docs" / "examples" / "strided_matching.py"


def load_example():
    if "strided_matching" not in tomerge.list_strategies():
        spec = importlib.util.spec_from_file_location("strided_matching", EXAMPLE)
        module = sys.modules["strided_matching"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


def test_documented_strategy_passes_the_contract_and_runs_on_a_unet():
    load_example()
    check_strategy("strided_matching")
    plan = tomerge.get_strategy("strided_matching", stride=3).plan(
        torch.randn(1, 36, 8), tomerge.MergeContext(grid=(6, 6), ratio=0.4))
    assert plan.num_removed == int(36 * 0.4)
    assert set(plan.dst[0, :12].tolist()) == set(range(0, 36, 3))  # destinations on the stride

    unet, inputs = tiny_unet(), unet_inputs()
    with torch.no_grad():
        before = unet(*inputs).sample
        with tomerge.merging(unet, "strided_matching", ratio=0.4, stride=3) as handle:
            merged = unet(*inputs).sample
        assert handle.stats["tokens_removed"] > 0 and not torch.equal(merged, before)
        assert torch.equal(unet(*inputs).sample, before)


def test_documented_strategy_compiles_without_a_graph_break():
    """What docs/writing-a-strategy.md promises a strategy written like the example: a compiled trajectory
    with no graph break and nothing compiled after the first step."""
    from helpers.compiled import compiled_against_eager

    load_example()
    frames = compiled_against_eager("native_dit", "strided_matching")
    assert frames[-1] == frames[0], frames
