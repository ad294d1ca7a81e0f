"""Where and in what precision a model source runs: the names ``model.dtype`` takes and their torch dtypes,
the ``model.offload`` modes and how a pipeline is put on its device (:func:`place_pipeline`), and the CPU
generator every item's initial noise is drawn from (:func:`cpu_generator`), so that an image depends only on
its seed and settings, on any device.

Example:
    >>> torch_dtype("bf16")
    torch.bfloat16
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

# torch is imported where a dtype or generator is made, so that configs (and `tomerge ... --help`) load without it.

__all__ = ["DTYPE_NAMES", "DTYPES", "OFFLOAD_MODES", "torch_dtype", "cpu_generator", "place_pipeline"]

DTYPE_NAMES = ("fp32", "fp16", "bf16")
OFFLOAD_MODES = ("model", "sequential")


def torch_dtype(name: str) -> torch.dtype:
    """``"fp32"`` / ``"fp16"`` / ``"bf16"`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch dtype, built on first use (imports torch)
        return {n: torch_dtype(n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def cpu_generator(seed: int) -> torch.Generator:
    """The generator an item's initial noise is drawn from: ``torch.Generator("cpu").manual_seed(seed)``."""
    import torch

    return torch.Generator("cpu").manual_seed(int(seed))


def place_pipeline(pipe: Any, device: str, offload: str | None = None) -> None:
    """Puts a loaded pipeline on ``device`` (``pipe.to(device)``), or with ``offload``
    (:attr:`~tomerge.experiments.sources.models.ModelSpec.offload`) keeps its models in CPU memory and has
    diffusers move them to ``device`` when they run: ``"model"`` a whole model at a time
    (``pipe.enable_model_cpu_offload(device=device)``), ``"sequential"`` one layer at a time
    (``pipe.enable_sequential_cpu_offload(device=device)``). Both use ``accelerate``'s hooks, which run inside the
    module calls, so :func:`tomerge.apply` hooks on the same modules compose with them."""
    if offload is None:
        pipe.to(device)
    elif offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        raise ValueError(f"offload must be None, model or sequential, got {offload!r}")
