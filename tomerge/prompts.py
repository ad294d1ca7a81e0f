"""Prompt token reweighting (SDTM, strategies.md section 6): token categories and the exact text-key bias.

Prompt tokens are sorted into ``"structure"`` (objects, layout, counts, spatial words), ``"detail"``
(colour, material, texture, style, lighting) and ``"none"``. During the structure phase the attention
of image queries to structure tokens is multiplied by ``a_p``, during the detail phase to detail
tokens; that is an additive ``log(a_p)`` on those keys' logits (:func:`token_bias`).

Categorizers (the :class:`PromptCategorizer` protocol, ``categorize(prompt, tokens) -> labels``):

* :class:`WordListCategorizer`: word lists shipped with the project (``tomerge/data/prompt_words.json``),
  no model, no network. Handles CLIP (``"red</w>"``), T5/SentencePiece (``"▁red"``), GPT-2 (``"Ġred"``)
  and WordPiece (``"##ed"``) sub-word tokens: the pieces of a word are joined, the word is looked up
  (lower case, outer punctuation stripped, plural ``-s``/``-es``/``-ies`` also tried, hyphenated parts
  tried) and every piece gets the word's label. Special and punctuation tokens are ``"none"``.
* :class:`JSONLabelsCategorizer`: labels a user produced offline (e.g. with an LLM), see its docstring.

The bias is exact and keeps a fused attention kernel (method (a) of the spec, :func:`key_bias_attention`):
every query gets extra head channels, every key its bias there, and ``scale`` is passed explicitly,
so each image-query logit to text key ``j`` gains exactly ``b_j`` and no attention mask is built.
:func:`bias_text_keys` applies it to one attention module by intercepting the
``torch.nn.functional.scaled_dot_product_attention`` call inside the module's forward only (a
``TorchFunctionMode`` entered by a forward pre-hook and left by an ``always_call`` forward hook): the
processor is neither copied nor replaced. Attention backends that do not call torch's SDPA (e.g. a
``flash_attn`` backend in diffusers' dispatcher) raise instead of silently skipping the bias.

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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from .adapter import TextKeys

STRUCTURE, DETAIL, NONE = "structure", "detail", "none"
CATEGORIES = (STRUCTURE, DETAIL, NONE)
PHASES = (STRUCTURE, DETAIL)
WORDS_FILE = "prompt_words.json"  # in tomerge/data/

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
    data = json.loads((importlib.resources.files("tomerge") / "data" / WORDS_FILE).read_text(encoding="utf-8"))
    return tuple(w for g in data[STRUCTURE].values() for w in g), tuple(w for g in data[DETAIL].values() for w in g)


class WordListCategorizer:
    """Labels tokens from word lists; by default the lists shipped in ``tomerge/data/prompt_words.json``.

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
def check_reweight(a_p: Any, what: str = "prompt_reweight") -> float:
    """Raises unless ``a_p`` is a finite number ``> 0``; returns it as a float."""
    if isinstance(a_p, bool) or not isinstance(a_p, (int, float)) or not math.isfinite(a_p) or a_p <= 0:
        raise ValueError(f"{what} (a_p) must be a finite number > 0, got {a_p!r}")
    return float(a_p)


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
    log_a = math.log(check_reweight(a_p))
    return torch.tensor([log_a if _check_label(c, f"token {i}") == phase else 0.0 for i, c in enumerate(categories)],
                        dtype=torch.float32)


class PromptCategories:
    """The text-token labels of one application (``MergeState.prompt_categories``), one row per prompt.

    Rows follow the model's batch: with ``R`` rows and a batch of ``B`` samples, row ``i`` covers samples
    ``i * B/R .. (i + 1) * B/R - 1`` (diffusers' ``num_images_per_prompt`` order). With classifier-free
    guidance the batch is ``[negative prompts, prompts]``: give the negative prompts' rows first (an
    unlabelled negative gets no bias); a single row applies to every sample.

    Args:
        rows: label lists, all of the model's text length ``T``.
    """

    def __init__(self, rows: Sequence[Sequence[str]]) -> None:
        if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence) or not rows:
            raise ValueError("prompt_categories must be a non-empty list of label lists, one per prompt")
        if all(isinstance(r, str) for r in rows):
            raise ValueError("prompt_categories is a list of label lists (one per prompt); wrap a single prompt's "
                             "labels in a list: [labels]")
        self.rows = tuple(tuple(_check_label(c, f"prompt_categories[{i}][{j}]") for j, c in enumerate(r))
                          for i, r in enumerate(rows))
        if len({len(r) for r in self.rows}) != 1:
            raise ValueError(f"prompt_categories rows have different lengths {[len(r) for r in self.rows]}; "
                             "each row labels the model's full text sequence")
        self._cache: dict[tuple, Tensor | None] = {}

    def bias(self, phase: str, a_p: float, batch: int, text_len: int, device: torch.device) -> Tensor | None:
        """``[B, T]`` fp32 bias of the model call, or ``None`` when it is zero everywhere."""
        key = (phase, a_p, batch, text_len, device)
        if key not in self._cache:
            T, R = len(self.rows[0]), len(self.rows)
            if T != text_len:
                raise ValueError(f"prompt_categories label {T} text tokens but the model attends to {text_len}; "
                                 "label the tokens the model sees (e.g. tomerge.backbones.sd3.text_tokens)")
            if batch % R:
                raise ValueError(f"the model batch has {batch} samples, not a multiple of the {R} prompt_categories "
                                 "rows (with classifier-free guidance give [negative rows..., prompt rows...])")
            b = torch.stack([token_bias(r, phase, a_p) for r in self.rows]).repeat_interleave(batch // R, 0)
            self._cache[key] = b.to(device) if bool(b.any()) else None  # [B, T]
        return self._cache[key]


# ---------------------------------------------------------------------- the exact key bias
def key_bias_attention(query: Tensor, key: Tensor, value: Tensor, bias: Tensor, query_mask: Tensor | None = None,
                       attn_mask: Tensor | None = None, dropout_p: float = 0.0, is_causal: bool = False,
                       scale: float | None = None, enable_gqa: bool = False) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` through a fused SDPA kernel, without an attention mask.

    Two channels are appended to every head: ``1`` (``0`` where ``query_mask`` is false) to the query and
    ``b_j / scale`` split into a high and a low part in the query's dtype to key ``j``, and the head is
    padded with zeros to a multiple of 8 (values too); with ``scale`` passed explicitly every logit to key
    ``j`` gains exactly ``b_j`` (in bf16/fp16 up to the kernel's fp32 accumulation).

    Args:
        query, key, value: ``[B, h, Lq, d]``, ``[B, hk, Lk, d]``, ``[B, hk, Lk, dv]`` (SDPA layout).
        bias: ``[B, Lk]`` additive logit bias per key.
        query_mask: ``[Lq]`` or ``[B, Lq]``, true for the queries that get the bias (``None``: all).
        attn_mask, dropout_p, is_causal, scale, enable_gqa: as in ``F.scaled_dot_product_attention``.

    Returns:
        ``[B, h, Lq, dv]``.
    """
    B, _, Lq, d = query.shape
    dv = value.shape[-1]
    s = scale if scale is not None else d ** -0.5
    width = -(-(max(d, dv) + 2) // 8) * 8  # padded head size the fused kernels accept
    qm = torch.ones(Lq, device=query.device) if query_mask is None else query_mask.to(query.device)
    qm = qm.to(query.dtype).expand(B, Lq)  # [B, Lq]
    kb = bias.to(key.device, torch.float32) / s  # [B, Lk]
    hi = kb.to(key.dtype)
    lo = (kb - hi.float()).to(key.dtype)
    q_extra = query.new_zeros(*query.shape[:-1], width - d)  # [B, h, Lq, width - d]
    q_extra[..., 0] = qm[:, None]
    q_extra[..., 1] = qm[:, None]
    k_extra = key.new_zeros(*key.shape[:-1], width - d)  # [B, hk, Lk, width - d]
    k_extra[..., 0] = hi[:, None]
    k_extra[..., 1] = lo[:, None]
    v_extra = value.new_zeros(*value.shape[:-1], width - dv)  # [B, hk, Lk, width - dv]
    kwargs = {"enable_gqa": True} if enable_gqa else {}
    out = F.scaled_dot_product_attention(
        torch.cat([query, q_extra], -1), torch.cat([key, k_extra], -1), torch.cat([value, v_extra], -1),
        attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=s, **kwargs)  # [B, h, Lq, width]
    return out[..., :dv]


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}


class _TextKeyBias(TorchFunctionMode):
    """Routes the SDPA calls of one attention forward through :func:`key_bias_attention`."""

    def __init__(self, bias: Tensor, text_len: int, text_first: bool) -> None:
        super().__init__()
        self.bias, self.text_len, self.text_first = bias, text_len, text_first  # [B, T]
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        call = {**_SDPA_DEFAULTS, **dict(zip(_SDPA_ARGS, args)), **kwargs}
        q, k = call["query"], call["key"]
        T, (B, Lq), Lk = self.text_len, (q.shape[0], q.shape[-2]), k.shape[-2]
        if Lq != Lk or Lk < T or self.bias.shape != (B, T):
            raise RuntimeError(
                f"tomerge prompt reweighting: expected a joint self-attention over {T} text + image tokens with batch "
                f"{self.bias.shape[0]}, got query {tuple(q.shape)} and key {tuple(k.shape)}")
        self.calls += 1
        text = torch.zeros(Lk, dtype=torch.bool, device=q.device)
        text[slice(0, T) if self.text_first else slice(Lk - T, Lk)] = True  # [Lk]
        full = self.bias.new_zeros(B, Lk)
        full[:, text] = self.bias.to(full.device)  # [B, Lk]
        return key_bias_attention(bias=full, query_mask=~text, **call)


def bias_text_keys(keys: TextKeys, bias_for: Callable[[int, int, torch.device], Tensor | None]) -> list[Any]:
    """Hooks that add a per-call text-key bias to one joint attention module (for image queries only).

    Args:
        keys: the module and where its text tokens are (from the backbone adapter).
        bias_for: ``(batch, text_len, device) -> [B, T] bias or None`` (``None``: run the module unchanged).

    Returns:
        The hook handles (a forward pre-hook and a prepended ``always_call`` forward hook).

    Raises:
        RuntimeError: (from the forward) when the module ran without calling torch's SDPA, e.g. with an
            attention backend that calls a flash-attention library directly.
    """
    active: list[_TextKeyBias] = []

    def enter(module: nn.Module, args: tuple, kwargs: dict) -> None:
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]  # [B, N, C]
        T = keys.text_len(args, kwargs)
        bias = bias_for(x.shape[0], T, x.device) if T > 0 else None
        if bias is not None:
            mode = _TextKeyBias(bias, T, keys.text_first)
            mode.__enter__()
            active.append(mode)

    def leave(module: nn.Module, args: tuple, output: Any) -> None:
        if not active:
            return
        mode = active.pop()
        mode.__exit__(None, None, None)
        if output is not None and mode.calls == 0:  # output None: the forward raised; that error propagates
            raise RuntimeError(
                f"tomerge prompt reweighting: {type(module).__name__} ran without calling "
                "torch.nn.functional.scaled_dot_product_attention (an attention backend or processor that calls "
                "another kernel); use diffusers' native attention backend or drop prompt_categories")

    return [keys.module.register_forward_pre_hook(enter, with_kwargs=True),
            keys.module.register_forward_hook(leave, prepend=True, always_call=True)]
