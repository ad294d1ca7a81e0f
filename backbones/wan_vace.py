"""`wan_vace`: Wan VACE, video generation and editing under control videos, masks and reference images (diffusers
`WanVACETransformer3DModel`).

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_wan_vace.py``):

* Two block lists, run one after the other: first every ``WanVACETransformerBlock`` (kind ``"vace"``, in
  ``vace_blocks``), then every ``WanTransformerBlock`` (kind ``"wan"``, in ``blocks``). A VACE block reads the
  control tokens ``control_hidden_states`` (its third argument; the control latent patchified like the video,
  zero-padded to the video's token count ``N``, so on the same grid), adds the video tokens to them in its first
  block (``proj_in(control) + hidden_states``, before any merge point), runs Wan's ``attn1`` / ``attn2`` /
  ``ffn`` on them, and returns the hint ``proj_out(control)`` with the control tokens. The model adds hint ``i``
  (times ``control_hidden_states_scale[i]``) to the video tokens after main block ``vace_layers[i]``.
* Merge points: the video blocks' as ``wan``'s; the VACE blocks' the same three sublayers on the control tokens
  (same grid, same RoPE ``[1, N, 1, d]``). Both unmerge before their block's residual, so the hints leave their
  block at full length and are added to the full-length video tokens as they are consumed: nothing else changes.
* Reference images (``reference_images=`` of ``WanVACEPipeline``) are latent frames in front of the video's
  (and zero frames in front of the control latent), cut off after the last step: they are frames of the grid.
* Caching schedules that skip whole blocks (``block_cache``, ``fora``, ``taylorseer``, ``first_block_cache``) are
  refused at ``apply``: a VACE block's hint is a new tensor, no input plus a residual
  (:meth:`~WanVACEAdapter.uncached_kinds`).
* Grid: the latent ``[B, C, F, H, W]`` divided by ``patch_size = (1, 2, 2)``, as Wan's; the pipeline passes the
  scheduler's timestep (``t_max = 1000``).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from ._declared import Kind
from .wan import WanAdapter

_WAN = WanAdapter.kinds[0]


class WanVACEAdapter(WanAdapter):
    """Adapter for diffusers `WanVACETransformer3DModel` (Wan 2.1 / 2.2 VACE); see the module docstring."""

    name: ClassVar[str] = "wan_vace"
    model_class: ClassVar[str] = "WanVACETransformer3DModel"
    kinds: ClassVar[tuple[Kind, ...]] = (
        # forward(hidden_states, encoder_hidden_states, control_hidden_states, temb, rotary_emb)
        dataclasses.replace(_WAN, name="vace", container="vace_blocks", classes=("WanVACETransformerBlock",),
                            arg="control_hidden_states", index=2),
        _WAN,
    )

    @classmethod
    def uncached_kinds(cls) -> dict[str, str]:
        return {"vace": "they return a new hint beside the control tokens, not the new value of an input, so a "
                        "skipped call has no residual to add"}
