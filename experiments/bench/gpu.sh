#!/usr/bin/env bash
# GPU speed benchmark of tomerge (docs/benchmarks.md, "GPU"): needs a CUDA GPU, no network and no
# pretrained weights (every model has random weights).
#
#   bash experiments/bench/gpu.sh                        # writes runs/bench_gpu/benchmarks_gpu.md
#   WHEELS=/path/to/wheels OUT_DIR=/tmp/b bash experiments/bench/gpu.sh
#   QUICK=1 bash experiments/bench/gpu.sh               # tiny models: checks that everything runs
#
# 1. End-to-end: SD3-Medium (1536/24), PixArt (1152/16) and Flux (3072/24) widths, depth 2, and an
#    SD1.5-width UNet (tomerge's tomesd against the tomesd package), N = 1024 and 4096 image tokens,
#    batch 2, ratio 0.5, bf16, SDPA restricted to the flash kernel, CUDA-event timings, baseline and
#    every strategy/schedule alternating; measured vs FLOP-ideal speed-up. Merge plans run as dense
#    batched matmuls (the default on CUDA).
#    Video: Wan 2.1 T2V 1.3B (1536/12, FFN 8960) and 14B (5120/40, FFN 13824) widths, depth 2, batch 1, at
#    N = 32760 tokens (81 frames of 480 x 832: token grid 21 x 30 x 52), 512 UMT5 tokens, ratio 0.5, every
#    method without idm (the wan adapter has no received-attention probe).
#    Caching: 20-step sampling loops at SD3 and Flux widths, N = 4096, of cached_detail (tomesd at 0.5 and
#    0.75 inside), fora, taylorseer, block_cache, sdtm_release, toma and tomesd (random weights: what the
#    work costs, not which steps an adaptive criterion would skip on trained weights); token-wise caching
#    (toca) beside cached_detail, fora and tomesd at DiT and PixArt widths (their attention returns the image
#    tokens alone, which toca's reused attention needs).
# 2. Kernels: plan + merge + unmerge of every strategy against tomesd's bipartite_soft_matching_random2d,
#    N = 1024, ratio 0.25 (and 0.5), C = 1536, batch 2, bf16, CUDA events.
#
# Missing Python packages are installed only from local wheel files (no index, no network):
# WHEELS (default: ./wheels, then /opt/wheels) must hold them and their dependencies, e.g. made on a
# machine with network access by `pip download diffusers tomesd tqdm -d wheels` (torch is expected to
# be installed already; a GPU box often has torch, timm and Lightning but not diffusers).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-runs/bench_gpu}
REPEATS=${REPEATS:-10}
mkdir -p "$OUT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled

if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "bench_gpu.sh: no CUDA GPU visible to torch; run it on a GPU machine (CPU: tomerge bench --e2e)" >&2
    exit 1
fi

# --- packages: only from local wheels, only when missing ------------------------------------------
wheel_dirs=()
for d in "${WHEELS:-}" wheels /opt/wheels; do
    [ -n "$d" ] && [ -d "$d" ] && wheel_dirs+=(--find-links "$d")
done
install_local() {  # install_local PACKAGE... : from the wheel folders, never from an index
    if [ ${#wheel_dirs[@]} -eq 0 ]; then
        echo "bench_gpu.sh: missing $*; put their wheels (and dependencies) in ./wheels or set WHEELS=DIR" >&2
        exit 1
    fi
    "$PY" -m pip install -q --no-index "${wheel_dirs[@]}" "$@"
}
missing=()
for spec in diffusers:diffusers tomesd:tomesd tqdm:tqdm; do
    "$PY" -c "import ${spec%%:*}" >/dev/null 2>&1 || missing+=("${spec#*:}")
done
[ ${#missing[@]} -eq 0 ] || install_local "${missing[@]}"
# tomerge itself (its strategies register through entry points, so it must be installed, not on PYTHONPATH).
if ! "$PY" -c "import tomerge, sys; sys.exit(0 if 'tomesd' in tomerge.list_strategies() else 1)" >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || { echo "bench_gpu.sh: could not install tomerge from this checkout (needs setuptools>=68, wheel)" >&2; exit 1; }
fi

# --- the two benchmarks ----------------------------------------------------------------------------
if [ -n "${QUICK:-}" ]; then
    e2e=(--quick --widths sd3 pixart flux unet --repeats 2)
    video=(--quick --widths wan wan14b --tokens 96 --frames 2 --repeats 2)
    compiled=(--quick --widths sd3 pixart dit --repeats 2 --strategies tomesd ssm facility_location)
    compiled_loop=(--quick --widths sd3 --steps 4 --repeats 2 --strategies sdtm toma)
    kernels=(--tokens 256 --ratios 0.25 --channels 64)
    caching_loop=(--quick --widths sd3 --steps 4 --repeats 2 --strategies cached_detail fora tomesd)
    toca_loop=(--quick --widths dit --steps 4 --repeats 2 --strategies toca cached_detail fora)
else
    e2e=(--widths sd3 pixart flux unet --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --repeats "$REPEATS")
    video=(--widths wan wan14b --tokens 32760 --ratios 0.5 --depth 2 --batch 1 --repeats "$REPEATS")
    compiled=(--widths sd3 pixart dit --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --repeats "$REPEATS"
              --strategies tomesd ssm idm facility_location)
    compiled_loop=(--widths sd3 --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --steps 10 --repeats "$REPEATS"
                   --strategies sdtm toma)
    kernels=(--tokens 1024 --ratios 0.25 0.5 --channels 1536 --batch 2)
    caching_loop=(--widths sd3 flux --tokens 4096 --ratios 0.5 0.75 --depth 2 --batch 2 --steps 20 --repeats "$REPEATS"
                  --strategies cached_detail fora taylorseer block_cache sdtm_release toma tomesd)
    # token-wise caching needs an attention that returns the image tokens alone: DiT and PixArt widths
    toca_loop=(--widths dit pixart --tokens 4096 --ratios 0.5 --depth 2 --batch 2 --steps 20 --repeats "$REPEATS"
               --strategies toca cached_detail fora tomesd)
fi
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash "${e2e[@]}" \
    --out "$OUT/e2e_bf16.csv"
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash "${video[@]}" \
    --out "$OUT/e2e_video_bf16.csv"
# compiled baseline vs compiled merged (inductor, CUDA graphs: mode reduce-overhead), forwards and sampling loops
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash --compile reduce-overhead \
    "${compiled[@]}" --out "$OUT/e2e_compiled_bf16.csv"
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash --compile reduce-overhead \
    "${compiled_loop[@]}" --out "$OUT/e2e_compiled_loop_bf16.csv"
# merging composed with caching (docs/claims.md, "tomerge's own"): 20-step sampling loops, eager; the caching
# schedules run unmerged at their defaults (rows at ratio 0), cached_detail merges with tomesd at the ratio
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash "${caching_loop[@]}" \
    --out "$OUT/e2e_caching_loop_bf16.csv"
"$PY" -m tomerge.experiments.commands.bench --e2e --device cuda --dtype bf16 --sdpa flash "${toca_loop[@]}" \
    --out "$OUT/e2e_toca_loop_bf16.csv"
"$PY" -m tomerge.experiments.commands.bench --kernels --device cuda --dtype bf16 "${kernels[@]}" \
    --out "$OUT/kernels_bf16.csv"

# --- one Markdown file with the machine, versions and commands -------------------------------------
"$PY" - "$OUT" <<'PYEOF'
import importlib.metadata as md, platform, subprocess, sys
from pathlib import Path

import torch

out = Path(sys.argv[1])
def version(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return "not installed"
try:
    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True, timeout=30).stdout.strip().splitlines()[0]
except Exception:  # noqa: BLE001 - the driver version is informative only
    driver = "unknown"
try:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
except Exception:  # noqa: BLE001
    commit = ""
lines = [
    "# tomerge GPU benchmark", "",
    f"- GPU: {torch.cuda.get_device_name()} (driver {driver}), CUDA {torch.version.cuda}, "
    f"cuDNN {torch.backends.cudnn.version()}",
    f"- host: {platform.processor() or platform.machine()}, python {platform.python_version()}",
    f"- torch {torch.__version__}, diffusers {version('diffusers')}, tomesd {version('tomesd')}, "
    f"tomerge {version('tomerge')} {commit}",
    "- bf16, SDPA flash backend, CUDA-event timings, median of alternating rounds; hard plans run as dense "
    "batched matmuls (`backend=\"auto\"` on CUDA)", "",
]
for name, title in (("e2e_bf16", "End-to-end: measured vs FLOP-ideal speed-up"),
                    ("e2e_video_bf16", "End-to-end, video (Wan) widths at 32760 tokens (21 x 30 x 52)"),
                    ("e2e_compiled_bf16", "End-to-end, compiled (inductor, mode reduce-overhead): forwards"),
                    ("e2e_compiled_loop_bf16", "End-to-end, compiled: 10-step sampling loops with sdtm and toma"),
                    ("e2e_caching_loop_bf16", "End-to-end: 20-step sampling loops, merging and caching"),
                    ("e2e_toca_loop_bf16", "End-to-end: 20-step sampling loops, token-wise caching (DiT, PixArt)"),
                    ("kernels_bf16", "Kernels: plan + merge + unmerge vs the tomesd package")):
    md_file = out / f"{name}.md"
    lines += [f"## {title}", "", md_file.read_text() if md_file.exists() else "(missing)", ""]
(out / "benchmarks_gpu.md").write_text("\n".join(lines))
print(f"wrote {out / 'benchmarks_gpu.md'}")
PYEOF
