"""`z_image`: Z-Image (diffusers `ZImageTransformer2DModel`), single-stream blocks over ``[image, caption]``.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_z_image.py``):

* The model is called with lists: ``x`` one latent ``[C, F, H, W]`` per sample, ``cap_feats`` one caption
  ``[T_i, C]`` per sample. Each sample's image tokens (``F/pF x H/p x W/p`` patches in raster order) are padded
  to a multiple of 32 with a pad token, so is its caption, and the samples are padded to one length; padded
  batches get a key mask ``attn_mask [B, L]``.
* Every ``ZImageTransformerBlock`` runs ``attention(attention_norm1(x) * scale, attention_mask=attn_mask,
  freqs_cis=freqs)`` (a softmax self-attention over its whole input; complex RoPE ``[B, L, d/2]``, one row
  per token) and ``feed_forward(ffn_norm1(x) * scale)``, each followed by a per-token RMS norm and a gate.
  Two block lists see the image tokens: ``noise_refiner`` (kind ``"refiner"``: the padded image tokens alone)
  and ``layers`` (kind ``"joint"``: ``[image, image padding, caption, caption padding]``, image FIRST);
  ``context_refiner`` sees the caption alone and is not merged. Merge points (the image part of the block
  input, its first ``N`` tokens; the rest is kept, ``joint_context = "rest"``): ``attention`` (``"attn"``; its
  RoPE rows and key-mask columns gathered per slot) and ``feed_forward`` (``"mlp"``).
* Grid: ``(H / p, W / p)`` (``(F / pF, H / p, W / p)`` for ``F / pF > 1``) of the call's ``patch_size`` and
  ``f_patch_size``, when every sample has the same latent size; Z-Image Omni's nested lists (condition images
  and SigLIP tokens before and after the target) are not merged, with a warning.
* Timestep: the pipeline calls the model with ``t = (1000 - timestep) / 1000``, 1 at the clean image; the
  adapter reports ``1 - t`` (``t_max = 1``), the scheduler's timestep over 1000.
* Received attention (``idm``, the ``sdtm`` schedules), from the attention's SDPA call (``probe="sdpa"``: the
  processor rotates q/k with the complex table itself): in ``layers`` the text-query rule of joint attentions,
  the queries of every token after the image (its padding, the caption and the caption's padding; the batch's
  padding is masked); the noise refiner has no text query, so there at most 64 strided image queries
  (``probe_queries="image"``). Both: the softmax over every key with the key mask, averaged over heads and
  queries, restricted to the image keys and renormalised per sample.
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
