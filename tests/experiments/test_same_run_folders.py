"""scripts/same_run_folders.py on small hand-made run folders."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from helpers import ROOT

SCRIPT = ROOT / "scripts" / "same_run_folders.py"


@pytest.fixture(scope="module")
def same():
    spec = importlib.util.spec_from_file_location("same_run_folders", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_folder(path: Path, name: str, speedup: float = 1.25, pixel: int = 7, commit: str = "abc1234",
                noisy: bool = False) -> Path:
    """A run folder with the files `tomerge ablate` writes (contents made up, not real images)."""
    (path / "images" / "baseline").mkdir(parents=True)
    (path / "maps").mkdir()
    (path / "wandb" / "run-1").mkdir(parents=True)
    (path / "config.yaml").write_text(f"batch_size: 20\nname: {name}\nout_dir: {path.parent}\nseed: 0\n")
    (path / "images" / "baseline" / "00000_class0_seed0.png").write_bytes(bytes([137, 80, 78, 71, pixel]))
    (path / "maps" / "tomesd-r0.5.json").write_text('[{"step": 0}]\n')
    (path / "tomerge.lock").write_text(f"{name} pid\n")
    (path / "wandb_id.txt").write_text(f"{name}-id\n")
    (path / "wandb" / "run-1" / "log.txt").write_text(f"{name} log\n")
    rows = [{"run": "baseline", "ratio": 0.0, "psnr": 100.0, "git_commit": commit},
            {"run": "tomesd-r0.5", "ratio": 0.5, "time_s": 1.0 / speedup, "speedup": speedup, "psnr": 15.7,
             "overhead_ratio": speedup / 1.34, "git_commit": commit}]
    (path / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (path / "results.csv").write_text("run,ratio,time_s,speedup,psnr,git_commit\n"
                                      f"baseline,0.0,,,100.0,{commit}\n"
                                      f"tomesd-r0.5,0.5,{1.0 / speedup},{speedup},15.7,{commit}\n")
    (path / "table.md").write_text("| run | ratio | speed-up | FLOP-ideal | PSNR dB |\n|---|---:|---:|---:|---:|\n"
                                   "| baseline | 0 | - | - | 100.0 |\n"
                                   f"| tomesd-r0.5 | 0.5 | {speedup:.3g} | 1.34 | 15.7 |\n"
                                   + ("\n(noisy): the timing repeats of that run disagree by more than 10%\n"
                                      if noisy else ""))
    return path


def test_identical_folders_are_the_same(same, tmp_path, capsys):
    before = make_folder(tmp_path / "one" / "before", "before")
    after = make_folder(tmp_path / "two" / "after", "after", commit="def5678")  # other name, out_dir, commit
    assert same.main([str(before), str(after)]) == 0
    assert capsys.readouterr().out == "6 files compared: the same\n"


def test_a_changed_image_byte_is_a_difference(same, tmp_path, capsys):
    before = make_folder(tmp_path / "before", "before")
    after = make_folder(tmp_path / "after", "after", pixel=8)
    assert same.main([str(before), str(after)]) == 1
    out = capsys.readouterr().out
    assert "1 difference(s)" in out and "images/baseline/00000_class0_seed0.png: the bytes differ" in out


def test_a_changed_timing_only_is_the_same(same, tmp_path, capsys):
    before = make_folder(tmp_path / "before", "before", speedup=1.25)
    after = make_folder(tmp_path / "after", "after", speedup=0.97, noisy=True)  # the note under the table too
    assert same.main([str(before), str(after)]) == 0
    assert "the same" in capsys.readouterr().out


def test_a_changed_quality_value_and_a_missing_file_are_differences(same, tmp_path, capsys):
    before = make_folder(tmp_path / "before", "before")
    after = make_folder(tmp_path / "after", "after")
    rows = (after / "results.jsonl").read_text().replace("15.7", "15.8")
    (after / "results.jsonl").write_text(rows)
    (after / "maps" / "tomesd-r0.5.json").unlink()
    assert same.main([str(before), str(after)]) == 1
    out = capsys.readouterr().out
    assert f"only in {before}: maps/tomesd-r0.5.json" in out
    assert "results.jsonl, line 2:" in out and "15.8" in out
