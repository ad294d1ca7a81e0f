"""The GPU benchmark's driver (``experiments/bench/gpu.sh``): its sections, each a ``tomerge bench`` command, run
one after the other in one process, and one Markdown file with the machine, the versions, the commit, the
command, a headline table and every section's tables.

    python -m tomerge.experiments.commands.bench_report OUT_DIR --command "bash experiments/bench/gpu.sh --quick" \\
        --section "e2e|End-to-end, eager|--e2e --widths sd3 --steps 8 ..." --section ...

A section is ``NAME|TITLE|ARGUMENTS``: ``tomerge bench ARGUMENTS --out OUT_DIR/NAME.csv``. A section that fails
is reported as failed (its error in the file, its traceback on stderr) and the others still run; the exit code is
then 1. The headline table (:func:`headline_table`) reads the sections named ``e2e`` (eager) and ``compiled``: one
line per (model, method), speed-up / FLOP-ideal speed-up of the sampling loop (of the forward where no loop was
timed), eager and compiled, merging's own GFLOPs per image and the eager peak memory.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import importlib.metadata as md
import platform
import shlex
import subprocess
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

from ..measure.columns import COLUMNS, format_markdown_table
from . import bench

__all__ = ["Section", "parse_section", "run_sections", "headline_table", "write_report", "main"]


@dataclasses.dataclass(frozen=True)
class Section:
    """One ``tomerge bench`` command of the run and its title in the report."""

    name: str
    title: str
    args: tuple[str, ...]


def parse_section(text: str) -> Section:
    """``"NAME|TITLE|ARGUMENTS"`` -> :class:`Section` (``ARGUMENTS`` split as a shell would).

    Example:
        >>> parse_section("kernels|Kernels|--kernels --tokens 64")
        Section(name='kernels', title='Kernels', args=('--kernels', '--tokens', '64'))
    """
    parts = text.split("|", 2)
    if len(parts) != 3 or not parts[0].strip() or not parts[2].strip():
        raise ValueError(f"a section is NAME|TITLE|ARGUMENTS, got {text!r}")
    name, title, args = (p.strip() for p in parts)
    if not name.replace("_", "").isalnum():
        raise ValueError(f"a section name is letters, digits and _, got {name!r}")
    return Section(name, title, tuple(shlex.split(args)))


def run_sections(sections: Sequence[Section], out: Path) -> dict[str, tuple[float, str | None]]:
    """Runs every section (``tomerge bench ARGUMENTS --out OUT/NAME.csv``); returns ``{name: (seconds, error or
    None)}``. CUDA's cached memory is released between sections."""
    import gc

    import torch

    results: dict[str, tuple[float, str | None]] = {}
    for section in sections:
        argv = [*section.args, "--out", str(out / f"{section.name}.csv")]
        print(f"\n=== {section.name}: tomerge bench {shlex.join(argv)}", flush=True)
        start = time.perf_counter()
        error = None
        try:
            code = bench.main(argv)
            if code:
                error = f"tomerge bench exited with code {code}"
        except SystemExit as exit_:  # argparse: a bad argument
            error = f"tomerge bench exited with code {exit_.code}"
        except Exception as err:  # noqa: BLE001 - one failed section must not lose the others
            traceback.print_exc()
            error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        seconds = time.perf_counter() - start
        results[section.name] = (seconds, error)
        print(f"=== {section.name}: {'failed, ' + error if error else 'done'} in {seconds:.0f} s", flush=True)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return results


def _rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with path.open() as f:
        return list(csv.DictReader(f))


def _pick_mode(rows: list[dict[str, str]]) -> dict[tuple[str, str, str], dict[str, str]]:
    """``{(model, tokens, method): row}``, the sampling-loop row where there is one, else the forward."""
    picked: dict[tuple[str, str, str], dict[str, str]] = {}
    for row in rows:
        key = (row["model"], row["tokens"], row["method"])
        if key not in picked or row["mode"].startswith("loop"):
            picked[key] = row
    return picked


def _speedup(row: dict[str, str] | None) -> str:
    if row is None:
        return "-"
    noisy = row.get("base_spread") and row.get("merged_spread") and \
        max(float(row["base_spread"] or 0), float(row["merged_spread"] or 0)) > 0.10
    return f"{float(row['speedup']):.2f} / {float(row['ideal']):.2f}" + (" noisy" if noisy else "")


def _mb(value: str | None) -> str:
    return f"{float(value):.0f}" if value not in (None, "") else "-"


def headline_table(eager: list[dict[str, str]], compiled: list[dict[str, str]]) -> str:
    """One line per (model, N, method) of the eager rows: the mode timed (``loopK`` where a loop was timed),
    ratio, eager and compiled ``speed-up / FLOP-ideal``, merging's own GFLOPs per image, eager peak memory of
    the baseline and the method (CUDA; ``-`` on CPU)."""
    eager_rows, compiled_rows = _pick_mode(eager), _pick_mode(compiled)
    titles = ["model (C)", "N", "mode", "method", "ratio", "eager: speed-up / ideal", "compiled: speed-up / ideal",
              COLUMNS["merge_gflops"].table_title, "peak MiB, baseline", "peak MiB"]
    cells = []
    for key, row in eager_rows.items():
        other = compiled_rows.get(key)
        cells.append([f"{row['model']} ({row['width']})", row["tokens"], row["mode"], row["method"], row["ratio"],
                      _speedup(row), _speedup(other) if other is None or other["mode"] == row["mode"] else
                      f"{_speedup(other)} ({other['mode']})", f"{float(row['merge_gflops']):.3g}",
                      _mb(row.get("peak_memory_base_mb")), _mb(row.get("peak_memory_mb"))])
    numeric = [False, True, False, False, True, True, True, True, True, True]
    return format_markdown_table(titles, cells, numeric)


def _version(name: str) -> str:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"


def _run(command: list[str]) -> str:
    try:
        out = subprocess.run(command, capture_output=True, text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""
    except (OSError, subprocess.SubprocessError):
        return ""


def machine_lines() -> list[str]:
    """The device (GPU, driver, CUDA, cuDNN; or the CPU), the host, the versions and the commit."""
    import torch

    root = Path(__file__).resolve().parents[2]
    commit = _run(["git", "-C", str(root), "describe", "--always", "--dirty", "--abbrev=7"]) or "unknown"
    if torch.cuda.is_available():
        driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]) or "unknown"
        device = (f"GPU: {torch.cuda.get_device_name()} (driver {driver}), CUDA {torch.version.cuda}, "
                  f"cuDNN {torch.backends.cudnn.version()}")
    else:
        device = f"no GPU: CPU {platform.processor() or platform.machine()}, {torch.get_num_threads()} torch threads"
    return [f"- {device}",
            f"- host: {platform.node()}, {platform.platform()}, python {platform.python_version()}",
            f"- torch {torch.__version__}, diffusers {_version('diffusers')}, tomesd {_version('tomesd')}, "
            f"tomerge {_version('tomerge')}, commit `{commit}`"]


def write_report(out: Path, sections: Sequence[Section], results: dict[str, tuple[float, str | None]],
                 command: str, notes: Sequence[str] = ()) -> Path:
    """``OUT/benchmarks_gpu.md``: machine, versions, commit and command; the headline table; every section's
    command, time and tables (``OUT/NAME.md`` as ``tomerge bench --out`` wrote it)."""
    lines = ["# tomerge GPU benchmark", "", *machine_lines(), f"- command: `{command}`", *[f"- {n}" for n in notes],
             "- hard merge plans run as index gathers and scatters (`MergePlan` backend `index`, the default on "
             "every device); the kernels section times the `dense` one-hot matmuls beside them",
             f"- `{COLUMNS['merge_gflops'].table_title}`: FLOPs of planning, merging and unmerging per image, a part "
             "of the merged FLOPs (0 for gathers); speed-up / ideal: measured and FLOP-ideal speed-up over the "
             "unmerged model", ""]
    if "e2e" in results:
        lines += ["## Headline", "",
                  headline_table(_rows(out / "e2e.csv"), _rows(out / "compiled.csv") if "compiled" in results else []),
                  ""]
    for section in sections:
        seconds, error = results.get(section.name, (0.0, "not run"))
        md_file = out / f"{section.name}.md"
        lines += [f"## {section.title}", "", f"`tomerge bench {shlex.join(section.args)}` ({seconds:.1f} s)", ""]
        if error:
            lines += [f"(failed: {error})", ""]
        elif md_file.exists():
            lines += [md_file.read_text().rstrip(), ""]
        else:
            lines += ["(no rows)", ""]
    path = out / "benchmarks_gpu.md"
    path.write_text("\n".join(lines))
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tomerge.experiments.commands.bench_report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder of the CSVs, the sections' tables and benchmarks_gpu.md")
    parser.add_argument("--command", required=True, help="the command line that ran the benchmark (recorded)")
    parser.add_argument("--section", dest="sections", action="append", default=[], metavar="NAME|TITLE|ARGUMENTS",
                        help="a `tomerge bench` command (repeatable, run in order)")
    parser.add_argument("--note", dest="notes", action="append", default=[], help="a line for the header (repeatable)")
    args = parser.parse_args(argv)
    try:
        sections = [parse_section(s) for s in args.sections]
    except ValueError as err:
        parser.error(str(err))
    if not sections:
        parser.error("no --section given")
    args.out.mkdir(parents=True, exist_ok=True)
    results = run_sections(sections, args.out)
    path = write_report(args.out, sections, results, args.command, args.notes)
    failed = [name for name, (_, error) in results.items() if error]
    print(f"\nwrote {path}" + (f"; failed sections: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
