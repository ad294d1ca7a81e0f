"""The received-attention reference, computed in float64 from the ``scaled_dot_product_attention`` call a model's
attention makes (the q, k, mask and scale it attends with, after its norms and rotary rotation), independently of
the probe under test: the probe's documented rule is the text queries' softmax over all keys, averaged over heads
and the text queries the mask keeps, restricted to the image keys and renormalised per sample
(``backbones._diffusers.probe_joint_attention``). Used by tests/backbones/test_probes.py and the family tests.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

import tomerge

class _SDPACalls(TorchFunctionMode):
    """Records every SDPA call while entered: its ``query``, ``key``, ``value``, ``attn_mask``, ``scale`` and
    ``out``, the result of the call (as a mode entered before this one, e.g. the text-key bias, computes it)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[dict[str, Any]] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
            self.calls.append({"attn_mask": None, "scale": None, **dict(zip(names, args)), **kwargs, "out": out})
        return out


def attentions_of(*containers: str, path: str = "attn") -> Callable[[nn.Module], dict[int, nn.Module]]:
    """``model -> {layer: attention module}``: the module ``path`` of every block of ``containers`` (dotted paths of
    block lists), in layer order."""
    def find(model: nn.Module) -> dict[int, nn.Module]:
        blocks = [block for c in containers for block in model.get_submodule(c)]
        return {layer: block.get_submodule(path) for layer, block in enumerate(blocks)}
    return find


def record_sdpa(modules: dict[int, nn.Module]) -> tuple[dict[int, list], list]:
    """Hooks recording the SDPA calls made inside each module's forward, keyed like ``modules``. Installed after
    tomerge's hooks, they see the call the processor makes (inside the text-key bias)."""
    seen: dict[int, list] = {key: [] for key in modules}
    hooks = []
    for key, module in modules.items():
        mode = _SDPACalls()

        def enter(m, args, kwargs, mode=mode):
            mode.__enter__()

        def leave(m, args, output, mode=mode, key=key):
            mode.__exit__(None, None, None)
            seen[key].extend(mode.calls)
            mode.calls = []

        hooks += [module.register_forward_pre_hook(enter, with_kwargs=True),  # entered last: innermost mode
                  module.register_forward_hook(leave, prepend=True, always_call=True)]  # so left first
    return seen, hooks


def reference_received_attention(query: Tensor, key: Tensor, mask: Tensor | None, scale: float | None, N: int,
                                 text_first: bool, context: tuple[int, int] = (0, 0)) -> Tensor:
    """The probe's rule, from the SDPA inputs ``[B, h, T + S, d]`` (``S``: the image stream, ``context[0]``
    reference tokens, the ``N`` target tokens, ``context[1]`` reference tokens): ``[B, N]`` float64."""
    q, k = query.double(), key.double()
    B, h, L, d = q.shape
    T = L - N - sum(context)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k) * (d ** -0.5 if scale is None else scale)  # [B, h, L, L]
    attended = torch.ones(B, L, dtype=torch.bool)  # [B, L]: keys some query may attend
    if mask is not None:
        if mask.dtype == torch.bool:
            logits = logits.masked_fill(~mask, -math.inf)
            attended = mask.expand(B, h, L, L).any(dim=2).any(dim=1)
        else:
            logits = logits + mask
    p = logits.softmax(-1)  # rows of masked queries may be NaN: they are not counted
    text = torch.arange(T) if text_first else torch.arange(L - T, L)
    image = (T if text_first else 0) + context[0] + torch.arange(N)  # the target's keys
    out = []
    for b in range(B):
        rows = text[attended[b, text]]  # the text queries the mask keeps
        a = p[b][:, rows].mean(dim=(0, 1))[image]  # [N]
        out.append(a / a.sum())
    return torch.stack(out)


def idm_records(model: nn.Module, inputs: dict, hooks: list) -> dict[int, Tensor]:
    """The received attention ``{layer: [B, N]}`` idm records in one call of ``model`` on ``inputs``; ``hooks``
    (the test's recorders) are removed after it."""
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle, torch.no_grad():
            model(**inputs)
            return dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()


def check_probe_matches_the_model(model: nn.Module, inputs: dict,
                                  attentions: Callable[[nn.Module], dict[int, nn.Module]], num_tokens: int,
                                  text_first: bool, masked: bool, context: tuple[int, int] = (0, 0)) -> None:
    """float64: the received attention recorded for every block of ``attentions(model)`` (``{layer: attention
    module}``) equals the reference from that module's SDPA call; ``masked``: the call has a text mask, and the
    reference without it differs (so the probe used it); ``context``: reference-image tokens before and after the
    ``num_tokens`` target tokens of the image stream."""
    model = copy.deepcopy(model).double()
    inputs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v for k, v in inputs.items()}
    modules = attentions(model)
    seen, hooks = record_sdpa(modules)
    recorded = idm_records(model, inputs, hooks)
    assert sorted(recorded) == sorted(modules)
    for layer, calls in seen.items():
        assert len(calls) == 1, f"layer {layer}: {len(calls)} SDPA calls"
        q, k, mask, scale = (calls[0][name] for name in ("query", "key", "attn_mask", "scale"))
        reference = reference_received_attention(q, k, mask, scale, num_tokens, text_first, context)
        a = recorded[layer]
        assert a.shape == reference.shape and a.dtype == torch.float32
        torch.testing.assert_close(a.double(), reference, rtol=1e-5, atol=1e-8)
        assert (reference.max(-1).values - reference.min(-1).values > 1e-3).all()  # not uniform: real q/k
        if masked:
            assert mask is not None
            unmasked = reference_received_attention(q, k, None, scale, num_tokens, text_first, context)
            assert (unmasked - reference).abs().max() > 1e-4


def idm_attention_and_inputs(model: nn.Module, inputs: dict, attentions: list[nn.Module],
                             call=None) -> tuple[dict[int, Tensor], dict[int, Tensor]]:
    """One forward of ``model`` under ``idm`` (ratio 0.5): the received attention it recorded per layer, and the
    input ``x [B, L, C]`` each of ``attentions`` (one per layer) was called with."""
    seen: dict[int, Tensor] = {}

    def record(layer: int):
        def hook(module: nn.Module, args: tuple) -> None:
            seen[layer] = args[0]
        return hook

    hooks = [attn.register_forward_pre_hook(record(layer)) for layer, attn in enumerate(attentions)]
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle, torch.no_grad():
            (call or (lambda: model(**inputs)))()
            recorded = dict(handle.state.attention)
    finally:
        for hook in hooks:
            hook.remove()
    return recorded, seen
