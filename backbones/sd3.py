"""`sd3`: Stable Diffusion 3 / 3.5 (diffusers `SD3Transformer2DModel`, MMDiT `JointTransformerBlock`).

Each `JointTransformerBlock` runs ``attn(hidden_states=norm1(x), encoder_hidden_states=norm1_context(c))``.
The joint attention processor projects image and text separately, concatenates them after the
projection and splits the result at the image length, so a shorter (merged) image sequence passes
through unchanged; it returns ``(image, text)``. Merge points:

* ``attn``: the image ``hidden_states`` argument; the image element (index 0) of its tuple output is
  unmerged. The text stream is never merged, also in the last block (``context_pre_only``, whose
  attention still returns a tuple).
* ``attn2`` (SD3.5 dual attention, ``use_dual_attention``: a second image self-attention on
  ``norm_hidden_states2``): merged like ``attn`` when ``merge_attn2=True`` (default), else it runs at
  full length. It always runs: the adapter never changes ``use_dual_attention``.
* ``ff``: the image feed-forward input (``ff_context``, the text feed-forward, is left alone).

Positions are absolute (added at the patch embedding): no positional work. The grid is
``(H0 // p, W0 // p)`` of the latent the model is called with. The timestep comes from each call,
so the CFG batch, split CFG and SD3.5 skip-layer guidance (a third call at the same timestep) share a
step.

Received attention for ``idm``: the text-to-image part of the joint attention. Forward hooks on the
projection submodules (``to_k`` then ``norm_k``, ``add_q_proj`` then ``norm_added_q``, ``add_k_proj``
then ``norm_added_k``; ``to_qkv`` / ``to_added_qkv`` when the projections are fused) capture the keys
and text queries the processor computes anyway, so the attention keeps its fused kernel. The text
queries' softmax over all keys (image and text, as in the model) is averaged over heads and text
queries, restricted to the image keys and renormalised to sum to 1 per sample
(:func:`~tomerge.backbones._diffusers.probe_joint_attention`, text last).

Prompt reweighting (``sdtm`` with text labels, :mod:`tomerge.strategies.sdtm_prompts` and
:mod:`tomerge.text_bias`): the text tokens are the last ``T`` keys of the joint attention ``attn`` (``T`` from
its ``encoder_hidden_states``); the image queries get the text-key bias inside its SDPA call. The text
sequence of ``StableDiffusion3Pipeline`` is 77 CLIP
tokens then ``max_sequence_length`` T5 tokens: :func:`text_tokens` lists them for a categorizer.

Feed-forward chunking (``enable_forward_chunking``) works with merging: in calls that merge the MLP,
:class:`~tomerge.backbones._diffusers.FeedForwardPoint` hands ``ff`` the whole merged sequence and runs it,
and the text ``ff_context``, in the block's chunks (docs/backbones/sd3.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

from torch import nn

from tomerge.adapter import BlockSpec, KindSummary, MergePoint, TextKeys
from tomerge.state import MergeState

from ._diffusers import FeedForwardPoint, PatchifiedAdapter, call_arg, probe_joint_attention


@dataclasses.dataclass(frozen=True)
class SD3Options:
    """Options of the ``sd3`` adapter.

    Args:
        merge_attn2: merge SD3.5's second image self-attention (``attn2``) with the block's plan like
            ``attn`` (True), or run it at full length (False). It is never disabled.
    """

    merge_attn2: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.merge_attn2, bool):
            raise ValueError(f"merge_attn2 must be True or False, got {self.merge_attn2!r}")


class SD3Adapter(PatchifiedAdapter):
    """Adapter for diffusers `SD3Transformer2DModel` (see the module docstring).

    Example (``pipe``: a `StableDiffusion3Pipeline`, or the transformer itself):
        >>> import tomerge
        >>> handle = tomerge.apply(pipe, "sdtm", ratio=0.3, merge_attn2=True)  # doctest: +SKIP
    """

    name: ClassVar[str] = "sd3"
    block_names: ClassVar[tuple[str, ...]] = ("JointTransformerBlock",)
    Options: ClassVar[type] = SD3Options
    model_class: ClassVar[str] = "SD3Transformer2DModel"
    block_kind: ClassVar[str] = "joint"
    block_outputs: ClassVar[tuple[str, ...]] = ("encoder_hidden_states", "hidden_states")  # None in the last block
    timestep_index: ClassVar[int] = 3  # forward(hidden_states, encoder_hidden_states, pooled_projections, timestep)

    def merge_points(self, block: nn.Module) -> tuple[MergePoint, ...]:
        points = [MergePoint("attn", block.attn, output=0)]  # output: (image, text)
        if getattr(block, "attn2", None) is not None and self.options.merge_attn2:
            points.append(MergePoint("attn", block.attn2))  # image self-attention: a tensor output
        # the block chunks both feed-forwards: the text one (None in the last, context_pre_only, block) too
        points.append(FeedForwardPoint("mlp", block.ff, block=block, feed_forwards=("ff", "ff_context")))
        return tuple(points)

    def text_keys(self, block: BlockSpec, point: MergePoint) -> TextKeys | None:
        if point.module is not block.module.attn:
            return None  # attn2 (dual attention) is image-only
        return TextKeys(point.module, text_len=_text_len, text_first=False)  # [image, text] in the processor

    @classmethod
    def kind_summaries(cls) -> tuple[KindSummary, ...]:
        return (KindSummary(cls.block_kind, ("attn", "mlp"), context="joint attention, text last"),)

    @classmethod
    def probed_kinds(cls) -> frozenset[str]:
        return frozenset({cls.block_kind})

    def probe(self, block: BlockSpec, point: MergePoint, state: MergeState) -> list[Any]:
        if point.module is not block.module.attn:
            return []  # attn2 (dual attention): the joint attention's text-to-image probe is the record
        return probe_joint_attention(point.module, state, text_side="last",
                                     heads_first=True)  # the processor's norms see [B, heads, L, d]


def _text_len(args: tuple, kwargs: dict) -> int:
    text = call_arg(args, kwargs, "encoder_hidden_states", 1)  # [B, T, C]
    return 0 if text is None else int(text.shape[1])


def text_tokens(pipe: Any, prompt: str, max_sequence_length: int = 256) -> list[str]:
    """The text tokens a `StableDiffusion3Pipeline` gives the transformer for ``prompt``, as strings.

    The pipeline concatenates the CLIP tokens (``tokenizer``, padded to its 77) and the T5 tokens
    (``tokenizer_3``, padded to ``max_sequence_length``; without T5 they are zero embeddings, listed
    as ``"<pad>"``). Feed the result to a :class:`~tomerge.strategies.sdtm_prompts.PromptCategorizer`.

    Args:
        pipe: the pipeline (its tokenizers are used; no model runs).
        prompt: the prompt.
        max_sequence_length: the pipeline call's ``max_sequence_length``.

    Returns:
        ``77 + max_sequence_length`` token strings (CLIP ``"red</w>"``, T5 ``"▁red"``).

    Example:
        >>> labels = WordListCategorizer().categorize(prompt, text_tokens(pipe, prompt))   # doctest: +SKIP
    """
    clip = pipe.tokenizer
    ids = clip(prompt, padding="max_length", max_length=pipe.tokenizer_max_length, truncation=True).input_ids
    tokens = list(clip.convert_ids_to_tokens(ids))
    t5 = getattr(pipe, "tokenizer_3", None)
    if t5 is None or getattr(pipe, "text_encoder_3", None) is None:
        return tokens + ["<pad>"] * max_sequence_length
    ids = t5(prompt, padding="max_length", max_length=max_sequence_length, truncation=True,
             add_special_tokens=True).input_ids
    return tokens + list(t5.convert_ids_to_tokens(ids))
