"""`latte`: Latte text-to-video (diffusers `LatteTransformer3DModel`, maxin-cn/Latte-1): spatial and temporal
blocks alternate; the spatial blocks are merged, frame by frame.

Facts from the installed diffusers (0.42.1, ``models/transformers/latte_transformer_3d.py``):

* The model folds the frames into the batch and alternates ``transformer_blocks[i]`` (spatial, kind
  ``"spatial"``: a PixArt-style ``BasicTransformerBlock`` with ``norm_type="ada_norm_single"`` on
  ``[B * F, H * W, C]``, each frame's tokens alone, with cross-attention to the T5 text) and
  ``temporal_transformer_blocks[i]`` (the same block class on ``[B * H * W, F, C]``: each spatial position's
  frames, no cross-attention).
* Merging the spatial blocks per frame is the natural fit: in every spatial block call the batch is the
  ``B * F`` frames and the tokens are one ``H x W`` grid, merged per frame like an image. Merge points:
  ``attn1`` (``"attn"``), ``attn2`` (``"crossattn"``: queries; off unless ``merge_crossattn=True``; the text mask
  broadcasts over queries) and ``ff`` (``"mlp"``). ``attn1`` is a softmax self-attention over the frame's tokens:
  ``idm`` records the attention received there (``probe=True``). Positions are absolute (sin-cos at the patch
  embedding; a fixed temporal table added before the first temporal block): no positional work.
* The temporal blocks are not merged: they attend over a spatial position's frames, which a merged frame no
  longer has as columns; they run at full length between the spatial blocks, which unmerge their outputs.
* Grid: ``(H / p, W / p)`` of the latent ``[B, C, F, H, W]``. The pipeline passes the scheduler's timestep
  (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Site
from ._diffusers import call_arg
from ._grid import latent_grid


class LatteAdapter(DeclaredAdapter):
    """Adapter for diffusers `LatteTransformer3DModel` (Latte-1): its spatial blocks, per frame; see the module
    docstring."""

    name: ClassVar[str] = "latte"
    model_class: ClassVar[str] = "LatteTransformer3DModel"
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("spatial", "transformer_blocks", ("BasicTransformerBlock",), (
            Site("attn", "attn1", probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sample = call_arg(args, kwargs, self.latent_arg, self.latent_index)  # [B, C, F, H, W]
        p = int(self.model.config.patch_size)
        return latent_grid(sample[:, :, 0], (p, p))  # one frame's grid: the spatial blocks see [B * F, H * W, C]
