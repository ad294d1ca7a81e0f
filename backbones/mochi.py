"""`mochi`: Mochi 1 (diffusers `MochiTransformer3DModel`, genmo/mochi-1-preview).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_mochi.py``):

* Every ``MochiTransformerBlock`` (kind ``"mochi"``, in ``transformer_blocks``) runs ``attn1(hidden_states=
  norm1(x), encoder_hidden_states=norm1_context(c), image_rotary_emb=freqs, attention_mask=text_mask)``: a
  joint attention (``MochiAttnProcessor2_0``) with separate video (``to_q/k/v``) and text (``add_q/k/v_proj``)
  projections, RoPE on the video queries and keys only, and per sample only the prompt's valid text tokens
  (the mask ``[B, T]`` selects them, whatever the number of video tokens); it returns ``(video, text)``. Then
  ``ff`` on the modulated video stream (``ff_context`` on the text stream; the last block has none).
* Merge points: ``attn1`` (``"attn"``; the RoPE tables ``(cos, sin)``, each ``[N, heads, d/2]`` without a batch
  axis, gathered per slot: layout ``"broadcast"``; the text mask passes) and ``ff`` (``"mlp"``).
* Grid: the latent ``[B, C, F, H, W]``, each frame patched ``p x p`` (no temporal patch): ``(F, H / p, W / p)``.
* Timestep: the pipeline runs the scheduler with inverted sigmas and calls the model with ``t`` RISING from
  about 0 (noise) to 1000 (data). The adapter reports ``1000 - t`` (what the pipeline itself calls the
  "non-reversed" timestep), so that steps advance and progress runs from the noisiest call on; the
  scheduler's timesteps are mapped the same way.
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, Site
from ._diffusers import call_arg
from ._grid import latent_grid


class MochiAdapter(DeclaredAdapter):
    """Adapter for diffusers `MochiTransformer3DModel` (Mochi 1); see the module docstring."""

    name: ClassVar[str] = "mochi"
    model_class: ClassVar[str] = "MochiTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, mask, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("mochi", "transformer_blocks", ("MochiTransformerBlock",), (
            Site("attn", "attn1", output=0, rope=Rope("image_rotary_emb", 3, "broadcast"), mask="pass", probe=True),
            Site("mlp", "ff"),
        ), text_arg="encoder_hidden_states", joint="last", outputs=("hidden_states", "encoder_hidden_states")),
    )

    def call_grid(self, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
        p = int(self.model.config.patch_size)
        return latent_grid(call_arg(args, kwargs, self.latent_arg, self.latent_index), (1, p, p))

    def call_timestep(self, args: tuple, kwargs: dict) -> Tensor | float | None:
        t = super().call_timestep(args, kwargs)
        return None if t is None else self.t_max - t

    def scheduler_timesteps(self, timesteps: Tensor) -> Tensor:
        return self.t_max - timesteps.float()
