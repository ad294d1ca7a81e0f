"""The bytes tomerge keeps across model calls, at real sizes, after a 50-step trajectory: a markdown table.

Every method of the fake-CUDA suite (tests/helpers/fake_cuda.py, the one owner of the models, inputs and runner)
on SD3-Medium, FLUX.1-dev and SDXL at 1024^2 (batch 2: classifier-free guidance batched) and Wan 2.1 14B at 480p x
81 frames (guidance as two calls of batch 1), the full models, bf16 on fake ``cuda`` tensors: nothing is allocated,
so it runs on a CPU. A cell is ``MergeState.kept_bytes()`` after the last step divided by the rows of one step's
calls (batch x calls per step: 2 everywhere), in GiB: the bytes per sample row; an image or video generated with
guidance keeps twice that. Where the trajectory kept more at an earlier step, the peak follows in parentheses.

    OMP_NUM_THREADS=1 python3 scripts/kept_memory.py --jobs 2 --out runs/kept_memory.md  # about 45 min on 2 cores
    OMP_NUM_THREADS=1 python3 scripts/kept_memory.py --models sd3 --methods fora toma --steps 10
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import subprocess
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from helpers import fake_cuda as harness  # noqa: E402  (tests/helpers/fake_cuda.py)


_BUILT: dict[str, Any] = {}


def measure(job: tuple[str, str, int]) -> tuple[str, str, tuple[int, int, dict[str, int], str | None]]:
    """One model and method: ``(model, method, (bytes after the last step, peak bytes, bytes by kind, error))``."""
    name, method, steps = job
    if name not in _BUILT:  # one build per model and process
        _BUILT.clear()
        _BUILT[name] = harness.build(name)
    mode, model = _BUILT[name]
    t = harness.run(harness.MODELS[name], model, mode, method, steps, harness.method_options(method, short=False))
    error = None if t.error is None else f"{type(t.error).__name__}: {str(t.error).splitlines()[0]}"
    kept = t.kept_bytes or [0]
    print(f"{name} {method}: {harness.gib(kept[-1])} GiB after {len(t.kept_bytes)} steps ({t.seconds:.0f} s)"
          f"{' ' + error if error else ''}", file=sys.stderr, flush=True)
    return name, method, (kept[-1], max(kept), t.kept_by_kind[-1] if t.kept_by_kind else {}, error)


def commit() -> str:
    try:
        out = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return out.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    except OSError:
        return "unknown"


def table(results: dict[str, dict[str, Any]], names: list[str], methods: list[str]) -> str:
    header = "| method | " + " | ".join(harness.MODELS[n].title for n in names) + " |"
    lines = [header, "|---|" + "---:|" * len(names)]
    by_model = results
    for method in methods:
        cells = []
        for name in names:
            last, peak, _, error = by_model[name][method]
            rows = harness.MODELS[name].batch * harness.MODELS[name].calls_per_step
            if error:
                cells.append(f"error: {error}")
                continue
            cell, most = harness.gib(last / rows), harness.gib(peak / rows)
            cells.append(cell if most == cell else f"{cell} ({most})")
        lines.append(f"| `{method}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=list(harness.MODELS), choices=list(harness.MODELS))
    parser.add_argument("--methods", nargs="+", default=list(harness.METHODS), choices=list(harness.METHODS))
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--jobs", type=int, default=1, help="trajectories measured in parallel processes")
    parser.add_argument("--out", help="write the markdown here (default: stdout)")
    args = parser.parse_args(argv)
    import diffusers
    import torch

    start, tree = time.time(), commit()  # the tree measured: read before the runs
    jobs = [(name, method, args.steps) for name in args.models for method in args.methods]
    if args.jobs > 1:
        with multiprocessing.get_context("spawn").Pool(args.jobs) as pool:
            measured = pool.map(measure, jobs, chunksize=1)
    else:
        measured = [measure(job) for job in jobs]
    results: dict[str, dict[str, Any]] = {name: {} for name in args.models}
    for name, method, row in measured:
        results[name][method] = row
    command = "OMP_NUM_THREADS=1 python3 scripts/kept_memory.py " + " ".join(sys.argv[1:] if argv is None else argv)
    text = "\n".join([
        table(results, args.models, args.methods), "",
        f"GiB per sample row after {args.steps} steps (kept bytes / (batch x calls per step)); in parentheses the peak "
        "where an earlier step kept more.",
        f"Command: `{command.strip()}` ({time.time() - start:.0f} s); torch {torch.__version__}, diffusers "
        f"{diffusers.__version__}, commit {tree}; {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs, fake CUDA tensors (FakeTensorMode).", ""])
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
