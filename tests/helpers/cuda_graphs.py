"""What CUDA graphs do to the outputs of a captured block, emulated on the CPU.

Under ``torch.compile(mode="reduce-overhead")`` (or ``compile_repeated_blocks`` with CUDA graphs) the tensors a
compiled block call computes live in the graph's memory pool, and a later replay writes over them ("accessing
tensor output of CUDAGraphs that has been overwritten by a subsequent run"). :class:`ReplayOverwrite` records the
storage of every tensor an op makes inside a block's ``forward`` (the region ``compile_repeated_blocks`` compiles:
after the blocks' eager pre-hooks, before their post-hooks) and fills each one still alive with ``0xFF`` bytes (NaN
in every float dtype, -1 in integer ones) when the region's memory is reused:

* ``scope="model"``: at the start of the next model call (the issue's emulation);
* ``scope="block"``: at the start of the next block call, except the tensors that call receives as arguments (a
  replay copies its inputs into the graph's own buffers first). Stricter: nothing of a block call outlives it but
  what the next block takes as input.

Whatever tomerge keeps across calls must then be a copy made outside the region, or the images change.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _storages(values: Any) -> set[StorageWeakRef]:
    return {StorageWeakRef(t.untyped_storage()) for t in tree_leaves(values) if isinstance(t, torch.Tensor)}


class ReplayOverwrite(TorchDispatchMode):
    """Attach to a tomerge handle (:meth:`attach`); ``overwritten`` counts the storages filled so far."""

    def __init__(self, scope: str = "model") -> None:
        super().__init__()
        assert scope in ("model", "block")
        self.scope = scope
        self.made: dict[StorageWeakRef, None] = {}  # storages made inside block calls, not yet overwritten
        self.overwritten = 0
        self.recorded = 0
        self.hooks: list[Any] = []

    def attach(self, handle: Any) -> ReplayOverwrite:
        """Hooks the handle's model and blocks: the block hooks run inside tomerge's (registered after its pre-hook,
        prepended before its post-hook), so tomerge's eager bookkeeping stays outside the emulated region."""
        add = self.hooks.append
        add(handle.model.register_forward_pre_hook(lambda *a: self._model_starts(), prepend=True))
        for block in handle._blocks:
            add(block.module.register_forward_pre_hook(self._block_starts, with_kwargs=True))
            add(block.module.register_forward_hook(lambda *a: self.__exit__(None, None, None), prepend=True,
                                                  always_call=True))
        return self

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()

    def _model_starts(self) -> None:
        if self.scope == "model":
            self.overwrite(keep=set())

    def _block_starts(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self.scope == "block":
            self.overwrite(keep=_storages((args, kwargs)))
        self.__enter__()

    def overwrite(self, keep: set[StorageWeakRef]) -> None:
        """Fills every recorded storage still alive, but those in ``keep``, with ``0xFF`` bytes."""
        for ref in list(self.made):
            if ref in keep:
                continue
            del self.made[ref]
            if ref.expired():
                continue
            storage = torch.UntypedStorage._new_with_weak_ptr(ref.cdata)
            torch.empty(0, dtype=torch.uint8).set_(storage).fill_(255)
            self.overwritten += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = _storages((args, kwargs))
        for storage in _storages(out):
            if storage not in inputs or storage in self.made:  # a new tensor, or a view of one made in the region
                if storage not in self.made:
                    self.recorded += 1
                self.made[storage] = None
        return out
