"""`z_image`: Z-Image (diffusers `ZImageTransformer2DModel`), single-stream blocks over ``[image, caption]``.

The model takes per-sample lists and pads image and caption tokens to multiples of 32; the noise refiner sees the
image alone, the main ``layers`` the joint sequence, image first. Both merge the image part (the first ``N``
tokens, the rest kept) of their attention and feed-forward, with its RoPE rows and key-mask columns. The call
layout, timestep and received attention: docs/backbones/z_image.md.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg


def _sites(probe_queries: str) -> tuple[Site, ...]:
    """The merge points of a ``ZImageTransformerBlock``, its attention probed with ``probe_queries``."""
    # Attention.forward(hidden_states, encoder_hidden_states, attention_mask, **kwargs): freqs_cis by keyword
    return (Site("attn", "attention", tokens="joint", rope=Rope("freqs_cis", 3, "complex", text="last"), mask="keys",
                 probe="sdpa", probe_queries=probe_queries),
            Site("mlp", "feed_forward", arg="x", tokens="joint"))


class ZImageAdapter(DeclaredAdapter):
    """Adapter for diffusers `ZImageTransformer2DModel` (Z-Image, Z-Image-Turbo); see the module docstring."""

    name: ClassVar[str] = "z_image"
    model_class: ClassVar[str] = "ZImageTransformer2DModel"
    t_max: ClassVar[float] = 1.0
    timestep_arg: ClassVar[str] = "t"  # forward(x, t, cap_feats, ..., patch_size, f_patch_size)
    timestep_index: ClassVar[int] = 1
    text_arg: ClassVar[str] = "cap_feats"
    text_index: ClassVar[int] = 2
    joint_context: ClassVar[Literal["text", "rest"]] = "rest"
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("refiner", "noise_refiner", ("ZImageTransformerBlock",), _sites("image"), arg="x", joint_input="last",
             joint="last"),
        Kind("joint", "layers", ("ZImageTransformerBlock",), _sites("text"), arg="x", joint_input="last",
             joint="last"),
    )

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        t = call_arg(args, kwargs, "t", 1)
        return None if t is None else 1 - t

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        latents = call_arg(args, kwargs, "x", 0)
        if not isinstance(latents, (list, tuple)) or not latents or not all(isinstance(x, Tensor) for x in latents):
            return None  # Omni's nested lists
        sizes = {tuple(x.shape[1:]) for x in latents}  # (F, H, W) of each sample's [C, F, H, W]
        if len(sizes) != 1:
            return None
        p = call_arg(args, kwargs, "patch_size", 7) or 2
        pF = call_arg(args, kwargs, "f_patch_size", 8) or 1
        F, H, W = sizes.pop()
        grid = (F // pF, H // p, W // p)
        return grid[1:] if grid[0] == 1 else grid

    def unknown_grid_reason(self) -> str:
        return "its samples' latents differ in size, or it is a Z-Image Omni call (condition images)"
