"""The GPU stand-in: full-size diffusers models on fake CUDA tensors, a host-read oracle, and one trajectory runner.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a model of real size (SD3-Medium, FLUX.1-dev, SDXL, Wan 2.1
14B) builds and runs on this CPU without allocating: tensors have real shapes, dtypes and devices, a device
mismatch raises, and no op produces data. :class:`HostReadOracle` counts every read of tensor data on the host
(each one waits for the GPU), answers the reads of the input tensors the test registered (and of tensors computed
from them alone) with their real values, and raises on a read of a tensor computed from weights or activations.
The tests (``tests/fake_cuda``, which import it as ``harness``) and ``scripts/kept_memory.py`` import this module;
it is their one owner of the model configs, the inputs and the runner.

One stand-in beyond the fake tensors: :func:`cpu_generators` makes ``MergeState._generator`` hand out CPU
generators, because ``torch.Generator(device="cuda")`` needs a driver (the fake mode accepts a CPU generator for
a draw on ``cuda``; a real GPU draws with its own).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

import tomerge
from tomerge.state import MergeState

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tomerge.__file__)))
# tomerge's source folders (the package maps tomerge.backbones and tomerge.strategies to these)
_TOMERGE_DIRS = tuple(os.path.join(_ROOT, d) + os.sep for d in ("tomerge", "backbones", "strategies"))

_aten = torch.ops.aten
# Ops whose result is a host value or whose output shape depends on the data: on CUDA each one synchronises.
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_DATA_SHAPED = {"nonzero", "nonzero_numpy", "argwhere", "masked_select", "unique", "_unique", "_unique2",
                "unique_dim", "unique_consecutive", "unique_dim_consecutive", "bincount"}
_MASK_INDEXED = {"index", "index_put", "index_put_", "_index_put_impl_", "_unsafe_index", "_unsafe_index_put"}
_NAMES: dict[Any, str] = {}  # op -> its schema name without the namespace


class HostReadError(AssertionError):
    """A read of a computed tensor on the host outside the functions a test allows."""


@dataclasses.dataclass(frozen=True)
class Read:
    """One host read.

    Attributes:
        call: the model call it happened in (0-based; -1 before the first).
        in_block: it happened inside a hooked block's forward (the compiled region of ``compile_repeated_blocks``).
        where: the innermost tomerge function on the Python stack (``qualname``), or ``"(outside tomerge)"``.
        stack: the qualnames of every tomerge function on the stack, innermost first.
        op: the aten op.
        known: it read a known tensor (a registered input, or computed from registered inputs alone: answered with
            the real values), not one that depends on weights or activations.
    """

    call: int
    in_block: bool
    where: str
    stack: tuple[str, ...]
    op: str
    known: bool

    def within(self, name: str) -> bool:
        """Whether ``name`` (a qualname or its last part) is on the read's tomerge stack."""
        return any(q == name or q.endswith("." + name) for q in self.stack)


def _tensors(args: Any, kwargs: dict) -> Iterator[Tensor]:
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, Tensor))


def _map(fn: Callable[[Tensor], Any], value: Any) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (list, tuple)):
        return type(value)(_map(fn, v) for v in value)
    return value


class HostReadOracle(TorchDispatchMode):
    """Counts, answers and polices host reads under a :class:`FakeTensorMode` (enter it inside the fake mode, so
    that it sees every op first).

    A host read is ``aten._local_scalar_dense`` (``.item()``, ``float()``, ``bool()``, ``.tolist()``), ``equal``,
    ``is_nonzero``, an op with a data-dependent output shape (``nonzero``, ``masked_select``, ``unique``, boolean
    mask indexing, which lowers to ``nonzero`` on CUDA) and a device-to-host copy (``_to_copy`` / ``copy_`` from
    ``cuda`` to ``cpu``: on a GPU a synchronising copy, under the fake mode silently allowed). Every read is
    recorded (:class:`Read`). A read of a known tensor, a registered input (:meth:`register`) or one computed from
    known tensors alone (the oracle computes those ops on the CPU too, e.g. a model's ``1 - t``), returns its real
    values (a copy to the host returns the real CPU tensor; ops whose tensors are all real CPU tensors then run for
    real, outside the fake mode). A read of a computed tensor that depends on anything else (weights, activations)
    raises :class:`HostReadError`, except inside the functions of
    ``allowed`` (name -> stand-in value of the read, e.g. ``{"relative_l1": 0.05}``), and is kept in
    ``violations`` even if some code swallows the error.

    Args:
        fake_mode: the fake mode the model's tensors belong to.
        allowed: function name (a qualname, or its last part) -> the value a read of a computed tensor returns
            inside it (a number, or a callable returning one per read).
    """

    def __init__(self, fake_mode: FakeTensorMode, allowed: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.fake_mode = fake_mode
        self.allowed = dict(allowed or {})
        self.reads: list[Read] = []
        self.violations: list[str] = []
        self.call = -1
        self.block_depth = 0
        self._known: dict[StorageWeakRef, tuple[Tensor, Tensor]] = {}  # storage -> (fake owner, real flat storage)

    # ------------------------------------------------------------------ inputs
    def register(self, real: Tensor, device: str = "cuda") -> Tensor:
        """A fake tensor on ``device`` holding ``real``'s values (answered by the oracle when read)."""
        with _disable_current_modes():
            real = real.detach().contiguous()
            flat = real.reshape(-1)
            with self.fake_mode:
                fake = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device=device)
        self._known[StorageWeakRef(fake.untyped_storage())] = (fake, flat)
        return fake

    def _is_known(self, t: Tensor) -> bool:
        known = self._known.get(StorageWeakRef(t.untyped_storage()))
        return known is not None and known[1].dtype == t.dtype

    def _real(self, t: Tensor) -> Tensor | None:
        """The real values of a view of a known tensor (``None``: unknown)."""
        if not isinstance(t, FakeTensor):
            return t
        known = self._known.get(StorageWeakRef(t.untyped_storage()))
        if known is None or known[1].dtype != t.dtype:
            return None
        with _disable_current_modes():
            return torch.as_strided(known[1], t.shape, t.stride(), t.storage_offset())

    # ------------------------------------------------------------------ hooks that locate the reads
    @contextlib.contextmanager
    def watching(self, model: nn.Module, blocks: list[nn.Module]) -> Iterator[HostReadOracle]:
        """Counts ``model``'s calls and marks the forwards of ``blocks`` (the hooked blocks, hooks registered after
        ``tomerge.apply``: the flag is set after tomerge's block pre-hook and cleared before its post-hook)."""
        def model_pre(*_: Any) -> None:
            self.call += 1

        def enter(*_: Any) -> None:
            self.block_depth += 1

        def leave(*_: Any) -> None:
            self.block_depth -= 1

        handles = [model.register_forward_pre_hook(model_pre, prepend=True)]
        for block in blocks:
            handles.append(block.register_forward_pre_hook(enter))
            handles.append(block.register_forward_hook(leave, prepend=True, always_call=True))
        try:
            with self:
                yield self
        finally:
            for h in handles:
                h.remove()

    # ------------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        tensors = list(_tensors(args, kwargs))
        fakes = [t for t in tensors if isinstance(t, FakeTensor)]
        device = kwargs.get("device")
        to_cuda = device is not None and torch.device(device).type == "cuda"
        if not fakes and not to_cuda:  # host work (real CPU tensors, CPU factories): runs for real, as on a GPU host
            with _disable_current_modes():
                return func(*args, **kwargs)
        if not fakes and tensors and func is _aten._to_copy.default:  # host-to-device copy: values known
            with _disable_current_modes():
                out = func(*args, **{**kwargs, "device": torch.device("cpu")})
            return self.register(out)
        kind = self._read_kind(func, args, kwargs)
        if kind is not None:
            return self._read(func, kind, args, kwargs, fakes)
        if len(fakes) < len(tensors):  # real CPU tensors beside fake ones: the fake mode checks the devices
            args, kwargs = _map(self._as_fake, args), _map(self._as_fake, kwargs)
        if func._schema.is_mutable:
            self._forget_written(func, args)
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if fakes and all(self._is_known(t) for t in fakes):  # factories (no tensor) stay unknown
            self._shadow(func, args, kwargs, out)
        return out

    def _shadow(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Computes an op whose tensors are all known on the CPU too, so that its new outputs are known (the
        timestep's ``1 - t``, an id tensor's columns): only tensors that depend on something unregistered (weights,
        activations) stay unknown."""
        outputs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, FakeTensor)]
        if not outputs or all(StorageWeakRef(t.untyped_storage()) in self._known for t in outputs):
            return  # no tensor output, or views of known storages
        with _disable_current_modes():
            real = func(*_map(self._real, args), **({**kwargs, "device": torch.device("cpu")} if "device" in kwargs
                                                     else _map(self._real, kwargs)))
            for fake, value in zip(outputs, real if isinstance(real, (tuple, list)) else (real,)):
                storage = StorageWeakRef(fake.untyped_storage())
                if storage in self._known or not isinstance(value, Tensor):
                    continue
                flat = torch.empty(fake.untyped_storage().nbytes() // fake.element_size(), dtype=fake.dtype)
                flat.as_strided(fake.shape, fake.stride(), fake.storage_offset()).copy_(value)
                self._known[storage] = (fake, flat)

    def _as_fake(self, t: Tensor) -> Tensor:
        if isinstance(t, FakeTensor):
            return t
        with _disable_current_modes():
            return self.fake_mode.from_tensor(t)

    @staticmethod
    def _read_kind(func: Any, args: tuple, kwargs: dict) -> str | None:
        name = _NAMES.get(func)
        if name is None:
            name = _NAMES[func] = func._schema.name.split("::")[-1]
        if func in _SCALAR_READS:
            return "scalar"
        if name in _DATA_SHAPED:
            return "shape"
        if name in _MASK_INDEXED:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(isinstance(i, Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                return "shape"
        if name == "_to_copy":
            device = kwargs.get("device")
            if args[0].device.type == "cuda" and device is not None and torch.device(device).type == "cpu":
                return "copy"
        if name == "copy_" and args[0].device.type == "cpu" and args[1].device.type == "cuda":
            return "copy"
        return None

    def _forget_written(self, func: Any, args: tuple) -> None:
        """An op writing into a known tensor makes it unknown (its real copy would be stale)."""
        for arg, value in zip(func._schema.arguments, args):
            if arg.alias_info is not None and arg.alias_info.is_write and isinstance(value, FakeTensor):
                self._known.pop(StorageWeakRef(value.untyped_storage()), None)

    def _read(self, func: Any, kind: str, args: tuple, kwargs: dict, fakes: list[Tensor]) -> Any:
        stack = _tomerge_stack()
        source = [t for t in fakes if t.device.type == "cuda"] or fakes
        reals = [self._real(t) for t in source]
        known = all(r is not None for r in reals)
        read = Read(self.call, self.block_depth > 0, stack[0] if stack else "(outside tomerge)", stack,
                    str(func), known)
        self.reads.append(read)
        if known:
            with _disable_current_modes():
                real_args = _map(self._real, args)
                if kind == "copy" and func is not _aten._to_copy.default:  # copy_ into a host tensor
                    if isinstance(args[0], FakeTensor):  # a fake host tensor: it stays fake
                        return func(*args, **kwargs)
                    return args[0].copy_(real_args[1])
                cpu_kwargs = {**kwargs, "device": torch.device("cpu")} if "device" in kwargs else kwargs
                out = func(*real_args, **cpu_kwargs)
            if kind == "shape":  # a data-dependent result stays on the device, its values now known
                return _map(lambda r: self.register(r, device=source[0].device.type), out)
            return out
        names = _python_stack()
        frames = set(names) | {q.rsplit(".", 1)[-1] for q in names}
        for name, value in self.allowed.items():
            if name in frames and kind in ("scalar", "copy"):
                value = value() if callable(value) else value
                if kind == "copy":
                    with _disable_current_modes():
                        return torch.full(tuple(args[0].shape), value, dtype=kwargs.get("dtype") or args[0].dtype)
                if func is not _aten._local_scalar_dense.default or source[0].dtype == torch.bool:
                    return bool(value)
                return float(value) if source[0].dtype.is_floating_point else int(value)
        message = (f"fake cuda: host read of a computed tensor (not known from the inputs): {func} in {read.where} "
                   f"(model call {read.call}, {'inside' if read.in_block else 'outside'} a block forward; "
                   f"tomerge stack: {' <- '.join(stack) or '-'})")
        self.violations.append(message)
        raise HostReadError(message)

    # ------------------------------------------------------------------ summaries
    def per_call(self, predicate: Callable[[Read], bool]) -> dict[int, int]:
        """Model call -> how many reads ``predicate`` accepts."""
        counts: dict[int, int] = {}
        for read in self.reads:
            if predicate(read):
                counts[read.call] = counts.get(read.call, 0) + 1
        return counts


def _python_stack() -> list[str]:
    frame, names = sys._getframe(2), []
    while frame is not None:
        names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return names


def _tomerge_stack() -> tuple[str, ...]:
    """The qualnames of the tomerge functions on the Python stack, innermost first."""
    frame, names = sys._getframe(2), []
    while frame is not None:
        if frame.f_code.co_filename.startswith(_TOMERGE_DIRS):
            names.append(frame.f_code.co_qualname)
        frame = frame.f_back
    return tuple(names)


@contextlib.contextmanager
def cpu_generators() -> Iterator[None]:
    """The suite's one stand-in: ``MergeState._generator`` hands out CPU generators (``torch.Generator(device=
    "cuda")`` and ``torch.cuda.get_rng_state`` need a driver)."""
    original = MergeState._generator

    def on_cpu(self: MergeState, strategy: Any, where: Any, device: torch.device) -> torch.Generator:
        return original(self, strategy, where, torch.device("cpu"))

    MergeState._generator = on_cpu
    try:
        yield
    finally:
        MergeState._generator = original


# ====================================================================== the models
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """One model at its real size.

    Attributes:
        name: ``sd3``, ``flux``, ``sdxl``, ``wan``.
        title: the model's name.
        cls: the diffusers class name.
        config: the model card's ``config.json`` (the transformer's / UNet's).
        batch: samples per model call (2: classifier-free guidance batched; Wan: 1, guidance as two calls).
        calls_per_step: model calls per denoising step.
        tokens: image tokens per sample at the merged blocks' highest resolution.
        width: the hidden width of those blocks.
        text: text tokens per sample.
        t_max: the timestep of the noisiest step as the pipeline passes it.
    """

    name: str
    title: str
    cls: str
    config: dict[str, Any]
    batch: int
    calls_per_step: int
    tokens: int
    width: int
    text: int
    t_max: float
    latent: tuple[int, ...]
    short: dict[str, Any]  # config changes of the short model: fewer blocks, every block kind kept

    def build(self, fake_mode: FakeTensorMode, short: bool = False) -> nn.Module:
        """The model with random (fake) weights, bf16 on ``cuda``, in eval mode; ``short``: with fewer blocks
        (:attr:`short`), the same widths, token counts and block kinds."""
        import diffusers

        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with fake_mode, torch.device("cuda"):
                model = getattr(diffusers, self.cls)(**{**self.config, **(self.short if short else {})}).eval()
        finally:
            torch.set_default_dtype(previous)
        return model

    def timesteps(self, steps: int) -> list[float]:
        """Decreasing timesteps of a ``steps``-step trajectory, in the units the pipeline passes."""
        return [self.t_max * (1.0 - s / steps) for s in range(steps)]

    def inputs(self, oracle: HostReadOracle, fake_mode: FakeTensorMode) -> Callable[[float], dict[str, Any]]:
        """``t -> kwargs`` of one model call at timestep ``t``: the latents and text on fake ``cuda`` (unknown
        values), the inputs an adapter may read (timestep, position ids) registered with the oracle. The same
        latent, text and id tensors every call, as a pipeline passes the ids and masks."""
        B, bf16 = self.batch, torch.bfloat16
        with fake_mode:
            latent = torch.randn(B, *self.latent, device="cuda", dtype=bf16)
            text = torch.randn(B, self.text, 4096 if self.name != "sdxl" else 2048, device="cuda", dtype=bf16)
        fixed: dict[str, Any] = {}
        if self.name == "sd3":
            with fake_mode:
                fixed = dict(hidden_states=latent, encoder_hidden_states=text,
                             pooled_projections=torch.randn(B, 2048, device="cuda", dtype=bf16))
        elif self.name == "flux":
            H, W = self.latent[0] // 2, self.latent[1] // 2  # packed 2 x 2 latent patches
            ids = torch.zeros(H, W, 3)  # FluxPipeline._prepare_latent_image_ids: (0, row, col) in raster order
            ids[..., 1] += torch.arange(H)[:, None]
            ids[..., 2] += torch.arange(W)[None, :]
            with fake_mode:
                packed = torch.randn(B, H * W, self.latent[2] * 4, device="cuda", dtype=bf16)  # [B, N, 64]
                pooled = torch.randn(B, 768, device="cuda", dtype=bf16)
            fixed = dict(hidden_states=packed, encoder_hidden_states=text, pooled_projections=pooled,
                         img_ids=oracle.register(ids.reshape(H * W, 3).to(bf16)),  # [N, 3], the model dtype
                         txt_ids=oracle.register(torch.zeros(self.text, 3, dtype=bf16)),
                         guidance=oracle.register(torch.full((B,), 3.5)))
        elif self.name == "sdxl":
            with fake_mode:
                added = {"text_embeds": torch.randn(B, 1280, device="cuda", dtype=bf16)}
            added["time_ids"] = oracle.register(torch.tensor([[1024.0, 1024, 0, 0, 1024, 1024]] * B, dtype=bf16))
            fixed = dict(sample=latent, encoder_hidden_states=text, added_cond_kwargs=added)
        elif self.name == "wan":
            fixed = dict(hidden_states=latent, encoder_hidden_states=text)

        def call(t: float) -> dict[str, Any]:
            timestep = oracle.register(torch.full((B,), t, dtype=torch.float32))  # pipelines: t.expand(B), float32
            return dict(fixed, timestep=timestep, return_dict=False)
        return call


# Configs from the model cards (Hugging Face config.json of each repository's transformer / unet folder).
SD3_MEDIUM = dict(  # stabilityai/stable-diffusion-3-medium-diffusers
    sample_size=128, patch_size=2, in_channels=16, num_layers=24, attention_head_dim=64, num_attention_heads=24,
    joint_attention_dim=4096, caption_projection_dim=1536, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192)
FLUX1_DEV = dict(  # black-forest-labs/FLUX.1-dev
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56))
SDXL_BASE = dict(  # stabilityai/stable-diffusion-xl-base-1.0
    sample_size=128, in_channels=4, out_channels=4, down_block_types=(
        "DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"), block_out_channels=(320, 640, 1280),
    layers_per_block=2, attention_head_dim=(5, 10, 20), cross_attention_dim=2048, transformer_layers_per_block=(
        1, 2, 10), use_linear_projection=True, addition_embed_type="text_time", addition_time_embed_dim=256,
    projection_class_embeddings_input_dim=2816, norm_num_groups=32, act_fn="silu", flip_sin_to_cos=True,
    freq_shift=0)
WAN21_T2V_14B = dict(  # Wan-AI/Wan2.1-T2V-14B-Diffusers
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
    eps=1e-6, rope_max_seq_len=1024)

MODELS: dict[str, ModelSpec] = {
    # 1024^2: latent 128 x 128, patch 2 -> 64 x 64 = 4,096 tokens; 77 CLIP + 256 T5 text tokens
    "sd3": ModelSpec("sd3", "SD3-Medium", "SD3Transformer2DModel", SD3_MEDIUM, batch=2, calls_per_step=1,
                     tokens=4096, width=1536, text=333, t_max=1000.0, latent=(16, 128, 128),
                     short=dict(num_layers=3)),
    # 1024^2: latent 128 x 128 packed 2 x 2 -> 4,096 tokens of 64 channels; 512 T5 tokens; t in [0, 1]
    "flux": ModelSpec("flux", "FLUX.1-dev", "FluxTransformer2DModel", FLUX1_DEV, batch=2, calls_per_step=1,
                      tokens=4096, width=3072, text=512, t_max=1.0, latent=(128, 128, 16),
                      short=dict(num_layers=2, num_single_layers=2)),
    # 1024^2: latent 128 x 128; the highest-resolution transformer blocks (down 2) see 64 x 64 = 4,096 tokens
    "sdxl": ModelSpec("sdxl", "SDXL", "UNet2DConditionModel", SDXL_BASE, batch=2, calls_per_step=1,
                      tokens=4096, width=640, text=77, t_max=999.0, latent=(4, 128, 128),
                      short=dict(layers_per_block=1, transformer_layers_per_block=(1, 1, 1))),
    # 480p x 81 frames: latent 21 x 60 x 104, patch (1, 2, 2) -> 21 x 30 x 52 = 32,760 tokens; guidance as two calls
    "wan": ModelSpec("wan", "Wan 2.1 14B", "WanTransformer3DModel", WAN21_T2V_14B, batch=1, calls_per_step=2,
                     tokens=32760, width=5120, text=512, t_max=1000.0, latent=(16, 21, 60, 104),
                     short=dict(num_layers=2)),
}


# ====================================================================== the methods
# Every registered strategy and schedule with the options it runs with here (its defaults otherwise), one
# composition (a caching schedule around a merging schedule, strategies/caching.py) and ToMA with one plan per
# block (group_size=1, whose plans under step-dependent keys the issue found growing).
METHODS: dict[str, dict[str, Any]] = {
    "tomesd": dict(ratio=0.5), "ssm": dict(ratio=0.5), "idm": dict(ratio=0.5),
    "facility_location": dict(ratio=0.5), "toma": dict(ratio=0.5), "toma_release": {},
    "sdtm": dict(ratio=0.5), "sdtm_release": {}, "sdtm_paper": {},
    "cached_detail": {}, "fresh_tokens": dict(ratio=0.5),
    "block_cache": {}, "fora": {}, "taylorseer": {}, "first_block_cache": {}, "toca": {},
    "fora+toma": dict(merge="toma", merge_options=dict(ratio=0.5)),
    "toma(group_size=1)": dict(ratio=0.5, group_size=1),
}
# Options the short models need: toma_release skips the first 5 blocks of each kind, which a short model has not.
SHORT_OPTIONS: dict[str, dict[str, Any]] = {"toma_release": dict(skip_first=1)}
# first_block_cache's criterion reads the change of the first block's residual once per model call; the oracle
# answers that read with this change (below the default threshold 0.08: the later blocks reuse).
FIRST_BLOCK_CHANGE = 0.05


def method_name(method: str) -> str:
    """The registered name of a method (``"fora+toma"`` -> ``"fora"``, ``"toma(group_size=1)"`` -> ``"toma"``)."""
    return method.split("+")[0].split("(")[0]


def method_options(method: str, short: bool) -> dict[str, Any]:
    return {**METHODS[method], **(SHORT_OPTIONS.get(method, {}) if short else {})}


@dataclasses.dataclass
class Trajectory:
    """What one application did over a trajectory on fake CUDA tensors."""

    outputs: list[Tensor]
    reads: list[Read]
    violations: list[str]
    kept_bytes: list[int]  # after each step
    kept_by_kind: list[dict[str, int]]  # after each step: what keeps them (MergeState.kept_tensors) -> bytes
    stats: dict[str, Any]
    labels: dict[str, int]  # record label (the decision's kind) -> block calls
    calls: int  # model calls made
    seconds: float
    error: BaseException | None = None


def run(spec: ModelSpec, model: nn.Module, fake_mode: FakeTensorMode, method: str, steps: int,
        options: dict[str, Any] | None = None, on_step: Callable[[int, int], None] | None = None) -> Trajectory:
    """Applies ``method`` to ``model`` (``num_steps=steps``, no scheduler: the trajectory clock counts distinct
    timesteps), runs ``steps`` denoising steps of ``spec.calls_per_step`` calls each under the oracle, and removes
    the hooks. An error of ``tomerge.apply`` or of a call is returned in ``error``, not raised. After each step
    it reads ``MergeState.kept_bytes(by_kind=True)`` (fake tensors report their storage's ``nbytes``)."""
    options = dict(METHODS.get(method, {}) if options is None else options)
    oracle = HostReadOracle(fake_mode, allowed={"relative_l1": FIRST_BLOCK_CHANGE})
    inputs = spec.inputs(oracle, fake_mode)
    outputs: list[Tensor] = []
    kinds: list[dict[str, int]] = []
    labels: dict[str, int] = {}
    start = time.perf_counter()
    error: BaseException | None = None
    with cpu_generators():
        try:
            with fake_mode:
                handle = tomerge.apply(model, method_name(method), num_steps=steps, **options)
        except Exception as err:  # noqa: BLE001 - the caller asserts on it (a refusal)
            return Trajectory([], [], [], [], [], {}, {}, 0, time.perf_counter() - start, err)
        try:
            with fake_mode, oracle.watching(model, [b.module for b in handle._blocks]), torch.no_grad():
                for step, t in enumerate(spec.timesteps(steps)):
                    for _ in range(spec.calls_per_step):
                        out = model(**inputs(t))
                        outputs.append(out[0] if isinstance(out, tuple) else out.sample)
                    kinds.append(handle.state.kept_bytes(by_kind=True))
                    if on_step is not None:
                        on_step(step, sum(kinds[-1].values()))
        except Exception as err:  # noqa: BLE001 - the caller asserts on it
            error = err
        finally:
            stats = handle.stats
            for record in handle.state.records:
                labels[record.label] = labels.get(record.label, 0) + 1
            handle.remove()
    return Trajectory(outputs, oracle.reads, oracle.violations, [sum(k.values()) for k in kinds], kinds, stats,
                      labels, oracle.call + 1, time.perf_counter() - start, error)


@dataclasses.dataclass(frozen=True)
class BlockGeometry:
    """One hooked block in an unmerged model call: its image tokens, the elements of the token streams its
    output replaces (``BlockSpec.streams``: what a block cache keeps), and of each merge point's whole output."""

    kind: str
    tokens: int
    stream_numel: int
    image_numel: int
    point_numels: tuple[int, ...]


def geometry(spec: ModelSpec, model: nn.Module, fake_mode: FakeTensorMode) -> list[BlockGeometry]:
    """The hooked blocks' sizes in one unmerged call (the adapter's blocks and merge points, found by a
    ``tomerge.apply`` removed at once; the call runs without tomerge)."""
    with fake_mode:
        handle = tomerge.apply(model, "fora", num_steps=2)
    blocks = handle._blocks
    handle.remove()
    seen: dict[int, dict[str, Any]] = {}
    hooks = []

    def numel(value: Any) -> int:
        if isinstance(value, Tensor):
            return value.numel()
        return sum(numel(v) for v in value) if isinstance(value, (tuple, list)) else 0

    for block in blocks:
        def pre(module: nn.Module, args: tuple, kwargs: dict, block: Any = block) -> None:
            streams = block.streams(args, kwargs)
            seen[block.layer] = dict(tokens=block.block_input(args, kwargs).shape[1], points={},
                                     stream=sum(numel(x) for x in streams),
                                     image=numel(streams[block.image_stream]))
        hooks.append(block.module.register_forward_pre_hook(pre, with_kwargs=True))
        for index, point in enumerate(block.points):
            def post(module: nn.Module, args: tuple, output: Any, block: Any = block, index: int = index) -> None:
                points = seen[block.layer]["points"]
                points[index] = max(points.get(index, 0), numel(output))  # a shared module: its largest call
            hooks.append(point.module.register_forward_hook(post))
    oracle = HostReadOracle(fake_mode)
    call = spec.inputs(oracle, fake_mode)(spec.t_max)
    try:
        with fake_mode, oracle, torch.no_grad():
            model(**call)
    finally:
        for h in hooks:
            h.remove()
    return [BlockGeometry(b.kind, seen[b.layer]["tokens"], seen[b.layer]["stream"], seen[b.layer]["image"],
                          tuple(seen[b.layer]["points"].get(i, 0) for i in range(len(b.points))))
            for b in blocks]


def build(name: str, short: bool = False) -> tuple[FakeTensorMode, nn.Module]:
    """(a new fake mode, the model ``name`` built in it)."""
    mode = FakeTensorMode()
    return mode, MODELS[name].build(mode, short=short)


GIB = 1024 ** 3


def gib(n: float) -> str:
    """``n`` bytes in GiB: three significant digits, one decimal from 100 GiB up."""
    value = n / GIB
    if value == 0:
        return "0"
    if value >= 100:
        return f"{value:.1f}"
    return f"{value:.3g}"
