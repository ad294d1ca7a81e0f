"""The token grid of a model call: from a patchified latent's shape, or from FLUX-style packed-latent position ids
(read on the host, once per ids tensor, through :class:`~tomerge.backbones._host.HostFacts`)."""

from __future__ import annotations

import torch
from torch import Tensor

from ._context import NO_CONTEXT, ContextTokens


def latent_grid(sample: Tensor, patch: tuple[int, ...]) -> tuple[int, ...]:
    """The token grid of a patchified latent ``[B, C, H, W]`` or ``[B, C, F, H, W]``: each size floor-divided
    by its patch size (``patch``: one per spatial/temporal axis, as ``(p_h, p_w)`` or ``(p_t, p_h, p_w)``).

    Example:
        >>> latent_grid(torch.zeros(1, 4, 5, 12, 18), (1, 2, 2))
        (5, 6, 9)
    """
    sizes = sample.shape[2:]
    if len(sizes) != len(patch):
        raise ValueError(f"a latent {tuple(sample.shape)} needs {len(sizes)} patch sizes, got {patch}")
    return tuple(int(s) // int(p) for s, p in zip(sizes, patch))


def grid_from_ids(img_ids: Tensor) -> tuple[int, int] | None:
    """The ``(H, W)`` grid of packed-latent ids ``[N, 3]`` (``(0, row, col)``), or ``None``.

    ``None`` unless the ids enumerate one ``H x W`` grid of integer positions in raster order (any
    offset), which is how Flux pipelines build them. Runs on the host: ids on a GPU are copied once (the adapters
    call it through :class:`~tomerge.backbones._host.HostFacts`, once per ids tensor).

    Example:
        >>> rows, cols = torch.meshgrid(torch.arange(2), torch.arange(3), indexing="ij")
        >>> grid_from_ids(torch.stack([torch.zeros(6), rows.flatten(), cols.flatten()], 1))
        (2, 3)
    """
    ids = img_ids[0] if img_ids.dim() == 3 else img_ids  # [N, 3] (3D is diffusers' deprecated form)
    if ids.dim() != 2 or ids.shape[1] < 3 or ids.shape[0] == 0:
        return None
    ids = ids.detach().cpu()  # the reads below are host work
    pos = ids[:, 1:3].round().long()  # [N, 2] (row, col)
    lo, hi = pos.min(0).values, pos.max(0).values  # [2], [2]
    r0, c0, r1, c1 = torch.cat([lo, hi]).tolist()
    H, W = r1 - r0 + 1, c1 - c0 + 1
    N = ids.shape[0]
    if H * W != N:
        return None
    raster = (pos[:, 0] - r0) * W + (pos[:, 1] - c0)  # [N] raster index of every token
    ok = (raster == torch.arange(N, device=ids.device)).all() & (ids[:, 1:3] == pos.to(ids.dtype)).all()
    return (int(H), int(W)) if bool(ok) else None


def split_ids(img_ids: Tensor) -> tuple[tuple[int, int] | None, ContextTokens]:
    """The target's ``(H, W)`` grid and the context tokens of a model call's image ids ``[L, 3]`` (FLUX.1
    ``(t, row, col)``) or ``[L, 4]`` (FLUX.2 ``(t, h, w, l)``); ``(None, no context)`` when there is no target.

    The target is the generated image: the tokens whose first id ``t`` is the smallest (0 in every FLUX
    pipeline; reference images have ``t = 1`` in Kontext, ``10, 20, ...`` in FLUX.2), which must be one
    contiguous run forming a raster grid (:func:`grid_from_ids`). The tokens before and after it are context.
    Runs on the host: ids on a GPU are copied once (the adapters cache the result per ids tensor,
    :class:`~tomerge.backbones._host.HostFacts`).

    Example:
        >>> target = torch.tensor([[0, r, c] for r in range(2) for c in range(3)])
        >>> reference = torch.tensor([[1, r, c] for r in range(2) for c in range(2)])
        >>> split_ids(torch.cat([target, reference]))
        ((2, 3), ContextTokens(before=0, after=4))
    """
    ids = img_ids[0] if img_ids.dim() == 3 else img_ids  # [L, 3 or 4]
    if ids.dim() != 2 or ids.shape[0] == 0:
        return None, NO_CONTEXT
    ids = ids.detach().cpu()  # one device-to-host copy; the rest is host work
    first = ids[:, 0]
    target = (first == first.min()).nonzero().flatten()  # [N] positions of the target's tokens
    start, stop = int(target[0]), int(target[-1]) + 1
    grid = grid_from_ids(ids[start:stop]) if stop - start == target.numel() else None
    if grid is None:
        return None, NO_CONTEXT
    return grid, ContextTokens(before=start, after=ids.shape[0] - stop)
