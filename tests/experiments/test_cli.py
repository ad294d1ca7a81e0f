"""The `tomerge` command line: user errors in one line (exit 2), bugs with their traceback (exit 1),
Ctrl-C in one line saying what resumes (exit 130), `--debug` re-raising everything; `--help` without
the heavy imports, and `ablate --help` listing every config key with its default."""

from __future__ import annotations

import dataclasses
import importlib
import json
import re
import subprocess
import sys

import pytest

from tomerge.experiments import cli
from tomerge.experiments.config.help import config_help
from tomerge.experiments.config.schema import AblationConfig, ConfigError, MetricsConfig

BAD_GRID = "grid=[{strategy: tomesd, ratios: [1.5]}]"


def _patch_run(monkeypatch, command: str, error: BaseException) -> None:
    module = importlib.import_module(cli.SUBCOMMANDS[command][0])

    def run(args):
        raise error

    monkeypatch.setattr(module, "run", run)


# ------------------------------------------------------------------------------------ user errors
def test_a_bad_config_is_one_error_message_with_exit_code_2(tmp_path, capsys):
    assert cli.main(["ablate", "--set", BAD_GRID, "--out-dir", str(tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        "tomerge ablate: error: the config has 1 problem(s):",
        "  - grid[0] (tomesd at ratio 1.5): ratio must be a number in [0, 1), got 1.5",
    ]
    assert "Traceback" not in captured.err and captured.out == ""
    assert not (tmp_path / "reference").exists()  # nothing was started


@pytest.mark.parametrize("where", ["before", "after"])
def test_debug_re_raises_user_errors(tmp_path, where):
    argv = ["ablate", "--set", BAD_GRID, "--out-dir", str(tmp_path)]
    argv = ["--debug", *argv] if where == "before" else [*argv, "--debug"]
    with pytest.raises(ConfigError, match=r"ratio must be a number in \[0, 1\), got 1.5"):
        cli.main(argv)


@pytest.mark.parametrize("argv, message", [
    (["ablate", "--config", "/nonexistent/grid.yaml"], "tomerge ablate: error: config /nonexistent/grid.yaml not found"),
    (["ablate", "--set", "grid=[{"], "tomerge ablate: error: --set grid=[{: the value is not valid YAML"),
    (["generate", "--classes", "0", "--prompts", "p.txt", "--out", "unused"],
     "tomerge generate: error: --prompts needs a text-to-image --pipeline"),
    (["generate", "--classes", "0", "--strategy", "tomesd", "--set", "use_rnd=false", "--out", "unused"],
     "tomerge generate: error: unknown option(s) ['use_rnd'] for strategy 'tomesd'"),
])
def test_user_errors_of_each_kind_are_one_line(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and len(err.splitlines()) == 1 and "Traceback" not in err


def test_value_errors_are_the_users_only_inside_user_input(monkeypatch, capsys):
    def checked(args):
        with cli.user_input():
            raise ValueError("--ratio must be below 1")

    module = importlib.import_module("tomerge.experiments.commands.bench")
    monkeypatch.setattr(module, "run", checked)
    assert cli.main(["bench", "--kernels"]) == 2
    assert capsys.readouterr().err == "tomerge bench: error: --ratio must be below 1\n"

    _patch_run(monkeypatch, "bench", ValueError("an internal shape mismatch"))  # outside: a bug
    assert cli.main(["bench", "--kernels"]) == 1
    assert "Traceback" in capsys.readouterr().err

    _patch_run(monkeypatch, "bench", FileNotFoundError("prompt file not found: p.txt"))  # anywhere: the user's
    assert cli.main(["bench", "--kernels"]) == 2
    assert capsys.readouterr().err == "tomerge bench: error: prompt file not found: p.txt\n"


# ------------------------------------------------------------------------------------ bugs, Ctrl-C
def test_a_bug_prints_its_traceback_and_asks_for_a_report(monkeypatch, capsys):
    _patch_run(monkeypatch, "ablate", RuntimeError("boom"))
    assert cli.main(["ablate"]) == 1
    err = capsys.readouterr().err
    assert "Traceback (most recent call last)" in err and "RuntimeError: boom" in err
    assert err.splitlines()[-1].startswith("tomerge ablate: internal error (RuntimeError): this is a bug")
    assert "report it" in err.splitlines()[-1]
    with pytest.raises(RuntimeError, match="boom"):
        cli.main(["ablate", "--debug"])


def test_a_closed_output_pipe_ends_the_command_quietly(monkeypatch, capsys):
    _patch_run(monkeypatch, "backbones", BrokenPipeError(32, "Broken pipe"))
    assert cli.main(["backbones"]) == 141
    assert capsys.readouterr().err == ""
    with pytest.raises(BrokenPipeError):
        cli.main(["--debug", "backbones"])


def test_ctrl_c_says_that_rerunning_resumes(monkeypatch, capsys):
    _patch_run(monkeypatch, "ablate", KeyboardInterrupt())
    assert cli.main(["ablate"]) == 130
    err = capsys.readouterr().err
    assert err.strip() == ("tomerge ablate: interrupted; finished runs and images are kept, "
                           "rerun the same command to resume")
    _patch_run(monkeypatch, "generate", KeyboardInterrupt())
    assert cli.main(["generate", "--classes", "0", "--out", "unused"]) == 130
    assert "finished images are kept, rerun the same command to resume" in capsys.readouterr().err
    with pytest.raises(KeyboardInterrupt):
        cli.main(["--debug", "generate", "--classes", "0", "--out", "unused"])


def test_python_dash_m_reports_errors_as_the_command_does(monkeypatch, capsys):
    gen = importlib.import_module("tomerge.experiments.commands.generate")
    monkeypatch.setattr(sys, "argv", ["generate.py", "--classes", "0", "--prompts", "p.txt", "--out", "unused"])
    with pytest.raises(SystemExit) as exit_:
        cli.module_main("generate", gen.main)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == "tomerge generate: error: --prompts needs a text-to-image --pipeline\n"


# ------------------------------------------------------------------------------------ --help
def test_help_imports_no_subcommand_module_and_no_torch():
    code = (
        "import json, sys\n"
        "from tomerge.experiments import cli\n"
        "seen = {}\n"
        "for argv in (['--help'], ['ablate', '--help'], ['generate', '--help'], ['bench', '--help'],\n"
        "             ['train-reference', '--help'], ['figures', '--help'], ['backbones', '--help']):\n"
        "    try:\n"
        "        cli.main(argv)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "    heavy = sorted(m for m in sys.modules if m.split('.')[0] in\n"
        "                   ('torch', 'diffusers', 'transformers', 'timm', 'pytorch_lightning', 'wandb', 'matplotlib'))\n"
        "    subcommands = sorted(m for m in sys.modules if m.startswith('tomerge.experiments.')\n"
        "                         and m.rsplit('.', 1)[1] in ('ablate', 'generate', 'figures', 'bench', 'train_reference',\n"
        "                                                     'coverage'))\n"
        "    seen[' '.join(argv)] = [heavy[:3], subcommands]\n"
        "print(json.dumps(seen))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen["--help"] == [[], []]  # the top-level help builds no subcommand
    for argv, (heavy, _) in seen.items():
        assert heavy == [], argv
    assert "tomerge.experiments.commands.figures" not in seen["train-reference --help"][1]


def test_ablate_help_lists_every_config_key_with_its_default(capsys):
    with pytest.raises(SystemExit):
        cli.main(["ablate", "--help"])
    out = capsys.readouterr().out
    assert out.endswith(config_help() + "\n")
    text = config_help(width=10**6)
    for field in dataclasses.fields(AblationConfig):  # each key with its default, in a line of its own or a group
        assert re.search(rf"^  (\S+ = .*, )?{field.name} = ", text, re.M), field.name
    for field in dataclasses.fields(MetricsConfig):
        assert f"\n  metrics.{field.name} = " in text, field.name
    assert "\n  classes = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9], per_class = 4\n" in text
    assert "  model.dtype = fp32\n      fp32, fp16 or bf16" in text
    assert "  model.call = {num_steps: 20, cfg_scale: 2.0, shift: 1.0}" in text
    assert "  metrics.batch_size = 32\n      images per feature-extractor forward." in text
    assert "[ablate.yaml: fd_reference_images: 500]" in text  # what the default config changes
