"""The layout of ``tomerge.experiments`` (its docstring): one stage per folder, each module importing only
from the stages before it, no import circle, no module longer than ``MAX_LINES``. Imports are read from the
source (every ``import`` statement, also those inside functions), so a lazy import that breaks the order is
found as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import tomerge.experiments as experiments

ROOT = Path(experiments.__file__).parent
# The stages in the order a run takes them; a module imports from its own stage and the ones before.
STAGES = ("errors", "plugins", "sources", "config", "generation", "measure", "runs", "figures", "bench",
          "commands", "cli")


def module_name(path: Path) -> str:
    """``runs/records.py`` -> ``runs.records``; ``runs/__init__.py`` -> ``runs``; the package -> ``""``."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split(".")) if name else ROOT
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def import_statements(tree: ast.AST, typing_only: bool) -> list[ast.stmt]:
    """Every import statement of ``tree``; those under ``if TYPE_CHECKING:`` only when ``typing_only``."""
    found, todo = [], [tree]
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif not typing_only and isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            todo += node.orelse
        else:
            todo += ast.iter_child_nodes(node)
    return found


def imported_modules(path: Path, typing_only: bool = True) -> set[str]:
    """The modules of ``tomerge.experiments`` that ``path`` imports (names relative to the package); with
    ``typing_only=False`` without the imports for annotations only (``if TYPE_CHECKING:``)."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in import_statements(ast.parse(path.read_text()), typing_only):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - node.level + 1]
                module = ".".join([*base, *([node.module] if node.module else [])])
            elif node.module and (node.module + ".").startswith("tomerge.experiments."):
                module = node.module.removeprefix("tomerge.experiments").lstrip(".")
            else:
                continue
            for alias in node.names:  # `from .runs import records` imports the module runs.records
                child = f"{module}.{alias.name}" if module else alias.name
                found.add(child if is_module(child) else module)
        elif isinstance(node, ast.Import):
            found |= {a.name.removeprefix("tomerge.experiments.") for a in node.names
                      if a.name.startswith("tomerge.experiments.")}
    return {m for m in found if m and m != name}


SOURCES = sorted(ROOT.rglob("*.py"))
GRAPH = {module_name(p): imported_modules(p) for p in SOURCES}
RUNTIME_GRAPH = {module_name(p): imported_modules(p, typing_only=False) for p in SOURCES}


def stage(module: str) -> str:
    return module.split(".")[0]


def test_every_module_is_in_a_stage():
    assert {stage(m) for m in GRAPH if m} <= set(STAGES)


def test_a_module_imports_only_from_its_stage_and_the_ones_before():
    late = [f"{m} imports {t}" for m, targets in GRAPH.items() if m for t in sorted(targets)
            if STAGES.index(stage(t)) > STAGES.index(stage(m))]
    assert late == []


def test_no_import_circle_at_run_time():
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        if module in path:
            cycle = " -> ".join([*path[path.index(module):], module])
            pytest.fail(f"import circle: {cycle}")
        if module in done:
            return
        for target in sorted(RUNTIME_GRAPH.get(module, ())):
            visit(target, (*path, module))
        done.add(module)

    for module in sorted(RUNTIME_GRAPH):
        visit(module, ())


MAX_LINES = 450  # a module a reader takes in at once


def test_no_module_is_longer_than_max_lines():
    lengths = {module_name(p): len(p.read_text().splitlines()) for p in SOURCES}
    assert {m: n for m, n in lengths.items() if n > MAX_LINES} == {}
