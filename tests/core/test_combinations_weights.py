"""Merging and caching combined with the weights researchers load (issue #42, the weights side of the matrix).

Each cell runs tiny random-weight pipelines saved to disk and loaded with ``from_pretrained(...,
local_files_only=True)`` (tests/helpers/local_pipelines.py): LoRA files loaded with ``pipe.load_lora_weights`` (peft),
unfused, fused, switched with ``set_adapters`` between calls, and loaded or unloaded after ``apply``; the SD3 and
FLUX.1 ControlNet pipelines (ControlNet residuals added between the transformer's blocks); transformers quantized
by torchao on the CPU (int8 weight-only, int8 dynamic, float8 weight-only); accelerate's offload hooks beside
tomerge's (``enable_model_cpu_offload(device="cpu")``, and the per-module hooks ``enable_sequential_cpu_offload``
installs, through ``accelerate.cpu_offload``).

Per cell and method (``tomesd``, ``toma``, ``sdtm_release``, ``fora``, ``first_block_cache``, ``fora`` with
``merge="tomesd"``), :func:`check_method` asserts against the unaccelerated run of the same combination: the
method's identity setting (ratio 0, ``interval=1``, ``threshold=0``) gives the same image bit for bit (PSNR 100);
the engaged setting merges or reuses (``handle.stats``), and gives a finite, different image of the same content;
after ``handle.remove()`` the pipeline gives the image it gave before ``apply``, bit for bit. STEPS = 3 is the
fewest at which every method engages: ``fora`` (interval 3, counted down) reuses step 1, ``first_block_cache``
reuses after its warm-up step.

Cells that need a GPU (bitsandbytes, torchao's float8 dynamic activations, offload onto an accelerator) are the
``gpu_only`` tests at the end: on a machine without CUDA pytest reports them as skipped, "GPU only, untested here".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from helpers import local_pipelines
import tomerge

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning", "ignore::DeprecationWarning",
                                      "ignore:Already found a `peft_config`:UserWarning")  # peft, on a second adapter

STEPS = 3
PROMPT = "a photo of a cat"

#: method -> (registered name, engaged options, identity options: the unaccelerated model bit for bit).
#: sdtm_release's ratio is the centre of a cosine curve of half-width ``deviation`` (0.2): ratio 0 alone still
#: merges the early steps, ``deviation=0`` with it merges nothing. first_block_cache's threshold 10 reuses every
#: step after the warm-up (a relative change never reaches 10), threshold 0 none.
METHODS: dict[str, tuple[str, dict[str, Any], dict[str, Any]]] = {
    "tomesd": ("tomesd", {"ratio": 0.5, "use_rand": False}, {"ratio": 0.0, "use_rand": False}),
    "toma": ("toma", {"ratio": 0.5, "num_tiles": 4}, {"ratio": 0.0, "num_tiles": 4}),
    "sdtm_release": ("sdtm_release", {"ratio": 0.5}, {"ratio": 0.0, "deviation": 0.0}),
    "fora": ("fora", {}, {"interval": 1}),
    "first_block_cache": ("first_block_cache", {"threshold": 10.0}, {"threshold": 0.0}),
    "fora+tomesd": ("fora", {"merge": "tomesd", "ratio": 0.5, "merge_options": {"use_rand": False}},
                    {"merge": "tomesd", "ratio": 0.0, "interval": 1, "merge_options": {"use_rand": False}}),
}
#: what each method's engaged run must have counted
ENGAGES = {"tomesd": ("merged_calls",), "toma": ("merged_calls",), "sdtm_release": ("merged_calls",),
           "fora": ("reused_calls",), "first_block_cache": ("reused_calls",),
           "fora+tomesd": ("merged_calls", "reused_calls")}
#: sdtm records received attention through the probe (hooks on to_k / add_q_proj / add_k_proj): the LoRA cells
#: that replace those layers after apply check it too
PROBED = {"sdtm": ("sdtm", {"ratio": 0.5}, {"ratio": 0.0})}


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    """PSNR in dB of two images in [0, 1]; 100 for identical ones (the project's convention)."""
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return 100.0 if mse == 0 else 10 * np.log10(1.0 / mse)


def call_defaults(family: str) -> dict[str, Any]:
    if family in local_pipelines.CONTROLNET_CALL_DEFAULTS:
        return local_pipelines.CONTROLNET_CALL_DEFAULTS[family]
    return local_pipelines.CALL_DEFAULTS["sd3" if family == "sd3_medium" else family]


def load(family: str, **kwargs: Any):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(local_pipelines.pipeline_folder(family), local_files_only=True, **kwargs)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def generator_for(pipe, family: str) -> Callable[[], np.ndarray]:
    """``() -> image [1, 32, 32, 3]`` of PROMPT, STEPS steps, fixed noise (and fixed control image)."""
    call = {**call_defaults(family), "num_inference_steps": STEPS}
    if family in local_pipelines.CONTROLNET_CALL_DEFAULTS:
        call["control_image"] = local_pipelines.control_image()

    def generate() -> np.ndarray:
        torch.manual_seed(0)  # SD3's ControlNet pipeline samples the control latents from the global generator
        return pipe(PROMPT, **call, generator=torch.Generator().manual_seed(0), output_type="np").images
    return generate


def check_method(pipe, generate: Callable[[], np.ndarray], method: str, reference: np.ndarray | None = None,
                 methods: dict[str, tuple[str, dict, dict]] = METHODS) -> np.ndarray:
    """The identity setting gives ``reference`` (the unaccelerated image of the same combination) bit for bit; the
    engaged setting merges or reuses and gives a finite, different image of the same content; ``remove()`` leaves
    the pipeline giving ``reference`` again. Returns the engaged image."""
    reference = generate() if reference is None else reference
    name, engaged, identity = methods[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a handle that merged or reused nothing says so: here that is the point
        with tomerge.merging(pipe, name, **identity) as handle:
            same = generate()
    assert handle.stats["block_calls"] > 0, handle.stats
    assert psnr(same, reference) == 100.0, f"{method} at its identity setting changed the image"
    handle = tomerge.apply(pipe, name, **engaged)
    try:
        out = generate()
    finally:
        handle.remove()
    for key in ENGAGES.get(method, ("merged_calls",)):
        assert handle.stats[key] > 0, (key, handle.stats)
    assert np.isfinite(out).all()
    assert 15.0 < psnr(out, reference) < 100.0, psnr(out, reference)  # changed, and still the same picture
    assert np.array_equal(generate(), reference), f"{method}: remove() left the pipeline changed"
    return out


# ---------------------------------------------------------------------- LoRA (peft)
LORA_FAMILIES = ("sd3", "flux")


@pytest.fixture(scope="module")
def plain_images() -> dict[str, np.ndarray]:
    return {family: generator_for(load(family), family)() for family in LORA_FAMILIES}


@pytest.fixture(scope="module", params=LORA_FAMILIES)
def lora_pipe(request):
    """The family's pipeline with one LoRA loaded (unfused) through ``load_lora_weights``."""
    pipe = load(request.param)
    pipe.load_lora_weights(local_pipelines.lora_folder(request.param), adapter_name="a")
    return request.param, pipe, generator_for(pipe, request.param)


@pytest.fixture(scope="module", params=LORA_FAMILIES)
def fused_lora_pipe(request):
    """The family's pipeline with one LoRA loaded and fused into the weights (``fuse_lora``)."""
    pipe = load(request.param)
    pipe.load_lora_weights(local_pipelines.lora_folder(request.param), adapter_name="a")
    pipe.fuse_lora(adapter_names=["a"])
    return request.param, pipe, generator_for(pipe, request.param)


def test_the_lora_changes_the_image(lora_pipe, plain_images):
    """Else the LoRA cells would test nothing."""
    family, pipe, generate = lora_pipe
    assert pipe.get_active_adapters() == ["a"]
    assert psnr(generate(), plain_images[family]) < 60


def test_the_fused_lora_changes_the_image(fused_lora_pipe, plain_images):
    family, pipe, generate = fused_lora_pipe
    assert psnr(generate(), plain_images[family]) < 60


@pytest.mark.parametrize("method", METHODS)
def test_lora_unfused(lora_pipe, method):
    family, pipe, generate = lora_pipe
    check_method(pipe, generate, method)


@pytest.mark.parametrize("method", METHODS)
def test_lora_fused(fused_lora_pipe, method):
    family, pipe, generate = fused_lora_pipe
    check_method(pipe, generate, method)


@pytest.fixture(scope="module")
def two_adapters():
    """SD3 with two LoRAs loaded, ``a`` and ``b``, and the unaccelerated image of each."""
    pipe = load("sd3")
    pipe.load_lora_weights(local_pipelines.lora_folder("sd3", 0), adapter_name="a")
    pipe.load_lora_weights(local_pipelines.lora_folder("sd3", 1), adapter_name="b")
    generate = generator_for(pipe, "sd3")
    images = {}
    for adapter in ("a", "b"):
        pipe.set_adapters(adapter)
        images[adapter] = generate()
    assert psnr(images["a"], images["b"]) < 60  # the two adapters give different images
    return pipe, generate, images


@pytest.mark.parametrize("method", METHODS)
def test_set_adapters_between_calls(two_adapters, method):
    """One handle across ``set_adapters("a")``, a call, ``set_adapters("b")``, a call: each call equals the
    unaccelerated image of its adapter at the identity setting; engaged, the call after the switch equals a fresh
    handle's call on ``b`` (nothing kept from the ``a`` call: no plan, residual or step count), and differs from
    the ``a`` call (the switch reaches the accelerated model). ``remove()`` leaves ``b`` active and unchanged."""
    pipe, generate, images = two_adapters
    name, engaged, identity = METHODS[method]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with tomerge.merging(pipe, name, **identity):
            for adapter in ("a", "b"):
                pipe.set_adapters(adapter)
                assert np.array_equal(generate(), images[adapter]), adapter
    with tomerge.merging(pipe, name, **engaged) as handle:
        pipe.set_adapters("a")
        after_a = {"a": generate()}
        pipe.set_adapters("b")
        after_a["b"] = generate()
    for key in ENGAGES[method]:
        assert handle.stats[key] > 0, (key, handle.stats)
    with tomerge.merging(pipe, name, **engaged):
        fresh_b = generate()
    assert np.array_equal(after_a["b"], fresh_b)
    assert not np.array_equal(after_a["a"], after_a["b"])
    for adapter in ("a", "b"):
        assert np.isfinite(after_a[adapter]).all() and 15.0 < psnr(after_a[adapter], images[adapter]) < 100.0
    assert pipe.get_active_adapters() == ["b"] and np.array_equal(generate(), images["b"])


@pytest.mark.parametrize("family", ("sd3_medium", "flux"))
@pytest.mark.parametrize("method", [*METHODS, *PROBED])
def test_lora_loaded_and_unloaded_after_apply(family, method):
    """peft replaces the targeted linear layers by LoRA wrappers on ``load_lora_weights`` and puts them back on
    ``unload_lora_weights``. With the handle applied before either, the images equal those of applying after it:
    the hooks on a replaced merge point (FLUX.1's single-stream ``proj_mlp``/``proj_out``) and the received-attention
    probe's captures (SD3-Medium's ``to_k``/``add_q_proj``/``add_k_proj``, no q/k norm after them) move to the
    module now in its place. Bugs found here: a size mismatch on FLUX.1 (the wrapper's LoRA branch read the
    unmerged tokens), and ``sdtm``'s received attention from the keys without the LoRA (SD3-Medium) or none at all
    (after unloading: "needs ['received_attention']")."""
    methods = {**METHODS, **PROBED}
    name, engaged, _ = methods[method]
    pipe = load(family)
    generate = generator_for(pipe, family)
    folder = local_pipelines.lora_folder(family)
    plain = generate()
    with tomerge.merging(pipe, name, **engaged):
        plain_accelerated = generate()
    pipe.load_lora_weights(folder)
    with tomerge.merging(pipe, name, **engaged):
        lora_accelerated = generate()
    pipe.unload_lora_weights()

    handle = tomerge.apply(pipe, name, **engaged)
    try:
        pipe.load_lora_weights(folder)
        loaded_after = generate()
        pipe.unload_lora_weights()
        unloaded_after = generate()
    finally:
        handle.remove()
    assert handle.stats["merged_calls"] + handle.stats["reused_calls"] > 0
    assert not np.array_equal(lora_accelerated, plain_accelerated)
    assert np.array_equal(loaded_after, lora_accelerated)
    assert np.array_equal(unloaded_after, plain_accelerated)
    assert np.array_equal(generate(), plain)


def test_a_lora_loaded_after_apply_with_token_wise_caching_is_refused_in_one_line():
    """``toca`` replaces the ``forward`` of FLUX.1's single-stream ``proj_mlp`` (a reused sublayer returns its
    stored output): a wrapper put in its place cannot take that along, so the next call refuses, naming the module
    and what to do; after ``remove()`` the LoRA'd pipeline runs as without tomerge."""
    pipe = load("flux")
    generate = generator_for(pipe, "flux")
    handle = tomerge.apply(pipe, "toca", interval=2)
    generate()
    assert handle.stats["merged_calls"] > 0
    pipe.load_lora_weights(local_pipelines.lora_folder("flux"))
    with pytest.raises(RuntimeError, match=r"^tomerge: FluxSingleTransformerBlock\.proj_mlp was replaced by a "
                                           r"peft\..*remove\(\) the handle, load or unload the LoRA, then apply again$"):
        generate()
    handle.remove()
    with_lora = generate()
    pipe.unload_lora_weights()
    pipe.load_lora_weights(local_pipelines.lora_folder("flux"))
    assert np.array_equal(generate(), with_lora)


# ---------------------------------------------------------------------- ControlNet
@pytest.fixture(scope="module", params=("sd3_controlnet", "flux_controlnet"))
def controlnet_pipe(request):
    pipe = load(request.param)
    return request.param, pipe, generator_for(pipe, request.param)


def test_the_controlnets_change_the_images(controlnet_pipe):
    """Else the ControlNet cells would test nothing: conditioning scale 1 and 0 give different images."""
    family, pipe, generate = controlnet_pipe
    call = {**call_defaults(family), "num_inference_steps": STEPS, "controlnet_conditioning_scale": 0.0}
    torch.manual_seed(0)
    off = pipe(PROMPT, control_image=local_pipelines.control_image(), **call,
               generator=torch.Generator().manual_seed(0), output_type="np").images
    assert psnr(generate(), off) < 60


@pytest.mark.parametrize("method", METHODS)
def test_controlnet(controlnet_pipe, method):
    """The ControlNet's residuals are added to the image tokens between the transformer's blocks, outside the
    hooked blocks: merged blocks and skipped (cached) blocks both leave them in."""
    family, pipe, generate = controlnet_pipe
    check_method(pipe, generate, method)
    assert not any(hasattr(module, "_tomerge_handle") for module in pipe.controlnet.modules())


# ---------------------------------------------------------------------- quantized transformers (torchao, CPU)
def _torchao_config(kind: str):
    from diffusers import TorchAoConfig
    from torchao.quantization import Float8WeightOnlyConfig, Int8DynamicActivationInt8WeightConfig, Int8WeightOnlyConfig

    configs = {"int8_weight_only": Int8WeightOnlyConfig, "int8_dynamic": Int8DynamicActivationInt8WeightConfig,
               "float8_weight_only": Float8WeightOnlyConfig}
    return TorchAoConfig(configs[kind]())


@pytest.fixture(scope="module", params=("int8_weight_only", "int8_dynamic", "float8_weight_only"))
def quantized_pipe(request):
    """SD3 whose transformer is quantized by torchao while loading (``quantization_config``), float32 elsewhere."""
    from diffusers import SD3Transformer2DModel

    folder = local_pipelines.pipeline_folder("sd3")
    transformer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True,
                                                        quantization_config=_torchao_config(request.param),
                                                        torch_dtype=torch.float32)
    pipe = load("sd3", transformer=transformer)
    return request.param, pipe, generator_for(pipe, "sd3")


def test_the_transformers_are_quantized(quantized_pipe, plain_images):
    kind, pipe, generate = quantized_pipe
    weight = pipe.transformer.transformer_blocks[0].attn.to_q.weight
    assert type(weight).__module__.startswith("torchao"), type(weight)
    assert psnr(generate(), plain_images["sd3"]) < 100


@pytest.mark.parametrize("method", METHODS)
def test_quantized_transformer(quantized_pipe, method):
    kind, pipe, generate = quantized_pipe
    check_method(pipe, generate, method)


# ---------------------------------------------------------------------- accelerate's offload hooks (CPU)
@pytest.fixture(scope="module")
def offloaded_pipe():
    """SD3 with ``enable_model_cpu_offload(device="cpu")``: accelerate's ``CpuOffload`` hook on every component
    (without ``device`` diffusers refuses on a machine without an accelerator)."""
    pipe = load("sd3")
    pipe.enable_model_cpu_offload(device="cpu")
    assert type(getattr(pipe.transformer, "_hf_hook", None)).__name__ == "CpuOffload"
    return pipe, generator_for(pipe, "sd3")


@pytest.mark.parametrize("method", METHODS)
def test_model_cpu_offload_then_apply(offloaded_pipe, plain_images, method):
    pipe, generate = offloaded_pipe
    reference = generate()
    assert np.array_equal(reference, plain_images["sd3"])  # offloading onto the CPU computes the same image
    check_method(pipe, generate, method, reference)


@pytest.mark.parametrize("method", ["fora+tomesd", "first_block_cache"])
def test_apply_then_model_cpu_offload(plain_images, method):
    """Offload enabled after ``apply`` (accelerate wraps the transformer's ``forward`` around tomerge's hooks and
    block patches); ``remove()`` with the offload hooks still in place leaves the unaccelerated image."""
    name, engaged, _ = METHODS[method]
    pipe = load("sd3")
    generate = generator_for(pipe, "sd3")
    with tomerge.merging(pipe, name, **engaged):
        expected = generate()
    handle = tomerge.apply(pipe, name, **engaged)
    try:
        pipe.enable_model_cpu_offload(device="cpu")
        out = generate()
    finally:
        handle.remove()
    for key in ENGAGES[method]:
        assert handle.stats[key] > 0
    assert np.array_equal(out, expected)
    assert np.array_equal(generate(), plain_images["sd3"])
    pipe.remove_all_hooks()


@pytest.fixture(scope="module")
def sequentially_offloaded_pipe():
    """SD3 whose transformer has the hooks ``enable_sequential_cpu_offload`` installs: ``accelerate.cpu_offload``
    with the same arguments, onto ``torch.device("cpu")``. ``pipe.enable_sequential_cpu_offload(device="cpu")``
    itself fails on a CPU machine without tomerge (diffusers makes the device ``cpu:0``; accelerate 1.16's
    ``set_module_tensor_to_device`` then raises a TypeError moving a weight back to ``meta``)."""
    from accelerate import cpu_offload

    pipe = load("sd3")
    cpu_offload(pipe.transformer, torch.device("cpu"), offload_buffers=len(pipe.transformer._parameters) > 0)
    assert next(pipe.transformer.parameters()).device.type == "meta"  # weights are loaded per module, per call
    return pipe, generator_for(pipe, "sd3")


@pytest.mark.parametrize("method", METHODS)
def test_sequential_cpu_offload_hooks(sequentially_offloaded_pipe, plain_images, method):
    pipe, generate = sequentially_offloaded_pipe
    reference = generate()
    assert np.array_equal(reference, plain_images["sd3"])
    check_method(pipe, generate, method, reference)
    assert next(pipe.transformer.parameters()).device.type == "meta"


# ---------------------------------------------------------------------- GPU only, untested here
gpu_only = pytest.mark.skipif(not torch.cuda.is_available(),
                              reason="GPU only, untested here: needs a CUDA device (no GPU on this machine)")


def _gpu_quantized(kind: str):
    from diffusers import SD3Transformer2DModel

    folder = local_pipelines.pipeline_folder("sd3")
    if kind.startswith("bitsandbytes"):
        pytest.importorskip("bitsandbytes", reason="GPU only, untested here: bitsandbytes is not installed")
        from diffusers import BitsAndBytesConfig

        config = (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
                  if kind == "bitsandbytes_nf4" else BitsAndBytesConfig(load_in_8bit=True))
    else:
        from diffusers import TorchAoConfig
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig

        config = TorchAoConfig(Float8DynamicActivationFloat8WeightConfig())
    transformer = SD3Transformer2DModel.from_pretrained(folder, subfolder="transformer", local_files_only=True,
                                                        quantization_config=config, torch_dtype=torch.bfloat16,
                                                        device_map="cuda")
    return load("sd3", transformer=transformer, torch_dtype=torch.bfloat16).to("cuda")


@pytest.mark.gpu_only
@gpu_only
@pytest.mark.parametrize("kind", ["bitsandbytes_nf4", "bitsandbytes_int8", "torchao_float8_dynamic"])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_quantized_transformer(kind, method):
    """bitsandbytes (diffusers refuses it without a GPU) and torchao's float8 dynamic activations (CUDA compute
    capability 8.9 or higher)."""
    pipe = _gpu_quantized(kind)
    call = {**call_defaults("sd3"), "num_inference_steps": STEPS}
    check_method(pipe, lambda: pipe(PROMPT, **call, generator=torch.Generator("cuda").manual_seed(0),
                                    output_type="np").images, method)


@pytest.mark.gpu_only
@gpu_only
@pytest.mark.parametrize("offload", ["enable_model_cpu_offload", "enable_sequential_cpu_offload"])
@pytest.mark.parametrize("method", METHODS)
def test_gpu_offload(offload, method):
    """Offload onto the GPU: the weights move to CUDA per component (or per module) at each call."""
    pipe = load("sd3")
    getattr(pipe, offload)()
    call = {**call_defaults("sd3"), "num_inference_steps": STEPS}
    check_method(pipe, lambda: pipe(PROMPT, **call, generator=torch.Generator("cuda").manual_seed(0),
                                    output_type="np").images, method)
