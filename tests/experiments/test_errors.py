"""tomerge.experiments.errors: the one owner of the user-facing errors; the other spellings are the same
objects, and no module of the package imports the command line."""

from __future__ import annotations

import ast
import importlib

import pytest

from tomerge.experiments import errors
from helpers import ROOT

EXPERIMENTS = ROOT / "experiments"

# module -> the names of errors.py it also holds (its own spellings of them)
OTHER_SPELLINGS = {
    "cli": ["UserError", "UsageError", "user_input", "did_you_mean", "is_user_error", "report_errors",
            "module_main", "INTERRUPTED"],
    "plugins": ["PluginError"],
    "measure.metrics": ["MissingWeightsError"],
    "generation.files": ["DiskFullError", "DamagedFileError", "FolderInUseError", "is_disk_full"],
    "generation.generate": ["UsageError"],
    "commands.generate": ["RankFailedError", "UsageError", "user_input"],
    "runs.records": ["UsageError"],
    "commands.ablate": ["user_input"],
    "runs.search": ["UsageError"],
    "runs.search_space": ["did_you_mean"],
    "commands.search": ["user_input"],
    "commands.bench": ["UsageError", "user_input"],
    "commands.train_reference": ["user_input"],
}


@pytest.mark.parametrize("module", sorted(OTHER_SPELLINGS))
def test_other_spellings_are_the_same_objects(module):
    imported = importlib.import_module(f"tomerge.experiments.{module}")
    for name in OTHER_SPELLINGS[module]:
        assert getattr(imported, name) is getattr(errors, name), f"{module}.{name}"


def test_every_error_is_a_user_error_reported_in_one_line(capsys):
    raised = [errors.UsageError("bad value"), errors.ConfigError(["one", "two"]), errors.PluginError("no", "p.py"),
              errors.MissingWeightsError("no weights"), errors.DiskFullError(28, "no space left writing x"),
              errors.DamagedFileError("broken"), errors.FolderInUseError("in use"), errors.RankFailedError("rank 1")]
    for err in raised:
        assert errors.is_user_error(err)

        def fail(err=err):
            raise err

        assert errors.report_errors("ablate", fail) == 2
        assert capsys.readouterr().err == f"tomerge ablate: error: {err}\n"
    assert str(raised[4]) == "no space left writing x"  # without OSError's "[Errno 28]"


def test_no_module_imports_the_command_line():
    """The command line imports the subcommands, never the other way round (no cli <-> plugins circle)."""
    importers = []
    for path in sorted(EXPERIMENTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""] + [f"{node.module or ''}.{a.name}" for a in node.names]
                if node.level == 1 and any(n in ("cli", ".cli") or n.startswith("cli.") for n in names) \
                        or any(n.startswith("tomerge.experiments.cli") for n in names) \
                        or node.module == "tomerge.experiments" and any(a.name == "cli" for a in node.names):
                    importers.append(path.name)
            elif isinstance(node, ast.Import) and any(a.name.startswith("tomerge.experiments.cli") for a in node.names):
                importers.append(path.name)
    assert importers == []


def test_errors_imports_nothing_of_tomerge():
    tree = ast.parse((EXPERIMENTS / "errors.py").read_text())
    imported = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    imported += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in imported if m is None or m.startswith("tomerge")]
