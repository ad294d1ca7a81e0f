"""What the tests share, imported as ``helpers.<module>`` (tests/conftest.py puts tests/ on ``sys.path``; a script
outside the suite inserts that folder itself, as ``scripts/compile_counts.py`` does). No test file imports another
test file: what two of them use lives here.

* ``models``: tiny random-weight models of the hand-written adapters (``unet``, ``sd3``, ``pixart``, ``dit``,
  ``flux``, ``native_dit``) and their inputs;
* ``family``, ``image_families``, ``video_families``, ``families``: the declared adapters' families under test (a
  :class:`~helpers.family.Family` row: builder, inputs, blocks, grids) and the checks of their contract
  (tests/backbones/test_family_contract.py runs them over every row);
* ``cases``: one trajectory's calls of every backbone (the Family rows and the hand-written adapters), for the
  tests that run every strategy or schedule on every backbone;
* ``probes``: the received-attention reference computed from a model's own SDPA call;
* ``reference_images``: editing calls with reference-image tokens (FLUX.1 Kontext, FLUX.2, Qwen-Image-Edit);
* ``compiled``: the tiny DiTs and the trajectory of the ``torch.compile`` tests (also read by
  ``scripts/compile_counts.py``);
* ``cuda_graphs``, ``fake_cuda``: the CPU stand-ins of CUDA graphs and of CUDA tensors (the fake-CUDA suite in
  tests/fake_cuda and ``scripts/kept_memory.py``);
* ``ties``: inputs without near ties for tests that compare discrete choices;
* ``local_pipelines``, ``pipeline_ablation``, ``tiny_reference``, ``run_folders``: tiny saved pipelines, the
  ``tomerge ablate`` runs on them, the tiny reference DiT and data set, synthetic run folders;
* ``wandb_offline``: the W&B offline log of an ablation run folder, read back with ``wandb leet inspect``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

#: The repository's root folder (README.md, docs/, scripts/, experiments/).
ROOT = Path(__file__).resolve().parents[2]


def seeded(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed``."""
    return torch.Generator().manual_seed(seed)


def no_hooks_left(model: nn.Module) -> bool:
    """No forward hook or pre-hook on any module of ``model`` (what ``remove()`` must leave)."""
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
