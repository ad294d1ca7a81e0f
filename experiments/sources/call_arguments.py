"""The arguments a model source is called with (``model.call``): each pipeline family's defaults
(:data:`CALL_DEFAULTS`), the ones tomerge sets itself, the reference DiT's names for the pipelines' ones, and
the checks of a ``call`` mapping against a pipeline class (:func:`check_call`), including what the class
takes: a video length (:func:`video_length_arg`) or input images (:func:`takes_image`).

Example:
    >>> from diffusers import PixArtAlphaPipeline
    >>> check_call(PixArtAlphaPipeline, {"num_inference_steps": 20, "guidance_scale": 4.5})
    >>> video_length_arg(PixArtAlphaPipeline), takes_image(PixArtAlphaPipeline)
    (None, False)
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from ..errors import did_you_mean

__all__ = ["CALL_DEFAULTS", "VIDEO_CALL_ARGS", "RESERVED_CALL_ARGS", "SAME_CALL_ARGS", "unknown_call_arguments",
           "check_call", "video_length_arg", "takes_image"]

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
# pipeline (models.ModelSpec.is_video).
VIDEO_CALL_ARGS = ("num_frames", "video_length")
# Arguments tomerge sets itself for every call (one image per item, per-item generators, tensor output).
RESERVED_CALL_ARGS = ("prompt", "generator", "output_type", "num_images_per_prompt", "num_videos_per_prompt",
                      "return_dict", "class_labels", "latents", "prompt_embeds", "image")
# The reference DiT's sampler argument and the pipeline call argument that means the same.
SAME_CALL_ARGS = {"num_steps": "num_inference_steps", "cfg_scale": "guidance_scale"}


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

