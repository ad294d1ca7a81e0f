"""`wan_vace`: Wan VACE, video generation and editing under control videos, masks and reference images (diffusers
`WanVACETransformer3DModel`).

Merges both block lists as `wan` does: the video blocks, and the VACE blocks, which run the same sublayers on the
control tokens (on the video's grid). Every merge point unmerges before its block's residual, so the hints the VACE
blocks return stay full length; whole-block caching is refused, as a hint is no input plus a residual
(:meth:`~WanVACEAdapter.uncached_kinds`). The blocks, hints and reference frames: docs/backbones/wan.md ("VACE").
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
