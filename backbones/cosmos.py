"""`cosmos`: NVIDIA Cosmos world models (diffusers `CosmosTransformer3DModel`): Cosmos 1.0 Text2World /
Video2World, Cosmos Predict2 (2.0) Text2Image / Video2World and Predict2.5.

Facts from the installed diffusers (0.42.1, ``models/transformers/transformer_cosmos.py``):

* Every ``CosmosTransformerBlock`` (kind ``"cosmos"``, in ``transformer_blocks``) adds the learnable positions
  (Cosmos 1.0) to its input, then runs ``attn1(norm1(x), image_rotary_emb=freqs)`` (self-attention over the
  video tokens, RMS q/k norms, 3-D RoPE), ``attn2(norm2(x), encoder_hidden_states=text, attention_mask=mask)``
  (cross-attention to T5; Predict2.5 adds an image-context attention inside it) and ``ff`` on ``norm3(x)``; the
  adaLN modulation and gates may be per token (Video2World 2.x: a timestep per frame).
* Merge points: ``attn1`` (``"attn"``; the RoPE ``(cos, sin)`` tables ``[N, d]`` of the video rows gathered per
  slot; a softmax self-attention, so ``idm`` records the attention received there: ``probe=True``), ``attn2``
  (``"crossattn"``: video queries; the text mask ``[B, 1, 1, S]`` is over the keys and passes; off unless
  ``merge_crossattn=True``), ``ff`` (``"mlp"``).
* Grid: the latent ``[B, C, F, H, W]`` (the condition mask and the padding mask are concatenated along channels)
  divided by ``patch_size = (p_t, p_h, p_w)``: ``(F / p_t, H / p_h, W / p_w)``.
* Timestep: one model class, three conventions: Cosmos 1.0 is called with EDM's ``c_noise = log(sigma) / 4``
  (the scheduler's timesteps), Predict2 with ``sigma / (sigma + 1)``, Predict2.5 with the flow sigma; a
  Video2World timestep ``[B, 1, F, 1, 1]`` gives the step by its largest value. All fall as sampling proceeds,
  so the steps are counted in call order (the scheduler's timesteps are not used: ``scheduler_timesteps`` is
  ``None``); progress without a step count reads ``t`` on ``[0, 1]`` (``t_max = 1``, right for the 2.x
  models; pass ``num_steps`` for Cosmos 1.0).
"""

from __future__ import annotations

from typing import ClassVar

from torch import Tensor

from ._declared import DeclaredAdapter, Kind, Rope, Site


class CosmosAdapter(DeclaredAdapter):
    """Adapter for diffusers `CosmosTransformer3DModel` (Cosmos 1.0, Predict2, Predict2.5); see the module
    docstring."""

    name: ClassVar[str] = "cosmos"
    model_class: ClassVar[str] = "CosmosTransformer3DModel"
    grid_dims: ClassVar[int] = 3
    t_max: ClassVar[float] = 1.0
    timestep_index: ClassVar[int] = 1  # forward(hidden_states, timestep, encoder_hidden_states, ...)
    text_index: ClassVar[int] = 2
    kinds: ClassVar[tuple[Kind, ...]] = (
        Kind("cosmos", "transformer_blocks", ("CosmosTransformerBlock",), (
            Site("attn", "attn1", rope=Rope("image_rotary_emb", 3, "rows"), probe=True),
            Site("crossattn", "attn2", mask="pass"),
            Site("mlp", "ff"),
        )),
    )

    def scheduler_timesteps(self, timesteps: Tensor) -> Tensor | None:
        return None  # the pipelines call the model with c_noise, sigma / (sigma + 1) or sigma, not these
