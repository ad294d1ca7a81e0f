"""Editing calls with reference images: FLUX.1 Kontext, FLUX.2 with a reference image after the target or before it
(klein's KV-cache extract call), Qwen-Image-Edit, on the tiny models of ``helpers.models`` and
``helpers.image_families``: the generated image (the target, ``GRID``) and one reference image (``REFERENCE``, another
size) in one image stream. ``CASES``: each call's model builder, inputs and context tokens ahead of the target.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor, nn

from helpers.family import grid_ids
from helpers.image_families import build_flux2, build_qwenimage, flux2_inputs, qwenimage_inputs
from helpers.models import flux_inputs, image_ids, tiny_flux

GRID = (6, 6)  # the generated image's tokens
REFERENCE = (4, 5)  # one reference image's tokens (another size than the target)
N, R = math.prod(GRID), math.prod(REFERENCE)


# ---------------------------------------------------------------------- inputs with reference images
def _tokens(batch: int, count: int, channels: int, seed: int) -> Tensor:
    return torch.randn(batch, count, channels, generator=torch.Generator().manual_seed(seed))


def kontext_inputs(model: nn.Module, batch: int = 2, seed: int = 1, **_) -> dict:
    """FluxKontextPipeline's call: ``[target, reference]`` packed latents, reference ids ``(1, row, col)``."""
    inputs = flux_inputs(batch=batch, grid=GRID, seed=seed)
    reference_ids = image_ids(*REFERENCE)
    reference_ids[:, 0] = 1
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], _tokens(batch, R, 8, seed + 50)], dim=1)
    inputs["img_ids"] = torch.cat([inputs["img_ids"], reference_ids])  # [N + R, 3]
    return inputs


def flux2_reference_inputs(model: nn.Module, batch: int = 2, seed: int = 1, first: bool = False, **_) -> dict:
    """Flux2Pipeline's call with one reference image (ids ``t = 10``) after the target, or before it
    (``first``: klein's KV-cache extract call)."""
    inputs = flux2_inputs(model, batch=batch, grid=GRID, seed=seed)
    target_ids = grid_ids(1, *GRID, 1)
    reference_ids = grid_ids(1, *REFERENCE, 1) + torch.tensor([10, 0, 0, 0])
    reference = _tokens(batch, R, 128, seed + 50)
    parts = [reference, inputs["hidden_states"]] if first else [inputs["hidden_states"], reference]
    ids = [reference_ids, target_ids] if first else [target_ids, reference_ids]
    inputs["hidden_states"] = torch.cat(parts, dim=1)
    inputs["img_ids"] = torch.cat(ids)[None].expand(batch, -1, -1)  # [B, N + R, 4]
    return inputs


def qwen_edit_inputs(model: nn.Module, batch: int = 2, seed: int = 1, **_) -> dict:
    """QwenImageEditPipeline's call: ``[target, reference]`` tokens, one ``img_shapes`` entry per image."""
    inputs = qwenimage_inputs(model, batch=batch, grid=GRID, seed=seed)
    inputs["hidden_states"] = torch.cat([inputs["hidden_states"], _tokens(batch, R, 64, seed + 50)], dim=1)
    inputs["img_shapes"] = [[(1, *GRID), (1, *REFERENCE)]] * batch
    return inputs


@dataclasses.dataclass(frozen=True)
class EditCase:
    build: Callable[[], nn.Module]
    inputs: Callable[..., dict]
    before: int  # context tokens ahead of the target in the image stream


CASES = {
    "flux_kontext": EditCase(lambda: tiny_flux(), kontext_inputs, 0),
    "flux2_reference": EditCase(build_flux2, flux2_reference_inputs, 0),
    "flux2_reference_first": EditCase(build_flux2, lambda m, **kw: flux2_reference_inputs(m, first=True, **kw), R),
    "flux2_kv_extract": EditCase(build_flux2, lambda m, **kw: dict(flux2_reference_inputs(m, first=True, **kw),
                                                                   kv_cache_mode="extract", num_ref_tokens=R), R),
    "qwenimage_edit": EditCase(build_qwenimage, qwen_edit_inputs, 0),
}
