"""`sd3`: Stable Diffusion 3 / 3.5 (diffusers `SD3Transformer2DModel`, MMDiT `JointTransformerBlock`).

Merges the image stream of every joint block (``attn``, SD3.5's ``attn2``, ``ff``; the text stream never), records
the joint attention's text-to-image part for ``idm`` and keeps diffusers' feed-forward chunking working. What is
merged where, the received attention, guidance calls, chunking and the limits: docs/backbones/sd3.md.
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
