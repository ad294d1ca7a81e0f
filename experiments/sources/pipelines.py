"""Diffusers pipelines as a model source (``model: {pipeline: PATH, dtype, device, offload, call}``):
:class:`PipelineSource` loads a pipeline folder from local disk with ``DiffusionPipeline.from_pretrained(PATH,
local_files_only=True)`` (never a download), puts it on its device (``devices.place_pipeline``), and calls it
once per batch of items with their prompts (and input images, for editing pipelines), one CPU generator per
item, with the family's call defaults (``call_arguments.CALL_DEFAULTS``) under ``model.call``. Image pipelines
produce images ``[B, 3, H, W]``, video pipelines videos ``[B, T, 3, H, W]``.

Example:
    >>> from tomerge.experiments.sources.items import Item
    >>> from tomerge.experiments.sources.models import ModelSpec
    >>> source = PipelineSource(ModelSpec(kind="pipeline", path="/models/sd3-medium"))   # doctest: +SKIP
    >>> images = source.generate([Item(0, 0, prompt="a red fox in snow")])              # doctest: +SKIP
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .call_arguments import CALL_DEFAULTS, check_call, takes_image
from .devices import cpu_generator, place_pipeline, torch_dtype

if TYPE_CHECKING:
    from torch import Tensor, nn

    from .items import Item
    from .models import ModelSpec  # for annotations only: models imports this module

__all__ = ["PipelineSource"]


class PipelineSource:
    """A diffusers pipeline from a local folder, called once per batch of prompts (image or video pipelines)."""

    conditioning = "prompt"

    def __init__(self, spec: ModelSpec) -> None:
        from diffusers import DiffusionPipeline

        self.spec = spec
        spec.check()
        folder = Path(spec.path).expanduser()
        with warnings.catch_warnings():
            # diffusers 0.42 renames torch_dtype; older releases know only it
            warnings.filterwarnings("ignore", message="`torch_dtype` is deprecated", category=FutureWarning)
            self.pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=torch_dtype(spec.dtype),
                                                          local_files_only=True)
        place_pipeline(self.pipe, spec.device, spec.offload)
        self.video = spec.is_video
        self.pipe.set_progress_bar_config(disable=True)
        self.family = self._family()
        self.call = {**CALL_DEFAULTS.get(self.family, {}), **spec.call}
        check_call(type(self.pipe), self.call)

    def _family(self) -> str | None:
        import tomerge
        from tomerge.registry import backbone_class

        for name in tomerge.list_backbones():
            if backbone_class(name).find_model(self.pipe) is not None:
                return name
        return None

    @property
    def target(self) -> Any:
        return self.pipe

    @property
    def denoiser(self) -> nn.Module:
        from torch import nn

        for attr in ("transformer", "unet"):
            module = getattr(self.pipe, attr, None)
            if isinstance(module, nn.Module):
                return module
        raise ValueError(f"{type(self.pipe).__name__} has no transformer or unet")

    @property
    def num_steps(self) -> int | None:
        steps = self.call.get("num_inference_steps")
        if steps is None:
            steps = inspect.signature(self.pipe.__call__).parameters["num_inference_steps"].default
        return int(steps)

    def merge_options(self) -> dict[str, Any]:
        return {}  # the step clock comes from the pipeline's scheduler

    def check_items(self, items: Sequence[Item]) -> None:
        if any(i.prompt is None for i in items):
            raise UsageError(f"{type(self.pipe).__name__} is a text-to-image pipeline: give prompts (`prompts:`)")
        with_image = {i.image is not None for i in items}
        if with_image == {True, False}:
            raise UsageError("some items have an input image and some have none; give every prompt one")
        if True in with_image and not takes_image(type(self.pipe)):
            raise UsageError(f"{type(self.pipe).__name__} takes no input image (`image=`); remove "
                             "prompts.image_field or use an editing pipeline")

    def generate(self, batch: Sequence[Item]) -> Tensor:
        """Images ``[B, 3, H, W]``, or for a video pipeline videos ``[B, T, 3, H, W]``, in ``[-1, 1]`` (float32,
        CPU). Video pipelines return their frames (``output_type="pt"``: ``.frames``, ``[B, T, C, H, W]`` in
        ``[0, 1]``), image pipelines ``.images`` (``[B, C, H, W]``)."""
        images = {} if batch[0].image is None else {"image": [_load_rgb(i.image) for i in batch]}
        out = self.pipe(prompt=[i.prompt for i in batch], generator=[cpu_generator(i.seed) for i in batch],
                        output_type="pt", **images, **self.call)
        for name in ("frames", "images"):
            if hasattr(out, name):
                pixels = getattr(out, name)
                break
        else:
            pixels = out[0]
        expected = 5 if self.video else 4
        if not hasattr(pixels, "ndim") or pixels.ndim != expected:
            shape = tuple(pixels.shape) if hasattr(pixels, "shape") else type(pixels).__name__
            what = "videos [B, T, C, H, W]" if self.video else "images [B, C, H, W]"
            raise ValueError(f"{type(self.pipe).__name__} returned {shape} with output_type='pt'; expected {what}")
        return (pixels.float().cpu() * 2 - 1).clamp(-1, 1)  # [B, 3, H, W] or [B, T, 3, H, W]


def _load_rgb(path: str):
    """An item's input image as an RGB PIL image (what the pipelines' image processors take)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")

