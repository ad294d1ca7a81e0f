"""Tensor gathers of the declared adapters: the call arguments that follow merged image tokens (rotary tables, attention
masks, ragged joint sequences), indexed with a plan's representatives ``plan.dst [B, M]``.

Each layout, and why it is gathered so, is in ``docs/backbones/adding-a-family.md`` ("Rotary layouts", "Masks").
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from ._declaration import Side


# ---------------------------------------------------------------------- call arguments
def with_arg(args: tuple, kwargs: dict, name: str, index: int, value: Any) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the argument ``name`` (keyword, or positional ``index``) set to ``value``."""
    if name not in kwargs and len(args) > index:
        return (*args[:index], value, *args[index + 1:]), kwargs
    return args, {**kwargs, name: value}


def gather_rows(t: Tensor, dst: Tensor, dim: int) -> Tensor:
    """``t`` with its ``dim`` axis (the tokens) indexed per sample by ``dst [B', M]``; a leading axis of size 1
    (or none, ``dim == 0``) is shared by the samples. Returns ``[B', M, ...]`` (``dim == 0``: ``[M, ...]`` when
    ``B' == 1``)."""
    index = dst.to(t.device)
    if dim == 0:
        return t[index[0]] if index.shape[0] == 1 else t[index]  # [M, ...] or [B', M, ...]
    if t.shape[0] == 1:
        return t[0][index]  # [B', M, ...]
    batch = torch.arange(t.shape[0], device=t.device)[:, None]  # [B, 1]
    return t[batch, index.expand(t.shape[0], -1)]  # [B, M, ...]



# ---------------------------------------------------------------------- rotary tables
def gather_rope(freqs: Any, dst: Tensor, num_tokens: int, layout: str, text_side: Side = "first",
                lengths: Tensor | None = None, heads: bool = False) -> Any:
    """The rotary argument of a merged call (see the module docstring's layouts).

    Args:
        freqs: the call's rotary argument.
        dst: ``[B, M]`` (or ``[1, M]``) token position representing each slot (``plan.dst``).
        num_tokens: ``N``, the image tokens of the unmerged call.
        layout: ``"rows"``, ``"batched"``, ``"wan"``, ``"qwen"``, ``"complex"``, ``"broadcast"`` or ``"allegro"``.
        text_side: where a ``"batched"``, ``"wan"`` or ``"complex"`` table's text (other) rows are (``"rows"``: first).
        lengths: ``[B]`` per-sample text lengths of a ragged joint sequence (:func:`ragged_index`; ``"batched"``
            tables only, text first); ``None``: one text length.
        heads: a 4-D ``"batched"`` table is per head, ``[B or 1, H, N, d]`` (:attr:`Rope.heads`).

    Example:
        >>> cos = torch.arange(4.0).view(1, 4, 1, 1)                      # wan layout, N = 4
        >>> c, _ = gather_rope((cos, cos), torch.tensor([[3, 0], [1, 2]]), 4, "wan")
        >>> c.flatten(1).tolist()
        [[3.0, 0.0], [1.0, 2.0]]
    """
    if layout == "rows":
        rows = freqs[0].shape[0]
        if rows < num_tokens:
            raise ValueError(f"tomerge: the rotary table has {rows} rows for {num_tokens} image tokens")
        return gather_rotary(freqs, dst, rows - num_tokens)  # text rows first, kept
    if lengths is not None and layout != "batched":
        raise ValueError(f"tomerge: per-sample text lengths need a 'batched' rotary table, not {layout!r}")
    if layout in ("batched", "wan"):
        def gather(t: Tensor) -> Tensor:
            if heads and layout == "batched" and t.dim() == 4:  # [B, H, N, d]: the tokens on axis 2
                return _gather_table_rows(t.movedim(2, 1), dst, num_tokens, layout, text_side, lengths).movedim(1, 2)
            return _gather_table_rows(t, dst, num_tokens, layout, text_side, lengths)
        return gather(freqs) if isinstance(freqs, Tensor) else tuple(gather(t) for t in freqs)
    if layout == "qwen":
        image, text = freqs
        if image.shape[0] != num_tokens:
            raise ValueError(f"tomerge: the image rotary table has {image.shape[0]} rows for {num_tokens} image tokens")
        gathered = gather_rows(image, dst, 0)  # [M, d/2] or [B, M, d/2]
        return (gathered if gathered.dim() == image.dim() else BatchedComplexTable(gathered), text)
    if layout == "complex":
        return _gather_complex_rows(freqs, dst, num_tokens, text_side)
    if layout == "broadcast":
        out = []
        for t in (freqs,) if isinstance(freqs, Tensor) else freqs:
            if t.dim() < 2 or t.shape[0] != num_tokens:
                raise ValueError(f"tomerge: a 'broadcast' rotary table must be [N={num_tokens}, ...], got {tuple(t.shape)}")
            out.append(gather_rows(t, dst, 0))  # [M, ...] or [B, M, ...]
        return out[0] if isinstance(freqs, Tensor) else tuple(out)
    if layout == "allegro":
        tables, positions = freqs
        out = []
        for ids in positions:
            if ids.dim() != 2 or ids.shape[1] != num_tokens:
                raise ValueError(f"tomerge: Allegro's rotary position ids must be [1 or B, N={num_tokens}], got "
                                 f"{tuple(ids.shape)}")
            out.append(gather_rows(ids, dst, 1))  # [B', M]
        return tables, tuple(out)
    raise ValueError(f"unknown rotary layout {layout!r}")


def _gather_complex_rows(table: Tensor, dst: Tensor, num_tokens: int, text_side: Side) -> Tensor | BatchedComplexTable:
    """A ``"complex"`` rotary table ``[L, d/2]`` or ``[B, L, d/2]`` (``L = R + N``, the ``R`` other rows on
    ``text_side``) with its image rows gathered per slot: ``[R + M, d/2]`` for a shared table and one row of
    destinations, else ``[B, R + M, d/2]`` (a :class:`BatchedComplexTable` when the table was shared)."""
    if not isinstance(table, Tensor) or not table.is_complex() or table.dim() not in (2, 3):
        raise ValueError(f"tomerge: a 'complex' rotary table must be a complex [L, d/2] or [B, L, d/2] tensor, got "
                         f"{type(table).__name__}{tuple(table.shape) if isinstance(table, Tensor) else ''}")
    axis = table.dim() - 2  # the rows
    L = table.shape[axis]
    if L < num_tokens:
        raise ValueError(f"tomerge: the rotary table has {L} rows for {num_tokens} image tokens")
    R = L - num_tokens
    image_start, other_start = (R, 0) if text_side == "first" else (0, num_tokens)
    image = table.narrow(axis, image_start, num_tokens)  # [N, d/2] or [B, N, d/2]
    other = table.narrow(axis, other_start, R)  # [R, d/2] or [B, R, d/2]
    gathered = gather_rows(image, dst, axis)  # [M, d/2] or [B', M, d/2]
    if gathered.dim() == 3:
        other = other.expand(gathered.shape[0], *other.shape[-2:])  # [B', R, d/2]
    joint = torch.cat([other, gathered] if text_side == "first" else [gathered, other], dim=-2)
    return BatchedComplexTable(joint) if table.dim() == 2 and joint.dim() == 3 else joint


def _gather_table_rows(t: Tensor, dst: Tensor, num_tokens: int, layout: str, text_side: Side,
                       lengths: Tensor | None = None) -> Tensor:
    """A ``[B or 1, R + N, ...]`` table with its ``N`` image rows gathered per slot and its ``R`` text rows (on
    ``text_side``) kept: ``[B', R + M, ...]``; with per-sample text ``lengths``, a ragged table (text first)."""
    if t.dim() < 3 or t.shape[1] < num_tokens:
        raise ValueError(f"tomerge: a {layout!r} rotary table must be [B or 1, R + N, ...] with N={num_tokens} image "
                         f"rows, got {tuple(t.shape)}")
    R = t.shape[1] - num_tokens
    if lengths is not None:
        return gather_rows(t, ragged_index(lengths, R, num_tokens, lengths[:, None] + dst.to(t.device)), 1)
    text, image = (t[:, :R], t[:, R:]) if text_side == "first" else (t[:, num_tokens:], t[:, :num_tokens])
    gathered = gather_rows(image, dst, 1)  # [B', M, ...]
    if R == 0:
        return gathered
    text = text.expand(gathered.shape[0], *text.shape[1:])  # [B', R, ...]
    return torch.cat([text, gathered] if text_side == "first" else [gathered, text], dim=1)


class BatchedComplexTable:
    """A per-sample Qwen-Image rotary table ``[B, M, d/2]`` (complex): Qwen's ``apply_rotary_emb_qwen`` calls
    ``freqs.unsqueeze(1)`` on an ``[S, d/2]`` table to broadcast over ``[B, S, heads, d/2]``; here that gives
    ``[B, M, 1, d/2]``. Any other use raises, so a processor that uses the table differently fails loudly.

    Example:
        >>> BatchedComplexTable(torch.zeros(2, 5, 4, dtype=torch.complex64)).unsqueeze(1).shape
        torch.Size([2, 5, 1, 4])
    """

    def __init__(self, table: Tensor) -> None:
        if table.dim() != 3:
            raise ValueError(f"a batched complex rotary table is [B, M, d], got {tuple(table.shape)}")
        self.table = table

    def unsqueeze(self, dim: int) -> Tensor:
        if dim != 1:
            raise TypeError(f"tomerge: the per-sample rotary table was unsqueezed at {dim}; only apply_rotary_emb_qwen's "
                            "unsqueeze(1) is supported")
        return self.table[:, :, None, :]

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"tomerge: the per-sample rotary table [B, M, d] has no {name!r}; an attention processor "
                             "that uses the rotary table other than through apply_rotary_emb_qwen cannot run merged")


class BatchedRotaryTable:
    """A per-sample RoPE ``cos`` or ``sin`` table ``[B, S, d]`` that diffusers' ``apply_rotary_emb`` accepts.

    ``apply_rotary_emb`` (diffusers 0.42) indexes an ``[S, d]`` table as ``t[None, :, None, :]`` (or
    ``t[None, None, :, :]``); here that leading new axis becomes the batch: ``[B, S, 1, d]``. Any other
    use raises, so a processor that uses the table differently fails loudly instead of mixing positions.

    Args:
        table: ``[B, S, d]``.

    Example:
        >>> t = BatchedRotaryTable(torch.zeros(2, 5, 4))
        >>> t[None, :, None, :].shape
        torch.Size([2, 5, 1, 4])
    """

    def __init__(self, table: Tensor) -> None:
        if table.dim() != 3:
            raise ValueError(f"a batched rotary table is [B, S, d], got {tuple(table.shape)}")
        self.table = table

    def __getitem__(self, key: Any) -> Tensor:
        if not (isinstance(key, tuple) and key and key[0] is None):
            raise TypeError(
                f"tomerge flux: the per-sample rotary table was indexed with {key!r}; only the leading-new-axis "
                "indexing of diffusers' apply_rotary_emb (t[None, :, None, :]) is supported. A custom attention "
                "processor must apply RoPE with diffusers.models.embeddings.apply_rotary_emb to be merged")
        return self.table[(slice(None), *key[1:])]  # the new leading axis becomes the batch axis

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(
            f"tomerge flux: the per-sample rotary table [B, S, d] has no {name!r}; an attention processor that "
            "uses image_rotary_emb other than through diffusers' apply_rotary_emb cannot run merged")


def gather_rotary(freqs: tuple[Tensor, Tensor], dst: Tensor, text_len: int) -> tuple[Any, Any]:
    """The rotary table of a merged joint sequence: text rows kept, image rows gathered per slot.

    Args:
        freqs: ``(cos, sin)``, each ``[T + N, d]``, text rows first (as ``FluxPosEmbed`` returns them).
        dst: ``[B, M]`` (or ``[1, M]``) token position representing each slot (``plan.dst``).
        text_len: ``T``.

    Returns:
        ``(cos, sin)``: plain ``[T + M, d]`` tensors when ``dst`` has one row (shared by the batch), else
        :class:`BatchedRotaryTable` of ``[B, T + M, d]``.

    Example:
        >>> cos = torch.arange(5.0)[:, None].expand(5, 2)                 # T = 2 text rows, N = 3
        >>> c, s = gather_rotary((cos, cos), torch.tensor([[2, 0]]), 2)
        >>> c[:, 0].tolist()
        [0.0, 1.0, 4.0, 2.0]
    """
    out = []
    for t in freqs:
        if not isinstance(t, Tensor) or t.dim() != 2:
            raise ValueError(
                f"tomerge flux: image_rotary_emb must be (cos, sin) tables [T + N, d], got "
                f"{type(t).__name__}{tuple(t.shape) if isinstance(t, Tensor) else ''}")
        text, image = t[:text_len], t[text_len:]  # [T, d], [N, d]
        index = dst.to(t.device)
        if index.shape[0] == 1:
            out.append(torch.cat([text, image[index[0]]], dim=0))  # [T + M, d]
        else:
            B = index.shape[0]
            gathered = image[index]  # [B, M, d]
            out.append(BatchedRotaryTable(torch.cat([text.expand(B, -1, -1), gathered], dim=1)))  # [B, T + M, d]
    return out[0], out[1]


# ---------------------------------------------------------------------- attention masks, ragged sequences
def gather_key_mask(mask: Tensor, dst: Tensor, num_tokens: int, text_side: Side,
                    lengths: Tensor | None = None) -> Tensor:
    """A key mask over a joint sequence, its ``N`` image columns gathered per slot (text columns kept).

    Args:
        mask: ``[B, ..., L]`` with ``L = T + N`` (text on ``text_side``), e.g. ``[B, 1, 1, L]``.
        dst: ``[B, M]`` or ``[1, M]`` representatives.
        num_tokens: ``N``.
        lengths: ``[B]`` per-sample text lengths of a ragged joint sequence (:func:`ragged_index`; a ``[B, L]``
            mask, text first); ``None``: one text length.

    Returns:
        ``[B, ..., T + M]``.

    Example:
        >>> m = torch.tensor([[True, False, True, True, False]])            # 3 image, then 2 text columns
        >>> gather_key_mask(m, torch.tensor([[2, 1]]), 3, "last").tolist()
        [[True, False, True, False]]
    """
    L = mask.shape[-1]
    T = L - num_tokens
    if T < 0:
        raise ValueError(f"tomerge: an attention mask over {L} keys cannot cover {num_tokens} image tokens")
    if lengths is not None:
        if mask.dim() != 2 or text_side != "first":
            raise ValueError(f"tomerge: a mask over ragged joint sequences must be [B, L] with text first, got "
                             f"{tuple(mask.shape)}, text {text_side}")
        return gather_rows(mask, ragged_index(lengths, T, num_tokens, lengths[:, None] + dst.to(mask.device)), 1)
    index = dst.to(mask.device)
    if index.shape[0] > 1 and mask.dim() > 1 and mask.shape[0] == 1:
        mask = mask.expand(index.shape[0], *mask.shape[1:])  # a mask shared by the batch, per-sample slots
    image, text = (mask[..., T:], mask[..., :T]) if text_side == "first" else (mask[..., :num_tokens], mask[..., num_tokens:])
    if index.shape[0] == 1:
        gathered = image[..., index[0]]
    else:
        shape = (mask.shape[0],) + (1,) * (mask.dim() - 2) + (index.shape[1],)
        gathered = torch.gather(image, -1, index.view(shape).expand(*image.shape[:-1], index.shape[1]))
    return torch.cat([text, gathered] if text_side == "first" else [gathered, text], dim=-1)


def gather_pair_mask(mask: Tensor, dst: Tensor, num_tokens: int, text_side: Side,
                     lengths: Tensor | None = None) -> Tensor:
    """A query-by-key mask ``[B, 1, L, L]`` over a joint sequence (``L = T + N``, text on ``text_side``), its
    image rows and columns gathered per slot (text rows and columns kept): ``[B, 1, T + M, T + M]``; ``lengths``:
    per-sample text lengths (:func:`gather_key_mask`).

    Example:
        >>> m = torch.tensor([1.0, 0, 1, 1])                            # 1 text token, then 3 image tokens
        >>> pairs = (m[:, None] * m[None, :])[None, None]               # [1, 1, 4, 4]
        >>> gather_pair_mask(pairs, torch.tensor([[2, 0]]), 3, "first")[0, 0].tolist()
        [[1.0, 1.0, 0.0], [1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]
    """
    if mask.dim() < 2 or mask.shape[-1] != mask.shape[-2]:
        raise ValueError(f"tomerge: a query-by-key mask must be [B, 1, L, L], got {tuple(mask.shape)}")
    columns = gather_key_mask(mask, dst, num_tokens, text_side, lengths)  # [B, 1, L, T + M]
    return gather_key_mask(columns.transpose(-1, -2), dst, num_tokens, text_side, lengths).transpose(-1, -2)


def ragged_index(lengths: Tensor, text: int, image: int, image_rows: Tensor) -> Tensor:
    """Row indices of a ragged joint sequence with new image rows: sample ``b`` is ``[text_b, image, padding]``
    (``lengths[b]`` text rows, padding up to ``text``, the longest), before and after.

    Args:
        lengths: ``[B]`` per-sample text lengths.
        text: ``T``, the longest (the sequences hold ``T + image`` rows).
        image: ``N``, the image rows of the indexed sequence.
        image_rows: ``[B or 1, M]``: the row of the indexed sequence each new image row takes (a token's row
            ``lengths[b] + dst``, or rows appended after the sequence).

    Returns:
        ``[B, T + M]``: text rows stay, image rows are ``image_rows``, padding rows follow the image.

    Example:
        >>> ragged_index(torch.tensor([1, 2]), 2, 3, torch.tensor([[2, 1], [4, 3]]))   # 3 image rows -> 2
        tensor([[0, 2, 1, 4],
                [0, 1, 4, 3]])
    """
    B, M = lengths.shape[0], image_rows.shape[1]
    p = torch.arange(text + M, device=lengths.device)[None]  # [1, T + M]
    T = lengths[:, None]  # [B, 1]
    slot = (p - T).clamp(0, M - 1)  # [B, T + M]: the image slot of image positions
    new_image = image_rows.to(lengths.device).expand(B, -1).gather(1, slot)  # [B, T + M]
    return torch.where(p < T, p, torch.where(p < T + M, new_image, p - M + image))
