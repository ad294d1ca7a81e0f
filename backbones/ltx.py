"""`ltx`: LTX-Video (diffusers `LTXVideoTransformer3DModel`, LTX-Video 0.9.x).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_ltx.py``):

* Every ``LTXVideoTransformerBlock`` (kind ``"ltx"``, in ``transformer_blocks``) runs ``attn1(hidden_states=
  norm1(x) * (1 + scale) + shift, image_rotary_emb=...)`` (self-attention with 3-D RoPE), ``attn2(x,
  encoder_hidden_states=text, attention_mask=encoder_attention_mask)`` (cross-attention to T5, no norm before
  it) and ``ff`` on ``norm2(x) * (1 + scale) + shift``.
* Merge points: ``attn1`` (``"attn"``; the RoPE ``(cos, sin)``, each ``[B, N, C]`` over the whole width,
  gathered per slot), ``attn2`` (``"crossattn"``: image queries; the text mask is a bias over the keys and
  broadcasts; off unless ``merge_crossattn=True``), ``ff`` (``"mlp"``).
* Per-token modulation (image-to-video's conditioning frame has its own timestep: ``temb [B, N, 6C]``) is
  applied before the merge points and its gates after the unmerge: nothing to adjust; the per-token timestep
  ``[B, N]`` gives the step by its largest value.
* Grid: the model gets a packed latent ``[B, N, C]`` and ``num_frames``, ``height``, ``width`` of the latent
  (LTX-Video's patch size is 1, so they are the token grid, frames x height x width in raster order). A call
  with ``video_coords`` instead (LTX condition pipelines with extra conditioning tokens) is merged only when
  ``num_frames * height * width`` is its token count. The pipelines pass the scheduler's timestep
  (``t_max = 1000``).
"""

from __future__ import annotations

from typing import ClassVar

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg


class LTXAdapter(DeclaredAdapter):
    """Adapter for diffusers `LTXVideoTransformer3DModel` (LTX-Video 0.9.x); see the module docstring."""

    name: ClassVar[str] = "ltx"
    model_class: ClassVar[str] = "LTXVideoTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, mask, F, H, W, ...)
    #: keyword and position of the model call's latent ``num_frames``, ``height``, ``width``
    grid_args: ClassVar[tuple[tuple[str, int], ...]] = (("num_frames", 4), ("height", 5), ("width", 6))
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("ltx", "transformer_blocks", ("LTXVideoTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "batched"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        sizes = [call_arg(args, kwargs, name, i) for name, i in self.grid_args]
        if any(s is None for s in sizes):
            return None
        grid = tuple(int(s) for s in sizes)
        p, pt = int(self.model.config.patch_size), int(self.model.config.patch_size_t)
        return (grid[0] // pt, grid[1] // p, grid[2] // p)

    def unknown_grid_reason(self) -> str:
        return "num_frames, height and width were not passed"
