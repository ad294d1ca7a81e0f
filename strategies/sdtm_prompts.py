"""SDTM's prompt token reweighting: token categories, categorizers, and the per-call text-key bias.

Prompt tokens are labelled ``"structure"``, ``"detail"`` or ``"none"`` (:class:`WordListCategorizer`,
:class:`JSONLabelsCategorizer`); :class:`PromptCategories` turns one application's labels into the ``[B, T]``
``log(a_p)`` bias on the keys of the phase's category. The categories and the word lookup: docs/schedules.md,
"Prompt token reweighting".

Example:
    >>> cat = WordListCategorizer()
    >>> cat.categorize("two red cars", ["▁two", "▁red", "▁car", "s", "</s>"])
    ['structure', 'detail', 'structure', 'structure', 'none']
    >>> token_bias(["structure", "detail", "none"], "detail", a_p=2.0)
    tensor([0.0000, 0.6931, 0.0000])
"""

from __future__ import annotations

import functools
import importlib.resources
import json
import math
import re
import string
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor

from tomerge.options import check_number

STRUCTURE, DETAIL, NONE = "structure", "detail", "none"
CATEGORIES = (STRUCTURE, DETAIL, NONE)
PHASES = (STRUCTURE, DETAIL)
WORDS_FILE = "prompt_words.json"  # in strategies/data/ (package tomerge.strategies)

_SPECIAL = re.compile(r"^(<\|?[^<>\s]*\|?>|\[[A-Z_]+\])$")  # <|endoftext|>, </s>, <pad>, [CLS]
_STRIP = string.punctuation + "“”‘’«»…"


# ---------------------------------------------------------------------- categorizers
@runtime_checkable
class PromptCategorizer(Protocol):
    """Labels every token of a tokenised prompt ``"structure"``, ``"detail"`` or ``"none"``."""

    def categorize(self, prompt: str, tokens: list[str]) -> list[str]:
        """One label per entry of ``tokens`` (the tokenisation of ``prompt`` the model sees)."""
        ...


def group_words(tokens: Sequence[str]) -> list[tuple[list[int], str | None]]:
    """Groups sub-word tokens into words.

    A word starts at a ``▁``/``Ġ`` token (SentencePiece, GPT-2), after a CLIP token ending in ``</w>``, after
    a special or punctuation token, and (WordPiece, when some token starts with ``##``) at every token not
    starting with ``##``. Other tokens continue the current word. If no token carries any marker, every
    token is a word.

    Args:
        tokens: token strings as the tokenizer writes them.

    Returns:
        ``(token indices, word)`` per word in order; ``word`` is ``None`` for special and punctuation tokens.

    Example:
        >>> group_words(["photo", "realistic</w>", ",</w>", "cat</w>"])
        [([0, 1], 'photorealistic'), ([2], None), ([3], 'cat')]
    """
    marked = any(t.startswith(("▁", "Ġ", "##")) or t.endswith("</w>") for t in tokens)
    wordpiece = any(t.startswith("##") for t in tokens)
    words: list[tuple[list[int], str | None]] = []
    current: tuple[list[int], list[str]] | None = None
    for i, token in enumerate(tokens):
        core = token.removesuffix("</w>").removeprefix("##").lstrip("▁Ġ")
        if _SPECIAL.match(token) or (core and not any(c.isalnum() for c in core)):
            current = None
            words.append(([i], None))
            continue
        if (current is None or not marked or token.startswith(("▁", "Ġ"))
                or (wordpiece and not token.startswith("##"))):
            current = ([i], [core])
            words.append((current[0], None))  # text filled in below
        else:
            current[0].append(i)
            current[1].append(core)
        words[-1] = (current[0], "".join(current[1]))
        if token.endswith("</w>"):
            current = None
    return words


def lookup(word: str, table: dict[str, str]) -> str:
    """The label of ``word`` in ``table`` (lower-case keys): exact, then singular forms, then hyphen parts.

    Example:
        >>> lookup("Puppies!", {"puppy": "structure"})
        'structure'
    """
    w = word.lower().strip(_STRIP).removesuffix("'s")
    candidates = [w]
    if w.endswith("ies"):
        candidates.append(w[:-3] + "y")
    if w.endswith("es"):
        candidates.append(w[:-2])
    if w.endswith("s"):
        candidates.append(w[:-1])
    for c in candidates:
        if c in table:
            return table[c]
    for part in (p for p in re.split(r"[-_/]", w) if p and p != w):
        if part in table:
            return table[part]
    return NONE


def label_tokens(tokens: Sequence[str], table: dict[str, str]) -> list[str]:
    """Labels every token with its word's label in ``table`` (see :func:`group_words`)."""
    labels = [NONE] * len(tokens)
    for indices, word in group_words(tokens):
        label = lookup(word, table) if word else NONE
        for i in indices:
            labels[i] = label
    return labels


def _check_label(label: Any, where: str) -> str:
    if label not in CATEGORIES:
        raise ValueError(f"{where}: label {label!r} is not one of {CATEGORIES}")
    return label


@functools.lru_cache(maxsize=1)
def _shipped_words() -> tuple[tuple[str, ...], tuple[str, ...]]:
    data = json.loads((importlib.resources.files("tomerge.strategies") / "data" / WORDS_FILE).read_text(encoding="utf-8"))
    return tuple(w for g in data[STRUCTURE].values() for w in g), tuple(w for g in data[DETAIL].values() for w in g)


class WordListCategorizer:
    """Labels tokens from word lists; by default the lists shipped in ``strategies/data/prompt_words.json``.

    Args:
        structure: words labelled ``"structure"`` (``None``: the shipped list).
        detail: words labelled ``"detail"`` (``None``: the shipped list).

    Raises:
        ValueError: when a word is in both lists.

    Example:
        >>> WordListCategorizer().categorize("", ["a</w>", "red</w>", "wooden</w>", "house</w>"])
        ['none', 'detail', 'detail', 'structure']
    """

    def __init__(self, structure: Sequence[str] | None = None, detail: Sequence[str] | None = None) -> None:
        shipped_s, shipped_d = _shipped_words()
        s = {w.lower() for w in (shipped_s if structure is None else structure)}
        d = {w.lower() for w in (shipped_d if detail is None else detail)}
        both = sorted(s & d)
        if both:
            raise ValueError(f"WordListCategorizer: words in both lists: {both[:10]}; each word has one category")
        self.table: dict[str, str] = {**{w: STRUCTURE for w in s}, **{w: DETAIL for w in d}}

    def categorize(self, prompt: str, tokens: list[str]) -> list[str]:
        """One label per token (``prompt`` is not needed: the tokens carry the words)."""
        return label_tokens(tokens, self.table)


class JSONLabelsCategorizer:
    """Labels from a JSON file, e.g. produced offline with an LLM. Three layouts are accepted:

    * ``{"a red car": ["none", "detail", "structure"]}``: per prompt, exactly one label per token of
      the tokenisation passed to :meth:`categorize` (special and padding tokens included);
    * ``{"a red car": {"red": "detail", "car": "structure"}}``: per prompt, a word -> label map
      (applied like :class:`WordListCategorizer`; unlisted words are ``"none"``);
    * ``{"red": "detail", "car": "structure"}``: one word -> label map for every prompt.

    Labels are ``"structure"``, ``"detail"`` or ``"none"``.

    Args:
        path: the JSON file.

    Raises:
        ValueError: unreadable file, a layout other than the three above, an unknown label; at
            :meth:`categorize`: a prompt the file does not have, or a label list of the wrong length.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"JSONLabelsCategorizer: cannot read {self.path}: {err}") from None
        where = f"JSONLabelsCategorizer {self.path}"
        if not isinstance(data, dict) or not data:
            raise ValueError(f"{where}: expected a non-empty JSON object ({{prompt: labels}} or {{word: label}})")
        kinds = {type(v) for v in data.values()}
        self.words: dict[str, str] | None = None
        self.prompts: dict[str, list[str] | dict[str, str]] = {}
        if kinds == {str}:
            self.words = {k.lower(): _check_label(v, f"{where}, word {k!r}") for k, v in data.items()}
        elif kinds <= {list, dict}:
            for prompt, labels in data.items():
                if isinstance(labels, list):
                    self.prompts[prompt] = [_check_label(v, f"{where}, prompt {prompt!r}") for v in labels]
                else:
                    self.prompts[prompt] = {w.lower(): _check_label(v, f"{where}, prompt {prompt!r}, word {w!r}")
                                            for w, v in labels.items()}
        else:
            raise ValueError(
                f"{where}: values must be all strings ({{word: label}}) or all lists/objects ({{prompt: [labels]}} "
                f"or {{prompt: {{word: label}}}}), got {sorted(k.__name__ for k in kinds)}")

    def categorize(self, prompt: str, tokens: list[str]) -> list[str]:
        """The file's labels for ``prompt`` and its ``tokens`` (see the class docstring)."""
        if self.words is not None:
            return label_tokens(tokens, self.words)
        if prompt not in self.prompts:
            some = ", ".join(repr(p) for p in list(self.prompts)[:3])
            raise ValueError(f"JSONLabelsCategorizer {self.path}: no labels for prompt {prompt!r} (the file has "
                             f"{len(self.prompts)} prompts, e.g. {some}); label it or use a {{word: label}} file")
        labels = self.prompts[prompt]
        if isinstance(labels, dict):
            return label_tokens(tokens, labels)
        if len(labels) != len(tokens):
            raise ValueError(
                f"JSONLabelsCategorizer {self.path}: prompt {prompt!r} has {len(labels)} labels but its tokenisation "
                f"has {len(tokens)} tokens; label exactly that tokenisation or give a {{word: label}} map instead")
        return list(labels)


# ---------------------------------------------------------------------- biases
def token_bias(categories: Sequence[str], phase: str, a_p: float = 2.0) -> Tensor:
    """The additive logit bias of one prompt's tokens in a phase.

    Args:
        categories: one label per text token.
        phase: ``"structure"`` or ``"detail"``: the category that is reweighted.
        a_p: attention multiplier (``1``: no change).

    Returns:
        ``[T]`` fp32: ``log(a_p)`` on tokens labelled ``phase``, 0 elsewhere.
    """
    if phase not in PHASES:
        raise ValueError(f"phase must be one of {PHASES}, got {phase!r}")
    log_a = math.log(check_number(a_p, "a_p", "token_bias", low=0.0, low_open=True))
    return torch.tensor([log_a if _check_label(c, f"token {i}") == phase else 0.0 for i, c in enumerate(categories)],
                        dtype=torch.float32)


class PromptCategories:
    """The text-token labels of one application (:class:`tomerge.text_bias.TextLabels`), one row per prompt.

    Rows follow the model's batch: with ``R`` rows and a batch of ``B`` samples, row ``i`` covers samples
    ``i * B/R .. (i + 1) * B/R - 1`` (diffusers' ``num_images_per_prompt`` order). With classifier-free
    guidance the batch is ``[negative prompts, prompts]``: give the negative prompts' rows first (an
    unlabelled negative gets no bias); a single row applies to every sample.

    Args:
        rows: label lists, all of the model's text length ``T``.
    """

    def __init__(self, rows: Sequence[Sequence[str]]) -> None:
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
            raise ValueError("text_labels must be a non-empty list of label lists, one per prompt")
        if all(isinstance(r, str) for r in rows):
            raise ValueError("text_labels is a list of label lists (one per prompt); wrap a single prompt's "
                             "labels in a list: [labels]")
        self.rows = tuple(tuple(_check_label(c, f"text_labels[{i}][{j}]") for j, c in enumerate(r))
                          for i, r in enumerate(rows))
        if len({len(r) for r in self.rows}) != 1:
            raise ValueError(f"text_labels rows have different lengths {[len(r) for r in self.rows]}; "
                             "each row labels the model's full text sequence")
        self._cache: dict[tuple, Tensor | None] = {}

    def bias(self, phase: str, a_p: float, batch: int, text_len: int, device: torch.device) -> Tensor | None:
        """``[B, T]`` fp32 bias of the model call, or ``None`` when it is zero everywhere."""
        key = (phase, a_p, batch, text_len, device)
        if key not in self._cache:
            T, R = len(self.rows[0]), len(self.rows)
            if T != text_len:
                raise ValueError(f"text_labels label {T} text tokens but the model attends to {text_len}; "
                                 "label the tokens the model sees (e.g. tomerge.backbones.sd3.text_tokens)")
            if batch % R:
                raise ValueError(f"the model batch has {batch} samples, not a multiple of the {R} text_labels "
                                 "rows (with classifier-free guidance give [negative rows..., prompt rows...])")
            b = torch.stack([token_bias(r, phase, a_p) for r in self.rows]).repeat_interleave(batch // R, 0)
            self._cache[key] = b.to(device) if bool(b.any()) else None  # [B, T]
        return self._cache[key]
