#!/bin/bash
# The CPU measurements of the "Compiled (CPU)" section of docs/benchmarks.md, one after another (run it alone).
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1 WANDB_MODE=offline
O=${OUT_DIR:-runs/bench17}; mkdir -p "$O"
date
tomerge bench --kernels --tokens 1024 4096 --ratios 0.25 --strategies tomesd --threads 1 --out $O/kernels.csv > $O/kernels.log 2>&1
python - > $O/bmm.log 2>&1 <<'PY'
import torch, torch.utils.benchmark as tb
torch.set_num_threads(1)
for N in (1024, 4096):
    S, D, C, B = 3 * N // 4, N // 4, 1536, 2
    a, b = torch.randn(B, S, C), torch.randn(B, D, C)
    t = tb.Timer("a @ b.transpose(1, 2)", globals=dict(a=a, b=b), num_threads=1).blocked_autorange(min_run_time=1.0)
    print(f"N={N}: similarity bmm [B={B}, {S}x{C}] @ [{C}x{D}]: {t.median * 1e3:.1f} ms")
PY
date
tomerge bench --e2e --widths sd3 --tokens 4096 --depth 2 --batch 1 --ratios 0.5 --strategies tomesd ssm idm facility_location --repeats 3 --threads 2 --out $O/eager_sd3_4096.csv > $O/eager_sd3_4096.log 2>&1
date
tomerge bench --e2e --compile --widths sd3 --tokens 4096 --depth 2 --batch 1 --ratios 0.5 --strategies tomesd ssm idm facility_location --repeats 3 --threads 2 --out $O/compiled_sd3_4096.csv > $O/compiled_sd3_4096.log 2>&1
date
tomerge bench --e2e --compile --widths pixart dit sd3 --tokens 1024 --depth 2 --batch 1 --ratios 0.5 --strategies tomesd ssm facility_location --repeats 3 --threads 2 --out $O/compiled_1024.csv > $O/compiled_1024.log 2>&1
date
tomerge bench --e2e --compile --widths sd3 --tokens 1024 --depth 2 --batch 1 --ratios 0.5 --steps 4 --strategies sdtm toma --repeats 2 --threads 2 --out $O/compiled_loop.csv > $O/compiled_loop.log 2>&1
date
tomerge bench --e2e --widths sd3 --tokens 1024 --depth 2 --batch 1 --ratios 0.5 --steps 4 --strategies sdtm toma --repeats 2 --threads 2 --out $O/eager_loop.csv > $O/eager_loop.log 2>&1
date
echo ALLDONE
