"""Hooks that follow a submodule replaced after :func:`~tomerge.attach.apply`.

peft replaces a model's linear layers on ``pipe.load_lora_weights`` (the layer becomes a LoRA wrapper whose
``base_layer`` is the old module) and puts the base layers back on ``unload_lora_weights``. A hook on the module
that was there at ``apply`` then sits on the wrapped base layer, whose input the wrapper also sends through its
LoRA branch unmerged (FLUX.1's single-stream ``proj_mlp``/``proj_out`` merge points: a size mismatch), or on a
module that is no longer called at all. :class:`FollowedHooks` keeps, for each hooked module, its parent and
attribute name; :meth:`FollowedHooks.follow`, called eagerly at every model call, moves the hooks of a replaced
module to the module now in its place, so merging sees the same tokens as when the LoRA is loaded before
``apply``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn


class FollowedHooks:
    """Forward pre- and post-hooks on submodules of ``root``, each following the module at its place.

    Args:
        root: the model the hooked modules are found in (by identity, at :meth:`add`).
    """

    def __init__(self, root: nn.Module) -> None:
        self.root = root
        self._places: dict[int, tuple[nn.Module, str]] | None = None
        self._entries: list[list[Any]] = []  # [parent, name, module, pre, post, fixed, handles]

    def _place(self, module: nn.Module) -> tuple[nn.Module | None, str | None]:
        if self._places is None:
            self._places = {id(child): (parent, name) for parent in self.root.modules()
                            for name, child in parent._modules.items() if child is not None}
        return self._places.get(id(module), (None, None))

    def add(self, module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any], fixed: bool = False) -> None:
        """Registers ``pre`` (``with_kwargs=True``) and ``post`` on ``module``. ``fixed``: the module also has its
        ``forward`` replaced (a :class:`~tomerge.attach._ForwardPatch`), which cannot follow: a replacement raises."""
        parent, name = self._place(module)
        entry = [parent, name, module, pre, post, fixed, self._register(module, pre, post)]
        self._entries.append(entry)

    @staticmethod
    def _register(module: nn.Module, pre: Callable[..., Any], post: Callable[..., Any]) -> list[Any]:
        return [module.register_forward_pre_hook(pre, with_kwargs=True), module.register_forward_hook(post)]

    def follow(self) -> None:
        """Moves the hooks of every module replaced since (its parent holds another module under its name) to the
        module now there. Eager only (a model pre-hook outside compiled graphs).

        Raises:
            RuntimeError: a replaced module whose ``forward`` tomerge had replaced too (token-wise caching's reused
                sublayers), in one line naming it and what to do.
        """
        for entry in self._entries:
            parent, name, module = entry[0], entry[1], entry[2]
            if parent is None:
                continue
            current = parent._modules.get(name)
            if current is None or current is module:
                continue
            if entry[5]:
                kind = type(current)
                raise RuntimeError(
                    f"tomerge: {type(parent).__name__}.{name} was replaced by a {kind.__module__}.{kind.__qualname__} "
                    "after apply (a LoRA loaded or unloaded with peft?), and token-wise caching had replaced its "
                    "forward (reused sublayers): remove() the handle, load or unload the LoRA, then apply again")
            for handle in entry[6]:
                handle.remove()
            entry[2], entry[6] = current, self._register(current, entry[3], entry[4])

    def remove(self) -> None:
        for entry in self._entries:
            for handle in entry[6]:
                handle.remove()
