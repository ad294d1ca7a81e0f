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
    # fora (interval 3) computes the first step and reuses every block on the other two
    forward, loop = (r for r in rows if r.method == "fora")
    assert forward.ideal == 1.0 and loop.ideal > 2.5


def test_kernels_tiny(tmp_path):
    out = tmp_path / "kernels.csv"
    code = bench.main(["--kernels", "--tokens", "256", "--ratios", "0.5", "--channels", "16",
                       "--strategies", "tomesd", "facility_location", "--min-run-time", "0.01", "--out", str(out)])
    assert code == 0
    rows = _rows(out)
    assert {r["method"] for r in rows} == {"tomesd package", "tomesd", "facility_location"}
    for r in rows:
        assert float(r["plan_ms"]) > 0 and float(r["merge_unmerge_ms"]) > 0 and int(r["removed"]) > 0
    assert "command: `python -m tomerge.experiments.commands.bench --kernels --tokens 256 " in \
        out.with_suffix(".md").read_text()


def test_the_command_line_is_the_commands_module():
    """``python -m tomerge.experiments.commands.bench`` is ``tomerge bench``; the names that left the benchmark
    modules (the command line to commands/, the models to bench.models) fail naming their owner."""
    import subprocess
    import sys

    from tomerge.experiments import bench as flat
    from tomerge.experiments.bench import e2e, kernels

    out = subprocess.run([sys.executable, "-m", "tomerge.experiments.commands.bench"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr == "tomerge bench: error: choose one mode, --e2e, --kernels or --config FILE\n"
    with pytest.raises(AttributeError, match=r"bench\.kernels\.main is tomerge\.experiments\.commands\.bench\.main"):
        kernels.main  # noqa: B018
    with pytest.raises(AttributeError, match=r"experiments\.bench\.main is tomerge\.experiments\.commands\.bench\.main"):
        flat.main  # noqa: B018
    with pytest.raises(AttributeError, match=r"bench\.kernels\.model_benchmark is tomerge\.experiments\.bench\.grid\."):
        kernels.model_benchmark  # noqa: B018
    with pytest.raises(AttributeError, match=r"bench\.e2e\.video_grid is tomerge\.experiments\.bench\.models\."):
        e2e.video_grid  # noqa: B018
    assert flat.kernel_benchmark is kernels.kernel_benchmark and flat.TOMESD_PACKAGE == e2e.TOMESD_PACKAGE


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

    from tomerge.experiments.bench.e2e import clock_function, time_once

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
