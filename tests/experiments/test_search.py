"""`tomerge search` on a tiny DiT: trials are runs of the run folder, the front is the non-dominated set,
an interrupted search keeps its finished trials, a bad space fails before any image, the front is re-scored
on held-out items and its config reruns it with `tomerge ablate`."""

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("optuna")

from tomerge.experiments.runs import search as search_module  # noqa: E402
from tomerge.experiments.runs import search_space  # noqa: E402
from tomerge.experiments.runs.ablation import run_ablation  # noqa: E402
from tomerge.experiments.config.load import load_config  # noqa: E402
from tomerge.experiments.config.schema import ConfigError  # noqa: E402
from tomerge.experiments.runs.search import load_search, run_search  # noqa: E402
from helpers.tiny_reference import tiny_config  # noqa: E402

SPACE = {
    "trials": 5, "sampler": "random", "seed": 3, "objectives": ["flops", "psnr"],
    "space": [{"strategy": "tomesd", "ratio": {"low": 0.1, "high": 0.7}, "options": {"use_rand": False}},
              {"strategy": "ssm", "ratio": [0.25, 0.5], "options": {"round_windows": [1, 2]}}],
    "held_out": {"seed": 500},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("search")
    config = tiny_config(root, "tiny_search", num_steps=2, per_class=1, batch_size=2, search=SPACE)
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
    assert table.startswith("tiny_search: sampler: random sampling (random), seed 3")
    trials_md = (folder / "search" / "trials.md").read_text()  # every trial, committable
    assert trials_md.count("| complete |") == 5 and all(run.run_id in trials_md for run, _ in result.trials)
    for suffix in ("png", "pdf"):
        assert (folder / "search" / f"front.{suffix}").stat().st_size > 0

    held = {r["run"]: r for r in rows(root / "runs" / "tiny_search_held_out")}
    assert set(held) == expected | {"baseline"}
    from tomerge.experiments.runs.records import format_value

    for run_id in expected:  # held-out PSNR with its interval, as the held-out row has them
        r = held[run_id]
        assert f"| {format_value(r['psnr'])} [{format_value(r['psnr_lo'])}, {format_value(r['psnr_hi'])}] |" in table
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
    real = search_module.run_trial

    def stop_on_the_second(config_, run):
        calls.append(run.run_id)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(config_, run)

    monkeypatch.setattr(search_module, "run_trial", stop_on_the_second)
    with pytest.raises(KeyboardInterrupt):
        run_search(config, space, progress=False, held_out=False)
    monkeypatch.setattr(search_module, "run_trial", lambda c, r: (calls.append(r.run_id), real(c, r))[1])
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
    from tomerge.experiments.runs.search_space import Dimension

    assert Dimension.parse([1, 2], "x")[0] == Dimension("choice", (1, 2))
    assert Dimension.parse({"low": 1, "high": 4}, "x")[0] == Dimension("int", (1, 4))
    assert Dimension.parse({"low": 0.1, "high": 0.4}, "x", default_step=0.01)[0] == Dimension("float", (0.1, 0.4), 0.01)
    assert Dimension.parse({"use_rand": False}, "x")[0] == Dimension("fixed", ({"use_rand": False},))
    assert Dimension.parse(0.3, "x")[0] == Dimension("fixed", (0.3,))
    assert "a range needs numbers low and high" in Dimension.parse({"low": 0.1}, "x")[1][0]


def test_the_command_line_is_the_commands_module():
    """``tomerge search`` and ``python -m tomerge.experiments.commands.search`` are the commands module's."""
    import subprocess
    import sys

    from tomerge.experiments import cli
    from tomerge.experiments.commands import search as command

    assert cli.SUBCOMMANDS["search"][0] == command.__name__
    out = subprocess.run([sys.executable, "-m", command.__name__, "--help"], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.startswith("usage: tomerge search [-h] --config CONFIG") and search_module.__doc__.strip() in out


# ------------------------------------------------------------------------------------------ the sampler (#41)
@pytest.mark.parametrize("trials, population, plan", [
    (10, 8, "1 generation and 2 trials of the next"),  # the floor: fewer than 2 generations (warned)
    (16, 8, "2 generations"),
    (40, 8, "5 generations"),
    (60, 12, "5 generations"),  # experiments/configs/search.yaml
    (61, 12, "5 generations and 1 trial of the next"),
    (100, 20, "5 generations"),
    (1000, 50, "20 generations"),  # the cap, Optuna's default: more generations, not a larger population
])
def test_nsga2_population_is_a_fifth_of_the_budget_within_8_and_50(trials, population, plan):
    assert search_space.nsga2_population(trials) == population
    space = search_space.SearchSpace.parse({**SPACE, "sampler": "nsga2", "trials": trials}, load_config(None))
    assert space.population == population
    assert f"population {population}, {trials} trials: {plan}" in space.plan()
    assert (space.warning is not None) == (trials < 16)


def test_population_can_be_given_for_nsga2_only_and_a_short_budget_is_warned():
    config = load_config(None)
    space = search_space.SearchSpace.parse({**SPACE, "sampler": "nsga2", "trials": 30, "population": 10}, config)
    assert space.population == 10 and space.warning is None and "3 generations" in space.plan()
    short = search_space.SearchSpace.parse({**SPACE, "sampler": "nsga2", "trials": 19, "population": 10}, config)
    assert "runs 1 full generation(s): the front is random draws" in short.warning
    assert search_space.SearchSpace.parse({**SPACE, "sampler": "tpe"}, config).population is None
    with pytest.raises(ConfigError, match="search.population is NSGA-II's"):
        search_space.SearchSpace.parse({**SPACE, "sampler": "tpe", "population": 10}, config)
    with pytest.raises(ConfigError, match="search.population must be an integer >= 2"):
        search_space.SearchSpace.parse({**SPACE, "sampler": "nsga2", "population": 1}, config)


def test_the_shipped_search_space_validates_and_searches_caching_around_attention_only_merging():
    from tomerge.experiments.config.schema import CONFIG_DIR

    config, space = load_search(CONFIG_DIR / "search.yaml", [], check_inputs=False)
    assert (space.sampler, space.trials, space.population) == ("nsga2", 60, 12) and space.warning is None
    names = [e.strategy for e in space.entries]
    assert "cached_detail" in names
    around = {}
    for entry in space.entries:
        options = dict(entry.options)
        if "merge" in options and entry.strategy != "cached_detail":
            assert options["merge_options"].values == ({"merge_mlp": False},)  # attention only, fixed
            around[entry.strategy] = options["merge"].values
    assert set(around) == {"block_cache", "fora", "taylorseer", "first_block_cache"}
    detail = dict(space.entries[names.index("cached_detail")].options)
    assert detail["detail"].values == ("merged_change", "slot_offset")


def test_an_nsga2_search_breeds_every_parameter_names_its_generations_and_lists_every_trial(setup):
    root, path = setup
    config, space = load_search(path, ["name=evolving", "search.sampler=nsga2", "search.trials=3",
                                       "search.population=2"])
    result = run_search(config, space, progress=False, held_out=False)
    out = root / "runs" / "evolving" / "search"
    # generation 0 holds the population's 2 trials, generation 1 the third (bred from them)
    assert "population 2; 3 completed trials: 1 full generation " in result.sampler
    assert result.sampler.endswith("partial: generation 1: 1 trial")
    assert (out / "front.md").read_text().startswith(f"evolving: {result.sampler}\n")
    lines = (out / "trials.md").read_text().splitlines()
    assert lines[0] == result.sampler
    assert lines[2].startswith("| trial | state | generation | run | strategy | ratio | options | flops | psnr |")
    table = [[c.strip() for c in line.strip("|").split("|")] for line in lines[4:]]
    assert [r[:3] for r in table] == [["0", "complete", "0"], ["1", "complete", "0"], ["2", "complete", "1"]]
    assert [r[3].strip("`") for r in table] == [run.run_id for run, _ in result.trials]
    assert [float(r[7]) for r in table] == [pytest.approx(v[0], rel=1e-5) for _, v in result.trials]
    import optuna
    from optuna.storages import JournalStorage
    from optuna.storages.journal import JournalFileBackend

    study = optuna.load_study(study_name="evolving", storage=JournalStorage(JournalFileBackend(
        str(out / "study.journal"))))
    for trial in study.trials:  # every entry's ratio and ssm's round_windows, whichever entry was chosen
        assert {"entry", "0:tomesd.ratio", "1:ssm.ratio", "1:ssm.round_windows"} == set(trial.params)
    with pytest.raises(search_module.UsageError, match="population 2, this config gives 3"):
        run_search(*load_search(path, ["name=evolving", "search.sampler=nsga2", "search.trials=4",
                                       "search.population=3"]), progress=False, held_out=False)


def test_dry_run_checks_the_space_prints_the_plan_and_runs_nothing(setup, capsys):
    from tomerge.experiments.commands import search as command

    root, path = setup
    assert command.main(["--config", str(path), "--set", "name=dry", "--set", "search.sampler=nsga2",
                         "--set", "search.trials=10", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "NSGA-II (nsga2), population 8, 10 trials: 1 generation and 2 trials of the next" in out
    assert err.startswith("warning: search.trials=10 with nsga2's population of 8")
    assert not (root / "runs" / "dry").exists()
