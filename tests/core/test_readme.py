"""Every ```python block of README.md runs as written: offline, on the CPU, each in a fresh namespace with an
empty temporary working directory (so files a snippet saves land there). A block added later is run too.

Substitution rule (the only change made to a snippet's text): real pipeline weights cannot exist in a test, so
a line of the form

    folder = "/models/stable-diffusion-3-medium-diffusers"   # your local copy

(the name ``folder``, a string, the comment ``# your local copy``) gets instead the path of the tiny
random-weight pipeline folder of ``tests/helpers/local_pipelines.py`` of the family the original path names (see
``FAMILY_BY_PATH``: "flux" -> flux, "pixart" -> pixart, "xl" -> sdxl, "stable-diffusion-3" or "sd3" -> sd3,
other "stable-diffusion" -> sd). In a block with such a line, every keyword ``name=<literal>`` whose name is a
key of ``local_pipelines.CALL_DEFAULTS[family]`` (``num_inference_steps``, ``height``, ``width``,
``guidance_scale``, ``max_sequence_length``, ...) gets the tiny pipeline's fast value, e.g.
``num_inference_steps=28`` -> ``2``.
Nothing else is changed; line numbers in tracebacks are README.md's.

After each block, what it defined is checked where the names say what it is (``baseline``/``merged`` sampled
images, ``plan`` a bare-tensor plan, ``pipe``/``image`` a pipeline call, ``handle`` a merge handle, files saved
under a string literal name ending in ``.png``).
"""

from __future__ import annotations

import re

import pytest
import torch

from tomerge.attach import _HANDLE_ATTR
from helpers import ROOT

README = ROOT / "README.md"

FOLDER_LINE = re.compile(  # folder = "<path>"   # your local copy
    r'^(?P<head>\s*folder\s*=\s*)(?P<q>["\'])(?P<path>[^"\']*)(?P=q)(?P<tail>\s*#\s*your local copy.*)$', re.MULTILINE)
FAMILY_BY_PATH = (("flux", "flux"), ("pixart", "pixart"), ("xl", "sdxl"), ("stable-diffusion-3", "sd3"),
                  ("sd3", "sd3"), ("stable-diffusion", "sd"))
LITERAL = r'(?:-?\d+(?:\.\d*)?(?:e-?\d+)?|True|False|None|"[^"\n]*"|\'[^\'\n]*\')'


def python_blocks(text: str) -> list[tuple[int, str]]:
    """``(first line number, source)`` of every fenced ```python block."""
    blocks, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```python":
            start, i = i + 2, i + 1
            body = []
            while lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            blocks.append((start, "\n".join(body) + "\n"))
        i += 1
    return blocks


BLOCKS = python_blocks(README.read_text())


def family_of(path: str) -> str:
    name = path.lower()
    for key, family in FAMILY_BY_PATH:
        if key in name:
            return family
    raise AssertionError(f"README pipeline path {path!r} names no family of tests/helpers/local_pipelines.py")


def substitute(source: str) -> tuple[str, str | None]:
    """The block with the substitution rule applied, and the pipeline family (None: no folder line)."""
    match = FOLDER_LINE.search(source)
    if match is None:
        return source, None
    from helpers import local_pipelines

    family = family_of(match["path"])
    folder = local_pipelines.pipeline_folder(family)
    source = FOLDER_LINE.sub(lambda m: f"{m['head']}{str(folder)!r}{m['tail']}", source)
    for key, value in local_pipelines.CALL_DEFAULTS[family].items():
        source = re.sub(rf"\b{key}={LITERAL}", f"{key}={value!r}", source)
    return source, family


def test_the_readme_has_the_three_quick_start_snippets():
    sources = [source for _, source in BLOCKS]
    assert len(sources) >= 3
    assert any("load_dit(" in s and "sample(" in s for s in sources)
    assert any(".plan(" in s for s in sources)
    assert sum(FOLDER_LINE.search(s) is not None for s in sources) >= 1  # the substitution rule still applies
    assert "tomerge.list_strategies()" in README.read_text() and "tomerge.list_backbones()" in README.read_text()


@pytest.mark.filterwarnings("ignore:`torch_dtype` is deprecated:FutureWarning")  # diffusers 0.42 renames it
@pytest.mark.parametrize("line, source", BLOCKS, ids=[f"README.md:{line}" for line, _ in BLOCKS])
def test_readme_snippet_runs(line, source, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    source, family = substitute(source)
    namespace = {"__name__": "__readme__"}
    exec(compile("\n" * (line - 1) + source, str(README), "exec"), namespace)

    if "baseline" in namespace and "merged" in namespace:  # the reference DiT, unmerged and merged
        baseline, merged = namespace["baseline"], namespace["merged"]
        assert baseline.shape == merged.shape and baseline.shape[1:] == (1, 32, 32)
        assert baseline.abs().max() <= 1 and merged.abs().max() <= 1
        assert not torch.equal(merged, baseline)
    if "plan" in namespace:  # bare tensors
        plan, x = namespace["plan"], namespace["x"]
        assert plan.num_removed > 0
        b, n, c = x.shape
        assert namespace["y"].shape == (b, n - plan.num_removed, c)
        assert namespace["x_back"].shape == x.shape
    if "pipe" in namespace:  # a diffusers pipeline from a local folder
        assert family is not None, "a pipeline snippet needs the `folder = ...  # your local copy` line"
        assert namespace["image"].size == (32, 32)
    if "handle" in namespace:  # merging ran and was removed on exit
        handle = namespace["handle"]
        assert handle.stats["tokens_removed"] > 0 and handle.stats["merged_calls"] > 0
        assert _HANDLE_ATTR not in handle.model.__dict__
    for name in re.findall(r'["\']([^"\'\n]+\.png)["\']', source):
        assert (tmp_path / name).is_file(), f"the snippet did not write {name}"


# ------------------------------------------------------------------ the main job's table

#: Columns of ``tomerge ablate``'s table that only a configured metric fills (``records.markdown_table`` shows
#: a column when some row has a value): column key -> the ``metrics.*`` field that enables it.
OPTIONAL_METRIC_COLUMNS = {"clip_score": "clip_model", "fid": "fid_weights", "dino_dist": "dino_model"}


def main_job_table(text: str) -> tuple[list[str], list[list[str]]]:
    """Header cells and body rows of the README table right after the sentence introducing the main job's
    output ("Its output on ...")."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("Its output on"))
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    table = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        table.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    header, rule, *rows = table
    assert all(set(cell) <= set("-:") for cell in rule), f"the README table's second line is not a rule: {rule}"
    return header, rows


def test_readme_main_job_table_runs_are_the_default_grid():
    """One row per run of `experiments/configs/ablate.yaml`, in the grid's order, the baseline first: a grid
    entry added to (or removed from) the default config without the README's table following fails here."""
    from tomerge.experiments.config.load import load_config
    from tomerge.experiments.config.schema import DEFAULT_CONFIG

    header, rows = main_job_table(README.read_text())
    assert header[0] == "run"
    config = load_config(DEFAULT_CONFIG)
    expected = ["baseline"] + [run.run_id for run in config.runs()]
    assert [row[0] for row in rows] == expected, (
        f"README.md's main-job table lists runs {[row[0] for row in rows]}, but {DEFAULT_CONFIG.name} produces "
        f"{expected}: rerun `tomerge ablate` and paste its table")


def test_readme_main_job_table_columns_are_the_ablate_table_columns():
    """The table's header is what `tomerge ablate` prints for the default config (records.TABLE_COLUMNS, less
    the metrics the default config does not compute), and every row has a cell per column."""
    from tomerge.experiments.config.load import load_config
    from tomerge.experiments.config.schema import DEFAULT_CONFIG
    from tomerge.experiments.runs.records import TABLE_COLUMNS

    header, rows = main_job_table(README.read_text())
    metrics = load_config(DEFAULT_CONFIG).metrics
    expected = [title for key, title in TABLE_COLUMNS
                if key not in OPTIONAL_METRIC_COLUMNS or getattr(metrics, OPTIONAL_METRIC_COLUMNS[key], None)]
    assert header == expected, f"README.md's main-job table has columns {header}; `tomerge ablate` prints {expected}"
    assert all(len(row) == len(header) for row in rows)


def test_main_job_table_parser_sees_an_added_grid_entry(monkeypatch, tmp_path):
    """The check above fails when the default grid gains an entry the README does not list."""
    import yaml

    from tomerge.experiments.config import schema as config_module

    grid = yaml.safe_load(config_module.DEFAULT_CONFIG.read_text())
    grid["grid"].append({"strategy": "ssm", "ratios": [0.25]})
    extended = tmp_path / "ablate.yaml"
    extended.write_text(yaml.safe_dump(grid))
    monkeypatch.setattr(config_module, "DEFAULT_CONFIG", extended)
    with pytest.raises(AssertionError, match="ssm-r0.25"):
        test_readme_main_job_table_runs_are_the_default_grid()
