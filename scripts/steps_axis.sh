#!/usr/bin/env bash
# The step-count axis of docs/claims.md ("tomerge's own"): for each step count, the published methods at their
# defaults and `tomerge tune` at 1.5x, 2x and 3x (FLOP-ideal) on the bundled reference DiT. Every folder resumes.
#     OMP_NUM_THREADS=1 bash scripts/steps_axis.sh [STEPS ...]      # default steps: 4 8 20; OUT=runs
# MODEL=1024 runs the 1,024-token reference DiT under the lighter protocol of the 1,024-token claims (20 images,
# one timing repeat) with 20 trials per target, into folders named ..._1024; the 256-token model gets 60. TRIALS=N
# sets the trials per target (a rerun with more resumes each tune); LIGHT_TIMING=1 times each tune's runs once on 2
# images (a tune by FLOPs does not use the timing; docs/claims.md says which step counts ran so).
set -uo pipefail
STEPS=${*:-4 8 20}
OUT=${OUT:-runs}
SUFFIX=""; MODEL_SET=(); TUNE_SET=()
if [ "${MODEL:-}" = 1024 ]; then
    SUFFIX=_1024; TRIALS=${TRIALS:-20}
    MODEL_SET=(--set model.reference=bundled-1024 --set per_class=2 --set timing_batch=2 --set warmup=0
               --set repeats=1)
elif [ "${LIGHT_TIMING:-}" = 1 ]; then
    TUNE_SET=(--set timing_batch=2 --set warmup=0 --set repeats=1)
fi
TRIALS=${TRIALS:-60}
for steps in $STEPS; do
    echo "== published, $steps steps $(date)"
    tomerge ablate --config experiments/configs/steps/published.yaml --set model.call.num_steps=$steps \
        "${MODEL_SET[@]}" --set name=steps_published_s$steps$SUFFIX --set out_dir=$OUT --wandb disabled \
        || echo "FAILED published $steps"
    for target in 1.5 2 3; do
        echo "== tune, $steps steps, ${target}x $(date)"
        tomerge tune --config experiments/configs/tune.yaml --target $target --trials $TRIALS \
            --set model.call.num_steps=$steps "${MODEL_SET[@]}" "${TUNE_SET[@]}" \
            --set name=steps_tune_s${steps}_t$target$SUFFIX --out-dir $OUT --wandb disabled || echo "FAILED tune $steps $target"
    done
done
echo "== all done $(date)"
