"""`tomerge ablate` end to end on a tiny DiT: rows, files, resume, and the W&B offline log."""

import json
from pathlib import Path

import pytest
import torch

from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.config.load import load_config
from tomerge.experiments.errors import UsageError
from helpers import ROOT
from helpers.tiny_reference import write_test_set, write_tiny_dit
from helpers.wandb_offline import offline_records


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablate")
    write_tiny_dit(root / "tiny.safetensors")
    data = write_test_set(root / "data")
    overrides = [f"model.reference={root / 'tiny.safetensors'}", "model.call.num_steps=2", f"data_root={data}",
                 f"out_dir={root / 'runs'}", "name=tiny", "classes=[0, 1]", "per_class=2", "batch_size=4",
                 "timing_batch=2",
                 "warmup=0", "repeats=1", "fd_reference_images=6", "wandb=offline",
                 "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}},"
                 " {strategy: ssm, ratios: [0.25, 0.5], options: {round_windows: 1}}]"]
    return root, overrides


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def test_ablation_writes_every_run_resumes_and_logs_to_wandb_offline(setup):
    root, overrides = setup
    folder = run_ablation(load_config(None, overrides), progress=False).path
    written = rows(folder)
    assert [r["run"] for r in written] == ["baseline", "tomesd-r0.5-use_rand=False", "ssm-r0.25-round_windows=1",
                                           "ssm-r0.5-round_windows=1"]
    for r in written[1:]:
        assert r["flops"] < r["flops_base"] and r["flop_speedup"] == pytest.approx(r["flops_base"] / r["flops"])
        assert r["time_s"] > 0 and 0 < r["ssim"] <= 1 and r["psnr"] > 0 and r["fd_effnetlite0_ref"] >= 0
        assert (folder / "images" / f"{r['run']}.png").exists()
        assert (folder / "maps" / f"{r['run']}.safetensors").exists()
        assert r["versions"]["torch"] and "git_commit" in r
    assert written[0]["psnr"] == 100.0  # the baseline against itself
    for r in written[1:]:  # 95% intervals around every quality value; one timing repeat: no speed-up interval
        for key in ("psnr", "ssim", "feat_cos_dist", "fd_effnetlite0", "fd_effnetlite0_ref"):
            assert r[f"{key}_lo"] <= r[key] <= r[f"{key}_hi"], key
        assert len(r["per_image"]["psnr"]) == 4 and r["speedup_lo"] is None and len(r["time_rounds_s"]) == 1
        assert sum(r["per_image"]["psnr"]) / 4 == pytest.approx(r["psnr"])
    assert "] |" in (folder / "table.md").read_text()  # value [lo, hi] cells
    from safetensors.torch import load_file
    from tomerge.experiments.runs.comparison import compare_runs

    features = load_file(folder / "features.safetensors")
    assert {f"run/{r['run']}" for r in written[1:]} | {"baseline", "reference"} == set(features)
    done, skipped, n = compare_runs(folder, "ssm-r0.25-round_windows=1", "ssm-r0.5-round_windows=1")
    assert [c.metric for c in done] == ["psnr", "ssim", "feat_cos_dist", "fd_effnetlite0", "fd_effnetlite0_ref"]
    assert not skipped and n == 4
    psnr = done[0]
    assert psnr.a == pytest.approx(written[2]["psnr"]) and psnr.b == pytest.approx(written[3]["psnr"])
    assert psnr.lo <= psnr.difference <= psnr.hi
    # a run of another folder with the same items and seeds pairs with this folder's; other items are refused
    other = run_ablation(load_config(None, [*overrides, "name=tiny_other",
                                            "grid=[{strategy: tomesd, ratios: [0.25], options: {use_rand: false}}]"]),
                         progress=False).path
    done, _, _ = compare_runs(folder, "ssm-r0.5-round_windows=1", "tomesd-r0.25-use_rand=False", folder_b=other)
    assert done[0].b == pytest.approx(rows(other)[1]["psnr"]) and done[0].a == pytest.approx(written[3]["psnr"])
    seeds = run_ablation(load_config(None, [*overrides, "name=tiny_seeds", "seed=7", "grid=[]"]), progress=False).path
    with pytest.raises(UsageError, match="do not hold the same baseline images"):
        compare_runs(folder, "baseline", "baseline", folder_b=seeds)
    table = (folder / "table.md").read_text()
    assert all(r["run"] in table for r in written)

    # An interrupted grid keeps what finished: drop the last row and rerun; only that run is redone.
    lines = (folder / "results.jsonl").read_text().splitlines()
    (folder / "results.jsonl").write_text("\n".join(lines[:-1]) + "\n")
    run_ablation(load_config(None, overrides), progress=False)
    again = rows(folder)
    assert [r["run"] for r in again] == [r["run"] for r in written]
    assert again[:3] == written[:3]

    # W&B offline: the run's config and metrics are in the local transaction log.
    _, records = offline_records(folder)
    config = next(r["run"]["config"]["update"] for r in records if r.get("type") == "run")
    assert config["model"]["call"]["num_steps"] == 2 and config["name"] == "tiny"
    logged = {k for r in records if r.get("type") == "history" for k in _history_keys(r)}
    assert "ssm-r0.5-round_windows=1/psnr" in logged and "tomesd-r0.5-use_rand=False/speedup" in logged


def test_rows_of_another_flop_counter_are_measured_again_reusing_their_images(setup):
    """A run folder whose FLOPs an older counter made (no ``flop_counter``) is not mixed with current counts:
    on resume those runs are measured again, and their images are not regenerated."""
    from tomerge.experiments.measure.flops import COUNTER_VERSION

    root, overrides = setup
    overrides = [*overrides, "name=recount", "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}]"]
    folder = run_ablation(load_config(None, overrides), progress=False).path
    first = rows(folder)
    assert [r["flop_counter"] for r in first] == [COUNTER_VERSION] * 2
    images = sorted((folder / "images" / "tomesd-r0.5-use_rand=False").glob("*.png"))
    stamps = [f.stat().st_mtime_ns for f in images]
    old = [{k: v for k, v in r.items() if k != "flop_counter"} for r in first]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    with pytest.warns(UserWarning, match="2 runs .* another FLOP counter"):
        run_ablation(load_config(None, overrides), progress=False)
    again = rows(folder)
    assert [r["run"] for r in again] == ["baseline", "tomesd-r0.5-use_rand=False"] * 2  # appended, the old kept
    assert [r.get("flop_counter") for r in again[2:]] == [COUNTER_VERSION] * 2
    assert again[3]["flops"] == first[1]["flops"] and again[3]["psnr"] == first[1]["psnr"]
    assert [f.stat().st_mtime_ns for f in images] == stamps  # images reused
    assert "tomesd-r0.5-use_rand=False" in (folder / "table.md").read_text()


def _history_keys(record: dict) -> list[str]:
    return list(record["history"].get("item", {}))  # {"key": value, ...} per logged step


def test_rows_written_before_intervals_get_them_on_resume_and_untimed_ones_are_named(setup):
    """A folder whose rows have no intervals (written before they were recorded): on resume each run's images are
    scored again and a row with the same values, its intervals and its features is appended; runs timed
    without rounds are named in a warning that says how to time them again."""
    root, overrides = setup
    overrides = [*overrides, "name=no_intervals", "repeats=2",
                 "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}]"]
    folder = run_ablation(load_config(None, overrides), progress=False).path
    first = rows(folder)
    assert first[1]["speedup_lo"] is not None
    old = [{k: v for k, v in r.items() if not k.endswith(("_lo", "_hi")) and k not in ("per_image", "time_rounds_s",
                                                                                       "time_rounds_base_s")}
           for r in first]
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in old))
    (folder / "features.safetensors").unlink()
    with pytest.warns(UserWarning, match=r"1 rows were timed before speed-up intervals.*tomesd-r0.5.*delete their lines"):
        run_ablation(load_config(None, overrides), progress=False)
    again = rows(folder)
    assert [r["run"] for r in again] == ["baseline", "tomesd-r0.5-use_rand=False"] * 2
    for before, after in zip(first, again[2:]):  # the same seeds, the same images: the same intervals
        assert {k: v for k, v in after.items() if k.endswith(("_lo", "_hi")) and not k.startswith("speedup")} == \
            {k: v for k, v in before.items() if k.endswith(("_lo", "_hi")) and not k.startswith("speedup")}
        assert after["per_image"] == before["per_image"] and after.get("speedup_lo") is None
    from safetensors.torch import load_file

    assert "run/tomesd-r0.5-use_rand=False" in load_file(folder / "features.safetensors")


def test_changed_config_in_the_same_folder_is_refused(setup):
    root, overrides = setup
    run_ablation(load_config(None, overrides), progress=False)
    with pytest.raises(ValueError, match="another config"):
        run_ablation(load_config(None, overrides + ["model.call.num_steps=3"]), progress=False)


def test_a_folder_saved_before_a_setting_existed_resumes(setup):
    """A run folder whose config.yaml lacks a key added since (``model.offload``) is the same ablation: it
    resumes without a run again; a saved key the current config does not have is a change."""
    import yaml

    root, overrides = setup
    folder = run_ablation(load_config(None, [*overrides, "name=older"]), progress=False).path
    before = rows(folder)
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    assert saved["model"].pop("offload") is None
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    run_ablation(load_config(None, [*overrides, "name=older"]), progress=False)
    assert rows(folder) == before
    saved["model"]["removed_setting"] = 1
    (folder / "config.yaml").write_text(yaml.safe_dump(saved))
    with pytest.raises(ValueError, match=r"another config \(changed: \['model'\]\)"):
        run_ablation(load_config(None, [*overrides, "name=older"]), progress=False)


def test_bad_config_keys_and_strategies_raise():
    with pytest.raises(ValueError, match="unknown key 'num_stepz'; did you mean 'model.call.num_steps'"):
        load_config(None, ["num_stepz=3"])
    with pytest.raises(ValueError, match="unknown strategy"):
        load_config(None, ["grid=[{strategy: nope, ratios: [0.5]}]"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        load_config(None, ["num_steps"])


def test_the_whole_grid_is_checked_before_any_work_and_every_problem_reported(tmp_path):
    """A bad ratio, a misspelled option, an unknown strategy and a bad adapter option in one grid: one error
    listing all four, raised by load_config (before the model is loaded or anything is generated)."""
    from tomerge.experiments.config.schema import ConfigError

    grid = ("grid=[{strategy: tomesd, ratios: [0.5, 1.5], options: {use_rand: false}},"
            " {strategy: tomesd, ratios: [0.25], options: {use_rnd: false}},"
            " {strategy: nope, ratios: [0.5]}, {strategy: ssm, ratios: [0.5], options: {window: 0}}]")
    with pytest.raises(ConfigError) as info:
        load_config(None, [grid, f"out_dir={tmp_path}"])
    problems = info.value.problems
    assert len(problems) == 4, problems
    assert "grid[0] (tomesd at ratio 1.5)" in problems[0] and "ratio" in problems[0]
    assert "grid[1]" in problems[1] and "use_rnd" in problems[1]
    assert "grid[2]" in problems[2] and "unknown strategy 'nope'" in problems[2]
    assert "grid[3]" in problems[3] and "window" in problems[3]
    assert not (tmp_path / "reference").exists()  # nothing was written
    with pytest.raises(ConfigError, match="model: .*not found"):
        load_config(None, [f"model.reference={tmp_path / 'missing.safetensors'}"])


def test_flop_matched_cells_find_the_closest_ratio_and_resume_by_target(setup):
    """A ``flop_speedups`` entry runs at the ratio whose counted FLOP-ideal speed-up is closest to the target:
    no ratio a step either side is closer. The row records the target and the ratio found; the run id names
    the target, so a rerun finds the run done without searching again."""
    from tomerge.experiments.runs.ablation import match_flop_speedups, measure_run
    from tomerge.experiments.config.schema import ConfigError, RunSpec

    root, overrides = setup
    grid = "grid=[{strategy: ssm, flop_speedups: [1.3], options: {round_windows: 1}}]"
    config = load_config(None, overrides + [grid, "name=matched"])
    folder = run_ablation(config, progress=False).path
    row = rows(folder)[-1]
    assert row["run"] == "ssm-flops1.3x-round_windows=1" and row["flop_target"] == 1.3

    source = config.model.load()
    items = config.items()[:1]
    base = measure_run(source, config, items, None, map_steps=False)["flops"]

    def speedup(ratio):
        run = RunSpec("ssm", ratio, {"round_windows": 1})
        return base / measure_run(source, config, items, run, map_steps=False)["flops"]

    found = row["ratio"]
    gap = abs(speedup(found) - 1.3)
    others = [abs(speedup(r / 20) - 1.3) for r in range(1, 19)]  # 0.05 .. 0.9
    assert gap <= min(others) + 1e-12 and gap < max(others)
    assert row["flop_speedup"] == pytest.approx(speedup(found), rel=1e-6)  # the timing batch scales with items

    before = (folder / "results.jsonl").read_text()
    run_ablation(config, progress=False)
    assert (folder / "results.jsonl").read_text() == before

    with pytest.raises(ConfigError, match="out of reach"):  # a usage error (exit code 2), not a bug
        match_flop_speedups(source, config, [RunSpec("tomesd", None, {"use_rand": False}, flop_target=50.0)], items)

    # sdtm's curve around centre 0 still merges its first steps: a target below that speed-up is out of reach,
    # not matched by a ratio near 0.
    curve = {"curve": "cosine", "deviation": 0.2}
    at_zero = base / measure_run(source, config, items, RunSpec("sdtm", 0.0, curve), map_steps=False)["flops"]
    assert at_zero > 1.01
    with pytest.raises(ConfigError, match="out of reach"):
        match_flop_speedups(source, config, [RunSpec("sdtm", None, curve, flop_target=1 + (at_zero - 1) / 2)], items)


def test_flop_matched_entries_are_checked_with_the_grid():
    from tomerge.experiments.config.schema import ConfigError

    grid = ("grid=[{strategy: ssm, ratios: [0.5], flop_speedups: [1.5]}, {strategy: ssm, flop_speedups: [0.9, 1.5]},"
            " {strategy: ssm, flop_speedups: [1.5], options: {window: 0}}]")
    with pytest.raises(ConfigError) as info:
        load_config(None, [grid])
    problems = info.value.problems
    assert len(problems) == 3, problems
    assert "ratios or flop_speedups" in problems[0]
    assert "grid[1]" in problems[1] and "[0.9]" in problems[1]
    assert "grid[2]" in problems[2] and "window" in problems[2]


def test_the_parent_releases_its_model_before_ranks_generate(setup, monkeypatch):
    """With ``devices > 1`` every rank loads its own model: the process running the grid drops its copy (and on
    CUDA empties the cache) before the ranks start, so no copy of it sits on cuda:0 beside rank 0's, and loads it
    again for the FLOPs and timings. The ranks are stood in for by one process generating the same images."""
    import gc
    import weakref

    from tomerge.experiments.generation import generate as gen
    from tomerge.experiments.runs import ablation
    from tomerge.experiments.sources.models import ModelSpec

    root, overrides = setup
    parent_models: list[weakref.ref] = []
    in_ranks = [False]
    load = ModelSpec.load

    def recording_load(self):
        source = load(self)
        if not in_ranks[0]:
            parent_models.append(weakref.ref(source.denoiser))
        return source

    alive_at_start: list[int] = []

    def ranks(items, spec, out, devices, accelerator, launcher, progress):
        gc.collect()
        alive_at_start.append(sum(ref() is not None for ref in parent_models))
        assert (devices, accelerator, launcher) == (2, "cpu", "ddp_fork")
        in_ranks[0] = True
        try:
            gen.generate_local(items, spec, out, progress=False)
        finally:
            in_ranks[0] = False
        return True

    monkeypatch.setattr(ModelSpec, "load", recording_load)
    monkeypatch.setattr(ablation, "generate_distributed", ranks)
    folder = run_ablation(load_config(None, [*overrides, "name=parent", "devices=2"]), progress=False).path
    written = rows(folder)
    assert [r["run"] for r in written] == ["baseline", "tomesd-r0.5-use_rand=False", "ssm-r0.25-round_windows=1",
                                           "ssm-r0.5-round_windows=1"]
    assert alive_at_start == [0, 0, 0, 0]  # the baseline and three runs: no parent model alive when ranks start
    assert len(parent_models) == 5  # loaded at the start (items, FLOP matching) and again after each generation
    # merging's own FLOPs per image: none unmerged; tomesd's similarity matmuls, a small part of its FLOPs
    assert written[0]["merge_gflops"] == 0
    assert 0 < written[1]["merge_gflops"] * 1e9 < written[1]["flops_per_image"] / 10


def test_a_run_folders_config_yaml_loads_back_as_the_config_that_made_it(setup):
    """``tomerge ablate --config runs/NAME/config.yaml`` reads the saved config (its ``model`` is written as
    ``{kind, path, ...}``), gets the config the folder was made with, and resumes that folder."""
    root, overrides = setup
    overrides = [*overrides, "name=roundtrip", "wandb=disabled", "model.call.cfg_scale=1.5",
                 "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}]"]
    original = load_config(None, overrides)
    folder = run_ablation(original, progress=False).path
    saved = folder / "config.yaml"
    assert "kind: reference" in saved.read_text()  # the saved form, not the one a user writes
    loaded = load_config(saved, check_inputs=True)  # what `tomerge ablate --config` calls
    assert loaded == original
    assert loaded.model.path == str(root / "tiny.safetensors") and loaded.model.call["cfg_scale"] == 1.5
    before = (folder / "results.jsonl").read_text()
    run_ablation(loaded, progress=False)  # the same folder, the same config: resumes, nothing to run
    assert (folder / "results.jsonl").read_text() == before


@pytest.mark.parametrize("saved", sorted(ROOT.glob("docs/runs/*/config.yaml")),
                         ids=lambda p: p.parent.name)
def test_the_committed_run_folders_configs_load(saved):
    import yaml

    config = load_config(saved)
    raw = yaml.safe_load(saved.read_text())
    assert config.to_dict()["model"] == raw["model"] and config.name == raw["name"]
    assert [e["strategy"] for e in config.grid] == [e["strategy"] for e in raw["grid"]]


def test_the_saved_model_form_is_checked_and_a_set_source_replaces_it():
    from tomerge.experiments.config.load import apply_override
    from tomerge.experiments.sources.models import ModelSpec

    saved = {"kind": "reference", "path": "bundled-1024", "dtype": "fp32", "device": "cpu", "offload": None,
             "call": {"num_steps": 20}}
    assert ModelSpec.parse(saved) == (ModelSpec(path="bundled-1024", call={"num_steps": 20}), [])
    assert ModelSpec.parse({**saved, "path": None})[0] == ModelSpec(call={"num_steps": 20})
    assert ModelSpec.parse({**saved, "kind": "unet"})[1] == ["model.kind must be reference or pipeline, got 'unet'"]
    assert "keep one" in ModelSpec.parse({**saved, "reference": "bundled"})[1][0]
    values = {"model": dict(saved)}
    apply_override(values, "model.reference", "bundled")  # the source named anew: kind and path go
    assert values["model"] == {"dtype": "fp32", "device": "cpu", "offload": None, "call": {"num_steps": 20},
                               "reference": "bundled"}
    values = {"model": dict(saved)}
    apply_override(values, "model.pipeline", "/m/sd3")  # another source: the reference's settings go
    assert values["model"] == {"pipeline": "/m/sd3"}
