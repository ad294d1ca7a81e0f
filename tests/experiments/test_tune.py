"""`tomerge tune` on a tiny DiT: every run it keeps reaches the target (counted FLOPs), a run that cannot is pruned
without images, the recipe is the best of the runs that reached it and round-trips (its YAML through `tomerge
generate` and `tomerge.apply` gives the search's images), a rerun measures nothing again, and bad targets fail
before any image."""

import json
from pathlib import Path

import pytest
import torch
import yaml

pytest.importorskip("optuna")

import tomerge  # noqa: E402
from tomerge.experiments.config.schema import ConfigError  # noqa: E402
from tomerge.experiments.errors import UsageError  # noqa: E402
from tomerge.experiments.runs import tune as tune_module  # noqa: E402
from tomerge.experiments.runs.tune import TuneSpec, load_tune, run_tune  # noqa: E402
from helpers.tiny_reference import tiny_config  # noqa: E402

TARGET = 1.5
SPACE = {
    "trials": 6, "sampler": "random", "seed": 1,
    "space": [{"strategy": "tomesd", "ratio": {"low": 0.0, "high": 0.9}, "options": {"use_rand": False,
                                                                                     "merge_mlp": True}},
              {"strategy": "block_cache", "ratio": 0.0, "options": {"interval": [2, 4]}},
              # never reuses: 1.0x, so it is pruned before any image
              {"strategy": "first_block_cache", "ratio": 0.0, "options": {"threshold": 1e-9}}],
    "held_out": {"seed": 500},
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tune")
    config = tiny_config(root, "tiny_tune", num_steps=4, per_class=2, batch_size=4, search=SPACE,
                         tune={"target": TARGET, "by": "flops", "objective": "psnr"})
    path = root / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    config_, space, spec = load_tune(path, [])
    return root, path, run_tune(config_, space, spec, progress=False)


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def journal(folder: Path):
    import optuna

    return optuna.load_study(study_name=folder.name, storage=optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(folder / "search" / "study.journal"))))


def test_every_kept_run_reaches_the_target_and_the_recipe_is_the_best_of_them(setup):
    root, _, result = setup
    written = rows(root / "runs" / "tiny_tune")
    runs = {r["run"] for r in written} - {"baseline"}
    assert runs and not any(r.startswith("first_block_cache") for r in runs)  # pruned unrun
    reached = [r for r in written if r["run"] != "baseline"]
    assert all(r["flop_speedup"] >= TARGET * tune_module.REACHED for r in reached)
    merged = [r for r in reached if r["strategy"] == "tomesd"]
    # a merging run is at the ratio its FLOP-ideal speed-up meets the target at (token steps: within 10%)
    assert all(r["flop_speedup"] < TARGET * 1.1 for r in merged)
    best = max(r["psnr"] for r in reached)
    assert result.row["psnr"] == best and result.recipe.strategy == result.row["strategy"]
    others = [r for r in reached if r["run"] != result.row["run"]]
    assert others and all(result.row["psnr"] - r["psnr"] > 0.1 for r in others)  # a choice without ties
    # the budget counts the trials that reached the target: 6 completed beside the pruned ones
    states = [t.state.name for t in journal(root / "runs" / "tiny_tune").trials]
    assert states.count("COMPLETE") == SPACE["trials"] and states.count("PRUNED") >= 1
    assert result.held_out_row is not None and "psnr_lo" in result.held_out_row
    assert result.held_out_row["run"] == result.row["run"]
    report = (result.folder / "tune" / "front.md").read_text()
    assert f"target {TARGET:g}x by flops" in report and result.row["run"] in report


def test_each_entrys_defaults_run_before_any_sampled_trial_where_the_space_holds_them(setup):
    """SPACE holds tomesd and the never-reusing first_block_cache as they are (nothing searched), but not
    block_cache's default interval 3 (it searches 2 and 4): the first two trials are those entries, then sampling."""
    root, _, _ = setup
    trials = journal(root / "runs" / "tiny_tune").trials
    assert [t.params["entry"] for t in trials[:2]] == ["0:tomesd", "2:first_block_cache"]
    assert [t.state.name for t in trials[:2]] == ["COMPLETE", "PRUNED"]
    assert [t.system_attrs.get("fixed_params") for t in trials[:2]] == [{"entry": "0:tomesd"},
                                                                        {"entry": "2:first_block_cache"}]
    assert not any("fixed_params" in t.system_attrs for t in trials[2:])


def test_a_tune_resumed_with_more_trials_does_not_try_a_default_again(setup, tmp_path):
    import shutil

    root, path, _ = setup
    shutil.copytree(root / "runs" / "tiny_tune", tmp_path / "tiny_tune")
    tomerge.tune(path, trials=SPACE["trials"] + 1, overrides=[f"out_dir={tmp_path}"], progress=False)
    trials = journal(tmp_path / "tiny_tune").trials
    assert [t.state.name for t in trials].count("COMPLETE") == SPACE["trials"] + 1
    assert [t.system_attrs.get("fixed_params") for t in trials].count({"entry": "0:tomesd"}) == 1


def test_a_default_is_tried_where_every_searched_option_holds_it():
    """The authors' defaults (docs/schedules.md, "Presets"): FORA's interval 3 (prathebaselva/FORA), TaylorSeer's
    interval 4 and order 4 (Shenyi-Z/TaylorSeer), first_block_cache's threshold 0.08 without accumulation. A choice
    gives its index, a range the value; an entry whose range or choices miss a default, or offer 0 for False, or a
    merge where a cache defaults to none, is not tried."""
    from tomerge.experiments.runs.search_space import Dimension, SearchSpace, SpaceEntry

    fixed, choice = Dimension("fixed", (0.0,)), lambda *v: Dimension("choice", v)
    entries = (
        SpaceEntry("fora", fixed, (("interval", choice(2, 3, 4, 5)),)),
        SpaceEntry("fora", fixed, (("interval", Dimension("int", (4, 6))),)),
        SpaceEntry("first_block_cache", fixed, (("threshold", Dimension("float", (0.02, 0.4))),
                                                ("accumulate", choice(True, False)))),
        SpaceEntry("first_block_cache", fixed, (("accumulate", choice(1, 0)),)),
        SpaceEntry("taylorseer", fixed, (("interval", Dimension("int", (2, 6))), ("forecast_order", choice(1, 2, 4)))),
        SpaceEntry("block_cache", Dimension("float", (0.0, 0.9)), (("merge", choice("tomesd", "ssm")),)),
        SpaceEntry("ssm", Dimension("float", (0.0, 0.9)), ()),
    )
    space = SearchSpace(10, "tpe", 0, ("psnr",), entries, {})
    assert space.default_trials() == [
        {"entry": "0:fora", "0:fora.interval": 1},
        {"entry": "2:first_block_cache", "2:first_block_cache.threshold": 0.08, "2:first_block_cache.accumulate": 1},
        {"entry": "4:taylorseer", "4:taylorseer.interval": 4, "4:taylorseer.forecast_order": 2},
        {"entry": "6:ssm"},
    ]


def test_a_step_that_jumps_past_the_target_resolves_to_the_ratio_above_it():
    """The FLOP-ideal speed-up is a step function of the ratio: SSM's 2 x 2 windows jump from 2.5x to 4.6x at
    0.75. Matching FLOPs keeps the closer side (2.5x, 0.5 from a 3x target); the tuner keeps the side that reaches."""
    from tomerge.experiments.config.schema import RunSpec
    from tomerge.experiments.runs.ablation import FlopSpeedups

    class Steps(FlopSpeedups):
        def __init__(self) -> None:  # no model: the speed-up is the step function
            pass

        def __call__(self, run, ratio):
            return 2.5 if ratio < 0.75 else 4.6

    steps, run = Steps(), RunSpec("ssm", 0.5, {})
    assert steps.bisect(run, 3.0, 0.0, 0.9, 1.0, 4.6) < 0.75  # |3 - 2.5| < |4.6 - 3|
    reached = steps.bisect(run, 3.0, 0.0, 0.9, 1.0, 4.6, reach=True)
    assert 0.75 <= reached <= 0.75 + 0.9 / 2**10 and reached == round(reached, 6)
    assert steps.bisect(run, 3.0, 0.0, 0.75, 1.0, 4.6, reach=True) == 0.75  # never above the range's top


def test_a_range_whose_lowest_ratio_is_within_half_a_percent_of_the_target_keeps_it(setup, monkeypatch):
    """A step cache counts 1.9987x at ratio 0 on the reference DiT at 4 steps (its bookkeeping): a ranged entry
    reaches a 2x target there as a fixed entry does, instead of merging a few tokens for the last 0.13%."""
    import types

    from tomerge.experiments.config.schema import RunSpec
    from tomerge.experiments.runs import ablation

    _, path, _ = setup
    config, space, _ = load_tune(path, [])

    class Counted:
        def __init__(self, source, config, items, base=None) -> None:
            self.base = 1.0

        def __call__(self, run, ratio):
            return 1.9987 if ratio == 0 else 2.01

        def bisect(self, *args, **kwargs):
            raise AssertionError("the lowest ratio reaches the target: nothing to bisect")

    monkeypatch.setattr(ablation, "FlopSpeedups", Counted)
    reach = tune_module._Reach(config, space, 2.0)
    run = RunSpec("tomesd", 0.5, {"use_rand": False, "merge_mlp": True})
    assert reach(types.SimpleNamespace(params={"entry": "0:tomesd"}), run).ratio == 0.0


def test_a_rerun_through_tomerge_tune_measures_nothing_again_and_draws_the_front(setup):
    root, path, result = setup
    before = [(root / "runs" / name / "results.jsonl").read_text() for name in ("tiny_tune", "tiny_tune_held_out")]
    trials = len(journal(root / "runs" / "tiny_tune").trials)
    again = tomerge.tune(path, progress=False)
    assert [(root / "runs" / name / "results.jsonl").read_text()
            for name in ("tiny_tune", "tiny_tune_held_out")] == before
    assert len(journal(root / "runs" / "tiny_tune").trials) == trials  # no default enqueued again
    assert again.recipe == result.recipe and again.held_out_row == result.held_out_row
    assert (result.folder / "tune" / "front.png").stat().st_size > 0


def test_the_recipe_round_trips_through_generate_and_apply(setup, tmp_path):
    root, _, result = setup
    recipe_file = result.folder / "tune" / "recipe.yaml"
    recipe = tomerge.Recipe.load(recipe_file)
    assert recipe == result.recipe
    from tomerge.experiments.commands import generate

    assert generate.main(["--config", str(recipe_file), "--out", str(tmp_path / "gen")]) == 0
    searched = sorted((result.folder / "images" / result.row["run"]).glob("*.png"))
    made = sorted((tmp_path / "gen").glob("*.png"))
    assert searched and [p.name for p in made] == [p.name for p in searched]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(made, searched))

    from tomerge.experiments.config.load import load_config
    from tomerge.experiments.sources.items import class_items

    config = load_config(recipe_file, [])
    source = config.model.load()
    items = class_items(list(config.classes), config.per_class, config.seed)[: config.batch_size]
    reference = source.generate(items)
    with tomerge.merging(source.target, recipe, num_steps=config.model.call["num_steps"]):
        merged = source.generate(items)
    from tomerge.experiments.generation.generate import merging
    from tomerge.experiments.config.schema import RunSpec

    with merging(source, RunSpec(recipe.strategy, recipe.ratio, dict(recipe.options))):
        expected = source.generate(items)
    assert torch.equal(merged, expected) and not torch.equal(merged, reference)


def test_bad_targets_fail_before_any_image_and_an_unreachable_one_names_the_fastest(setup, tmp_path):
    root, path, _ = setup
    with pytest.raises(ConfigError) as err:
        load_tune(path, ["tune.target=1", "tune.by=fast", "tune.objective=flops", "search.objectives=[psnr]"])
    text = str(err.value)
    for expected in ("tune.target is a speed-up > 1", "tune.by must be one of", "tune.objective must be a quality",
                     "search: has no objectives"):
        assert expected in text
    assert not (root / "runs" / "unreached").exists()
    config, space, spec = load_tune(path, ["name=unreached", "tune.target=50", "search.trials=3"])
    with pytest.raises(UsageError, match=r"no recipe of the space reached 50x .* the fastest found: \S+ at \d"):
        run_tune(config, space, spec, progress=False)
    assert not (root / "runs" / "unreached" / "images").exists() or not any(
        p.name != "baseline" for p in (root / "runs" / "unreached" / "images").iterdir())


def test_auto_measures_time_with_cuda_and_flops_without():
    assert TuneSpec.parse({"target": 2}, cuda=True).by == "time"
    cpu = TuneSpec.parse({"target": 2}, cuda=False)
    assert cpu.by == "flops" and "no CUDA device" in cpu.why and cpu.speedup_column == "flop_speedup"
    assert TuneSpec.parse({"target": 2, "by": "time"}, cuda=False).by == "time"


def test_apply_refuses_a_recipe_with_more_options_or_a_state_option_given_twice():
    recipe = tomerge.Recipe("tomesd", 0.5, {"use_rand": False})
    with pytest.raises(TypeError, match="a Recipe carries its ratio"):
        tomerge.apply(torch.nn.Linear(2, 2), recipe, ratio=0.3)
    with pytest.raises(TypeError, match=r"the Recipe sets \['seed'\] among its options"):
        tomerge.apply(torch.nn.Linear(2, 2), tomerge.Recipe("tomesd", 0.5, {"seed": 3}), seed=5)
    with pytest.raises(TypeError, match=r"the Recipe sets \['seed'\] among its options"):  # 0 is given too
        tomerge.apply(torch.nn.Linear(2, 2), tomerge.Recipe("tomesd", 0.5, {"seed": 3}), seed=0)


def test_the_shipped_tune_config_validates():
    from tomerge.experiments.config.schema import CONFIG_DIR

    config, space, spec = load_tune(CONFIG_DIR / "tune.yaml", [], cuda=False)
    assert (spec.target, spec.by, spec.objective) == (2.0, "flops", "fd_effnetlite0")
    assert space.objectives == ("fd_effnetlite0",) and space.sampler == "tpe" and space.held_out
    names = {e.strategy for e in space.entries}
    assert {"tomesd", "cached_detail", "block_cache", "first_block_cache", "toca", "fora"} <= names


def test_a_tune_on_a_pipeline_folder_returns_a_recipe_that_applies_to_the_pipeline(tmp_path):
    """The model of a tune is any model an ablation takes: here a tiny SD3 pipeline saved as a user's folder, with
    a prompt file. The recipe reaches the target, names the folder, and regenerates the search's images."""
    from helpers import local_pipelines

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a red fox in the snow\na lighthouse at dusk\n")
    config = {
        "name": "sd3_tune", "out_dir": str(tmp_path / "runs"), "wandb": "disabled",
        "model": {"pipeline": str(local_pipelines.pipeline_folder("sd3")), "dtype": "fp32",
                  "call": {**local_pipelines.CALL_DEFAULTS["sd3"], "num_inference_steps": 4}},
        "prompts": str(prompts), "seed": 5, "batch_size": 2, "timing_batch": 1, "warmup": 0, "repeats": 1,
        "search": {"trials": 3, "sampler": "random", "seed": 0, "held_out": {"seed": 50},
                   "space": [{"strategy": "tomesd", "ratio": {"low": 0.0, "high": 0.9}, "options": {"use_rand": False}},
                             {"strategy": "block_cache", "ratio": 0.0, "options": {"interval": [2]}}]},
        "tune": {"target": 1.2, "by": "flops", "objective": "psnr"},
    }
    path = tmp_path / "tune.yaml"
    path.write_text(yaml.safe_dump(config))
    result = tomerge.tune(path, progress=False)
    assert result.reached and all(r["flop_speedup"] >= 1.2 * tune_module.REACHED for r in result.reached)
    assert result.held_out_row is not None and result.held_out_row["n_images"] == 2
    recipe_file = result.folder / "tune" / "recipe.yaml"
    saved = yaml.safe_load(recipe_file.read_text())
    assert saved["model"]["pipeline"] == config["model"]["pipeline"] and saved["prompts"] == config["prompts"]
    assert tomerge.Recipe.load(recipe_file) == result.recipe
    from tomerge.experiments.commands import generate

    assert generate.main(["--config", str(recipe_file), "--out", str(tmp_path / "gen")]) == 0
    searched = sorted((result.folder / "images" / result.row["run"]).glob("*.png"))
    made = sorted((tmp_path / "gen").glob("*.png"))
    assert len(searched) == 2 and [p.name for p in made] == [p.name for p in searched]
    assert all(a.read_bytes() == b.read_bytes() for a, b in zip(made, searched))
    baseline = sorted((result.folder / "images" / "baseline").glob("*.png"))
    assert [p.read_bytes() for p in baseline] != [p.read_bytes() for p in made]  # the recipe changed the images
