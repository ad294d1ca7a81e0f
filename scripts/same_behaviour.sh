#!/usr/bin/env bash
# Whether this checkout writes the same run folders as commit BEFORE: the README main job (`tomerge ablate` on
# the bundled reference DiT) and a grid of tomesd, ssm and toma on a tiny saved SD3 pipeline, each run by both
# versions, compared by scripts/same_run_folders.py (every file byte for byte, except timings).
#
#     bash scripts/same_behaviour.sh BEFORE [OUT]        # OUT: default a new temporary folder
#
# Each side runs from its own virtual environment (sharing this Python's installed packages) with one thread,
# so that both compute the same floats. A side whose OUT/<side>/rc exists is not run again: rerun after a
# change reuses the BEFORE side. On the 2-core CPU machine each side takes about 10 minutes.
set -euo pipefail
BEFORE=$1
OUT=${2:-$(mktemp -d)}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
export OMP_NUM_THREADS=1 HF_HUB_OFFLINE=1 WANDB_MODE=offline

# The inputs both sides read, at the same paths (a run folder's config.yaml names them).
[ -d "$OUT/sd3" ] || (cd "$ROOT/tests" && "$PY" -c "from helpers import local_pipelines as p; p.save_tiny_pipeline('sd3', '$OUT/sd3')")
printf 'a red bicycle leaning on a wall\na bowl of green apples\na lighthouse at dusk\n' >"$OUT/prompts.txt"
cat >"$OUT/tiny_sd3.yaml" <<YAML
name: tiny_sd3
wandb: offline
model: {pipeline: $OUT/sd3, dtype: fp32, call: {height: 32, width: 32, num_inference_steps: 2, guidance_scale: 5.0, max_sequence_length: 16}}
prompts: $OUT/prompts.txt
seed: 5
batch_size: 2
timing_batch: 1
warmup: 0
repeats: 2
grid:
  - {strategy: tomesd, ratios: [0.5], options: {use_rand: false}}
  - {strategy: ssm, ratios: [0.5], options: {round_windows: 1}}
  - {strategy: toma, ratios: [0.5], options: {num_tiles: 4}}
YAML

run_side() {  # run_side SIDE SOURCE_FOLDER
    local side=$1 source=$2
    [ -f "$OUT/$side/rc" ] && return 0
    "$PY" -m venv --system-site-packages "$OUT/venv-$side"
    "$OUT/venv-$side/bin/pip" install -q -e "$source" --no-deps
    mkdir -p "$OUT/$side"
    (cd "$OUT/$side" && "$OUT/venv-$side/bin/tomerge" ablate --config "$OUT/tiny_sd3.yaml" --set out_dir="$OUT/$side/runs" \
        && "$OUT/venv-$side/bin/tomerge" ablate --set out_dir="$OUT/$side/runs") >"$OUT/$side.log" 2>&1
    echo done >"$OUT/$side/rc"
}

if [ ! -f "$OUT/before/rc" ]; then
    git -C "$ROOT" worktree add --detach "$OUT/before-source" "$BEFORE" >/dev/null
    run_side before "$OUT/before-source"
    git -C "$ROOT" worktree remove --force "$OUT/before-source"
fi
rm -f "$OUT/after/rc"
rm -rf "$OUT/after"
run_side after "$ROOT"
status=0
for grid in reference tiny_sd3; do
    echo "== $grid"
    "$PY" "$ROOT/scripts/same_run_folders.py" "$OUT/before/runs/$grid" "$OUT/after/runs/$grid" || status=1
done
exit $status
