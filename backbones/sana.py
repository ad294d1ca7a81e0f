"""`sana`: SANA (diffusers `SanaTransformer2DModel`): linear-attention DiT with a convolutional MLP.

Merges the ReLU linear self-attention's input, the cross-attention's queries and the two 1x1 convolutions of the
``GLUMBConv`` MLP (a 1x1 convolution is a per-token linear map; the 3x3 depthwise one between them runs on the full
grid). The attention received, for ``idm``, is tomerge's definition for linear attention
(:func:`~tomerge.probe.received_linear_attention`). The merge points, that definition, the measurement and the
limits: docs/backbones/sana.md.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch.nn.functional as F
from torch import Tensor, nn

from tomerge.adapter import BlockSpec, MergePoint
from tomerge.context import Grid
from tomerge.probe import attention_probe, received_linear_attention, split_heads
from tomerge.state import MergeState

from ._declared import DeclaredAdapter, DeclaredPoint, Kind, Rope, Site


class SanaAdapter(DeclaredAdapter):
    """Adapter for diffusers `SanaTransformer2DModel` (SANA, SANA 1.5); see the module docstring."""

    name: ClassVar[str] = "sana"
    model_class: ClassVar[str] = "SanaTransformer2DModel"
    timestep_index: ClassVar[int] = 2  # forward(hidden_states, encoder_hidden_states, timestep, ...)
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("sana", "transformer_blocks", ("SanaTransformerBlock",), (
            Site("attn", "attn1", probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff.conv_inverted", arg="input", tokens="conv"),
            Site("mlp", "ff.conv_point", arg="input", tokens="conv"),
        )),
    )

    def __init__(self, model: nn.Module, options: Any) -> None:
        super().__init__(model, options)
        self.t_max = 1000.0 * float(getattr(model.config, "timestep_scale", 1.0) or 1.0)

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        if isinstance(point, DeclaredPoint) and point.site.probe:
            return probe_linear_attention(point.module, state)
        return super().probe(block, point, state)


def probe_linear_attention(attn: nn.Module, state: MergeState) -> list[Any]:
    """Records the attention each image token receives in a SANA linear attention (``SanaLinearAttnProcessor2_0``:
    ReLU features of ``to_q``/``to_k``, after ``norm_q``/``norm_k`` when the model has them; defined in
    docs/backbones/sana.md). Calls whose attention ran on merged slots are not recorded."""
    sources = [("q", attn.to_q, None), ("k", attn.to_k, None),
               ("q", getattr(attn, "norm_q", None), None), ("k", getattr(attn, "norm_k", None), None)]  # [B, N, H*d]

    def compute(captured: dict[str, Tensor], grid: Grid) -> Tensor | None:
        q, k = captured.get("q"), captured.get("k")
        if q is None or k is None or k.shape[1] != math.prod(grid):
            return None  # a capture is missing, or the attention ran on merged slots
        phi_q, phi_k = (F.relu(split_heads(t, attn.heads)) for t in (q, k))  # [B, H, N, d]
        return received_linear_attention(phi_q, phi_k)

    return attention_probe(state, attn, sources, compute)


class SanaVideoAdapter(SanaAdapter):
    """Adapter for diffusers `SanaVideoTransformer3DModel` (SANA-Video, text- and image-to-video).

    Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_sana_video.py``): every
    ``SanaVideoTransformerBlock`` (kind ``"sana_video"``) is a SANA block on the ``F x H x W`` video tokens:
    ``attn1`` is the ReLU linear attention with Wan's 3-D RoPE (``rotary_emb``, ``(cos, sin)`` each ``[1, N, 1,
    d]``, gathered per slot; ``SanaLinearAttnProcessor3_0`` rotates the numerator's q/k only, the normaliser
    keeps the unrotated ReLU features, as does the received-attention probe of :class:`SanaAdapter`), ``attn2``
    the cross-attention to the text, and ``ff`` a ``GLUMBTempConv``: the frames folded into the batch (``[B * F,
    C, H, W]``), SANA's 1x1 ``conv_inverted``, 3x3 depthwise ``conv_depth``, gate and 1x1 ``conv_point``, then
    ``conv_temp``, a 3 x 1 convolution over the frames. Merge points as SANA's (the two 1x1 convolutions, their
    ``[B * F, C, H, W]`` inputs read as ``B`` samples of ``F * H * W`` tokens); the depthwise and the temporal
    convolution mix neighbours and run on the full grid (``3 C^2`` multiply-adds per token for ``conv_temp``).
    Grid: the latent ``[B, C, F, H, W]`` divided by ``patch_size = (p_t, p_h, p_w)``. The image-to-video pipeline
    passes a timestep per token (0 on the conditioning frame): the step is its largest value. ``t_max = 1000``.
    """

    name: ClassVar[str] = "sana_video"
    model_class: ClassVar[str] = "SanaVideoTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("sana_video", "transformer_blocks", ("SanaVideoTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("rotary_emb", 3, "wan"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff.conv_inverted", arg="input", tokens="conv"),
            Site("mlp", "ff.conv_point", arg="input", tokens="conv"),
        )),
    )
