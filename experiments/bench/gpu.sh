#!/usr/bin/env bash
# GPU speed benchmark of tomerge (docs/benchmarks.md, "GPU"): random-weight diffusers models at real widths, no
# network and no pretrained weights. Runs from any working directory of a fresh clone; writes one Markdown file,
# OUT_DIR/benchmarks_gpu.md (default: runs/bench_gpu/ at the repository root), with the machine, versions, commit,
# command, a headline table and every section's tables, and each section's CSV beside it.
#
#   bash experiments/bench/gpu.sh --quick         # the headline table, one H100: about 7 minutes (estimate below)
#   bash experiments/bench/gpu.sh                 # every section at full size: about an hour
#   bash experiments/bench/gpu.sh --cpu-smoke     # every section at tiny sizes on the CPU, under a minute (tests)
#   WHEELS=/path/to/wheels OUT_DIR=/tmp/b REPEATS=5 bash experiments/bench/gpu.sh --quick
#
# Sections (each a `tomerge bench` command, all in one process: experiments/commands/bench_report.py):
#   e2e       eager, bf16, SDPA flash, CUDA events, batch 2, ratio 0.5: the unmerged model against every method,
#             alternating, one forward and a K-step Euler loop (caching only saves across steps); measured and
#             FLOP-ideal speed-up, merging's own GFLOPs per image (planning + merge + unmerge, one FLOP counter),
#             peak memory (torch.cuda.max_memory_allocated) per row.
#   compiled  the same, each method on its own copy of the whole model compiled with torch.compile (inductor,
#             mode reduce-overhead: CUDA graphs) after merging is applied.
#   kernels   plan, and merge + unmerge, on bare [2, N, 1536] bf16 tensors against the tomesd package's
#             bipartite_soft_matching_random2d (the authors' function; ToMA and SDTM have no installable package);
#             hard plans with both backends: `index` (gathers and scatters, MergePlan's default on every device)
#             and `dense` (one-hot batched matmuls), so the GPU says which is faster.
#   unet      (full, smoke) an SD1.5-width UNet: tomerge's tomesd against the tomesd package's apply_patch.
#   video     (full, smoke) Wan 2.1 1.3B and 14B widths at 32760 tokens (81 frames of 480 x 832), batch 1.
#   toca      (full, smoke) token-wise caching (toca) at DiT and PixArt widths, 20-step loops.
#
# --quick (one H100; estimates, not yet measured on a GPU): SD3-Medium (1536, 24 heads of 64) and FLUX.1-dev
# (3072; 2 double + 2 single blocks) widths, depth 2, N = 4096 image tokens, METHODS below (the unmerged model,
# tomesd, ssm, toma, toma_release, sdtm_release, fora, taylorseer, first_block_cache and fora:merge=tomesd:
# FORA's caching with tomesd merging the blocks that run), 8-step loops, 3 rounds.
#   setup and imports ~0.5 min; e2e ~2 min (model builds ~0.5, FLOP counts ~0.5, ~900 timed forwards per width:
#   SD3 ~10 ms, Flux ~30 ms); compiled ~3.5 min (SD3 width only, 5 methods + baseline: an inductor compile of
#   ~30 s each, the loop's graphs mostly from inductor's cache, ~300 timed forwards); kernels ~0.5 min. Total ~7 min.
#   If it runs long, the compiled section is the one to trim (fewer methods in COMPILED).
# --cpu-smoke: every section at tiny widths (32-64 channels, 64-96 tokens, depth 1, 1 round), fp32 on the CPU,
#   SDPA's default kernel (no flash); the compiled section uses torch.compile's `eager` backend (dynamo traces,
#   guards and graph breaks as on the GPU; no inductor code generation and no CUDA graphs, which a CPU cannot
#   check in a minute). tests/experiments/test_bench.py runs it.
#
# Missing Python packages are installed only from local wheel files (no index, no network): WHEELS (default:
# ./wheels, then /opt/wheels) must hold them and their dependencies, e.g. made on a machine with network access
# by `pip download diffusers tomesd tqdm pyyaml -d wheels`. torch is expected to be installed already (a GPU
# machine's CUDA build); tomerge itself is installed from this checkout without dependencies.
set -euo pipefail
usage="usage: bash experiments/bench/gpu.sh [--quick | --cpu-smoke]"
mode=full
for arg in "$@"; do
    case "$arg" in
        --quick) mode=quick ;;
        --cpu-smoke) mode=smoke ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "gpu.sh: unknown argument $arg; $usage" >&2; exit 2 ;;
    esac
done
[ $# -le 1 ] || { echo "gpu.sh: give one of --quick and --cpu-smoke; $usage" >&2; exit 2; }
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd -P)
PY=${PYTHON:-python3}
OUT=${OUT_DIR:-$ROOT/runs/bench_gpu}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)  # OUT_DIR relative to the caller's directory
REPEATS=${REPEATS:-}
cd "$ROOT"
export PIP_DISABLE_PIP_VERSION_CHECK=1 HF_HUB_OFFLINE=1 WANDB_MODE=disabled

if [ "$mode" != smoke ] && ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu.sh: no CUDA GPU visible to torch; run it on a GPU machine (on a CPU: --cpu-smoke)" >&2
    exit 1
fi

# --- packages: only from local wheels, only when missing ------------------------------------------
wheel_dirs=()
for d in "${WHEELS:-}" wheels /opt/wheels; do
    [ -n "$d" ] && [ -d "$d" ] && wheel_dirs+=(--find-links "$d")
done
missing=()
for spec in diffusers:diffusers tomesd:tomesd tqdm:tqdm yaml:pyyaml; do
    "$PY" -c "import ${spec%%:*}" >/dev/null 2>&1 || missing+=("${spec#*:}")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ ${#wheel_dirs[@]} -eq 0 ]; then
        echo "gpu.sh: missing ${missing[*]}; put their wheels (and dependencies) in ./wheels or set WHEELS=DIR" >&2
        exit 1
    fi
    "$PY" -m pip install -q --no-index "${wheel_dirs[@]}" "${missing[@]}"
fi
# tomerge itself, from this checkout (its strategies register through entry points: installed, not on PYTHONPATH).
if ! (cd / && "$PY" -c 'import pathlib, sys, tomerge
sys.exit(0 if "tomesd" in tomerge.list_strategies() and pathlib.Path(tomerge.__file__).resolve().parent == pathlib.Path(sys.argv[1]) / "tomerge" else 1)' "$ROOT") >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . \
        || { echo "gpu.sh: could not install tomerge from $ROOT (needs setuptools>=68 and wheel)" >&2; exit 1; }
fi

# --- the sections: NAME|TITLE|tomerge bench arguments ----------------------------------------------
METHODS="tomesd ssm toma toma_release sdtm_release fora taylorseer first_block_cache fora:merge=tomesd"
COMPILED="tomesd ssm toma fora fora:merge=tomesd"
ALL="tomesd ssm idm facility_location sdtm sdtm_release sdtm_paper toma toma_release block_cache fora taylorseer"
ALL="$ALL first_block_cache cached_detail fora:merge=tomesd"
GPU="--device cuda --dtype bf16"
notes=("random weights: what each method's work costs at these sizes; an adaptive cache (first_block_cache) decides on random features, so how often it skips says nothing about trained weights")
case "$mode" in
quick)
    R=${REPEATS:-3}
    sections=(
        "e2e|End-to-end, eager|--e2e $GPU --sdpa flash --widths sd3 flux --tokens 4096 --ratios 0.5 --depth 2 --batch 2 --steps 8 --repeats $R --strategies $METHODS"
        "compiled|End-to-end, compiled (whole model, inductor, mode reduce-overhead: CUDA graphs)|--e2e $GPU --sdpa flash --compile reduce-overhead --widths sd3 --tokens 4096 --ratios 0.5 --depth 2 --batch 2 --steps 8 --repeats $R --strategies $COMPILED"
        "kernels|Kernels: plan, merge and unmerge against the tomesd package|--kernels $GPU --tokens 4096 --ratios 0.5 --channels 1536 --batch 2 --min-run-time 0.2 --strategies tomesd ssm idm facility_location"
    ) ;;
full)
    R=${REPEATS:-10}
    sections=(
        "e2e|End-to-end, eager|--e2e $GPU --sdpa flash --widths sd3 pixart flux --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --steps 20 --repeats $R --strategies $ALL"
        "compiled|End-to-end, compiled (whole model, inductor, mode reduce-overhead: CUDA graphs)|--e2e $GPU --sdpa flash --compile reduce-overhead --widths sd3 pixart dit --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --steps 10 --repeats $R --strategies tomesd ssm idm facility_location sdtm toma fora fora:merge=tomesd"
        "kernels|Kernels: plan, merge and unmerge against the tomesd package|--kernels $GPU --tokens 1024 4096 --ratios 0.25 0.5 --channels 1536 --batch 2"
        "unet|SD1.5-width UNet: tomerge's tomesd against the tomesd package|--e2e $GPU --sdpa flash --widths unet --tokens 1024 4096 --ratios 0.5 --depth 2 --batch 2 --repeats $R"
        "video|Video: Wan 2.1 1.3B and 14B widths at 32760 tokens (21 x 30 x 52)|--e2e $GPU --sdpa flash --widths wan wan14b --tokens 32760 --ratios 0.5 --depth 2 --batch 1 --repeats $R --strategies tomesd ssm idm facility_location sdtm toma"
        "toca|Token-wise caching (toca) at DiT and PixArt widths, 20-step loops|--e2e $GPU --sdpa flash --widths dit pixart --tokens 4096 --ratios 0.5 --depth 2 --batch 2 --steps 20 --repeats $R --strategies toca cached_detail fora tomesd"
    ) ;;
smoke)
    R=${REPEATS:-1}
    CPU="--device cpu --dtype fp32 --quick --depth 1 --repeats $R"
    notes+=("--cpu-smoke: tiny widths on the CPU, fp32, SDPA's default kernel; the compiled section runs torch.compile's eager backend (no inductor, no CUDA graphs): timings mean nothing, the run checks that every section works")
    sections=(
        "e2e|End-to-end, eager|--e2e $CPU --widths sd3 flux --tokens 64 --steps 3 --strategies $METHODS"
        "compiled|End-to-end, compiled (whole model, torch.compile backend eager)|--e2e $CPU --compile default --compile-backend eager --widths sd3 --tokens 64 --steps 3 --strategies $COMPILED"
        "kernels|Kernels: plan, merge and unmerge against the tomesd package|--kernels --device cpu --dtype fp32 --tokens 64 --ratios 0.5 --channels 32 --batch 2 --min-run-time 0.01 --strategies tomesd ssm idm facility_location"
        "unet|SD1.5-width UNet: tomerge's tomesd against the tomesd package|--e2e $CPU --widths unet --tokens 64"
        "video|Video: Wan widths|--e2e $CPU --widths wan --tokens 96 --frames 2 --strategies tomesd ssm idm facility_location sdtm toma"
        "toca|Token-wise caching (toca) at DiT width|--e2e $CPU --widths dit --tokens 64 --steps 3 --strategies toca cached_detail fora tomesd"
    ) ;;
esac

args=()
for s in "${sections[@]}"; do args+=(--section "$s"); done
for n in ${notes[@]+"${notes[@]}"}; do args+=(--note "$n"); done
exec "$PY" -m tomerge.experiments.commands.bench_report "$OUT" --command "bash experiments/bench/gpu.sh $*" "${args[@]}"
