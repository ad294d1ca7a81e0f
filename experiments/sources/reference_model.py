"""The reference DiT as a model source (``model: reference``, ``model: {reference: PATH, call: {...}}``): the
bundled checkpoints (:data:`BUNDLED_REFERENCES`, docs/reference-model.md), the file a config's
``model.reference`` names (:func:`reference_checkpoint`), and :class:`ReferenceSource`, which samples a native
DiT checkpoint with tomerge's Euler sampler (:mod:`tomerge.experiments.sources.sampling`) for items that carry
class labels.

Example:
    >>> from tomerge.experiments.sources.items import Item
    >>> from tomerge.experiments.sources.models import ModelSpec
    >>> source = ReferenceSource(ModelSpec(call={"num_steps": 2}))      # doctest: +SKIP
    >>> images = source.generate([Item(0, 0, label=3)])                 # doctest: +SKIP
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .devices import cpu_generator, torch_dtype

if TYPE_CHECKING:
    from torch import Tensor, nn

    from .items import Item
    from .models import ModelSpec  # for annotations only: models imports this module

__all__ = ["BUNDLED_REFERENCES", "REFERENCE_CHECKPOINT", "BUNDLED_REFERENCE_NAMES", "reference_checkpoint",
           "ReferenceSource"]

# The reference models shipped with the package, by the name a config gives (`model: {reference: NAME}`):
# the same DiT at 256 (32 x 32 images) and 1,024 image tokens (64 x 64), docs/reference-model.md.
BUNDLED_REFERENCES = {
    "bundled": Path(__file__).parents[1] / "reference" / "dit_reference.safetensors",
    "bundled-1024": Path(__file__).parents[1] / "reference" / "dit_reference_1024.safetensors",
}
REFERENCE_CHECKPOINT = BUNDLED_REFERENCES["bundled"]
# what figures call them (ModelSpec.display_name); the token counts are those of DIT_PRESETS "reference" and
# "reference-1024", which tests check
BUNDLED_REFERENCE_NAMES = {"bundled": "bundled reference DiT (256 tokens)",
                           "bundled-1024": "bundled reference DiT (1,024 tokens)"}


def reference_checkpoint(path: str | None) -> Path:
    """The file of ``model.reference``: ``None`` is the default bundled model, a name of
    :data:`BUNDLED_REFERENCES` its file, anything else a path.

    Example:
        >>> reference_checkpoint("bundled-1024").name
        'dit_reference_1024.safetensors'
    """
    if path is None:
        return REFERENCE_CHECKPOINT
    return BUNDLED_REFERENCES.get(path, Path(path))


class ReferenceSource:
    """A native DiT checkpoint sampled with :func:`tomerge.experiments.sources.sampling.sample`."""

    conditioning = "class"
    video = False

    def __init__(self, spec: ModelSpec) -> None:
        from tomerge.backbones.timm_dit import load_dit

        self.spec = spec
        spec.check()
        path = reference_checkpoint(spec.path)
        self.checkpoint = path
        self.model = load_dit(path, map_location=spec.device).eval().to(torch_dtype(spec.dtype))
        self.call = {**spec.REFERENCE_CALL, **spec.call}

    @property
    def target(self) -> nn.Module:
        """What :func:`tomerge.apply` attaches to."""
        return self.model

    @property
    def denoiser(self) -> nn.Module:
        return self.model

    @property
    def num_steps(self) -> int:
        return int(self.call["num_steps"])

    def merge_options(self) -> dict[str, Any]:
        """Extra :func:`tomerge.apply` options: the sampler's step count (schedules see exact progress)."""
        return {"num_steps": self.num_steps}

    def check_items(self, items: Sequence[Item]) -> None:
        n = self.model.config.num_classes
        if any(i.label is None for i in items):
            raise UsageError("the reference DiT is class-conditional: give class labels, not prompts")
        bad = sorted({i.label for i in items if not 0 <= i.label < n})
        if bad:
            raise UsageError(f"class ids {bad} outside the model's classes 0..{n - 1}")

    def generate(self, batch: Sequence[Item]) -> Tensor:
        """Images ``[B, C, H, W]`` in ``[-1, 1]`` (float32, CPU)."""
        import torch

        from .sampling import sample

        c = self.model.config
        noise = torch.stack([torch.randn((c.in_channels, *c.image_hw), generator=cpu_generator(i.seed))
                             for i in batch])  # [B, C, H, W]
        labels = torch.tensor([i.label for i in batch], dtype=torch.long)
        return sample(self.model, labels, num_steps=self.num_steps, cfg_scale=float(self.call["cfg_scale"]),
                      shift=float(self.call["shift"]), noise=noise).float().cpu()

