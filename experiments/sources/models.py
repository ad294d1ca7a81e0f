"""Model sources: what an experiment generates with.

Every subcommand that runs a model takes the same ``model:`` entry:

* ``model: reference`` (the default): the bundled class-conditional reference DiT, or a native DiT
  checkpoint (``{reference: PATH, call: {num_steps, cfg_scale, shift}}``; ``reference: bundled`` is
  the bundled one), sampled with tomerge's Euler sampler; items carry class labels.
* ``model: {pipeline: PATH, dtype: bf16|fp16|fp32, device: cpu|cuda, offload: model|sequential, call: {...}}``:
  any diffusers pipeline folder on local disk, loaded with ``DiffusionPipeline.from_pretrained(PATH,
  local_files_only=True)`` (never a download; diffusers loads through ``accelerate``, which keeps the modules a
  model class lists in ``_keep_in_fp32_modules`` in fp32); items carry prompts, and for editing pipelines an
  input image each (``prompts: {image_field: KEY}``, passed as ``image=``). ``call`` holds pipeline-call
  arguments (``num_inference_steps``, ``guidance_scale``, ``height``, ``width``,
  ``max_sequence_length``, ...) on top of the family's defaults (:data:`CALL_DEFAULTS`). ``offload``
  keeps the models of a pipeline larger than GPU memory in CPU memory (:func:`place_pipeline`).

Both produce images ``[B, C, H, W]`` in ``[-1, 1]`` (float32, CPU) for a batch of items, the initial
noise of item ``i`` drawn from ``torch.Generator("cpu").manual_seed(seed_i)`` so an image depends
only on its seed and settings (also across devices and batch compositions up to kernel rounding).
Video pipelines (a ``__call__`` taking a video length, :data:`VIDEO_CALL_ARGS`: ``num_frames`` for Wan,
HunyuanVideo, LTX-Video, ..., ``video_length`` for Latte) produce videos ``[B, T, C, H, W]`` the same way
(:attr:`ModelSpec.is_video`; docs/experiments.md, "Video pipelines").

Example:
    >>> spec = ModelSpec.from_config({"pipeline": "/models/sd3-medium", "dtype": "fp16", "device": "cuda",
    ...                               "call": {"num_inference_steps": 28}})     # doctest: +SKIP
    >>> source = spec.load()                                                     # doctest: +SKIP
    >>> images = source.generate([Item(0, 0, prompt="a red fox in snow")])      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import UsageError, did_you_mean

if TYPE_CHECKING:
    import torch
    from torch import Tensor, nn

# torch is imported where a model is loaded or run, so that configs (and `tomerge ... --help`) load without it.

__all__ = ["Item", "ModelSpec", "BUNDLED_REFERENCES", "BUNDLED_REFERENCE_NAMES", "reference_checkpoint", "check_call",
           "ReferenceSource", "PipelineSource", "CALL_DEFAULTS", "VIDEO_CALL_ARGS", "video_length_arg", "DTYPES",
           "DTYPE_NAMES", "OFFLOAD_MODES", "torch_dtype", "place_pipeline"]

# The reference models shipped with the package, by the name a config gives (`model: {reference: NAME}`):
# the same DiT at 256 (32 x 32 images) and 1,024 image tokens (64 x 64), docs/reference-model.md.
BUNDLED_REFERENCES = {
    "bundled": Path(__file__).parents[1] / "reference" / "dit_reference.safetensors",
    "bundled-1024": Path(__file__).parents[1] / "reference" / "dit_reference_1024.safetensors",
}
REFERENCE_CHECKPOINT = BUNDLED_REFERENCES["bundled"]
# what figures call them (ModelSpec.display_name); the token counts are those of DIT_PRESETS "reference" and
# "reference-1024", which tests check
BUNDLED_REFERENCE_NAMES = {"bundled": "bundled reference DiT (256 tokens)",
                           "bundled-1024": "bundled reference DiT (1,024 tokens)"}
DTYPE_NAMES = ("fp32", "fp16", "bf16")
OFFLOAD_MODES = ("model", "sequential")


def torch_dtype(name: str) -> torch.dtype:
    """``"fp32"`` / ``"fp16"`` / ``"bf16"`` -> the torch dtype."""
    import torch

    return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch dtype, built on first use (imports torch)
        return {n: torch_dtype(n) for n in DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

# Pipeline-call arguments per backbone family, on top of which `call:` applies. They are the released
# pipelines' own defaults made explicit (diffusers 0.42), so that every result row records them; the
# resolution is the family's native one.
CALL_DEFAULTS: dict[str, dict[str, Any]] = {
    "sd3": {"num_inference_steps": 28, "guidance_scale": 7.0, "height": 1024, "width": 1024,
            "max_sequence_length": 256},
    "flux": {"num_inference_steps": 28, "guidance_scale": 3.5, "height": 1024, "width": 1024,
             "max_sequence_length": 512},
    "pixart": {"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024},
    "unet": {"num_inference_steps": 50},  # SD 1.x/2.x (7.5, 512^2) and SDXL (5.0, 1024^2): the pipeline's own
    "dit": {"num_inference_steps": 250, "guidance_scale": 4.0},
    "sana": {"num_inference_steps": 20, "guidance_scale": 4.5, "height": 1024, "width": 1024,
             "max_sequence_length": 300},
    "wan": {"num_inference_steps": 50, "guidance_scale": 5.0, "height": 480, "width": 832, "num_frames": 81,
            "max_sequence_length": 512},  # Wan 2.1 T2V at 480p
    "hunyuan_video": {"num_inference_steps": 50, "guidance_scale": 6.0, "height": 720, "width": 1280,
                      "num_frames": 129, "max_sequence_length": 256},
    "ltx": {"num_inference_steps": 50, "guidance_scale": 3.0, "height": 512, "width": 704, "num_frames": 161,
            "max_sequence_length": 128},
}
# The call argument that sets a video pipeline's frame count, by the name its `__call__` gives it: `num_frames`
# (Wan, HunyuanVideo, LTX-Video, Mochi, ...) or `video_length` (LattePipeline). A pipeline taking one is a video
# pipeline (ModelSpec.is_video).
VIDEO_CALL_ARGS = ("num_frames", "video_length")
# Arguments tomerge sets itself for every call (one image per item, per-item generators, tensor output).
RESERVED_CALL_ARGS = ("prompt", "generator", "output_type", "num_images_per_prompt", "num_videos_per_prompt",
                      "return_dict", "class_labels", "latents", "prompt_embeds", "image")


# The reference DiT's sampler argument and the pipeline call argument that means the same.
SAME_CALL_ARGS = {"num_steps": "num_inference_steps", "cfg_scale": "guidance_scale"}
# Keys of the model mapping of earlier versions -> where they are now (under model.).
MOVED_MODEL_KEYS = {"checkpoint": "reference"}


def unknown_call_arguments(unknown: Sequence[str], valid: Iterable[str], what: str) -> str:
    """The message for ``model.call`` arguments ``what`` (the reference DiT, a pipeline class) does not take:
    each with the valid one of the other model kind's name (``num_steps`` <-> ``num_inference_steps``,
    ``cfg_scale`` <-> ``guidance_scale``) or the closest valid name.

    Example:
        >>> print(unknown_call_arguments(["num_inference_steps", "sheft"], ["num_steps", "shift"], "the reference DiT"))
        unknown model.call argument(s) ['num_inference_steps', 'sheft'] for the reference DiT ('num_inference_steps': \
the reference DiT calls it 'num_steps'; 'sheft': did you mean 'shift'?); valid: ['num_steps', 'shift']
    """
    valid = sorted(valid)
    same = {**SAME_CALL_ARGS, **{v: k for k, v in SAME_CALL_ARGS.items()}}
    hints = []
    for name in unknown:
        if same.get(name) in valid:
            hints.append(f"{name!r}: {what} calls it {same[name]!r}")
        elif close := did_you_mean(name, valid):
            hints.append(f"{name!r}: {close.removeprefix('; ')}")
    hint = f" ({'; '.join(hints)})" if hints else ""
    return f"unknown model.call argument(s) {sorted(unknown)} for {what}{hint}; valid: {valid}"


def check_call(pipeline_class: type, call: dict[str, Any]) -> None:
    """Raises unless every ``call`` argument is a named parameter of the pipeline's ``__call__`` (its
    ``**kwargs``, where it has them, would swallow a typo) and the pipeline takes prompts."""
    params = inspect.signature(pipeline_class.__call__).parameters
    valid = {k for k, p in params.items() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and k != "self"}
    unknown = sorted(set(call) - valid)
    if unknown:
        raise ValueError(unknown_call_arguments(unknown, valid - set(RESERVED_CALL_ARGS), pipeline_class.__name__))
    if "prompt" not in valid:
        raise ValueError(f"{pipeline_class.__name__} takes no prompt: tomerge generates from prompt sets with "
                         "text-to-image pipelines (use model: reference for class labels)")


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to produce: its global index, noise seed, and its condition (class label or prompt, and for
    editing pipelines the path of its input image).

    Example:
        >>> Item(7, 107, label=3).filename, Item(7, 107, prompt="a cat").filename
        ('00007_class3_seed107.png', '00007_seed107.png')
    """

    index: int
    seed: int
    label: int | None = None
    prompt: str | None = None
    image: str | None = None

    @property
    def filename(self) -> str:
        if self.label is not None:
            return f"{self.index:05d}_class{self.label}_seed{self.seed}.png"
        return f"{self.index:05d}_seed{self.seed}.png"

    @property
    def video_dirname(self) -> str:
        """The folder of a video item's frames (``frame_000.png``, ...): the file name without ``.png``.

        Example:
            >>> Item(7, 107, prompt="a cat").video_dirname
            '00007_seed107'
        """
        return self.filename.removesuffix(".png")

    def output_name(self, video: bool = False) -> str:
        """What the item is written as in a run's image folder: :attr:`filename` (a PNG), or for a video
        :attr:`video_dirname` (a folder of one PNG per frame)."""
        return self.video_dirname if video else self.filename


def _cpu_generator(seed: int) -> torch.Generator:
    import torch

    return torch.Generator("cpu").manual_seed(int(seed))


def reference_checkpoint(path: str | None) -> Path:
    """The file of ``model.reference``: ``None`` is the default bundled model, a name of
    :data:`BUNDLED_REFERENCES` its file, anything else a path.

    Example:
        >>> reference_checkpoint("bundled-1024").name
        'dit_reference_1024.safetensors'
    """
    if path is None:
        return REFERENCE_CHECKPOINT
    return BUNDLED_REFERENCES.get(path, Path(path))


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model source as plain data (what configs hold, what is pickled to worker processes).

    Args:
        kind: ``"reference"`` (native DiT) or ``"pipeline"`` (a diffusers pipeline folder).
        path: the DiT checkpoint (``None``: the bundled reference model; ``"bundled-1024"``: the bundled
            1,024-token one, :data:`BUNDLED_REFERENCES`) or the pipeline folder.
        dtype: ``fp32``, ``fp16`` or ``bf16`` (pipelines).
        device: ``cpu`` or ``cuda`` (``cuda:N`` too).
        offload: pipelines larger than GPU memory, with a ``cuda`` device: ``model`` keeps every model of the
            pipeline in CPU memory and moves each whole to the GPU while it runs (diffusers'
            ``enable_model_cpu_offload``: the largest model must fit, a little slower); ``sequential`` moves one
            layer at a time (``enable_sequential_cpu_offload``: the least GPU memory, much slower); unset: the
            whole pipeline on the device.
        call: sampler arguments: for the reference model ``num_steps``, ``cfg_scale``, ``shift``; for a
            pipeline its ``__call__`` arguments on top of :data:`CALL_DEFAULTS`.
    """

    kind: str = "reference"
    path: str | None = None
    dtype: str = "fp32"
    device: str = "cpu"
    offload: str | None = None
    call: dict[str, Any] = dataclasses.field(default_factory=dict)

    REFERENCE_CALL = {"num_steps": 20, "cfg_scale": 2.0, "shift": 1.0}

    def __post_init__(self) -> None:
        problems = self.field_problems(self.kind, self.path, self.dtype, self.device, self.call, self.offload)
        if problems:
            raise ValueError("; ".join(problems))

    @classmethod
    def field_problems(cls, kind: Any, path: Any, dtype: Any, device: Any, call: Any,
                       offload: Any = None) -> list[str]:
        """Every problem of these fields, one message each (what the constructor raises, joined by ``; ``),
        without touching the disk (:meth:`check` does)."""
        problems = []
        if offload is not None:
            if offload not in OFFLOAD_MODES:
                problems.append(f"model.offload must be model or sequential (or left out), got {offload!r}"
                                f"{did_you_mean(str(offload), OFFLOAD_MODES)}")
            elif kind != "pipeline":
                problems.append("model.offload is for pipeline folders (model: {pipeline: PATH, ...}); the reference "
                                "DiT runs whole on model.device")
            elif not (isinstance(device, str) and device.startswith("cuda")):
                problems.append(f"model.offload: {offload} needs model.device: cuda (it keeps the pipeline's models in "
                                "CPU memory and moves each to the GPU when it runs; with model.device "
                                f"{device!r} they are in CPU memory already): set model.device: cuda, or remove "
                                "model.offload")
        if kind not in ("reference", "pipeline"):
            problems.append(f"model kind must be reference or pipeline, got {kind!r}")
        if dtype not in DTYPE_NAMES:
            problems.append(f"model.dtype must be one of {sorted(DTYPE_NAMES)}, got {dtype!r}"
                            f"{did_you_mean(str(dtype), DTYPE_NAMES)}")
        if not isinstance(device, str) or not (device == "cpu" or device.startswith("cuda")):
            problems.append(f"model.device must be cpu or cuda, got {device!r}")
        if not isinstance(call, dict):
            problems.append(f"model.call must be a mapping of call arguments, got {call!r}")
        elif kind == "reference":
            unknown = sorted(set(call) - set(cls.REFERENCE_CALL))
            if unknown:
                problems.append(unknown_call_arguments(unknown, cls.REFERENCE_CALL, "the reference DiT"))
            steps, scale, shift = call.get("num_steps", 1), call.get("cfg_scale", 1.0), call.get("shift", 1.0)
            if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
                problems.append(f"model.call.num_steps must be an integer >= 1, got {steps!r}")
            if isinstance(scale, bool) or not isinstance(scale, (int, float)):
                problems.append(f"model.call.cfg_scale must be a number, got {scale!r}")
            if isinstance(shift, bool) or not isinstance(shift, (int, float)) or shift <= 0:
                problems.append(f"model.call.shift must be a number > 0, got {shift!r}")
        if kind == "pipeline":
            if not path:
                problems.append("model.pipeline needs the path of a local diffusers pipeline folder")
            reserved = sorted(set(call) & set(RESERVED_CALL_ARGS)) if isinstance(call, dict) else []
            if reserved:
                problems.append(f"model.call sets {reserved}, which tomerge sets per item; remove them "
                                "(prompts come from `prompts:`, seeds from `seed:`, input images from "
                                "`prompts: {image_field: KEY}`)")
        return problems

    @classmethod
    def from_config(cls, value: Any) -> ModelSpec:
        """``"reference"``, ``{reference: PATH, ...}`` or ``{pipeline: PATH, dtype, device, call}``; raises a
        ``ValueError`` with every problem of the value (:meth:`parse`), joined by ``; ``.

        Example:
            >>> ModelSpec.from_config("reference").kind
            'reference'
            >>> ModelSpec.from_config({"pipeline": "/m/sd3", "dtype": "bf16"}).dtype
            'bf16'
        """
        spec, problems = cls.parse(value)
        if problems:
            raise ValueError("; ".join(problems))
        return spec

    @classmethod
    def parse(cls, value: Any) -> tuple[ModelSpec | None, list[str]]:
        """A config's ``model`` value and every problem of it, one message each (unknown keys with the
        closest valid one, call arguments written one level too high, bad values): the spec with the
        fields that are right (defaults for the others, unknown call arguments left out), so that what
        depends on the model can still be checked; ``None`` when not even the kind of source is clear.

        Example:
            >>> spec, problems = ModelSpec.parse({"reference": "bundled", "dtpye": "fp16", "num_steps": 8})
            >>> spec.kind, problems[0], problems[1]
            ('reference', "unknown key 'model.dtpye'; did you mean 'model.dtype'?", "unknown key 'model.num_steps': \
it is a call argument, model.call.num_steps")
        """
        if value is None or value == "reference":
            return cls(), []
        if isinstance(value, ModelSpec):
            return value, []
        if isinstance(value, str):
            return None, [f"model must be `reference` or a mapping {{pipeline: PATH, ...}}, got {value!r}; "
                          "for a pipeline folder write model: {pipeline: PATH}"]
        if not isinstance(value, dict):
            return None, [f"model must be `reference` or a mapping, got {value!r}"]
        value = dict(value)
        problems = []
        kinds = [k for k in ("reference", "pipeline") if k in value]
        if len(kinds) != 1:
            problems.append("model needs exactly one of `reference: CHECKPOINT` or `pipeline: FOLDER`, "
                            f"got keys {sorted(value)}")
        valid = ("reference", "pipeline", "dtype", "device", "offload", "call")
        call_names = {*cls.REFERENCE_CALL, *(k for d in CALL_DEFAULTS.values() for k in d)}
        for key in [k for k in value if k not in valid]:
            if key in MOVED_MODEL_KEYS:
                problems.append(f"unknown key 'model.{key}': moved to model.{MOVED_MODEL_KEYS[key]}")
            elif key in call_names:
                problems.append(f"unknown key 'model.{key}': it is a call argument, model.call.{key}")
            else:
                problems.append(f"unknown key 'model.{key}'"
                                + (did_you_mean(f"model.{key}", [f"model.{v}" for v in valid])
                                   or f"; valid: {', '.join(valid)}"))
        fields = {k: value[k] for k in ("dtype", "device", "offload", "call") if k in value}
        if len(kinds) != 1:
            return None, problems
        kind, path = kinds[0], value[kinds[0]]
        path = None if path in (None, "bundled") else str(path)
        defaults = cls()
        problems += cls.field_problems(kind, path, fields.get("dtype", defaults.dtype),
                                       fields.get("device", defaults.device), fields.get("call", {}),
                                       fields.get("offload"))
        if fields.get("dtype", "fp32") not in DTYPE_NAMES:  # the right fields only, for the checks that follow
            del fields["dtype"]
        if cls.field_problems("reference", None, "fp32", fields.get("device", "cpu"), {}):
            del fields["device"]
        if cls.field_problems(kind, path, "fp32", fields.get("device", defaults.device), {}, fields.get("offload")):
            fields.pop("offload", None)
        if not isinstance(fields.get("call", {}), dict):
            del fields["call"]
        elif "call" in fields:
            fields["call"] = {k: v for k, v in fields["call"].items()
                              if (k in cls.REFERENCE_CALL if kind == "reference" else k not in RESERVED_CALL_ARGS)}
        for call in (fields.get("call", {}), {}):  # without the call arguments if one of their values is bad
            try:
                return cls(kind=kind, path=path, **{**fields, "call": call}), problems
            except ValueError:  # e.g. a pipeline without a path
                pass
        return None, problems

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def display_name(self) -> str:
        """The model as figures name it: a bundled reference DiT by :data:`BUNDLED_REFERENCE_NAMES`, another
        checkpoint by its file stem, a pipeline by its folder's name.

        Example:
            >>> ModelSpec().display_name, ModelSpec(path="/ckpt/dit_xl.safetensors").display_name
            ('bundled reference DiT (256 tokens)', 'dit_xl')
            >>> ModelSpec(kind="pipeline", path="/models/sd3-medium/").display_name
            'sd3-medium'
        """
        if self.kind == "reference":
            return BUNDLED_REFERENCE_NAMES.get(self.path or "bundled") or Path(self.path).stem
        return Path(self.path).name

    def to_config(self) -> dict[str, Any]:
        """The ``model:`` mapping of a config file that gives this spec back (:meth:`parse`).

        Example:
            >>> ModelSpec(call={"num_steps": 8}).to_config()
            {'reference': 'bundled', 'call': {'num_steps': 8}}
        """
        values: dict[str, Any] = {self.kind: self.path if self.path is not None else "bundled"}
        defaults = ModelSpec()
        values.update({k: getattr(self, k) for k in ("dtype", "device") if getattr(self, k) != getattr(defaults, k)})
        if self.call:
            values["call"] = dict(self.call)
        return values

    def check(self) -> None:
        """Fails fast, without loading weights: the checkpoint or pipeline folder exists, the folder is a
        diffusers pipeline, every ``call`` argument is one its ``__call__`` takes, and a GPU is visible for
        ``offload``."""
        if self.kind == "reference":
            path = reference_checkpoint(self.path)
            if not path.is_file():
                bundled = (f" (the bundled model {self.path!r} is not in this installation; "
                           f"docs/reference-model.md says how to train it)" if self.path in BUNDLED_REFERENCES else "")
                raise FileNotFoundError(f"model.reference: checkpoint {path} not found (local weights only){bundled}")
            return
        folder = Path(self.path).expanduser()
        if not folder.is_dir():
            hint = (" (it looks like a hub id: download the weights yourself, e.g. `huggingface-cli download "
                    f"{self.path} --local-dir DIR`, and give DIR)" if "/" in self.path and not Path(self.path).anchor
                    else "")
            raise FileNotFoundError(f"model.pipeline {self.path!r} is not a local folder{hint}; tomerge never "
                                    "downloads weights")
        index = folder / "model_index.json"
        if not index.is_file():
            raise FileNotFoundError(f"model.pipeline {folder} has no model_index.json: not a diffusers pipeline "
                                    "folder (save one with pipe.save_pretrained(DIR))")
        import json

        import diffusers

        name = json.loads(index.read_text()).get("_class_name")
        pipeline_class = getattr(diffusers, name, None) if isinstance(name, str) else None
        if pipeline_class is None:
            raise ValueError(f"model.pipeline {folder}: model_index.json names pipeline class {name!r}, which this "
                             f"diffusers ({diffusers.__version__}) does not have")
        check_call(pipeline_class, self.call)
        if self.offload is not None:
            import torch

            if not torch.cuda.is_available():
                raise ValueError(f"model.offload: {self.offload} needs a CUDA GPU, and torch sees none "
                                 "(torch.cuda.is_available() is False); on a CPU-only machine remove model.offload "
                                 "and set model.device: cpu")

    @property
    def conditioning(self) -> str:
        """``"class"`` (items carry labels) or ``"prompt"``."""
        return "class" if self.kind == "reference" else "prompt"

    @property
    def is_video(self) -> bool:
        """Whether the model generates videos ``[B, T, C, H, W]``: a pipeline whose ``__call__`` takes a video
        length (:func:`video_length_arg`; the class read from the folder's ``model_index.json``, without loading
        weights). Its items are written as folders of frames (:meth:`Item.output_name`)."""
        pipeline_class = self.pipeline_class()
        return pipeline_class is not None and video_length_arg(pipeline_class) is not None

    def pipeline_class(self) -> type | None:
        """The diffusers class named by the pipeline folder's ``model_index.json`` (``None`` for the reference
        model, or when the folder or class is missing: :meth:`check` says why)."""
        if self.kind != "pipeline":
            return None
        index = Path(self.path).expanduser() / "model_index.json"
        if not index.is_file():
            return None
        import json

        import diffusers

        name = json.loads(index.read_text()).get("_class_name")
        return getattr(diffusers, name, None) if isinstance(name, str) else None

    def load(self) -> ReferenceSource | PipelineSource:
        return ReferenceSource(self) if self.kind == "reference" else PipelineSource(self)


class ReferenceSource:
    """A native DiT checkpoint sampled with :func:`tomerge.experiments.sources.sampling.sample`."""

    conditioning = "class"
    video = False

    def __init__(self, spec: ModelSpec) -> None:
        from tomerge.backbones.timm_dit import load_dit

        self.spec = spec
        spec.check()
        path = reference_checkpoint(spec.path)
        self.checkpoint = path
        self.model = load_dit(path, map_location=spec.device).eval().to(torch_dtype(spec.dtype))
        self.call = {**ModelSpec.REFERENCE_CALL, **spec.call}

    @property
    def target(self) -> nn.Module:
        """What :func:`tomerge.apply` attaches to."""
        return self.model

    @property
    def denoiser(self) -> nn.Module:
        return self.model

    @property
    def num_steps(self) -> int:
        return int(self.call["num_steps"])

    def merge_options(self) -> dict[str, Any]:
        """Extra :func:`tomerge.apply` options: the sampler's step count (schedules see exact progress)."""
        return {"num_steps": self.num_steps}

    def check_items(self, items: Sequence[Item]) -> None:
        n = self.model.config.num_classes
        if any(i.label is None for i in items):
            raise UsageError("the reference DiT is class-conditional: give class labels, not prompts")
        bad = sorted({i.label for i in items if not 0 <= i.label < n})
        if bad:
            raise UsageError(f"class ids {bad} outside the model's classes 0..{n - 1}")

    def generate(self, batch: Sequence[Item]) -> Tensor:
        """Images ``[B, C, H, W]`` in ``[-1, 1]`` (float32, CPU)."""
        import torch

        from .sampling import sample

        c = self.model.config
        noise = torch.stack([torch.randn((c.in_channels, *c.image_hw), generator=_cpu_generator(i.seed))
                             for i in batch])  # [B, C, H, W]
        labels = torch.tensor([i.label for i in batch], dtype=torch.long)
        return sample(self.model, labels, num_steps=self.num_steps, cfg_scale=float(self.call["cfg_scale"]),
                      shift=float(self.call["shift"]), noise=noise).float().cpu()


class PipelineSource:
    """A diffusers pipeline from a local folder, called once per batch of prompts (image or video pipelines)."""

    conditioning = "prompt"

    def __init__(self, spec: ModelSpec) -> None:
        from diffusers import DiffusionPipeline

        self.spec = spec
        spec.check()
        folder = Path(spec.path).expanduser()
        with warnings.catch_warnings():
            # diffusers 0.42 renames torch_dtype; older releases know only it
            warnings.filterwarnings("ignore", message="`torch_dtype` is deprecated", category=FutureWarning)
            self.pipe = DiffusionPipeline.from_pretrained(str(folder), torch_dtype=torch_dtype(spec.dtype),
                                                          local_files_only=True)
        place_pipeline(self.pipe, spec.device, spec.offload)
        self.video = spec.is_video
        self.pipe.set_progress_bar_config(disable=True)
        self.family = self._family()
        self.call = {**CALL_DEFAULTS.get(self.family, {}), **spec.call}
        check_call(type(self.pipe), self.call)

    def _family(self) -> str | None:
        import tomerge
        from tomerge.registry import backbone_class

        for name in tomerge.list_backbones():
            if backbone_class(name).find_model(self.pipe) is not None:
                return name
        return None

    @property
    def target(self) -> Any:
        return self.pipe

    @property
    def denoiser(self) -> nn.Module:
        from torch import nn

        for attr in ("transformer", "unet"):
            module = getattr(self.pipe, attr, None)
            if isinstance(module, nn.Module):
                return module
        raise ValueError(f"{type(self.pipe).__name__} has no transformer or unet")

    @property
    def num_steps(self) -> int | None:
        steps = self.call.get("num_inference_steps")
        if steps is None:
            steps = inspect.signature(self.pipe.__call__).parameters["num_inference_steps"].default
        return int(steps)

    def merge_options(self) -> dict[str, Any]:
        return {}  # the step clock comes from the pipeline's scheduler

    def check_items(self, items: Sequence[Item]) -> None:
        if any(i.prompt is None for i in items):
            raise UsageError(f"{type(self.pipe).__name__} is a text-to-image pipeline: give prompts (`prompts:`)")
        with_image = {i.image is not None for i in items}
        if with_image == {True, False}:
            raise UsageError("some items have an input image and some have none; give every prompt one")
        if True in with_image and not takes_image(type(self.pipe)):
            raise UsageError(f"{type(self.pipe).__name__} takes no input image (`image=`); remove "
                             "prompts.image_field or use an editing pipeline")

    def generate(self, batch: Sequence[Item]) -> Tensor:
        """Images ``[B, 3, H, W]``, or for a video pipeline videos ``[B, T, 3, H, W]``, in ``[-1, 1]`` (float32,
        CPU). Video pipelines return their frames (``output_type="pt"``: ``.frames``, ``[B, T, C, H, W]`` in
        ``[0, 1]``), image pipelines ``.images`` (``[B, C, H, W]``)."""
        images = {} if batch[0].image is None else {"image": [_load_rgb(i.image) for i in batch]}
        out = self.pipe(prompt=[i.prompt for i in batch], generator=[_cpu_generator(i.seed) for i in batch],
                        output_type="pt", **images, **self.call)
        for name in ("frames", "images"):
            if hasattr(out, name):
                pixels = getattr(out, name)
                break
        else:
            pixels = out[0]
        expected = 5 if self.video else 4
        if not hasattr(pixels, "ndim") or pixels.ndim != expected:
            shape = tuple(pixels.shape) if hasattr(pixels, "shape") else type(pixels).__name__
            what = "videos [B, T, C, H, W]" if self.video else "images [B, C, H, W]"
            raise ValueError(f"{type(self.pipe).__name__} returned {shape} with output_type='pt'; expected {what}")
        return (pixels.float().cpu() * 2 - 1).clamp(-1, 1)  # [B, 3, H, W] or [B, T, 3, H, W]


def video_length_arg(pipeline_class: type) -> str | None:
    """The name of the ``__call__`` argument that sets a video pipeline's frame count (the first of
    :data:`VIDEO_CALL_ARGS` it takes), or ``None`` for an image pipeline.

    Example:
        >>> from diffusers import LattePipeline, WanPipeline, PixArtAlphaPipeline
        >>> [video_length_arg(c) for c in (WanPipeline, LattePipeline, PixArtAlphaPipeline)]
        ['num_frames', 'video_length', None]
    """
    parameters = inspect.signature(pipeline_class.__call__).parameters
    return next((name for name in VIDEO_CALL_ARGS if name in parameters), None)


def takes_image(pipeline_class: type) -> bool:
    """Whether a pipeline's ``__call__`` takes input images (``image``): editing pipelines (FLUX.1 Kontext,
    Qwen-Image-Edit, FLUX.2), image-to-image and image-to-video ones."""
    return "image" in inspect.signature(pipeline_class.__call__).parameters


def _load_rgb(path: str):
    """An item's input image as an RGB PIL image (what the pipelines' image processors take)."""
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


def place_pipeline(pipe: Any, device: str, offload: str | None = None) -> None:
    """Puts a loaded pipeline on ``device`` (``pipe.to(device)``), or with ``offload`` (:attr:`ModelSpec.offload`)
    keeps its models in CPU memory and has diffusers move them to ``device`` when they run: ``"model"`` a whole
    model at a time (``pipe.enable_model_cpu_offload(device=device)``), ``"sequential"`` one layer at a time
    (``pipe.enable_sequential_cpu_offload(device=device)``). Both use ``accelerate``'s hooks, which run inside the
    module calls, so :func:`tomerge.apply` hooks on the same modules compose with them."""
    if offload is None:
        pipe.to(device)
    elif offload == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif offload == "sequential":
        pipe.enable_sequential_cpu_offload(device=device)
    else:
        raise ValueError(f"offload must be None, model or sequential, got {offload!r}")
