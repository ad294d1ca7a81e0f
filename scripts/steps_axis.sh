#!/usr/bin/env bash
# The step-count axis of docs/claims.md ("tomerge's own"): for each step count, the published methods at their
# defaults and `tomerge tune` at 1.5x, 2x and 3x (FLOP-ideal) on the bundled reference DiT. Every folder resumes.
#     OMP_NUM_THREADS=1 bash scripts/steps_axis.sh [STEPS ...]      # default steps: 4 8 20; OUT=runs
set -uo pipefail
STEPS=${*:-4 8 20}
OUT=${OUT:-runs}
for steps in $STEPS; do
    echo "== published, $steps steps $(date)"
    tomerge ablate --config experiments/configs/steps/published.yaml --set model.call.num_steps=$steps \
        --set name=steps_published_s$steps --set out_dir=$OUT --wandb disabled \
        || echo "FAILED published $steps"
    for target in 1.5 2 3; do
        echo "== tune, $steps steps, ${target}x $(date)"
        tomerge tune --config experiments/configs/tune.yaml --target $target --trials 30 \
            --set model.call.num_steps=$steps --set name=steps_tune_s${steps}_t$target --out-dir $OUT \
            --wandb disabled || echo "FAILED tune $steps $target"
    done
done
echo "== all done $(date)"
