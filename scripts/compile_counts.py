"""The compile-count table of docs/compile.md: compiled frames after the first and the last step of a 12-step
loop, whole model and regional (every block compiled on its own), and dynamo's graph-break counter, for every
built-in strategy and schedule on the tiny native DiT of tests/helpers/compiled.py (4 blocks, ``aot_eager``).

    python scripts/compile_counts.py
"""

from __future__ import annotations

import pathlib
import sys

import torch
import torch._dynamo.testing
import torch._dynamo.utils

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from helpers import compiled as tc  # noqa: E402  (tests/helpers/compiled.py)

print("| strategy / schedule | whole model, step 1 | whole model, step 12 | regional, step 1 | regional, step 12 "
      "| graph breaks | tokens removed |")
print("|---|---:|---:|---:|---:|---:|---:|")
for name in tc.STRATEGIES + tc.SCHEDULES:
    model = tc.build("native_dit", depth=4)
    runs = {}
    for regional in (False, True):
        torch._dynamo.utils.counters.clear()
        counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
        _, frames, removed = tc.trajectory(model, "native_dit", name, counter, regional)
        runs[regional] = (frames[0], frames[-1], sum(torch._dynamo.utils.counters["graph_break"].values()), removed)
    whole, regional = runs[False], runs[True]
    print(f"| `{name}` | {whole[0]} | {whole[1]} | {regional[0]} | {regional[1]} | {whole[2]} | {whole[3]} |", flush=True)
