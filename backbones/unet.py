"""`unet`: Stable Diffusion 1.x/2.x/SDXL UNets (diffusers `UNet2DConditionModel`).

Merging happens in every `BasicTransformerBlock` whose token count corresponds to a downsampling of
the latent of at most ``max_downsample`` (1: only full-resolution blocks, as tomesd's default; SDXL
has no transformer block at full resolution, so use 2 or more there: tomerge warns when a call merged
nothing). Merge points: ``attn1`` (self-attention, ``"attn"``), ``attn2`` queries
(``"crossattn"``), ``ff`` (``"mlp"``). The grid of a block with ``N`` tokens is
``ceil(H0 / d) x ceil(W0 / d)`` with ``d = ceil(sqrt(H0 * W0 // N))``, ``H0 x W0`` the latent size,
exactly as tomesd computes it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, MergePoint, class_names
from tomerge.state import MergeState

from ._diffusers import call_arg, check_ff_chunking, probe_self_attention, submodel


@dataclasses.dataclass(frozen=True)
class UNetOptions:
    """Options of the ``unet`` adapter.

    Args:
        max_downsample: merge blocks at most this many times downsampled (1, 2, 4 or 8).
    """

    max_downsample: int = 1

    def __post_init__(self) -> None:
        if self.max_downsample not in (1, 2, 4, 8):
            raise ValueError(f"max_downsample must be 1, 2, 4 or 8, got {self.max_downsample}")


class UNetAdapter(BackboneAdapter):
    """Adapter for diffusers `UNet2DConditionModel` (see the module docstring)."""

    name: ClassVar[str] = "unet"
    block_names: ClassVar[tuple[str, ...]] = ("BasicTransformerBlock",)
    Options: ClassVar[type] = UNetOptions

    def __init__(self, model: nn.Module, options: UNetOptions) -> None:
        super().__init__(model, options)
        self.latent_size: tuple[int, int] | None = None

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        return submodel(obj, "unet", "UNet2DConditionModel")

    def check(self) -> None:
        check_ff_chunking([spec.module for spec in self.blocks()])

    def blocks(self) -> list[BlockSpec]:
        specs = []
        for module in self._modules_in_execution_order():
            if "BasicTransformerBlock" not in class_names(module):
                continue
            points = [MergePoint("attn", module.attn1)]
            if getattr(module, "attn2", None) is not None:
                points.append(MergePoint("crossattn", module.attn2))
            points.append(MergePoint("mlp", module.ff))
            specs.append(BlockSpec(module, layer=len(specs), kind="basic", points=tuple(points)))
        return specs

    def _modules_in_execution_order(self) -> list[nn.Module]:
        """Down blocks, mid block, up blocks (``modules()`` registers the up blocks before the mid block)."""
        stages = [*getattr(self.model, "down_blocks", []), getattr(self.model, "mid_block", None),
                  *getattr(self.model, "up_blocks", [])]
        ordered = [m for stage in stages if stage is not None for m in stage.modules()]
        seen = {id(m) for m in ordered}
        return ordered + [m for m in self.model.modules() if id(m) not in seen]

    def on_model_call(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        sample = call_arg(args, kwargs, "sample", 0)  # [B, C, H0, W0]
        self.latent_size = (sample.shape[-2], sample.shape[-1])
        return call_arg(args, kwargs, "timestep", 1)

    def grid(self, block: BlockSpec, num_tokens: int) -> tuple[int, int] | None:
        if self.latent_size is None:
            return None
        H0, W0 = self.latent_size
        downsample = int(math.ceil(math.sqrt(H0 * W0 // num_tokens)))
        if downsample > self.options.max_downsample:
            return None
        H, W = math.ceil(H0 / downsample), math.ceil(W0 / downsample)
        return (H, W) if H * W == num_tokens else None

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        return probe_self_attention(block, point, state)
