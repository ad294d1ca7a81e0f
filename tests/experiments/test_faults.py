"""Bad input and faults, tried as a new user meets them: a grid killed with SIGKILL at random moments and
resumed, broken run folders (truncated images, broken rows, missing images, rows of another version), two
processes on one folder, a rank of a distributed generation killed, a full disk.

What must hold: the user gets one line (``tomerge CMD: error: ...``, exit code 2) naming the file and what
to do, never a traceback asking for a bug report; whatever finished is kept whole; a rerun completes with
the same images and numbers as a run that was never interrupted.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tomerge.experiments.runs import ablation as ablate
from tomerge.experiments import cli
from tomerge.experiments.generation import files
from tomerge.experiments.generation import distributed
from tomerge.experiments.generation import generate as gen
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config

MERGED = "tomesd-r0.5-use_rand=False"
# the numbers of a row that do not depend on timing
QUALITY = ("psnr", "ssim", "feat_cos_dist", "fd_effnetlite0", "fd_effnetlite0_ref", "flops", "flops_per_image",
           "flop_speedup", "tokens_removed_mean")
TEMP = re.compile(r"^\..+\.tmp\d+$")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny DiT checkpoint and Fashion-MNIST stand-in files (tests/helpers/tiny_reference.py)."""
    from helpers.tiny_reference import write_test_set, write_tiny_dit

    root = tmp_path_factory.mktemp("faults")
    write_tiny_dit(root / "tiny.safetensors")
    write_test_set(root / "data")
    return root


def overrides(root: Path, name: str, *extra: str) -> list[str]:
    """A grid of one merged run over 4 images in batches of 2 (so a batch can be half written)."""
    return [f"model.reference={root / 'tiny.safetensors'}", "model.call.num_steps=2", f"data_root={root / 'data'}",
            f"out_dir={root / 'runs'}", f"name={name}", "classes=[0, 1]", "per_class=2", "batch_size=2",
            "timing_batch=2", "warmup=0", "repeats=1", "fd_reference_images=6", "wandb=disabled",
            f"grid=[{{strategy: tomesd, ratios: [0.5], options: {{use_rand: false}}}}]", *extra]


def ablate_command(root: Path, name: str) -> list[str]:
    return [sys.executable, "-m", "tomerge.experiments.commands.ablate", *set_args(overrides(root, name))]


def set_args(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines() if line.strip()]


def latest(folder: Path) -> dict[str, dict]:
    return {r["run"]: r for r in rows(folder)}


def pngs(folder: Path) -> dict[str, bytes]:
    """Every PNG under ``folder/images`` (the items' and the preview grids), by relative path."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted((folder / "images").rglob("*.png"))}


def leftovers(folder: Path) -> list[Path]:
    """Temporary files of interrupted writes, and PNGs that are not whole."""
    return [p for p in folder.rglob("*") if TEMP.match(p.name)] + \
        [p for p in folder.rglob("*.png") if not files.png_complete(p)]


def permanent_files(folder: Path) -> int:
    return sum(1 for _, _, names in os.walk(folder) for n in names if not TEMP.match(n))


def one_error_line(err: str) -> str:
    """The command's error line; asserts there is one and no traceback."""
    assert "Traceback" not in err and "internal error" not in err, err
    lines = [line for line in err.splitlines() if ": error: " in line]
    assert len(lines) == 1, err
    return lines[0]


def test_module_doctests():
    import doctest

    result = doctest.testmod(files, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ------------------------------------------------------------------------------------ SIGKILL and resume
def test_a_grid_killed_at_random_moments_resumes_to_the_same_images_and_numbers(tiny):
    """``tomerge ablate`` killed with SIGKILL at random moments (each after a random number of new files plus a
    random delay, so kills land in image writes, metric runs, row appends...), then resumed: the same PNG bytes
    and quality numbers as a run never interrupted, every row whole, no temporary or half-written file, the
    lock released."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(ablate_command(tiny, "whole"), env=env, check=True, capture_output=True, timeout=600)
    whole = tiny / "runs" / "whole"

    killed = tiny / "runs" / "killed"
    rng = random.Random(20251202)
    kills = 0
    for _ in range(6):
        start = permanent_files(killed) if killed.exists() else 0
        wanted, delay = rng.randint(1, 3), rng.uniform(0.0, 0.1)
        proc = subprocess.Popen(ablate_command(tiny, "killed"), env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        while proc.poll() is None and (not killed.exists() or permanent_files(killed) < start + wanted):
            time.sleep(0.01)
        time.sleep(delay)
        if proc.poll() is not None:
            break  # finished before this kill
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= 3
    subprocess.run(ablate_command(tiny, "killed"), env=env, check=True, capture_output=True, timeout=600)

    assert pngs(killed) == pngs(whole)
    for run, row in latest(whole).items():
        again = latest(killed)[run]
        assert {k: again[k] for k in QUALITY if k in row} == {k: row[k] for k in QUALITY if k in row}, run
    assert sorted(latest(killed)) == ["baseline", MERGED]
    assert (killed / "results.jsonl").read_text().endswith("\n")
    assert leftovers(killed) == []
    assert (killed / files.LOCK_FILE).read_text() == ""  # released: names no holder


# ------------------------------------------------------------------------------------ broken run folders
@pytest.fixture
def synthetic(tmp_path) -> Path:
    pytest.importorskip("matplotlib")
    from helpers.run_folders import make_run_folder

    return make_run_folder(tmp_path)


def figures_command(folder: Path, tmp_path: Path, capsys) -> tuple[int, str]:
    code = cli.main(["figures", str(folder), "--out", str(tmp_path / "figs"), "--metrics", "psnr"])
    return code, capsys.readouterr().err


def test_figures_names_a_truncated_image_and_what_to_do(synthetic, tmp_path, capsys):
    image = sorted((synthetic / "images" / "ssm-r0.5").glob("*.png"))[0]
    image.write_bytes(image.read_bytes()[:60])  # a disk filled up, a copy broke
    code, err = figures_command(synthetic, tmp_path, capsys)
    line = one_error_line(err)
    assert code == 2 and line.startswith(f"tomerge figures: error: {image} is damaged")
    assert f"delete it and rerun the `tomerge ablate` command that made {synthetic}" in line
    assert "which generates missing images again" in line


def test_figures_names_a_broken_row_and_leaves_out_an_unfinished_last_one(synthetic, tmp_path, capsys):
    results = synthetic / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text("\n".join(lines) + '\n{"run": "ssm-r0.75", "strat')  # killed mid-append
    with pytest.warns(UserWarning, match=rf"line {len(lines) + 1} is an unfinished row"):
        code, _ = figures_command(synthetic, tmp_path, capsys)
    assert code == 0

    lines[2] = lines[2][:40]
    results.write_text("\n".join(lines) + "\n")
    code, err = figures_command(synthetic, tmp_path, capsys)
    line = one_error_line(err)
    assert code == 2 and f"{results} line 3 is not a JSON row" in line and "fix or delete that line" in line


def test_figures_warns_about_missing_images_naming_one(synthetic, tmp_path, capsys):
    image = sorted((synthetic / "images" / "ssm-r0.5").glob("*.png"))[1]
    image.unlink()
    with pytest.warns(UserWarning, match=rf"1 images .* missing \(first: {re.escape(str(image))}\).*tomerge ablate"):
        code, _ = figures_command(synthetic, tmp_path, capsys)
    assert code == 0


def test_figures_refuses_rows_of_another_version_naming_the_keys(synthetic, tmp_path, capsys):
    results = synthetic / "results.jsonl"
    old = [{k: v for k, v in r.items() if k != "strategy"} for r in rows(synthetic)]
    results.write_text("".join(json.dumps(r) + "\n" for r in old))
    code, err = figures_command(synthetic, tmp_path, capsys)
    line = one_error_line(err)
    assert code == 2 and "has no 'strategy'" in line and "another tomerge version" in line
    results.write_text("".join(json.dumps({"name": r["run"]}) + "\n" for r in old))
    code, err = figures_command(synthetic, tmp_path, capsys)
    assert code == 2 and "line 1 has no 'run' (written by another tomerge version?)" in one_error_line(err)


def test_ablate_resumes_over_truncated_missing_images_and_a_cut_off_row(tiny):
    """Truncated PNGs (of the baseline and of a finished run) and a deleted one are written again, the same
    bytes; a row cut off mid-append is dropped with a warning and its run redone, the same numbers; a broken
    row in the middle, or one without a run id, stops the command naming the line."""
    config = load_config(None, overrides(tiny, "broken"))
    folder = run_ablation(config, progress=False).path
    before, first = pngs(folder), latest(folder)
    baseline_png = sorted((folder / "images" / "baseline").glob("*.png"))[1]
    merged_pngs = sorted((folder / "images" / MERGED).glob("*.png"))
    baseline_png.write_bytes(baseline_png.read_bytes()[:50])
    merged_pngs[0].write_bytes(merged_pngs[0].read_bytes()[:-5])
    merged_pngs[3].unlink()
    with pytest.warns(UserWarning, match="images .*missing or truncated"):
        run_ablation(config, progress=False)
    assert pngs(folder) == before and rows(folder) == list(first.values())  # nothing redone but the images

    results = folder / "results.jsonl"
    lines = results.read_text().splitlines()
    results.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # killed while appending the last row
    with pytest.warns(UserWarning, match="line 2 is an unfinished row"):
        run_ablation(config, progress=False)
    again = rows(folder)
    assert [r["run"] for r in again] == ["baseline", MERGED] and results.read_text().endswith("\n")
    assert {k: again[1][k] for k in QUALITY} == {k: first[MERGED][k] for k in QUALITY}

    good = results.read_text()
    results.write_text("{not json\n" + good)
    with pytest.raises(cli.UserError, match=rf"{re.escape(str(results))} line 1 is not a JSON row.*fix or delete"):
        run_ablation(config, progress=False)
    results.write_text(json.dumps({"name": "baseline"}) + "\n" + good)
    with pytest.raises(cli.UserError, match="line 1 has no 'run'"):
        run_ablation(config, progress=False)
    assert results.read_text() == json.dumps({"name": "baseline"}) + "\n" + good  # untouched


# ------------------------------------------------------------------------------------ one writer per folder
HOLD = ("import sys, time\n"
        "from tomerge.experiments.generation.files import lock_folder\n"
        "lock = lock_folder(sys.argv[1], sys.argv[2])\n"
        "print('locked', flush=True)\n"
        "time.sleep(600)\n")


def hold_lock(folder: Path, command: str) -> subprocess.Popen:
    """Another process holding ``folder``'s lock until killed."""
    folder.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(folder), command], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_ablate_on_a_run_folder_is_refused_naming_the_holder(tiny, capsys, monkeypatch):
    folder = tiny / "runs" / "locked"
    holder = hold_lock(folder, "tomerge ablate")
    try:
        code = cli.main(["ablate", *set_args(overrides(tiny, "locked"))])
        line = one_error_line(capsys.readouterr().err)
        assert code == 2 and line.startswith(f"tomerge ablate: error: {folder} is in use by tomerge ablate")
        assert f"pid {holder.pid} on host {socket.gethostname()}" in line
        assert sorted(p.name for p in folder.iterdir()) == [files.LOCK_FILE]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert str(holder.pid) in (folder / files.LOCK_FILE).read_text()  # a stale lock: its process is dead
    config = load_config(None, overrides(tiny, "locked"))
    run_ablation(config, progress=False)  # takes it over
    with files.lock_folder(folder, "test"):  # released on normal exit
        pass

    for error in (RuntimeError, KeyboardInterrupt):  # released on an error and on Ctrl-C
        def fail(*args, error=error):
            raise error()

        monkeypatch.setattr(ablate, "complete_finished_runs", fail)
        with pytest.raises(error):
            run_ablation(config, progress=False)
        with files.lock_folder(folder, "test"):
            pass


GENERATE = ["--classes", "0", "1", "--per-class", "3", "--seed", "10", "--call", "num_steps=2", "--batch-size", "2",
            "--strategy", "tomesd", "--ratio", "0.5", "--no-progress", "--threads", "1"]
EXPECTED = [f"{i:05d}_class{c}_seed{10 + i}.png" for i, c in enumerate([0, 0, 0, 1, 1, 1])]


def test_a_second_generate_on_an_output_folder_is_refused(tiny, tmp_path, capsys):
    out = tmp_path / "out"
    holder = hold_lock(out, "tomerge generate")
    try:
        code = cli.main(["generate", *GENERATE, "--checkpoint", str(tiny / "tiny.safetensors"), "--out", str(out)])
        line = one_error_line(capsys.readouterr().err)
        assert code == 2 and f"{out} is in use by tomerge generate (pid {holder.pid} on host" in line
    finally:
        holder.kill()
        holder.wait()
    assert cli.main(["generate", *GENERATE, "--checkpoint", str(tiny / "tiny.safetensors"), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.png")) == EXPECTED


# ------------------------------------------------------------------------------------ distributed faults
def test_a_killed_rank_stops_the_other_with_an_error_and_a_rerun_completes(tiny, tmp_path, capsys, monkeypatch):
    """2 gloo ranks (Lightning DDP, forked), one SIGKILLed after its first batch: the other is stopped at once
    (no waiting for a timeout), the command says which rank and how in one line; the rerun writes only
    what is missing, every item once."""
    args = [*GENERATE, "--batch-size", "1", "--checkpoint", str(tiny / "tiny.safetensors"), "--devices", "2",
            "--accelerator", "cpu", "--launcher", "ddp_fork", "--timeout", "60"]
    real = distributed.process_batch
    for victim in (1, 0):
        out = tmp_path / f"victim{victim}"
        flag = tmp_path / f"killed{victim}"

        def dying(source, batch, spec, out_dir, rank=0, victim=victim, flag=flag):
            written = real(source, batch, spec, out_dir, rank)
            if rank == victim and not flag.exists():
                flag.write_text("")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(0.2)  # the other rank is mid-run
            return written

        monkeypatch.setattr(distributed, "process_batch", dying)  # forked ranks see the patch
        start = time.monotonic()
        code = cli.main(["generate", *args, "--out", str(out)])
        line = one_error_line(capsys.readouterr().err)
        assert time.monotonic() - start < 50  # well below the 60 s timeout: stopped, not timed out
        assert code == 2 and re.search(rf"rank {victim} of 2 \(pid \d+\) was killed by SIGKILL", line), line
        assert "the other ranks were stopped" in line and "rerun the same command to resume" in line
        kept = {p.name: p.stat().st_mtime_ns for p in out.glob("*.png")}
        assert 1 <= len(kept) < len(EXPECTED)

        assert cli.main(["generate", *args, "--out", str(out)]) == 0
        assert sorted(p.name for p in out.glob("*.png")) == EXPECTED
        assert {n: (out / n).stat().st_mtime_ns for n in kept} == kept  # finished images not written again
        logged = Counter(json.loads(line)["file"] for line in (out / gen.LOG_FILE).read_text().splitlines())
        assert set(logged) <= set(EXPECTED) and max(logged.values()) == 1  # no item produced twice
        assert leftovers(out) == []


def test_a_hanging_rank_stops_the_job_after_the_timeout(tiny, tmp_path, capsys, monkeypatch):
    """A rank that hangs (alive, never finishing) is named by the others once they waited ``--timeout``
    seconds for it at the end; nothing blocks for ever."""
    out, flag = tmp_path / "out", tmp_path / "hung"
    real = distributed.process_batch

    def hanging(source, batch, spec, out_dir, rank=0):
        written = real(source, batch, spec, out_dir, rank)
        if rank == 1 and not flag.exists():
            flag.write_text("")
            time.sleep(3600)  # stopped by the parent once rank 0 gives up
        return written

    monkeypatch.setattr(distributed, "process_batch", hanging)
    args = [*GENERATE, "--batch-size", "1", "--checkpoint", str(tiny / "tiny.safetensors"), "--devices", "2",
            "--accelerator", "cpu", "--launcher", "ddp_fork", "--timeout", "3", "--out", str(out)]
    start = time.monotonic()
    code = cli.main(["generate", *args])
    line = one_error_line(capsys.readouterr().err)
    assert time.monotonic() - start < 45
    assert code == 2 and "did not all reach the end within --timeout 3 s" in line and "Ranks 1 failed" in line
    assert cli.main(["generate", *args]) == 0 and sorted(p.name for p in out.glob("*.png")) == EXPECTED


KILL_RANK_PLUGIN = '''
import os, signal, time
from pathlib import Path
from tomerge.experiments.generation import distributed

_real = distributed.process_batch


def _dying(source, batch, spec, out, rank=0):
    written = _real(source, batch, spec, out, rank)
    flag = Path(os.environ["KILL_FLAG"])
    if rank == 1 and not flag.exists():
        flag.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)
    return written


distributed.process_batch = _dying
'''


def test_a_killed_rank_under_the_default_launcher_is_named_before_every_rank_stops(tiny, tmp_path):
    """``--launcher ddp`` (the command re-executed per rank): Lightning kills every rank a few seconds after
    one dies; the command first says which rank died and how."""
    plugin = tmp_path / "kill_rank.py"
    plugin.write_text(KILL_RANK_PLUGIN)
    out = tmp_path / "out"
    command = ["tomerge", "generate", "--plugin", str(plugin), *GENERATE, "--batch-size", "1", "--checkpoint",
               str(tiny / "tiny.safetensors"), "--devices", "2", "--accelerator", "cpu", "--launcher", "ddp",
               "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KILL_FLAG": str(tmp_path / "killed")}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    # Which rank died and how (Lightning's observer noticed first), or, when rank 0 reached the end first, that
    # the connection to the dead rank closed (or how many images are missing): a one-line error either way.
    assert re.search(r"tomerge generate: error: (rank 1 of 2 on this node \(pid \d+\) was killed by SIGKILL; the "
                     r"other ranks are stopped|rank 0 of 2: the other ranks did not all reach the end .*: Connection "
                     r"closed by peer \S+|\d of 6 images were not written: a rank stopped before finishing its "
                     r"share)[^\n]*rerun the same command to resume", done.stderr), done.stderr
    rerun = ["generate", *GENERATE, "--batch-size", "1", "--checkpoint", str(tiny / "tiny.safetensors"),
             "--out", str(out)]
    assert cli.main(rerun) == 0  # the same settings in one process (the process count is not one of them)
    assert sorted(p.name for p in out.glob("*.png")) == EXPECTED and leftovers(out) == []


# ------------------------------------------------------------------------------------ disk full
def test_a_full_disk_while_saving_a_png_is_one_line_and_keeps_the_finished_images(tiny, tmp_path, capsys,
                                                                                monkeypatch):
    from PIL import Image

    out = tmp_path / "out"
    args = ["generate", *GENERATE, "--checkpoint", str(tiny / "tiny.safetensors"), "--out", str(out)]
    Image.init()  # fills the plugin registry
    real, saved = Image.SAVE["PNG"], []

    def fill_up(image, fp, filename, *rest):
        if len(saved) == 2:  # the third image: half written, then the disk is full
            fp.write(b"\x89PNG\r\n\x1a\n partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        saved.append(filename)
        return real(image, fp, filename, *rest)

    monkeypatch.setitem(Image.SAVE, "PNG", fill_up)
    code = cli.main(args)
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and line.startswith(f"tomerge generate: error: no space left on device writing "
                                         f"{out / EXPECTED[2]}")
    assert "rerun the same command" in line
    assert sorted(p.name for p in out.glob("*.png")) == EXPECTED[:2] and leftovers(out) == []
    kept = {n: (out / n).read_bytes() for n in EXPECTED[:2]}

    monkeypatch.setitem(Image.SAVE, "PNG", real)
    assert cli.main(args) == 0
    assert sorted(p.name for p in out.glob("*.png")) == EXPECTED
    assert {n: (out / n).read_bytes() for n in EXPECTED[:2]} == kept


def test_a_full_disk_in_one_rank_is_one_line_naming_the_rank_and_the_file(tiny, tmp_path, capsys, monkeypatch):
    out = tmp_path / "out"
    args = ["generate", *GENERATE, "--batch-size", "1", "--checkpoint", str(tiny / "tiny.safetensors"),
            "--devices", "2", "--accelerator", "cpu", "--launcher", "ddp_fork", "--out", str(out)]
    from PIL import Image

    Image.init()  # fills the plugin registry
    real = Image.SAVE["PNG"]

    def fill_up(image, fp, filename, *rest):
        if EXPECTED[3] in str(filename):  # rank 1's second image
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(image, fp, filename, *rest)

    monkeypatch.setitem(Image.SAVE, "PNG", fill_up)  # forked ranks see the patch
    code = cli.main(args)
    line = one_error_line(capsys.readouterr().err)
    assert code == 2 and re.search(r"error: rank 1 of 2 \(pid \d+\): no space left on device writing "
                                   rf"{re.escape(str(out / EXPECTED[3]))}", line), line
    assert leftovers(out) == []


def test_a_full_disk_while_appending_a_row_keeps_the_finished_rows(tiny, monkeypatch):
    config = load_config(None, overrides(tiny, "full"))
    folder = Path(config.out_dir) / config.name
    real_fsync = os.fsync

    def fsync(fd):
        name = os.readlink(f"/proc/self/fd/{fd}")
        if name.endswith("results.jsonl") and os.path.getsize(name) > 0 and "\n" in Path(name).read_text()[:-1]:
            os.ftruncate(fd, os.fstat(fd).st_size - 7)  # the second row half on disk, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    with pytest.raises(cli.UserError, match=f"no space left on device writing {re.escape(str(folder))}/results.jsonl"):
        run_ablation(config, progress=False)
    assert [r["run"] for r in rows(folder)] == ["baseline"] and (folder / "results.jsonl").read_text().endswith("\n")
    assert leftovers(folder) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    run_ablation(config, progress=False)
    assert [r["run"] for r in rows(folder)] == ["baseline", MERGED]
