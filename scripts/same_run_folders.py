"""Whether two run folders of `tomerge ablate` hold the same results: every file byte for byte, except what
differs between two runs of the same code on the same machine.

    python scripts/same_run_folders.py runs/before runs/after

Left out of the comparison:

* the measured timing columns of a result row (``timing.MEASURED_COLUMNS``), in ``results.jsonl``,
  ``results.csv`` and ``table.md`` (there under their table titles, ``records.TABLE_COLUMNS``, and the note
  on noisy timings under the table), and each row's ``git_commit``;
* in ``config.yaml``, ``out_dir`` and ``name`` (where the folder is, and what it is called);
* files of one process: ``tomerge.lock``, ``wandb_id.txt`` and everything under ``wandb/``.

Every other file is compared byte for byte, and so are the masked files outside the values left out (the
other values of a row, its key order, the table's layout). Prints ``N files compared: the same`` and exits
with 0, or prints each difference (a file in one folder only, a file whose bytes differ, a row value that
differs) and exits with 1.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import sys
from pathlib import Path

from tomerge.experiments.measure.timing import MEASURED_COLUMNS  # the columns a timing measures

ROW_KEYS_LEFT_OUT = MEASURED_COLUMNS | {"git_commit"}
CONFIG_KEYS_LEFT_OUT = ("out_dir", "name")
FILES_LEFT_OUT = frozenset({"tomerge.lock", "wandb_id.txt"})
FOLDERS_LEFT_OUT = frozenset({"wandb"})
LEFT_OUT = "<left out>"


def measured_titles() -> frozenset[str]:
    """The table titles of :data:`MEASURED_COLUMNS` (``table.md``'s header)."""
    from tomerge.experiments.runs.records import TABLE_COLUMNS

    return frozenset(title for key, title in TABLE_COLUMNS if key in MEASURED_COLUMNS)


def compared_files(folder: Path) -> set[str]:
    """The paths (relative, ``/``-separated) of the files of ``folder`` that are compared."""
    found = set()
    for path in folder.rglob("*"):
        relative = path.relative_to(folder)
        if path.is_dir() or relative.name in FILES_LEFT_OUT or FOLDERS_LEFT_OUT & set(relative.parts[:-1]):
            continue
        found.add(relative.as_posix())
    return found


def mask_jsonl(data: bytes) -> list[str]:
    """Each row of ``results.jsonl`` as JSON text with the values of :data:`ROW_KEYS_LEFT_OUT` replaced
    (key order kept)."""
    lines = []
    for line in data.decode().splitlines():
        row = json.loads(line)
        lines.append(json.dumps({k: LEFT_OUT if k in ROW_KEYS_LEFT_OUT else v for k, v in row.items()}))
    return lines


def mask_csv(data: bytes) -> list[str]:
    """Each line of ``results.csv`` with the cells of the columns in :data:`ROW_KEYS_LEFT_OUT` replaced."""
    rows = list(csv.reader(io.StringIO(data.decode())))
    if not rows:
        return []
    left_out = {i for i, key in enumerate(rows[0]) if key in ROW_KEYS_LEFT_OUT}
    return [",".join(LEFT_OUT if i in left_out else cell for i, cell in enumerate(row)) for row in rows]


NOISY_NOTE = "(noisy):"  # the start of the note under a table with a noisy timing (records.markdown_table)


def mask_markdown_table(data: bytes) -> list[str]:
    """Each line of ``table.md`` with the cells under a measured column's title replaced, without the note on
    noisy timings (and the blank line before it): it is there when a measured ``timing_noisy`` is."""
    titles = measured_titles()
    text = data.decode().splitlines()
    kept = [line for i, line in enumerate(text)
            if not line.startswith(NOISY_NOTE) and not (line == "" and text[i + 1:i + 2] and
                                                        text[i + 1].startswith(NOISY_NOTE))]
    lines, left_out = [], set()
    for line in kept:
        cells = line.split("|")  # "| a | b |" -> ["", " a ", " b ", ""]
        if not left_out and any(cell.strip() in titles for cell in cells):
            left_out = {i for i, cell in enumerate(cells) if cell.strip() in titles}
        elif line.startswith("|") and not set(line) <= set("|-: "):
            cells = [LEFT_OUT if i in left_out else cell for i, cell in enumerate(cells)]
        lines.append("|".join(cells))
    return lines


def mask_config(data: bytes) -> list[str]:
    """The lines of ``config.yaml`` with the top-level keys :data:`CONFIG_KEYS_LEFT_OUT` replaced."""
    return [f"{line.split(':', 1)[0]}: {LEFT_OUT}" if line.split(":", 1)[0] in CONFIG_KEYS_LEFT_OUT else line
            for line in data.decode().splitlines()]


MASKS = {"results.jsonl": mask_jsonl, "results.csv": mask_csv, "table.md": mask_markdown_table,
         "config.yaml": mask_config}


def differences(before: Path, after: Path) -> tuple[int, list[str]]:
    """``(files compared, one line per difference)``."""
    before_files, after_files = compared_files(before), compared_files(after)
    found = [f"only in {before}: {name}" for name in sorted(before_files - after_files)]
    found += [f"only in {after}: {name}" for name in sorted(after_files - before_files)]
    both = sorted(before_files & after_files)
    for name in both:
        before_bytes, after_bytes = (before / name).read_bytes(), (after / name).read_bytes()
        if before_bytes == after_bytes:
            continue
        mask = MASKS.get(name)
        if mask is None:
            found.append(f"{name}: the bytes differ ({len(before_bytes)} and {len(after_bytes)} bytes)")
            continue
        before_lines, after_lines = mask(before_bytes), mask(after_bytes)
        if len(before_lines) != len(after_lines):
            found.append(f"{name}: {len(before_lines)} and {len(after_lines)} lines")
        found += [f"{name}, line {i + 1}: {a!r} != {b!r}"
                  for i, (a, b) in enumerate(zip(before_lines, after_lines)) if a != b]
        if before_lines == after_lines and before_bytes.endswith(b"\n") != after_bytes.endswith(b"\n"):
            found.append(f"{name}: one ends with a newline, the other does not")
    return len(both), found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="a run folder")
    parser.add_argument("after", type=Path, help="the run folder to compare it with")
    args = parser.parse_args(argv)
    for folder in (args.before, args.after):
        if not folder.is_dir():
            parser.error(f"{folder} is not a folder")
    compared, found = differences(args.before, args.after)
    if not found:
        print(f"{compared} files compared: the same")
        return 0
    print(f"{compared} files compared, {len(found)} difference(s):")
    for line in found:
        print(f"  {line}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
