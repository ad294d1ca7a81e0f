"""Model sources: the ``model:`` entry every subcommand takes, as data (:class:`ModelSpec`), and :class:`Item`.

``model: reference`` is the bundled reference DiT (or a native DiT checkpoint), ``model: {pipeline: PATH, ...}``
a diffusers pipeline folder on local disk; both generate images ``[B, C, H, W]`` (videos ``[B, T, C, H, W]``) in
``[-1, 1]``, item ``i``'s noise from its own seed. This module also answers the public names of
``reference_model``, ``pipelines``, ``call_arguments`` and ``devices``, so the model-source API is one import.
The forms, defaults and rules: docs/experiments.md, "1. The model" and "8. Video pipelines".

Example:
    >>> spec = ModelSpec.from_config({"pipeline": "/models/sd3-medium", "dtype": "fp16", "device": "cuda",
    ...                               "call": {"num_inference_steps": 28}})     # doctest: +SKIP
    >>> source = spec.load()                                                     # doctest: +SKIP
    >>> images = source.generate([Item(0, 0, prompt="a red fox in snow")])      # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from ..errors import did_you_mean
from . import devices
# The model-source API in one import: `sources.models.NAME` answers each name below.
from .call_arguments import (CALL_DEFAULTS, RESERVED_CALL_ARGS, SAME_CALL_ARGS, VIDEO_CALL_ARGS, check_call,
                             takes_image, unknown_call_arguments, video_length_arg)
from .items import Item
from .devices import DTYPE_NAMES, OFFLOAD_MODES, place_pipeline, torch_dtype
from .pipelines import PipelineSource
from .reference_model import (BUNDLED_REFERENCE_NAMES, BUNDLED_REFERENCES, REFERENCE_CHECKPOINT, ReferenceSource,
                              reference_checkpoint)

# torch is imported where a model is loaded or run, so that configs (and `tomerge ... --help`) load without it.

__all__ = ["Item", "ModelSpec", "BUNDLED_REFERENCES", "BUNDLED_REFERENCE_NAMES", "reference_checkpoint", "check_call",
           "ReferenceSource", "PipelineSource", "CALL_DEFAULTS", "VIDEO_CALL_ARGS", "video_length_arg", "DTYPES",
           "DTYPE_NAMES", "OFFLOAD_MODES", "torch_dtype", "place_pipeline"]


def __getattr__(name: str) -> Any:
    if name == "DTYPES":  # name -> torch dtype, built on first use (imports torch)
        return devices.DTYPES
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
        if "kind" in value:  # the form a run folder's config.yaml holds (to_dict): read back as what it means
            value, problems = cls._from_saved(value)
            if problems:
                return None, problems
        kinds = [k for k in ("reference", "pipeline") if k in value]
        if len(kinds) != 1:
            problems.append("model needs exactly one of `reference: CHECKPOINT` or `pipeline: FOLDER`, "
                            f"got keys {sorted(value)}")
        valid = ("reference", "pipeline", "dtype", "device", "offload", "call")
        call_names = {*cls.REFERENCE_CALL, *(k for d in CALL_DEFAULTS.values() for k in d)}
        for key in [k for k in value if k not in valid]:
            if key in call_names:
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

    @staticmethod
    def _from_saved(value: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
        """``{kind, path, ...}`` (:meth:`to_dict`, what a run folder's ``config.yaml`` holds) as the mapping a
        user writes (``{reference: PATH}`` or ``{pipeline: PATH}``, the other keys as they are), so that
        ``tomerge ablate --config runs/NAME/config.yaml`` reads the config the folder was made with.

        Example:
            >>> ModelSpec._from_saved({"kind": "reference", "path": None, "call": {"num_steps": 8}})
            ({'call': {'num_steps': 8}, 'reference': 'bundled'}, [])
        """
        value = dict(value)
        kind, path = value.pop("kind"), value.pop("path", None)
        if {"reference", "pipeline"} & set(value):
            return value, ["model: `kind`/`path` (a run folder's config.yaml) and `reference:`/`pipeline:` both "
                           "name the source; keep one"]
        if kind not in ("reference", "pipeline"):
            return value, [f"model.kind must be reference or pipeline, got {kind!r}"]
        value[kind] = "bundled" if kind == "reference" and path is None else path
        return value, []

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
        values.update({k: getattr(self, k) for k in ("dtype", "device", "offload")
                       if getattr(self, k) != getattr(defaults, k)})
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

