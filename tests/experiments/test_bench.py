"""`tomerge bench` runs on tiny sizes and writes sane rows (speed itself is never asserted here)."""

from __future__ import annotations

import csv

import pytest
import torch
import torch.nn.functional as F

import tomerge

from tomerge.experiments.bench.e2e import TOMESD_PACKAGE
from tomerge.experiments.bench.models import build
from tomerge.experiments.commands import bench
from helpers import ROOT


def _rows(path) -> list[dict[str, str]]:
    with path.open() as f:
        return list(csv.DictReader(f))


def test_e2e_quick_transformer_rows(tmp_path):
    out = tmp_path / "e2e.csv"
    code = bench.main(["--e2e", "--quick", "--widths", "pixart", "--strategies", "tomesd", "ssm",
                       "--repeats", "1", "--out", str(out)])
    assert code == 0
    rows = _rows(out)
    assert [r["method"] for r in rows] == ["tomesd", "ssm"]
    for r in rows:
        assert r["model"] == "pixart" and int(r["tokens"]) == 256 and float(r["ratio"]) == 0.5
        assert float(r["base_ms"]) > 0 and float(r["merged_ms"]) > 0
        assert float(r["ideal"]) > 1.0, r  # ratio 0.5 removes FLOPs, plan cost included
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / float(r["ideal"]), rel=1e-3)
    assert "| pixart |" in out.with_suffix(".md").read_text()


def test_e2e_quick_unet_against_the_tomesd_package(tmp_path):
    out = tmp_path / "unet.csv"
    assert bench.main(["--e2e", "--quick", "--widths", "unet", "--repeats", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [r["method"] for r in rows] == [TOMESD_PACKAGE, "tomesd"]
    for r in rows:
        assert float(r["merged_ms"]) > 0 and float(r["ideal"]) > 1.0
    # Same ratio, same algorithm: the package and tomerge remove the same FLOPs.
    assert float(rows[0]["merged_gflop"]) == pytest.approx(float(rows[1]["merged_gflop"]), rel=1e-6)


def test_e2e_sampling_loop_and_schedules():
    from tomerge.experiments.bench.e2e import e2e_benchmark

    rows = e2e_benchmark(widths=["dit"], tokens=[256], ratios=[0.5], depth=1, methods=["toma", "fora"], steps=3,
                         repeats=1, quick=True, progress=False)
    assert [(r.mode, r.method, r.ratio) for r in rows] == [("forward", "toma", 0.5), ("forward", "fora", 0.0),
                                                           ("loop3", "toma", 0.5), ("loop3", "fora", 0.0)]
    assert all(r.merged_ms > 0 for r in rows) and all(r.ideal > 1.0 for r in rows if r.method == "toma")
    # a caching schedule runs unmerged at its defaults: one forward computes every block; the 3-step loop of
    # fora (interval 3, counted down as FORA's src/models.py does: 2, 1, 0) computes the first and the last step
    # and reuses every block on the middle one, at most 3/2 (the model outside its one block still runs)
    forward, loop = (r for r in rows if r.method == "fora")
    assert forward.ideal == 1.0 and 1.3 < loop.ideal <= 1.5


def test_e2e_composition_and_merging_flops_columns(tmp_path):
    """A method with options (``fora:merge=tomesd``: FORA's caching, tomesd merging the blocks that run) runs at the
    ratio and saves more than either alone over a loop; every row carries merging's own GFLOPs per image (planning,
    merging, unmerging: tomesd's similarity, none for caching alone) and, on CPU, no peak memory."""
    out = tmp_path / "e2e.csv"
    assert bench.main(["--e2e", "--quick", "--widths", "dit", "--tokens", "64", "--steps", "3", "--repeats", "1",
                       "--strategies", "tomesd", "fora", "fora:merge=tomesd", "--out", str(out)]) == 0
    loop = {r["method"]: r for r in _rows(out) if r["mode"] == "loop3"}
    assert {m: float(r["ratio"]) for m, r in loop.items()} == {"tomesd": 0.5, "fora": 0.0, "fora:merge=tomesd": 0.5}
    ideal = {m: float(r["ideal"]) for m, r in loop.items()}
    assert ideal["fora:merge=tomesd"] > max(ideal["fora"], ideal["tomesd"]) > 1
    gflops = {m: float(r["merge_gflops"]) for m, r in loop.items()}
    assert gflops["fora"] == 0 and 0 < gflops["fora:merge=tomesd"] < gflops["tomesd"]  # fora plans on step 0 only
    assert gflops["tomesd"] < float(loop["tomesd"]["merged_gflop"]) / 2  # a part of the merged FLOPs (batch 2)
    assert all(r["peak_memory_mb"] == r["peak_memory_base_mb"] == "" for r in _rows(out))
    assert "| merge GFLOP/image | base peak MiB | peak MiB |" in out.with_suffix(".md").read_text()


@pytest.mark.parametrize("method, message", [
    ("bogus", "unknown method 'bogus'"), ("fora:interval", "'interval': wanted KEY=VALUE"),
    ("fora:merge=nope", "fora:merge=nope: fora: merge='nope': unknown strategy 'nope'"),
    ("tomesd:use_rnd=1", "tomesd:use_rnd=1: unknown option(s) ['use_rnd']"),
])
def test_a_bad_method_is_a_one_line_error(method, message, capsys):
    from tomerge.experiments.cli import main

    with pytest.raises(SystemExit) as exited:  # argparse's usage error, as for any bad argument
        main(["bench", "--e2e", "--quick", "--strategies", method])
    assert exited.value.code == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("tomerge bench: error: argument --strategies: ") and message in err


def test_kernels_tiny(tmp_path):
    out = tmp_path / "kernels.csv"
    code = bench.main(["--kernels", "--tokens", "256", "--ratios", "0.5", "--channels", "16",
                       "--strategies", "tomesd", "facility_location", "--min-run-time", "0.01", "--out", str(out)])
    assert code == 0
    rows = _rows(out)
    assert {r["method"] for r in rows} == {"tomesd package", "tomesd", "facility_location"}
    for r in rows:
        assert float(r["plan_ms"]) > 0 and float(r["merge_unmerge_ms"]) > 0 and int(r["removed"]) > 0
    gflops = {(r["method"], r["backend"]): float(r["merge_gflops"]) for r in rows}
    # per image: the similarity matmuls of planning; the dense backend adds its one-hot matmuls (index: gathers)
    tomesd_plan = gflops[("tomesd", "index")]
    assert 0 < tomesd_plan < gflops[("tomesd", "dense")] and gflops[("tomesd package", "index")] > 0
    assert gflops[("tomesd", "dense")] == pytest.approx(tomesd_plan + 2 * 2 * 128 * 256 * 16 / 1e9)
    assert "command: `python -m tomerge.experiments.commands.bench --kernels --tokens 256 " in \
        out.with_suffix(".md").read_text()


def test_the_command_line_is_the_commands_module():
    """``python -m tomerge.experiments.commands.bench`` is ``tomerge bench``."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "tomerge.experiments.commands.bench"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "tomerge bench: error: choose one mode, --e2e, --kernels or --config FILE\n"


def test_a_mode_is_required(capsys):
    from tomerge.experiments.cli import main
    from tomerge.experiments.errors import UsageError

    with pytest.raises(UsageError, match="choose one mode, --e2e, --kernels or --config FILE"):
        bench.main([])
    assert main(["bench"]) == 2
    assert capsys.readouterr().err == "tomerge bench: error: choose one mode, --e2e, --kernels or --config FILE\n"
    assert main(["bench", "--kernels", "--strategies", "tomesd package"]) == 2
    assert capsys.readouterr().err == ("tomerge bench: error: the tomesd package is always in --kernels; "
                                       "name tomerge strategies\n")


@pytest.mark.parametrize("width", ["sd3", "flux"])
def test_models_see_exactly_n_image_tokens(width):
    """The builders size the latent so that every block sees the requested token count."""
    b = build(width, tokens=64, depth=1, batch=2, quick=True)
    block = b.model.transformer_blocks[0]
    seen = []
    handle = block.register_forward_pre_hook(lambda m, a, k: seen.append(k["hidden_states"].shape[1]),
                                             with_kwargs=True)
    with torch.no_grad():
        b.call()
    handle.remove()
    assert seen == [64]


def test_cpu_clock_counts_work_not_waiting():
    """``--clock cpu`` times process CPU time: a sleep costs wall-clock time but (almost) no CPU time."""
    import time

    from tomerge.experiments.measure.timing import clock_function, time_once

    wall = time_once(lambda: time.sleep(0.05), threads=1, clock="wall")
    cpu = time_once(lambda: time.sleep(0.05), threads=1, clock="cpu")
    assert wall >= 0.05 and cpu < 0.02
    with pytest.raises(ValueError, match="clock"):
        clock_function("gpu")


_MALLINFO_SCRIPT = """
import ctypes, sys, torch
from tomerge.experiments.bench.allocator import keep_freed_memory

class MallInfo2(ctypes.Structure):  # glibc >= 2.33, malloc.h
    _fields_ = [(name, ctypes.c_size_t) for name in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]

libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":
    assert keep_freed_memory()
a = torch.ones(16 << 20)  # 64 MiB, above glibc's largest default mmap threshold (32 MiB)
for _ in range(3):
    b = a + 1; del b
info = libc.mallinfo2()
print(info.hblkhd, info.fordblks)  # bytes in live mmap'd blocks, free bytes kept in the heap
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_keep_freed_memory_keeps_large_freed_blocks_in_the_heap():
    """By default a freed 64 MiB result is unmapped (the next one is faulted in page by page); kept, it
    stays in the heap for reuse. Read from malloc's own accounting rather than by counting page faults:
    this VM's kernel runs DAMON proactive reclaim, which pages out part of an idle kept block from run to
    run (0-40% measured), so fault counts say more about the kernel than about the allocator setting."""
    import subprocess
    import sys

    def mallinfo(mode: str) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", _MALLINFO_SCRIPT, mode], capture_output=True, text=True, check=True)
        mapped, free = out.stdout.strip().splitlines()[-1].split()
        return int(mapped), int(free)

    block = 64 << 20
    mapped, free = mallinfo("default")
    assert mapped >= block and free < block  # `a` lives in its own mmap; the freed results were unmapped
    mapped, free = mallinfo("keep")
    assert mapped < block and free >= block  # `a` is in the heap, and the freed result's block is kept there


def test_keep_freed_memory_rejects_limits_mallopt_cannot_take():
    from tomerge.experiments.bench.allocator import keep_freed_memory

    with pytest.raises(ValueError, match="limit_bytes"):
        keep_freed_memory(1 << 31)


# ---------------------------------------------------------------------- video widths
def test_video_grid_factors_a_token_count_into_frames_and_a_480p_like_frame():
    from tomerge.experiments.bench.models import video_grid

    assert video_grid(32760) == (21, 30, 52)  # 81 frames of 480 x 832 through Wan's VAE and patch (1, 2, 2)
    assert video_grid(4096) == (16, 16, 16) and video_grid(16384) == (16, 32, 32)
    assert video_grid(4096, frames=4) == (4, 32, 32) and video_grid(7) == (7, 1, 1)
    with pytest.raises(ValueError, match="does not divide"):
        video_grid(100, frames=3)


@pytest.mark.parametrize("width", ["wan", "wan14b"])
def test_video_widths_see_their_token_grid(width):
    """The Wan builders make a latent [B, 16, T, 2H, 2W] whose blocks see T * H * W tokens, and the wan adapter
    reads the grid (T, H, W) from it; the benchmark's methods merge on it."""
    import tomerge

    b = build(width, tokens=96, depth=1, batch=1, quick=True, frames=2)
    assert b.inputs["hidden_states"].shape == (1, 16, 2, 12, 16)  # (T, H, W) = (2, 6, 8)
    seen = []
    handle = b.model.blocks[0].register_forward_pre_hook(lambda m, a, k: seen.append(a[0].shape[1]),
                                                         with_kwargs=True)
    with torch.no_grad():
        base = b.call()
        with tomerge.merging(b.model, "tomesd", ratio=0.5) as merging:
            merged = b.call()
            assert merging.adapter.grid_size == (2, 6, 8)
            assert merging.stats["tokens_removed"] > 0
    handle.remove()
    assert seen == [96, 96] and merged.shape == base.shape == b.inputs["hidden_states"].shape


def test_e2e_quick_video_rows_and_refusals(tmp_path, capsys):
    out = tmp_path / "wan.csv"
    assert bench.main(["--e2e", "--quick", "--widths", "wan", "--tokens", "96", "--frames", "2", "--strategies",
                       "tomesd", "ssm", "--repeats", "1", "--out", str(out)]) == 0
    rows = _rows(out)
    assert [(r["model"], r["method"], int(r["tokens"])) for r in rows] == [("wan", "tomesd", 96), ("wan", "ssm", 96)]
    assert all(float(r["ideal"]) > 1.0 and float(r["merged_ms"]) > 0 for r in rows)
    from tomerge.experiments.bench.e2e import default_methods

    assert default_methods("wan") == default_methods("hunyuan_video") == list(tomerge.list_strategies())
    idm = tmp_path / "idm.csv"  # received attention: Wan's self-attention probe, HunyuanVideo's joint one
    assert bench.main(["--e2e", "--quick", "--widths", "wan", "hunyuan_video", "--tokens", "96", "--frames", "2",
                       "--strategies", "idm", "sdtm", "--repeats", "1", "--out", str(idm)]) == 0
    assert sorted((r["model"], r["method"]) for r in _rows(idm)) == [
        ("hunyuan_video", "idm"), ("hunyuan_video", "sdtm"), ("wan", "idm"), ("wan", "sdtm")]
    from tomerge.experiments.cli import UsageError

    with pytest.raises(UsageError, match="does not divide"):
        bench.main(["--e2e", "--quick", "--widths", "wan", "--tokens", "100", "--frames", "3"])
    with pytest.raises(UsageError, match="perfect squares"):
        bench.main(["--e2e", "--quick", "--widths", "wan", "pixart", "--tokens", "96"])


NEEDS_ATTENTION_PLUGIN = '''\
from __future__ import annotations  # string annotations: dataclasses look the module up in sys.modules

import dataclasses

import torch

import tomerge


@tomerge.register_strategy("test_bench_most_attended")
@dataclasses.dataclass(frozen=True, kw_only=True)
class MostAttended(tomerge.MergeStrategy):
    """The most attended tokens are the destinations; every other token merges into the first slot. It merges
    the feed-forward, as IDM does: the block's attention has run by then and its received attention is recorded."""

    @property
    def default_sublayers(self):
        return frozenset({"mlp"})

    @property
    def needs(self):
        return frozenset({"received_attention"})

    def select_destinations(self, x, ctx):
        kept = x.shape[1] - ctx.tokens_to_remove(x.shape[1])
        return ctx.received_attention.topk(kept, dim=1).indices.sort(dim=1).values  # [B, M]

    def merge_matrix(self, x, dst, ctx):
        B, N = x.shape[:2]
        slot = torch.zeros(B, N, dtype=torch.long, device=x.device)  # [B, N]: sources into slot 0
        slot.scatter_(1, dst, torch.arange(dst.shape[1], device=x.device).expand(B, -1))  # destinations: own slots
        return tomerge.MergePlan.hard(slot, dst, backend="index")
'''


def test_a_plugin_strategy_with_needs_runs_end_to_end(tmp_path):
    """bench --e2e asks MergeStrategy.needs (through tomerge.apply) and keeps no list of strategies that need
    received attention: a plugin's strategy that needs it runs on Wan, whose adapter records it."""
    from tomerge import registry
    from tomerge.experiments import cli
    from tomerge.experiments import plugins

    plugin = tmp_path / "most_attended.py"
    plugin.write_text(NEEDS_ATTENTION_PLUGIN)
    out = tmp_path / "needs.csv"
    registered, loaded = dict(registry._strategies._classes), dict(plugins._LOADED)
    try:
        assert cli.main(["bench", "--plugin", str(plugin), "--e2e", "--quick", "--widths", "wan", "--tokens", "96",
                         "--frames", "2", "--strategies", "test_bench_most_attended", "--repeats", "1",
                         "--out", str(out)]) == 0
    finally:
        for name in set(registry._strategies._classes) - set(registered):
            del registry._strategies._classes[name]
        for spec in set(plugins._LOADED) - set(loaded):
            del plugins._LOADED[spec]
    rows = _rows(out)
    assert [(r["model"], r["method"]) for r in rows] == [("wan", "test_bench_most_attended")]
    assert float(rows[0]["merged_gflop"]) < float(rows[0]["base_gflop"])  # it merged


# ---------------------------------------------------------------------- experiments/bench/gpu.sh
GPU_SCRIPT = ROOT / "experiments" / "bench" / "gpu.sh"
HEADLINE = ["tomesd", "ssm", "toma", "toma_release", "sdtm_release", "fora", "taylorseer", "first_block_cache",
            "fora:merge=tomesd"]


def _table_rows(text: str, title: str) -> list[list[str]]:
    """The cells of the first Markdown table after the ``## title`` heading."""
    section = text.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    lines = section.split("\n|", 1)[1].split("\n\n", 1)[0].splitlines()  # the header, the alignment, the rows
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in lines[2:]]


def test_the_gpu_script_runs_every_section_on_the_cpu_from_anywhere(tmp_path):
    """``gpu.sh --cpu-smoke`` from another working directory: every section runs at tiny sizes and lands in one
    Markdown file under OUT_DIR (relative to the caller), with the machine, the command, the headline table (a
    row per method and width, eager and compiled) and a row per method in every section's table."""
    import os
    import subprocess

    work = tmp_path / "elsewhere"
    work.mkdir()
    out = subprocess.run(["bash", str(GPU_SCRIPT), "--cpu-smoke"], cwd=work, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "OUT_DIR": "bench"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = (work / "bench" / "benchmarks_gpu.md").read_text()
    assert "- command: `bash experiments/bench/gpu.sh --cpu-smoke`" in report and "commit `" in report
    assert "failed" not in report and "(no rows)" not in report
    headline = _table_rows(report, "Headline")
    assert [(r[0], r[3]) for r in headline] == [(w, m) for w in ("sd3 (32)", "flux (32)") for m in HEADLINE]
    assert all(r[2] == "loop3" for r in headline)
    merge_gflops = {(r[0], r[3]): float(r[7]) for r in headline}
    assert merge_gflops[("sd3 (32)", "tomesd")] > 0 and merge_gflops[("sd3 (32)", "fora")] == 0  # caching plans nothing
    compiled = {r[3] for r in headline if r[0] == "sd3 (32)" and r[6] != "-"}
    assert compiled == {"tomesd", "ssm", "toma", "fora", "fora:merge=tomesd"}
    eager = _table_rows(report, "End-to-end, eager")
    assert {(r[0], r[5], r[7]) for r in eager} == {(w, mode, m) for w in ("sd3", "flux")
                                                 for mode in ("forward", "loop3") for m in HEADLINE}
    kernels = _table_rows(report, "Kernels: plan, merge and unmerge against the tomesd package")
    assert {(r[2], r[3]) for r in kernels} == {("tomesd package", "index"), ("facility_location", "dense"),
                                               *((m, b) for m in ("tomesd", "ssm", "idm") for b in ("index", "dense"))}
    gflops = {(r[2], r[3]): float(r[8]) for r in kernels}
    assert gflops[("tomesd", "dense")] > gflops[("tomesd", "index")] > 0  # one-hot matmuls on top of the plan's
    assert {r[7] for r in _table_rows(report, "SD1.5-width UNet: tomerge's tomesd against the tomesd package")} == \
        {"tomesd package", "tomesd"}
    assert {r[7] for r in _table_rows(report, "Video: Wan widths")} == {"tomesd", "ssm", "idm", "facility_location",
                                                                         "sdtm", "toma"}
    assert {r[7] for r in _table_rows(report, "Token-wise caching (toca) at DiT width")} == \
        {"toca", "cached_detail", "fora", "tomesd"}
    assert {p.name for p in (work / "bench").glob("*.csv")} == {f"{s}.csv" for s in
                                                               ("e2e", "compiled", "kernels", "unet", "video", "toca")}


def test_the_gpu_script_refuses_unknown_and_contradicting_flags(tmp_path):
    import subprocess

    for args, message in ((["--fast"], "unknown argument --fast"),
                          (["--quick", "--cpu-smoke"], "give one of --quick and --cpu-smoke")):
        out = subprocess.run(["bash", str(GPU_SCRIPT), *args], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 2 and message in out.stderr and out.stderr.count("\n") == 1, out.stderr
    if not torch.cuda.is_available():  # --quick and the full run need a GPU: one line saying so
        out = subprocess.run(["bash", str(GPU_SCRIPT), "--quick"], cwd=tmp_path, capture_output=True, text=True,
                             timeout=120, env={**__import__("os").environ, "OUT_DIR": str(tmp_path / "b")})
        assert out.returncode == 1 and out.stderr == ("gpu.sh: no CUDA GPU visible to torch; run it on a GPU machine "
                                                      "(on a CPU: --cpu-smoke)\n")
    assert not (tmp_path / "runs").exists()


def test_a_failed_section_is_reported_and_the_others_still_run(tmp_path, capsys):
    """The GPU script's driver runs every section even when one fails: the failure is in the Markdown file and
    the exit code, the other sections' tables are there."""
    from tomerge.experiments.commands import bench_report

    code = bench_report.main([str(tmp_path), "--command", "bash experiments/bench/gpu.sh --test",
                              "--section", "broken|Broken|--kernels --strategies fora",
                              "--section", "kernels|Kernels|--kernels --tokens 16 --ratios 0.5 --channels 8 "
                                           "--min-run-time 0.01 --strategies ssm"])
    assert code == 1 and "failed sections: broken" in capsys.readouterr().out
    report = (tmp_path / "benchmarks_gpu.md").read_text()
    assert "## Broken\n\n`tomerge bench --kernels --strategies fora`" in report
    assert "(failed: UsageError: --kernels plans bare tensors with merging strategies; ['fora'] are schedules" in report
    assert [r[2:4] for r in _table_rows(report, "Kernels")] == [["tomesd package", "index"], ["ssm", "index"],
                                                                ["ssm", "dense"]]
    with pytest.raises(SystemExit):
        bench_report.main([str(tmp_path), "--command", "x", "--section", "no title or arguments"])
    assert "a section is NAME|TITLE|ARGUMENTS" in capsys.readouterr().err
