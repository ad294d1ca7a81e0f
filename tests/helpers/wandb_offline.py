"""The W&B offline log of a run folder that ``tomerge ablate`` wrote with ``wandb=offline``, read back with the
``wandb leet inspect --json`` command (the records of each offline run's local transaction log)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path


def offline_records(folder: Path) -> tuple[list[Path], list[dict]]:
    """The offline runs under ``folder / "wandb"`` (asserted to be there) and their transaction logs' records."""
    run_dirs = sorted((folder / "wandb").glob("offline-run-*"))
    assert run_dirs
    records = []
    for run_dir in run_dirs:
        out = subprocess.run(["wandb", "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                             timeout=120)
        records += [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    return run_dirs, records
