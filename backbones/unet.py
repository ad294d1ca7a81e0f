"""`unet`: Stable Diffusion 1.x/2.x/SDXL UNets (diffusers `UNet2DConditionModel`).

Merging happens in every `BasicTransformerBlock` whose token count corresponds to a downsampling of
the latent of at most ``max_downsample``. The default (``None``) is the highest-resolution level that
has transformer blocks, read from the UNet's structure when the adapter is built (:func:`block_levels`):
1 on SD 1.x/2.x (full resolution, tomesd's default), 2 on SDXL (no transformer block at full
resolution); the chosen value is ``UNetAdapter.max_downsample`` and is logged (logger
``tomerge.backbones.unet``, level INFO). Merge points: ``attn1`` (self-attention, ``"attn"``),
``attn2`` queries (``"crossattn"``), ``ff`` (``"mlp"``). The grid of a block with ``N`` tokens is
``ceil(H0 / d) x ceil(W0 / d)`` with ``d = ceil(sqrt(H0 * W0 // N))``, ``H0 x W0`` the latent size,
exactly as tomesd computes it. See docs/backbones/unet.md.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any, ClassVar

from torch import Tensor, nn

from tomerge.adapter import BackboneAdapter, BlockSpec, KindSummary, MergePoint, class_names
from tomerge.state import MergeState

from ._diffusers import FeedForwardPoint, call_arg, probe_self_attention, submodel

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class UNetOptions:
    """Options of the ``unet`` adapter.

    Args:
        max_downsample: merge blocks at most this many times downsampled (1, 2, 4 or 8); ``None`` (the
            default): the highest-resolution level that has transformer blocks (1 on SD 1.x/2.x, as
            tomesd; 2 on SDXL).
    """

    max_downsample: int | None = None

    def __post_init__(self) -> None:
        if self.max_downsample is not None and self.max_downsample not in (1, 2, 4, 8):
            raise ValueError(f"max_downsample must be 1, 2, 4, 8 or None (the highest-resolution level with "
                             f"transformer blocks), got {self.max_downsample!r}")


def block_levels(unet: nn.Module) -> dict[int, int]:
    """The downsampling factor of every `BasicTransformerBlock` of a `UNet2DConditionModel`, by ``id``.

    Read from the structure: the down blocks start at 1 (full latent resolution) and each one with
    ``downsamplers`` halves the resolution after it; the mid block is at the lowest resolution; each up
    block with ``upsamplers`` doubles it after it. SD 1.5 gives 1, 2, 4 (down), 8 (mid), 4, 2, 1 (up);
    SDXL, whose first level has no attention, 2, 4, 4, 2.
    """
    levels: dict[int, int] = {}

    def record(stage: nn.Module | None, factor: int) -> None:
        for module in stage.modules() if stage is not None else ():
            if "BasicTransformerBlock" in class_names(module):
                levels.setdefault(id(module), factor)

    factor = 1
    for stage in getattr(unet, "down_blocks", []):
        record(stage, factor)
        factor *= 2 if getattr(stage, "downsamplers", None) is not None else 1
    record(getattr(unet, "mid_block", None), factor)
    for stage in getattr(unet, "up_blocks", []):
        record(stage, factor)
        factor //= 2 if getattr(stage, "upsamplers", None) is not None else 1
    return levels


class UNetAdapter(BackboneAdapter):
    """Adapter for diffusers `UNet2DConditionModel` (see the module docstring)."""

    name: ClassVar[str] = "unet"
    model_class: ClassVar[str] = "UNet2DConditionModel"
    block_names: ClassVar[tuple[str, ...]] = ("BasicTransformerBlock",)
    Options: ClassVar[type] = UNetOptions

    def __init__(self, model: nn.Module, options: UNetOptions) -> None:
        super().__init__(model, options)
        self.latent_size: tuple[int, int] | None = None
        self.max_downsample: int = self._resolve_max_downsample()

    def _resolve_max_downsample(self) -> int:
        """``options.max_downsample``, or for ``None`` the highest-resolution level with transformer blocks
        (logged once, when the adapter is built by :func:`tomerge.apply`)."""
        if self.options.max_downsample is not None:
            return self.options.max_downsample
        levels = block_levels(self.model)
        chosen = min(levels.values(), default=1)
        logger.info("tomerge: unet max_downsample=None -> %d, the highest-resolution level with transformer "
                    "blocks (%d of the %d blocks of this %s); pass adapter={'max_downsample': ...} to change it",
                    chosen, sum(level <= chosen for level in levels.values()), len(levels), type(self.model).__name__)
        return chosen

    @classmethod
    def find_model(cls, obj: Any) -> nn.Module | None:
        return submodel(obj, "unet", cls.model_class)

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return (KindSummary("basic", ("attn", "crossattn", "mlp"), context="cross-attention"),)

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({"basic"})

    def blocks(self) -> list[BlockSpec]:
        specs = []
        for module in self._modules_in_execution_order():
            if "BasicTransformerBlock" not in class_names(module):
                continue
            points = [MergePoint("attn", module.attn1)]
            if getattr(module, "attn2", None) is not None:
                points.append(MergePoint("crossattn", module.attn2))
            points.append(FeedForwardPoint("mlp", module.ff, block=module))
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
        if downsample > self.max_downsample:
            return None
        H, W = math.ceil(H0 / downsample), math.ceil(W0 / downsample)
        return (H, W) if H * W == num_tokens else None

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        return probe_self_attention(block, point, state)
