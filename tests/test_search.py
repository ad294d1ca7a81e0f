"""`tomerge search` on a tiny DiT: trials are runs of the run folder, the front is the non-dominated set,
an interrupted search keeps its finished trials, a bad space fails before any image, the front is re-scored
on held-out items and its config reruns it with `tomerge ablate`."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")

from tomerge.experiments.runs import search as search_module  # noqa: E402
from tomerge.experiments.runs.ablation import run_ablation  # noqa: E402
from tomerge.experiments.config.load import load_config  # noqa: E402
from tomerge.experiments.config.schema import ConfigError  # noqa: E402
from tomerge.experiments.runs.search import load_search, run_search  # noqa: E402
from tiny_reference import write_test_set, write_tiny_dit  # noqa: E402

SPACE = {
    "trials": 5, "sampler": "random", "seed": 3, "objectives": ["flops", "psnr"],
    "space": [{"strategy": "tomesd", "ratio": {"low": 0.1, "high": 0.7}, "options": {"use_rand": False}},
              {"strategy": "ssm", "ratio": [0.25, 0.5], "options": {"round_windows": [1, 2]}}],
    "held_out": {"seed": 500},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    write_tiny_dit(root / "tiny.safetensors")
    data = write_test_set(root / "data")
    config = {"name": "tiny_search", "model": {"reference": str(root / "tiny.safetensors"), "call": {"num_steps": 2}},
              "data_root": str(data), "out_dir": str(root / "runs"), "classes": [0, 1], "per_class": 1,
              "batch_size": 2, "timing_batch": 2, "warmup": 0, "repeats": 1, "fd_reference_images": 0,
              "wandb": "disabled", "search": SPACE}
    path = root / "search.yaml"
    path.write_text(yaml.safe_dump(config))
    return root, path


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def dominated(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """``a`` (flops, psnr) is dominated by ``b``: no more FLOPs, no lower PSNR, and better in one."""
    return b[0] <= a[0] and b[1] >= a[1] and (b[0] < a[0] or b[1] > a[1])


def test_search_runs_trials_as_runs_finds_the_front_and_rescores_it_held_out(setup):
    root, path = setup
    config, space = load_search(path, [])
    result = run_search(config, space, progress=False)
    folder = root / "runs" / "tiny_search"
    written = {r["run"]: r for r in rows(folder)}
    assert len(result.trials) == 5 and "baseline" in written
    for run, values in result.trials:  # every trial is a run of the folder, with its objectives
        assert values == (written[run.run_id]["flops"], written[run.run_id]["psnr"])
        assert run.strategy in ("tomesd", "ssm")
    points = {run.run_id: values for run, values in result.trials}
    expected = {r for r, v in points.items() if not any(dominated(v, w) for w in points.values())}
    assert {r.run_id for r in result.front} == expected  # the non-dominated set, computed here by hand
    table = (folder / "search" / "front.md").read_text()
    assert all(run_id in table for run_id in expected) and "held out" in table
    for suffix in ("png", "pdf"):
        assert (folder / "search" / f"front.{suffix}").stat().st_size > 0

    held = {r["run"]: r for r in rows(root / "runs" / "tiny_search_held_out")}
    assert set(held) == expected | {"baseline"}
    assert result.held_out_rows and all(r["run"] in expected for r in result.held_out_rows)
    saved = yaml.safe_load((root / "runs" / "tiny_search_held_out" / "config.yaml").read_text())
    assert saved["seed"] == 500

    # front.yaml reruns the front with `tomerge ablate`: the same runs, the same images, the same quality
    front = load_config(folder / "search" / "front.yaml")
    rerun = {r["run"]: r for r in rows(run_ablation(front, progress=False).path)}
    assert set(rerun) == expected | {"baseline"}
    assert all(rerun[r]["psnr"] == written[r]["psnr"] and rerun[r]["flops"] == written[r]["flops"] for r in expected)


def test_an_interrupted_search_keeps_its_trials_and_reruns_the_stopped_one(setup, monkeypatch):
    root, path = setup
    config, space = load_search(path, ["name=interrupted", "search.trials=3"])
    calls = []
    real = search_module._run_trial

    def stop_on_the_second(config_, run):
        calls.append(run.run_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(config_, run)

    monkeypatch.setattr(search_module, "_run_trial", stop_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_search(config, space, progress=False, held_out=False)
    monkeypatch.setattr(search_module, "_run_trial", lambda c, r: (calls.append(r.run_id), real(c, r))[1])
    result = run_search(config, space, progress=False, held_out=False)
    assert len(result.trials) == 3
    assert calls[2] == calls[1]  # the stopped trial runs again with its values first
    ran = [r["run"] for r in rows(root / "runs" / "interrupted")]
    assert len(ran) == len(set(ran)) and ran[:2] == ["baseline", calls[0]]  # the finished trial's row is kept, once


@pytest.mark.parametrize("change, message", [
    ({"space": [{"strategy": "tomesdd", "ratio": 0.5}]}, "did you mean 'tomesd'"),
    ({"space": [{"strategy": "ssm", "ratio": 0.5, "options": {"round_window": [1, 2]}}]}, "unknown option 'round_window'"),
    ({"space": [{"strategy": "tomesd", "ratio": {"low": 0.2, "high": 1.5}}]}, "search.space[0] (tomesd at ratio 1.5)"),
    ({"space": [{"strategy": "tomesd", "ratio": {"low": 0.6, "high": 0.2}}]}, "low 0.6 is above high 0.2"),
    ({"objectives": ["flops", "psnrr"]}, "did you mean 'psnr'"),
    ({"objectives": ["flops", "clip_score"]}, "clip_score needs metrics.clip_model"),
    ({"held_out": {"seed": 0}}, "held-out item(s) are searched items too"),
    ({"held_out": {"seeds": 5}}, "did you mean 'seed'"),
    ({"sampler": "nsga3"}, "did you mean 'nsga2'"),
    ({"trial": 4}, "unknown key 'search.trial'; did you mean 'trials'"),
])
def test_a_bad_search_space_is_a_config_error_before_any_image(setup, tmp_path, change, message):
    root, path = setup
    values = yaml.safe_load(path.read_text())
    values["search"] = {**SPACE, **change}
    values["name"] = "bad"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(values))
    with pytest.raises(ConfigError) as err:
        load_search(bad, [])
    assert message in str(err.value)
    assert not (root / "runs" / "bad").exists()


def test_ablate_refuses_a_search_config_naming_the_command(setup):
    _, path = setup
    with pytest.raises(ConfigError, match="tomerge search --config FILE"):
        load_config(path)


def test_dimensions_a_list_is_a_choice_a_low_high_mapping_a_range_any_other_value_fixed():
    from tomerge.experiments.runs.search import Dimension

    assert Dimension.parse([1, 2], "x")[0] == Dimension("choice", (1, 2))
    assert Dimension.parse({"low": 1, "high": 4}, "x")[0] == Dimension("int", (1, 4))
    assert Dimension.parse({"low": 0.1, "high": 0.4}, "x", default_step=0.01)[0] == Dimension("float", (0.1, 0.4), 0.01)
    assert Dimension.parse({"use_rand": False}, "x")[0] == Dimension("fixed", ({"use_rand": False},))
    assert Dimension.parse(0.3, "x")[0] == Dimension("fixed", (0.3,))
    assert "a range needs numbers low and high" in Dimension.parse({"low": 0.1}, "x")[1][0]


def test_the_command_line_is_the_commands_module():
    """``tomerge search`` and ``python -m tomerge.experiments.commands.search`` are the commands module's; the
    search module's old command-line names fail naming it."""
    import subprocess
    import sys

    from tomerge.experiments import cli
    from tomerge.experiments.commands import search as command

    assert cli.SUBCOMMANDS["search"][0] == command.__name__
    out = subprocess.run([sys.executable, "-m", command.__name__, "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("usage: tomerge search [-h] --config CONFIG") and search_module.__doc__.strip() in out
    with pytest.raises(AttributeError, match=r"runs\.search\.main is tomerge\.experiments\.commands\.search\.main"):
        search_module.main  # noqa: B018
