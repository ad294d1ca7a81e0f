"""The tiny DiTs and the sampling loop of the ``torch.compile`` tests (tests/core/test_compile.py), shared with the
tests that run a trajectory on the same models (caching, ToCa, cached detail, CUDA graphs, kept memory) and with
``scripts/compile_counts.py`` (the compile-count table of docs/compile.md).

``build("native_dit")``: the bundled DiT on 16 x 16 latents (patch 2: an 8 x 8 grid), float64; ``build("dit")``:
diffusers' DiT of ``helpers.models``. ``inputs(backbone, t)``: a guidance pair at time ``t`` in [0, 1].
"""

from __future__ import annotations

import traceback
from typing import Any

import torch
import torch._dynamo.testing
import torch._dynamo.utils
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

import tomerge

STEPS = 12
# Options that make every strategy remove tokens on the 8 x 8 grid of the tiny models.
OPTIONS: dict[str, dict[str, Any]] = {
    "ssm": {"round_windows": 1}, "facility_location": {"num_tiles": 4}, "toma": {"num_tiles": 4},
    "toma_release": {"num_tiles": 4, "skip_first": 0},
}
STRATEGIES = ("tomesd", "ssm", "idm", "facility_location")
SCHEDULES = ("toma", "toma_release", "sdtm", "sdtm_release", "sdtm_paper")
def build(backbone: str, depth: int = 2) -> nn.Module:
    if backbone == "native_dit":
        from tomerge.backbones.timm_dit import DiT, DiTConfig

        model = DiT(DiTConfig(input_size=16, patch_size=2, in_channels=4, hidden_size=32, depth=depth, num_heads=2,
                              num_classes=10, learn_sigma=False)).eval()
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        return model.double()
    from helpers.models import tiny_dit

    return tiny_dit().double()


def inputs(backbone: str, t: float) -> dict[str, Any]:
    """A guidance pair (class 3 and the null class) at time ``t`` in [0, 1]."""
    g = torch.Generator().manual_seed(0)
    latent = torch.randn(1, 4, 16, 16, generator=g, dtype=torch.float64).expand(2, -1, -1, -1)
    if backbone == "native_dit":
        return dict(x=latent, t=torch.full((2,), t, dtype=torch.float64), y=torch.tensor([3, 10]))
    return dict(hidden_states=latent, timestep=torch.full((2,), round(1000 * t)), class_labels=torch.tensor([3, 0]))


def times(steps: int = STEPS) -> list[float]:
    return [0.95 - 0.9 * s / steps for s in range(steps)]


def call(model: nn.Module, kwargs: dict[str, Any]) -> Tensor:
    with torch.no_grad():
        out = model(**kwargs)
    return out if isinstance(out, Tensor) else out.sample


def trajectory(model: nn.Module, backbone: str, strategy: str, compile_backend: Any = None,
               regional: bool = False, options: dict[str, Any] | None = None) -> tuple[list[Tensor], list[int], int]:
    """Outputs of one application over a sampling loop (eager, or compiled with ``compile_backend``: the
    whole model, or each block with ``regional``), the backend's compiled frames after each step (``[]``
    eager), and the tokens removed."""
    torch._dynamo.reset()
    frames: list[int] = []
    options = OPTIONS.get(strategy, {}) if options is None else options
    with tomerge.merging(model, strategy, ratio=0.5, num_steps=STEPS, seed=3, **options) as handle:
        if compile_backend is None:
            runner = model
        elif regional:
            for block in handle._blocks:
                block.module.compile(backend=compile_backend)
            runner = model
        else:
            runner = torch.compile(model, backend=compile_backend)
        outs = []
        for t in times():
            torch.manual_seed(0)  # tomesd's fork_global generator forks the global RNG at its first draw
            outs.append(call(runner, inputs(backbone, t)))
            if compile_backend is not None:
                frames.append(compile_backend.frame_count)
        removed = handle.stats["tokens_removed"]
    if regional:
        for block in handle._blocks:
            block.module._compiled_call_impl = None  # nn.Module.compile's attribute: back to the eager module
    torch._dynamo.reset()
    return outs, frames, removed


def compiled_against_eager(backbone: str, strategy: str, regional: bool = False,
                           options: dict[str, Any] | None = None) -> list[int]:
    model = build(backbone)
    eager, _, removed = trajectory(model, backbone, strategy, options=options)
    torch._dynamo.utils.counters.clear()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled, frames, removed_compiled = trajectory(model, backbone, strategy, counter, regional, options)
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert removed > 0 and removed_compiled == removed  # the hooks ran inside the compiled model
    assert not breaks, f"graph breaks: {breaks}"
    for a, b in zip(compiled, eager):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)
    return frames


class FailOnHostRead(TorchDispatchMode):
    """Raises on every aten op that reads tensor data on the host or has a data-dependent output shape (on CUDA
    each one synchronises, and none can be captured in a CUDA graph), except inside the allowed functions."""

    HOST_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique2", "item")

    def __init__(self, allowed: tuple[str, ...]) -> None:
        super().__init__()
        self.allowed, self.allowed_reads = allowed, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in self.HOST_OPS:
            frames = {f.name for f in traceback.extract_stack()}
            if not frames & set(self.allowed):
                raise AssertionError(f"host read {func} in the hot path")
            self.allowed_reads += 1
        return func(*args, **(kwargs or {}))
