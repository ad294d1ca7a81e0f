"""Bad input as a new user writes it (issue 25, items 1-2): every problem of a config in one ConfigError, one
line each, with the closest valid key or where a key written at the top belongs; hints that name options the
command has; the inputs of `tomerge ablate` (Fashion-MNIST, EfficientNet-Lite0) checked before any image."""

from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest
import torch

from tomerge.backbones.timm_dit import DiT, DiTConfig, save_dit
from tomerge.experiments import cli
from tomerge.experiments.config.load import load_config
from tomerge.experiments.config.schema import ConfigError
from tomerge.experiments.sources.data import write_idx

BAD_CONFIG = """\
per_clas: 1
num_steps: 2
grid:
  - {strategy: tomesd, ratios: [0.5, 1.5], options: {use_rnd: false}}
"""
EXPECTED = [
    "unknown key 'per_clas'; did you mean 'per_class'?",
    "unknown key 'num_steps': it is model.call.num_steps (model: {call: {num_steps: 2}})",
    "grid[0] (tomesd): unknown option 'use_rnd' for strategy 'tomesd'; did you mean 'use_rand'?",
    "grid[0] (tomesd at ratio 1.5): ratio must be a number in [0, 1), got 1.5",
]


@pytest.fixture
def bad_config(tmp_path) -> Path:
    path = tmp_path / "bad.yaml"
    path.write_text(BAD_CONFIG)
    return path


def problems_of(*overrides: str, path: Path | None = None, **kwargs) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, list(overrides), **kwargs)
    return info.value.problems


# ------------------------------------------------------------------------------------ every problem at once
def test_every_problem_of_a_config_is_reported_at_once_with_hints(bad_config, tmp_path):
    """Unknown keys no longer stop the check: the grid is checked too, and in the grid entry the unknown
    option does not hide the bad ratio."""
    assert problems_of(f"out_dir={tmp_path / 'runs'}", path=bad_config) == EXPECTED
    assert not (tmp_path / "runs").exists()


def test_the_command_line_prints_every_problem_with_exit_code_2(bad_config, tmp_path, capsys):
    assert cli.main(["ablate", "--config", str(bad_config), "--out-dir", str(tmp_path / "runs")]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == ["tomerge ablate: error: the config has 4 problem(s):",
                                         *(f"  - {p}" for p in EXPECTED)]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "runs").exists()


def test_set_gives_the_dotted_key_as_an_option():
    assert problems_of("per_clas=1", "num_steps=2")[:2] == [
        "unknown key 'per_clas'; did you mean 'per_class'?",
        "unknown key 'num_steps': it is model.call.num_steps (--set model.call.num_steps=2)",
    ]


def test_keys_of_nested_mappings_are_checked_and_suggested_too():
    problems = problems_of("dtype=fp16", "clip_model=/m/clip", "model.dtpye=fp16", "model.num_steps=3",
                           "model.call.num_inference_steps=5", "metrics.clip_modle=/m/clip",
                           "metrics.fd_reference_images=3", "metrics.batch_size=0", "num_stepz=3")
    assert problems == [
        "unknown key 'dtype': it is model.dtype (--set model.dtype=fp16)",
        "unknown key 'clip_model': it is metrics.clip_model (--set metrics.clip_model=/m/clip)",
        "unknown key 'num_stepz'; did you mean 'model.call.num_steps'?",
        "unknown key 'model.dtpye'; did you mean 'model.dtype'?",
        "unknown key 'model.num_steps': it is a call argument, model.call.num_steps",
        "unknown model.call argument(s) ['num_inference_steps'] for the reference DiT ('num_inference_steps': "
        "the reference DiT calls it 'num_steps'); valid: ['cfg_scale', 'num_steps', 'shift']",
        "unknown key 'metrics.clip_modle'; did you mean 'metrics.clip_model'?",
        "unknown key 'metrics.fd_reference_images': it is a top-level key, fd_reference_images",
        "metrics.batch_size must be an integer >= 1, got 0",
    ]


def test_a_key_with_nothing_close_lists_the_valid_keys():
    (problem,) = problems_of("zzzz=1")
    assert problem.startswith("unknown key 'zzzz'; valid keys: ['name', 'model', ")


def test_grid_entries_report_each_problem_once():
    grid = ("grid=[{strategy: tomsed, ratios: [0.5]}, {strategy: ssm, ratio: [0.5]},"
            " {strategy: ssm, ratios: [0.5, 0.25, 2], options: {window: 0, round_windws: 1}}]")
    problems = problems_of(grid)
    assert problems[0].startswith("grid[0] (tomsed): unknown strategy 'tomsed'; did you mean 'tomesd'? (registered: ")
    assert problems[1] == "grid[1]: unknown entry key 'ratio'; did you mean 'ratios'?"  # not also "no ratios"
    assert problems[2] == ("grid[2] (ssm): unknown option 'round_windws' for strategy 'ssm'; did you mean "
                           "'round_windows'?")
    assert problems[3].startswith("grid[2] (ssm at ratios 0.5, 0.25): ssm: window must be an int >= 2")
    assert problems[4] == "grid[2] (ssm at ratio 2): ratio must be a number in [0, 1), got 2"
    assert len(problems) == 5, problems


def test_the_option_values_of_an_entry_with_no_valid_ratio_are_still_checked():
    problems = problems_of("grid=[{strategy: ssm, ratios: [1.5], options: {window: 0}}]")
    assert len(problems) == 2 and "window must be an int >= 2" in problems[0] and "got 1.5" in problems[1]


def test_unknown_options_outside_configs_suggest_the_closest_too():
    from tomerge.attach import check_options

    with pytest.raises(TypeError, match=r"unknown option\(s\) \['use_rnd'\] for strategy 'tomesd' "
                                        r"\(did you mean 'use_rand'\?\); valid options: \["):
        check_options("tomesd", ratio=0.5, use_rnd=False)


def test_pipeline_call_arguments_name_the_pipeline_spelling():
    from tomerge.experiments.sources.call_arguments import check_call

    class TinyPipeline:
        def __call__(self, prompt=None, num_inference_steps=28, guidance_scale=7.0, height=None):
            pass

    with pytest.raises(ValueError) as info:
        check_call(TinyPipeline, {"num_steps": 3, "hieght": 64})
    assert str(info.value) == (
        "unknown model.call argument(s) ['hieght', 'num_steps'] for TinyPipeline ('hieght': did you mean "
        "'height'?; 'num_steps': TinyPipeline calls it 'num_inference_steps'); valid: ['guidance_scale', "
        "'height', 'num_inference_steps']")


def test_prompts_keys_suggest_the_closest():
    from tomerge.experiments.sources.prompt_sets import PromptSet

    with pytest.raises(ValueError, match=r"unknown prompts key\(s\) \['templat'\]; valid keys: \[.*\] "
                                         r"\(did you mean 'template' for 'templat'\?\)"):
        PromptSet.from_config({"file": "p.txt", "templat": "a {name}"})


# ------------------------------------------------------------------------------------ inputs before any image
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("inputs")
    torch.manual_seed(0)
    save_dit(DiT(DiTConfig(input_size=16, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                           num_classes=3)), root / "tiny.safetensors")
    data = root / "data"
    data.mkdir()
    write_idx(data / "t10k-images-idx3-ubyte", torch.randint(0, 256, (4, 12, 12), dtype=torch.uint8))
    write_idx(data / "t10k-labels-idx1-ubyte", torch.randint(0, 10, (4,), dtype=torch.uint8))
    overrides = [f"model.reference={root / 'tiny.safetensors'}", "model.call.num_steps=2", "classes=[0, 1]",
                 "per_class=1", "batch_size=2", "timing_batch=1", "warmup=0", "repeats=1", "fd_reference_images=4",
                 "wandb=disabled", "grid=[{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}]"]
    return root, data, overrides


def images_under(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*.png")) if folder.exists() else []


def test_a_missing_data_root_stops_the_ablation_before_any_image(tiny, tmp_path):
    from tomerge.experiments.runs.ablation import run_ablation

    root, _, overrides = tiny
    runs = tmp_path / "runs"
    config = load_config(None, [*overrides, f"out_dir={runs}", f"data_root={tmp_path / 'no-data'}"])
    with pytest.raises(ConfigError) as info:
        run_ablation(config, progress=False)
    (problem,) = info.value.problems
    assert problem.startswith(f"data_root: Fashion-MNIST folder {tmp_path / 'no-data'} does not exist")
    assert "--set data_root=DIR" in problem and "--set fd_reference_images=0" in problem
    assert "--data-root" not in problem
    assert images_under(runs) == []


def test_the_command_line_reports_missing_data_with_the_other_problems_before_any_image(tiny, tmp_path, capsys):
    root, data, overrides = tiny
    runs = tmp_path / "runs"
    empty = tmp_path / "empty"
    empty.mkdir()
    argv = ["ablate", *(a for o in overrides for a in ("--set", o)), "--set", f"data_root={empty}",
            "--set", "per_clas=1", "--out-dir", str(runs)]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "tomerge ablate: error: the config has 2 problem(s):"
    assert err[1] == "  - unknown key 'per_clas'; did you mean 'per_class'?"
    assert err[2].startswith(f"  - data_root: Fashion-MNIST file t10k-images-idx3-ubyte(.gz) not found in {empty}; "
                             "install the Debian package dataset-fashion-mnist")
    assert "--set data_root=DIR" in err[2]
    assert images_under(runs) == []

    # with the data there, the same command runs
    argv = ["ablate", *(a for o in overrides for a in ("--set", o)), "--set", f"data_root={data}",
            "--out-dir", str(runs)]
    assert cli.main(argv) == 0
    assert images_under(runs)


def test_fd_reference_images_0_or_a_cached_folder_needs_no_data(tiny, tmp_path):
    root, _, overrides = tiny
    missing = f"data_root={tmp_path / 'no-data'}"
    base = [*overrides, f"out_dir={tmp_path / 'runs'}", "name=cached", missing]
    assert load_config(None, [*base, "fd_reference_images=0"], check_inputs=True).input_problems() == []
    config = load_config(None, base)
    assert len(config.input_problems()) == 1
    (tmp_path / "runs" / "cached").mkdir(parents=True)
    (tmp_path / "runs" / "cached" / "features.safetensors").write_bytes(b"")  # the features were computed before
    assert config.input_problems() == []


# ------------------------------------------------------------------------------------ hints that exist
def _options_of(command: str) -> set[str]:
    parser = argparse.ArgumentParser()
    importlib.import_module(cli.SUBCOMMANDS[command][0]).add_arguments(parser)
    return {o for action in parser._actions for o in action.option_strings} | {"--plugin", "--debug"}


def _flags(message: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", message))


def test_every_data_hint_names_an_option_of_the_command_that_prints_it(tmp_path, capsys):
    missing = tmp_path / "no-data"
    assert cli.main(["train-reference", "--data-root", str(missing), "--max-steps", "1",
                     "--out-dir", str(tmp_path / "ckpt")]) == 2
    train = capsys.readouterr().err
    assert "pass --data-root DIR" in train
    assert cli.main(["ablate", "--set", f"data_root={missing}", "--out-dir", str(tmp_path / "runs")]) == 2
    ablate = capsys.readouterr().err
    assert "--set data_root=DIR" in ablate
    for command, message in (("train-reference", train), ("ablate", ablate)):
        assert _flags(message) and _flags(message) <= _options_of(command), (command, message)
    assert "--data-root" not in _options_of("ablate")
