"""Facts an adapter reads on the host from a model call's inputs, read once per input tensor.

Some adapters need a few numbers from a model call's tensors before the first block: FLUX's token grid from its
``img_ids``, Lumina 2's caption lengths from its mask, Kandinsky 6's reference frames from its token types. On a
GPU every such read waits for the device. Pipelines pass the same ids and masks, the same tensor objects, on every
step, so :class:`HostFacts` copies a tensor to the host once (one device-to-host copy), computes the facts there,
and answers the later calls with the same, unmodified tensor from its cache. No read happens inside a block call.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any, Generic, TypeVar

from torch import Tensor

T = TypeVar("T")


def _version(tensor: Tensor) -> int | None:
    """The tensor's in-place version counter (``None`` for an inference tensor, which keeps none)."""
    return None if tensor.is_inference() else tensor._version


class HostFacts(Generic[T]):
    """``compute(host copy of a tensor, *extra)``, computed once per tensor object and ``extra``.

    The cache holds one entry, keyed by a weak reference to the tensor, its version counter (an in-place change
    computes again; inference tensors keep no counter, so there the tensor object alone is the key) and ``extra``.

    Args:
        compute: ``(tensor on the host, *extra) -> facts``, run on the CPU copy only.

    Example:
        >>> import torch
        >>> lengths = HostFacts(lambda mask: mask.sum(dim=1).tolist())
        >>> mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        >>> lengths(mask), lengths(mask), lengths.copies
        ([2, 1], [2, 1], 1)
    """

    def __init__(self, compute: Callable[..., T]) -> None:
        self.compute = compute
        self.copies = 0  # device-to-host copies made (and facts computed)
        self._key: tuple[Any, int | None, tuple[Hashable, ...]] | None = None
        self._facts: T | None = None

    def __call__(self, tensor: Tensor, *extra: Hashable) -> T:
        key = self._key
        if key is not None and key[0]() is tensor and key[1] == _version(tensor) and key[2] == extra:
            return self._facts  # type: ignore[return-value]
        facts = self.compute(tensor.detach().cpu(), *extra)  # the one device-to-host copy of this tensor
        self._key, self._facts = (weakref.ref(tensor), _version(tensor), extra), facts
        self.copies += 1
        return facts
