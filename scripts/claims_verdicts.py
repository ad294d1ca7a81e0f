"""The paired comparisons behind docs/claims.md's verdicts: for each claims run folder, the pairs of runs a verdict
compares, each metric's difference with its 95% interval (``tomerge compare``), written as
``docs/runs/<folder>/verdicts.md``.

    python3 scripts/claims_verdicts.py runs [--suffix _1024] [--out docs/runs]

A verdict says "holds" / "not reproduced" only where the interval of the difference it rests on excludes 0.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tomerge.experiments.runs.comparison import compare_runs, comparison_table

ORDER = "round_windows=1"
SDTM, REVERSED = "sdtm-flops{b}-" + ORDER, "sdtm-flops{b}-order=detail_first-" + ORDER
SSM_ALONE, IDM_ALONE = SDTM + "-switch=1.0", REVERSED + "-switch=1.0"
CD = "cached_detail-flops{b}-merge=tomesd-merge_options={{'use_rand':False,'merge_mlp':True}}-refresh_every={r}"
CURVE = "sdtm-r0.3-curve={c}"
MATCHED = "sdtm-flops1.6x-curve={c}-round_windows=1"
FL = "facility_location-r0.5-{o}"

# folder -> [(what the pair tests, run a, run b[, the folder of run b: same items and seeds])]
PAIRS: dict[str, list[tuple[str, ...]]] = {
    "claims_headline_presets": [
        ("sdtm_release against tomesd at 1.34x / 1.34x", "sdtm_release-r0.5-switch_step=8",
         "tomesd-r0.5-use_rand=False", "claims_headline"),
        ("sdtm_release against tomesd at 1.20x / 1.22x", "sdtm_release-r0.35-switch_step=8",
         "tomesd-r0.35-use_rand=False", "claims_headline"),
        ("sdtm_paper (1.26x) against tomesd (1.34x)", "sdtm_paper-r0.2", "tomesd-r0.5-use_rand=False",
         "claims_headline"),
        ("sdtm_paper (1.45x) against ssm (1.71x)", "sdtm_paper-r0.35", "ssm-r0.5", "claims_headline"),
        ("toma_release against tomesd at 1.08x / 1.11x", "toma_release-r0.2-num_tiles=16-skip_first=1",
         "tomesd-r0.2-use_rand=False", "claims_headline"),
        ("toma_release against tomesd at 1.18x / 1.22x", "toma_release-r0.5-num_tiles=16-skip_first=1",
         "tomesd-r0.35-use_rand=False", "claims_headline"),
        ("toma_release (1.18x) against sdtm_release (1.20x)", "toma_release-r0.5-num_tiles=16-skip_first=1",
         "sdtm_release-r0.35-switch_step=8"),
    ],
    "claims_sdtm_order": [
        *[(f"SDTM's order against the reversed order at {b}", SDTM.format(b=b), REVERSED.format(b=b))
          for b in ("1.3x", "1.5x")],
        *[(f"SDTM against SSM alone at {b}", SDTM.format(b=b), SSM_ALONE.format(b=b)) for b in ("1.3x", "1.5x")],
        *[(f"SDTM against IDM alone at {b}", SDTM.format(b=b), IDM_ALONE.format(b=b)) for b in ("1.3x", "1.5x")],
    ],
    "claims_headline": [
        ("ssm against tomesd at 1.27x / 1.22x", "ssm-r0.2", "tomesd-r0.35-use_rand=False"),
        ("sdtm against tomesd at 1.45x / 1.47x", "sdtm-r0.5", "tomesd-r0.65-use_rand=False"),
        ("toma against facility_location at 2.14x / 2.12x", "toma-r0.5-num_tiles=16",
         "facility_location-r0.5-num_tiles=16"),
        ("ssm against facility_location at 1.71x / 1.66x", "ssm-r0.5", "facility_location-r0.35-num_tiles=16"),
    ],
    "claims_sdtm_curve": [
        ("cosine 0.2 against linear 0.4 (both 1.31x)", CURVE.format(c="cosine-deviation=0.2"),
         CURVE.format(c="linear-deviation=0.4")),
        ("linear 0.3 (1.29x) against the constant ratio (1.20x)", CURVE.format(c="linear-deviation=0.3"),
         CURVE.format(c="constant")),
        ("cosine 0.2 (1.31x) against the constant ratio (1.20x)", CURVE.format(c="cosine-deviation=0.2"),
         CURVE.format(c="constant")),
    ],
    "claims_sdtm_curve_matched": [
        *[(f"{c.replace('-deviation=', ' ')} against the constant ratio at 1.6x", MATCHED.format(c=c),
           MATCHED.format(c="constant"))
          for c in ("cosine-deviation=0.2", "cosine-deviation=0.3", "cosine-deviation=0.4", "linear-deviation=0.2",
                    "linear-deviation=0.3", "linear-deviation=0.4")],
        *[(f"cosine 0.2 against {c.replace('-deviation=', ' ')} at 1.6x", MATCHED.format(c="cosine-deviation=0.2"),
           MATCHED.format(c=c)) for c in ("linear-deviation=0.2", "linear-deviation=0.3", "linear-deviation=0.4")],
    ],
    "claims_toma_locality": [
        ("16 tiles against 16 stripes", FL.format(o="num_tiles=16"), FL.format(o="locality=stripes-num_tiles=16")),
        ("16 tiles against one global selection", FL.format(o="num_tiles=16"), FL.format(o="num_tiles=1")),
        ("64 tiles against 16 tiles", FL.format(o="num_tiles=64"), FL.format(o="num_tiles=16")),
        ("64 tiles against 4 tiles", FL.format(o="num_tiles=64"), FL.format(o="num_tiles=4")),
        ("transpose against pseudo-inverse unmerge", FL.format(o="num_tiles=16"),
         FL.format(o="num_tiles=16-unmerge_matrix=pinv")),
    ],
    "claims_own": [
        ("cached_detail against first_block_cache at 1.5x", CD.format(b="1.5x", r=3),
         "first_block_cache-r0-threshold=0.08"),
        ("cached_detail against sdtm_release at 1.5x", CD.format(b="1.5x", r=3), "sdtm_release-flops1.5x"),
        ("cached_detail against tomesd at 1.5x", CD.format(b="1.5x", r=3),
         "tomesd-flops1.5x-merge_mlp=True-use_rand=False"),
        ("cached_detail against block_cache interval 2 at 2x", CD.format(b="2x", r=3), "block_cache-r0-interval=2"),
        ("cached_detail at 2x against sdtm_release ratio 0.3 (the sub-target)", CD.format(b="2x", r=3),
         "sdtm_release-r0.3"),
        ("cached_detail against block_cache interval 3, order 1 at 3x", CD.format(b="3x", r=10),
         "block_cache-r0-forecast_order=1-interval=3"),
        ("toca (DDIM-50 recipe) against fora", "toca-r0", "fora-r0"),
    ],
    "claims_mlp_noise": [
        ("ssm on attention only against the MLP only (1.27x / 1.25x)", "ssm-r0.5-merge_mlp=False",
         "ssm-r0.5-merge_attn=False"),
        ("the MLP merged in the first half against every step", "ssm-r0.5-merge_attn=False-merge_until=0.49",
         "ssm-r0.5-merge_attn=False"),
        ("the MLP merged in the first half against the second half", "ssm-r0.5-merge_attn=False-merge_until=0.49",
         "ssm-r0.5-merge_attn=False-merge_from=0.5"),
        ("tomesd on attention against attention and MLP", "tomesd-r0.5-use_rand=False",
         "tomesd-r0.5-merge_mlp=True-use_rand=False"),
    ],
}


# The 1,024-token runs that differ from the 256-token ones: the order ablation at 1.25x (IDM alone reaches at most
# 1.26x there) and no global tile (docs/claims.md, "The same claims at 1,024 tokens").
PAIRS_1024 = {
    **PAIRS,
    "claims_sdtm_order": [
        ("SDTM's order against the reversed order at 1.25x", SDTM.format(b="1.25x"), REVERSED.format(b="1.25x")),
        ("SDTM against SSM alone at 1.25x", SDTM.format(b="1.25x"), SSM_ALONE.format(b="1.25x")),
        ("SDTM against IDM alone at 1.25x", SDTM.format(b="1.25x"), IDM_ALONE.format(b="1.25x")),
    ],
    "claims_toma_locality": [pair for pair in PAIRS["claims_toma_locality"] if "global" not in pair[0]],
    "claims_mlp_noise": [(what.replace("(1.27x / 1.25x)", "(1.72x / 1.20x)"), *rest)
                         for what, *rest in PAIRS["claims_mlp_noise"]],
    "claims_sdtm_curve": [
        ("cosine 0.2 (1.36x) against linear 0.4 (1.38x)", CURVE.format(c="cosine-deviation=0.2"),
         CURVE.format(c="linear-deviation=0.4")),
        ("linear 0.3 (1.34x) against the constant ratio (1.24x)", CURVE.format(c="linear-deviation=0.3"),
         CURVE.format(c="constant")),
        ("cosine 0.2 (1.36x) against the constant ratio (1.24x)", CURVE.format(c="cosine-deviation=0.2"),
         CURVE.format(c="constant")),
    ],
    # the same ratios save other FLOPs at 1,024 tokens: the pairs nearest in FLOP-ideal speed-up there
    "claims_headline_presets": [
        ("sdtm_release (1.44x) against tomesd (1.41x)", "sdtm_release-r0.65-switch_step=8",
         "tomesd-r0.35-use_rand=False", "claims_headline"),
        ("sdtm_release (1.25x) against tomesd (1.19x)", "sdtm_release-r0.35-switch_step=8",
         "tomesd-r0.2-use_rand=False", "claims_headline"),
        ("sdtm_paper (1.44x) against tomesd (1.41x)", "sdtm_paper-r0.35", "tomesd-r0.35-use_rand=False",
         "claims_headline"),
        ("toma_release (1.27x) against tomesd (1.19x)", "toma_release-r0.65-num_tiles=16-skip_first=1",
         "tomesd-r0.2-use_rand=False", "claims_headline"),
        ("toma_release (1.21x) against sdtm_release (1.25x)", "toma_release-r0.5-num_tiles=16-skip_first=1",
         "sdtm_release-r0.35-switch_step=8"),
    ],
    "claims_headline": [
        ("ssm (1.35x) against tomesd (1.41x)", "ssm-r0.2", "tomesd-r0.35-use_rand=False"),
        ("sdtm (1.46x) against tomesd (1.41x)", "sdtm-r0.5", "tomesd-r0.35-use_rand=False"),
        ("toma (2.41x) against facility_location (2.34x)", "toma-r0.5-num_tiles=16",
         "facility_location-r0.5-num_tiles=16"),
        ("ssm (1.76x) against facility_location (1.71x)", "ssm-r0.35", "facility_location-r0.35-num_tiles=16"),
    ],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, help="the folder holding the claims run folders (runs/)")
    parser.add_argument("--suffix", default="", help="the run folders' name suffix (_1024 for the 1,024-token runs)")
    parser.add_argument("--out", type=Path, default=Path("docs/runs"), help="where verdicts.md files go")
    args = parser.parse_args()
    for name, pairs in (PAIRS_1024 if args.suffix == "_1024" else PAIRS).items():
        folder = args.runs / f"{name}{args.suffix}"
        if not (folder / "results.jsonl").exists():
            print(f"{folder}: no results.jsonl, skipped")
            continue
        lines = [f"# Paired comparisons of {folder.name}", "",
                 f"`python3 scripts/claims_verdicts.py {args.runs} --suffix '{args.suffix}'` (`tomerge compare` on each "
                 "pair): each metric's difference over the same images and seeds, with its 95% interval (bootstrap; FD: jackknife).",
""]
        for what, a, b, *other in pairs:
            folder_b = args.runs / f"{other[0]}{args.suffix}" if other else None
            try:
                done, skipped, n = compare_runs(folder, a, b, folder_b=folder_b)
            except Exception as err:  # a run missing from a partial folder
                lines += [f"## {what}", "", f"not compared: {err}", ""]
                continue
            where = f" (of `{other[0]}{args.suffix}`)" if other else ""
            lines += [f"## {what}", "", f"`{a}` against `{b}`{where}", "", comparison_table(done, "a", "b", n), ""]
            lines += [f"not compared: {s}" for s in skipped]
        out = args.out / folder.name / "verdicts.md"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text("\n".join(lines).rstrip() + "\n")
        print(out)


if __name__ == "__main__":
    main()
