"""Host reads on fake CUDA tensors: the oracle itself, and the reads the adapters make per model call (docs/compile.md,
"CUDA graphs"): FLUX's ``img_ids`` and Lumina 2's caption mask are read once per input tensor, before the first
block; prompt reweighting's text-key bias reads nothing inside a block call. The suite's one stand-in beyond the
fake tensors: ``MergeState._generator`` hands out CPU generators (``harness.cpu_generators``)."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from helpers import fake_cuda as harness
import tomerge
from helpers.fake_cuda import MODELS, HostReadError, HostReadOracle
from tomerge.backbones._host import HostFacts

pytestmark = pytest.mark.fake_cuda


def allowed_read(x: torch.Tensor) -> float:
    return float(x.sum())


def test_the_oracle_answers_known_inputs_counts_every_read_and_refuses_computed_ones():
    mode = FakeTensorMode()
    oracle = HostReadOracle(mode, allowed={"allowed_read": 0.25})
    x = oracle.register(torch.tensor([3.0, 4.0, 0.0]))
    with mode, oracle:
        assert x.device.type == "cuda" and float(x[1]) == 4.0  # a registered input's real value
        host = x.cpu()  # a device-to-host copy: the real CPU tensor, then host work runs for real
        assert not isinstance(host, type(x)) and host.tolist() == [3.0, 4.0, 0.0] and int(host.sum()) == 7
        buffer = torch.empty(3)
        buffer.copy_(x)  # a copy into a host buffer
        assert buffer.tolist() == [3.0, 4.0, 0.0]
        positions = torch.nonzero(x)  # data-dependent shape of a known input: known, still on the device
        assert positions.device.type == "cuda" and positions.cpu().flatten().tolist() == [0, 1]
        assert float((1 - x)[0]) == -2.0  # computed from known tensors alone: known (the oracle computes it too)
        y = x * torch.randn(3, device="cuda")  # depends on unregistered data: unknown
        assert allowed_read(y) == 0.25  # the stand-in of an allowed function
        with pytest.raises(HostReadError, match="computed tensor"):
            float(y[0])
        with pytest.raises(HostReadError, match="computed tensor"):
            y.cpu()
        full, text = torch.zeros(2, 3, device="cuda"), torch.zeros(3, dtype=torch.bool, device="cuda")
        with pytest.raises(HostReadError, match="index_put"):
            full[:, text] = 1.0  # a boolean mask lowers to nonzero on CUDA
        full[:, 0:2] = 1.0  # a slice reads nothing
    assert [(r.op.split(".")[1], r.known) for r in oracle.reads] == [
        ("_local_scalar_dense", True), ("_to_copy", True), ("copy_", True), ("nonzero", True), ("_to_copy", True),
        ("_local_scalar_dense", True),
        ("_local_scalar_dense", False), ("_local_scalar_dense", False), ("_to_copy", False), ("index_put_", False)]
    assert len(oracle.violations) == 3  # the allowed function's read is not one


def test_host_facts_copy_once_per_tensor_and_version():
    """One computation per tensor object; a new tensor or an in-place change computes again."""
    facts = HostFacts(lambda t, k: int(t.sum()) + k)
    ids = torch.arange(4)
    assert [facts(ids, 1), facts(ids, 1), facts(ids, 2)] == [7, 7, 8] and facts.copies == 2
    ids.add_(1)
    assert facts(ids, 2) == 12 and facts(ids.clone(), 2) == 12 and facts.copies == 4
    with torch.inference_mode():
        frozen = torch.arange(3)
    assert facts(frozen, 0) == facts(frozen, 0) == 3 and facts.copies == 5  # no version counter: the object


def adapter_reads(oracle: HostReadOracle) -> dict[int, int]:
    return oracle.per_call(lambda r: r.within("on_model_call"))


@pytest.fixture(scope="module")
def flux():
    return harness.build("flux", short=True)


def test_flux_reads_its_ids_once_per_ids_tensor(flux):
    """The same ``img_ids`` tensor every call (as pipelines pass it): one copy to the host in the whole trajectory;
    new ids tensors: one copy each. The grid logic runs on the host, nothing inside a block call."""
    mode, model = flux
    spec = MODELS["flux"]
    oracle = HostReadOracle(mode)
    inputs = spec.inputs(oracle, mode)
    with harness.cpu_generators(), tomerge.merging(model, "tomesd", ratio=0.5, num_steps=5) as handle:
        with mode, oracle.watching(model, [b.module for b in handle._blocks]), torch.no_grad():
            for t in spec.timesteps(5)[:3]:
                model(**inputs(t))
            for t in spec.timesteps(5)[3:]:
                call = inputs(t)
                with harness._disable_current_modes():
                    ids = oracle._real(call["img_ids"]).clone()  # the same values in a new tensor
                model(**{**call, "img_ids": oracle.register(ids)})
        assert handle.stats["merged_calls"] == 5 * len(handle._blocks)  # the grid was found every call
    assert adapter_reads(oracle) == {0: 1, 3: 1, 4: 1}
    assert not [r for r in oracle.reads if r.in_block] and not oracle.violations


@pytest.mark.parametrize("name", ["sd3", "flux"])
def test_prompt_reweighting_reads_nothing_in_a_block(name, flux, monkeypatch):
    """``sdtm`` with text labels: the text-key bias of every joint attention is built from slices (a boolean mask
    assignment is a ``nonzero``, a host sync, on CUDA)."""
    import tomerge.text_bias as text_bias

    mode, model = flux if name == "flux" else harness.build(name, short=True)
    spec = MODELS[name]
    biased = []
    original = text_bias.key_bias_attention
    monkeypatch.setattr(text_bias, "key_bias_attention", lambda *a, **k: biased.append(1) or original(*a, **k))
    oracle = HostReadOracle(mode)
    inputs = spec.inputs(oracle, mode)
    labels = [list(itertools.islice(itertools.cycle(["structure", "detail", "none"]), spec.text))] * spec.batch
    with harness.cpu_generators(), tomerge.merging(model, "sdtm", ratio=0.5, num_steps=4) as handle:
        handle.set_text_labels(labels)
        with mode, oracle.watching(model, [b.module for b in handle._blocks]), torch.no_grad():
            for t in spec.timesteps(4):
                model(**inputs(t))
        assert handle.stats["merged_calls"] > 0
    assert biased  # the bias ran
    assert not [r for r in oracle.reads if r.in_block] and not oracle.violations


def tiny_lumina2(mode: FakeTensorMode) -> torch.nn.Module:
    """Lumina-Image 2.0's block structure (refiners, joint blocks, grouped-query heads), tiny widths: 8 x 8 tokens."""
    from diffusers import Lumina2Transformer2DModel

    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with mode, torch.device("cuda"):
            return Lumina2Transformer2DModel(
                sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
                num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6),
                axes_lens=(64, 32, 32), cap_feat_dim=32).eval()
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.parametrize("lengths", [(8, 5), (6, 6)], ids=["ragged", "equal"])
def test_lumina2_reads_caption_lengths_once_per_mask(lengths):
    """The caption lengths (per-sample, or one) are read on the host once per ``encoder_attention_mask`` tensor, in
    the model's pre-hook: none inside a block call. (diffusers' own ``Lumina2RotaryPosEmbed`` reads them in every
    call, ``attention_mask.sum(dim=1).tolist()``: B reads before the blocks.)"""
    mode = FakeTensorMode()
    model = tiny_lumina2(mode)
    oracle = HostReadOracle(mode)
    B, L = len(lengths), max(lengths)
    mask = torch.arange(L)[None] < torch.tensor(lengths)[:, None]  # [B, L] bool, the caption's real tokens

    def call(t: float, mask_tensor: torch.Tensor) -> dict:
        with mode:
            x, text = torch.randn(B, 4, 16, 16, device="cuda"), torch.randn(B, L, 32, device="cuda")
        return dict(hidden_states=x.bfloat16(), encoder_hidden_states=text.bfloat16(), return_dict=False,
                    timestep=oracle.register(torch.full((B,), t)), encoder_attention_mask=mask_tensor)

    same = oracle.register(mask)
    with harness.cpu_generators(), tomerge.merging(model, "ssm", ratio=0.5, num_steps=4) as handle:
        with mode, oracle.watching(model, [b.module for b in handle._blocks]), torch.no_grad():
            for t in (0.1, 0.4):
                model(**call(t, same))
            for t in (0.7, 0.9):
                model(**call(t, oracle.register(mask)))  # a new mask tensor: read again
        assert handle.stats["merged_calls"] == 4 * len(handle._blocks)
    assert adapter_reads(oracle) == {0: 1, 2: 1, 3: 1}
    assert not [r for r in oracle.reads if r.in_block] and not oracle.violations
    assert oracle.per_call(lambda r: r.within("TrajectoryClock.observe")) == {call: 1 for call in range(4)}
    model_own = oracle.per_call(lambda r: not r.stack)  # diffusers' RoPE embedder: the lengths' .tolist()
    assert model_own == {call: B for call in range(4)} and all(r.known for r in oracle.reads)
