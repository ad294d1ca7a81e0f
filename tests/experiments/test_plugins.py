"""Plugins without packaging (`--plugin`, `plugins:`): a strategy in one file, loaded by path or module
name, usable on bare tensors and in the CLI; clear errors; registering twice is harmless, also for a
decorated class that is its own entry point (no circular import)."""

import importlib
import pickle
import re
import sys
import uuid
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch

import tomerge
from tomerge import registry
from tomerge.attach import check_options
from tomerge.experiments import cli
from tomerge.experiments import plugins
from tomerge.experiments.plugins import PluginError, load_plugins

PLUGIN = '''\
from __future__ import annotations  # string annotations: dataclasses look the module up in sys.modules

import dataclasses
from typing import ClassVar

import torch

import tomerge


@tomerge.register_strategy({name!r})
@dataclasses.dataclass(frozen=True, kw_only=True)
class EveryOther(tomerge.MergeStrategy):
    """Even positions are destinations; each odd token merges into its left neighbour."""

    stride: int = 2

    def select_destinations(self, x, ctx):
        return torch.arange(0, x.shape[1], self.stride, device=x.device).expand(x.shape[0], -1)

    def merge_matrix(self, x, dst, ctx):
        B, N, _ = x.shape
        slot = torch.arange(N, device=x.device).div(self.stride, rounding_mode="floor")
        return tomerge.MergePlan.hard(slot.expand(B, -1), dst)
'''


def unique(prefix: str = "test_plugin") -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def strategy_file(folder: Path, name: str, stem: str | None = None, extra: str = "") -> Path:
    return write(folder / f"{stem or unique('tmplug')}.py", PLUGIN.format(name=name) + extra)


@pytest.fixture(autouse=True)
def clean_registry():
    """Names, modules and plugin records a test adds are removed again (other tests list strategies)."""
    before = {r: dict(r._classes) for r in (registry._strategies, registry._backbones)}
    loaded = dict(plugins._LOADED)
    yield
    for reg, classes in before.items():
        for name in set(reg._classes) - set(classes):
            if not reg._classes[name].__module__.startswith("tomerge."):  # keep lazily loaded built-ins
                del reg._classes[name]
        for name in set(reg._unverified) - set(classes):
            del reg._unverified[name]
    plugins._LOADED.clear()
    plugins._LOADED.update(loaded)
    for module in [m for m in sys.modules if m.startswith(("tomerge_plugin_", "tmplug_"))]:
        del sys.modules[module]


def check_usable(name: str) -> None:
    assert name in tomerge.list_strategies()
    x = torch.randn(2, 16, 4)
    plan = tomerge.get_strategy(name).plan(x, tomerge.MergeContext(grid=(4, 4), ratio=0.5))
    y = plan.merge(x)
    assert plan.num_removed == 8 and y.shape == (2, 8, 4)
    torch.testing.assert_close(y[:, 0], (x[:, 0] + x[:, 1]) / 2)


# ------------------------------------------------------------------------------------ loading
def test_a_file_plugin_registers_a_strategy_usable_on_bare_tensors(tmp_path):
    name = unique()
    path = strategy_file(tmp_path, name)
    [module] = load_plugins([str(path)])
    assert module.__name__ == plugins.module_name_for(path) and module.__name__.startswith("tomerge_plugin_tmplug_")
    assert sys.modules[module.__name__] is module and module.__file__ == str(path.resolve())
    check_usable(name)
    strategy = tomerge.get_strategy(name, stride=2)
    assert type(strategy) is module.EveryOther
    assert pickle.loads(pickle.dumps(strategy)) == strategy  # the class is found by its module name
    assert str(tmp_path) not in sys.path  # the plugin's folder is not added silently


def test_loading_the_same_file_twice_runs_it_once(tmp_path, monkeypatch):
    name = unique()
    counter = tmp_path / "runs.txt"
    path = strategy_file(tmp_path, name, extra=f"\nwith open({str(counter)!r}, 'a') as f:\n    f.write('x')\n")
    monkeypatch.chdir(tmp_path)
    first = load_plugins([str(path)])
    again = load_plugins([f"./{path.name}", str(path), path.name])  # other spellings of the same file
    assert counter.read_text() == "x"
    assert all(m is first[0] for m in again)
    assert plugins.loaded_plugins()[-1] == str(path.resolve())
    check_usable(name)


def test_a_module_plugin_and_the_same_file_by_path(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name = unique()
    stem = unique("tmplug")
    path = strategy_file(tmp_path, name, stem)
    [module] = load_plugins(stem)  # a single spec string is one plugin
    assert module.__name__ == stem
    check_usable(name)
    assert load_plugins([stem, str(path)]) == [module, module]  # already imported: not run again
    assert tomerge.registry.strategy_class(name) is module.EveryOther


def test_a_file_loaded_by_path_then_imported_by_module_name_is_one_registration(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    name, stem = unique(), unique("tmplug")
    path = strategy_file(tmp_path, name, stem)
    [by_path] = load_plugins([str(path)])
    by_name = importlib.import_module(stem)  # the same file runs again under another module name
    assert by_name is not by_path and by_name.EveryOther is not by_path.EveryOther
    assert tomerge.registry.strategy_class(name) is by_name.EveryOther  # the newer definition
    check_usable(name)


def test_relative_paths_resolve_against_base_dir_then_the_current_directory(tmp_path, monkeypatch):
    config_dir, cwd = tmp_path / "configs", tmp_path / "work"
    in_config, in_cwd, only_cwd = unique(), unique(), unique()
    strategy_file(config_dir / "plugins", in_config, "mine")
    strategy_file(cwd / "plugins", in_cwd, "mine")
    strategy_file(cwd / "other", only_cwd, "theirs")
    monkeypatch.chdir(cwd)
    load_plugins(["plugins/mine.py", "other/theirs.py"], base_dir=config_dir)
    names = tomerge.list_strategies()
    assert in_config in names and only_cwd in names and in_cwd not in names  # base_dir first
    load_plugins(["plugins/mine.py"])  # no base_dir: the current directory
    assert in_cwd in tomerge.list_strategies()
    assert plugins.resolve_specs(["plugins/mine.py", "my_pkg.strategies"], base_dir=config_dir) == [
        str((config_dir / "plugins" / "mine.py").resolve()), "my_pkg.strategies"]  # for workers elsewhere


# ------------------------------------------------------------------------------------ errors
def test_a_missing_file_or_module(tmp_path):
    with pytest.raises(PluginError, match=r"plugin file 'nowhere/mine\.py' not found .*nowhere/mine\.py"):
        load_plugins(["nowhere/mine.py"], base_dir=tmp_path)
    with pytest.raises(PluginError, match=r"plugin module 'tmplug_missing\.strategies' not found"):
        load_plugins(["tmplug_missing.strategies"])
    with pytest.raises(PluginError, match="is a folder"):
        load_plugins([str(tmp_path) + "/"])
    with pytest.raises(PluginError, match="neither a module name nor a path"):
        load_plugins(["not a module"])


def test_a_plugin_whose_import_raises(tmp_path):
    path = write(tmp_path / "broken.py", "import os\n\nraise ImportError('needs the foo package')\n")
    with pytest.raises(PluginError) as info:
        load_plugins([str(path)])
    message = str(info.value)
    assert f"plugin {str(path)!r} failed to import" in message
    assert f"{path.resolve()}:3" in message and "ImportError: needs the foo package" in message
    assert isinstance(info.value.__cause__, ImportError) and not isinstance(info.value.__cause__, PluginError)
    assert info.value.plugin == str(path)
    assert plugins.module_name_for(path) not in sys.modules  # no half-run module left behind
    with pytest.raises(PluginError, match="needs the foo package"):  # a retry runs it again
        load_plugins([str(path)])


def test_a_plugin_with_a_syntax_error(tmp_path):
    path = write(tmp_path / "typo.py", "import torch\n\ndef f(:\n    pass\n")
    with pytest.raises(PluginError, match=r"failed to import: SyntaxError: .*typo\.py, line 3") as info:
        load_plugins([str(path)])
    assert isinstance(info.value.__cause__, SyntaxError)


def test_a_plugin_importing_its_sibling_is_told_about_sys_path(tmp_path):
    helper = unique("tmplug")
    write(tmp_path / f"{helper}.py", "VALUE = 1\n")
    path = write(tmp_path / "uses_helper.py", f"import {helper}\n")
    hint = rf"ModuleNotFoundError: .*{helper}.*not put on sys.path: add {tmp_path} to PYTHONPATH"
    with pytest.raises(PluginError, match=hint):
        load_plugins([str(path)])


def test_a_name_clash_with_a_builtin_names_both_classes(tmp_path):
    path = strategy_file(tmp_path, "tomesd", "clash")
    with pytest.raises(PluginError) as info:
        load_plugins([str(path)])
    message = str(info.value)
    assert "a strategy named 'tomesd' is already registered by the built-in tomerge.strategies.tomesd.ToMeSD" in message
    assert f"cannot register {plugins.module_name_for(path)}.EveryOther from {path.resolve()}" in message
    assert isinstance(info.value.__cause__, ValueError)
    assert tomerge.registry.strategy_class("tomesd").__module__ == "tomerge.strategies.tomesd"  # not overridden


def test_a_name_clash_between_two_plugins_names_both_files(tmp_path):
    name = unique()
    first = strategy_file(tmp_path / "a", name, "same")
    second = strategy_file(tmp_path / "b", name, "same")  # same qualname, another file: another class
    load_plugins([str(first)])
    with pytest.raises(PluginError, match=rf"already registered by .*EveryOther from {first.resolve()}; "
                                          rf"cannot register .*EveryOther from {second.resolve()}"):
        load_plugins([str(second)])


# ------------------------------------------------------------------------------------ registry
def test_registering_the_same_class_twice_is_a_no_op_and_another_class_fails(tmp_path):
    name = unique()
    [module] = load_plugins([str(strategy_file(tmp_path, name))])
    cls = module.EveryOther
    assert tomerge.register_strategy(name)(cls) is cls
    assert tomerge.registry.strategy_class(name) is cls
    module.__spec__.loader.exec_module(module)  # run again (as reload, or a notebook cell re-run does):
    assert module.EveryOther is not cls  # same module and qualname, a new class object: same registration
    assert tomerge.registry.strategy_class(name) is module.EveryOther

    class Other(cls):
        pass

    with pytest.raises(ValueError, match=rf"already registered by .*EveryOther.*cannot register .*Other"):
        tomerge.register_strategy(name)(Other)


def _fake_entry_point(monkeypatch, name: str, value: str) -> None:
    eps = registry._strategies._eps()  # fill the cache, then add an entry point as an installed package would
    monkeypatch.setitem(eps, name, EntryPoint(name=name, value=value, group="tomerge.strategies"))


def _package(tmp_path: Path, monkeypatch, name: str, init: str = "") -> str:
    package = unique("tmplug")
    monkeypatch.syspath_prepend(str(tmp_path))
    write(tmp_path / package / "__init__.py", init)
    write(tmp_path / package / "strat.py", PLUGIN.format(name=name))
    return package


def test_a_decorated_class_that_is_its_own_entry_point_loads_without_a_circular_import(tmp_path, monkeypatch):
    """Issue 16: the decorator runs while the entry point imports its module; the registry must not
    load that entry point again (``partially initialized module ... has no attribute``)."""
    name = unique()
    package = _package(tmp_path, monkeypatch, name)
    _fake_entry_point(monkeypatch, name, f"{package}.strat:EveryOther")
    assert name in tomerge.list_strategies()
    cls = tomerge.registry.strategy_class(name)  # through the entry point
    assert cls is sys.modules[f"{package}.strat"].EveryOther
    check_usable(name)


def test_importing_a_module_that_is_also_an_entry_point(tmp_path, monkeypatch):
    name = unique()
    package = _package(tmp_path, monkeypatch, name)
    _fake_entry_point(monkeypatch, name, f"{package}.strat:EveryOther")
    module = importlib.import_module(f"{package}.strat")  # directly, while the package is "installed"
    assert tomerge.registry.strategy_class(name) is module.EveryOther


def test_an_entry_point_re_exporting_a_decorated_class(tmp_path, monkeypatch):
    name = unique()
    package = _package(tmp_path, monkeypatch, name, init="from .strat import EveryOther\n")
    _fake_entry_point(monkeypatch, name, f"{package}:EveryOther")  # an alias in the package
    module = importlib.import_module(f"{package}.strat")  # the package is mid-import when it registers
    assert tomerge.registry.strategy_class(name) is module.EveryOther
    check_usable(name)


def test_a_plugin_taking_the_name_of_another_packages_entry_point(tmp_path, monkeypatch):
    name = unique()
    package = _package(tmp_path, monkeypatch, unique())  # its class is registered under another name
    _fake_entry_point(monkeypatch, name, f"{package}.strat:EveryOther")
    path = strategy_file(tmp_path, name, "taker")
    with pytest.raises(PluginError, match=rf"already registered by {package}\.strat\.EveryOther "
                                          rf"\(entry point {package}\.strat:EveryOther\); cannot register"):
        load_plugins([str(path)])


# ------------------------------------------------------------------------------------ CLI
def test_cli_plugin_before_or_after_the_subcommand_adds_strategy_choices(tmp_path, capsys):
    forms = {}
    for form in ("global", "subcommand", "equals"):
        name = unique()
        path = str(strategy_file(tmp_path, name))
        forms[form] = name
        argv = {"global": ["--plugin", path, "generate", "--help"],
                "subcommand": ["generate", "--plugin", path, "--help"],
                "equals": ["generate", f"--plugin={path}", "--help"]}[form]
        with pytest.raises(SystemExit) as exit_:
            cli.main(argv)
        assert exit_.value.code == 0
        out = " ".join(capsys.readouterr().out.split())  # argparse wraps long lines
        assert f",{name}," in out.replace(" ", "") and "--plugin MODULE_OR_FILE" in out, form


def test_cli_passes_the_plugins_to_the_subcommand(tmp_path, monkeypatch):
    a, b = str(strategy_file(tmp_path, unique())), str(strategy_file(tmp_path, unique()))
    seen = []
    figures = importlib.import_module("tomerge.experiments.commands.figures")
    monkeypatch.setattr(figures, "run", lambda args: seen.append(args) or 0)
    assert cli.main(["--plugin", a, "figures", str(tmp_path), "--out", str(tmp_path / "f"), "--plugin", b]) == 0
    assert seen[0].plugins == [a, b] and not hasattr(seen[0], "subcommand_plugins")


def test_cli_reports_a_broken_plugin_in_one_line_with_exit_code_2(tmp_path, capsys):
    path = write(tmp_path / "broken.py", "raise RuntimeError('bad plugin')\n")
    assert cli.main(["figures", "--plugin", str(path), "--help"]) == 2
    captured = capsys.readouterr()
    assert captured.err == (f"tomerge: error: plugin {str(path)!r} failed to import (at {path.resolve()}:1): "
                            "RuntimeError: bad plugin\n")
    assert captured.out == ""
    assert cli.main(["--plugin", str(strategy_file(tmp_path, "tomesd")), "bench", "--help"]) == 2
    assert "already registered by the built-in" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ received attention
ATTENTION_PLUGIN = '''\
from __future__ import annotations

import dataclasses

import torch

import tomerge


@tomerge.register_strategy({name!r})
@dataclasses.dataclass(frozen=True, kw_only=True)
class MostAttendedKept(tomerge.MergeStrategy):
    """Needs received attention: the most attended tokens are the destinations, the others merge into slot 0.
    Its default sublayers are the base class's, attention and MLP."""

    @property
    def needs(self):
        return frozenset({{"received_attention"}})

    def select_destinations(self, x, ctx):
        M = x.shape[1] - ctx.tokens_to_remove(x.shape[1])
        return ctx.received_attention.topk(M, dim=1).indices.sort(dim=1).values  # [B, M]

    def merge_matrix(self, x, dst, ctx):
        B, N = x.shape[:2]
        assign = torch.zeros(B, N, dtype=torch.long, device=x.device)  # [B, N]: sources into slot 0
        assign.scatter_(1, dst, torch.arange(dst.shape[1], device=x.device).expand(B, -1))
        return tomerge.MergePlan.hard(assign, dst, backend="index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionEveryCall(tomerge.Schedule):
    """A schedule that merges the attention and the MLP with MostAttendedKept on every block call."""

    name = {name!r} + "_schedule"
    ratio: float = 0.5

    def decide(self, where):
        return tomerge.Decision(MostAttendedKept(), self.ratio, frozenset({{"attn", "mlp"}}))

    def strategies(self):
        return (MostAttendedKept(),)
'''

ATTENTION_MERGED_FIRST = "needs received attention and merges the attention sublayer ('attn')"


def native_dit():
    from tomerge.backbones.timm_dit import DiT, DiTConfig

    torch.manual_seed(0)
    model = DiT(DiTConfig(input_size=16, patch_size=2, in_channels=1, hidden_size=32, depth=2, num_heads=2,
                          num_classes=3, learn_sigma=False))
    return model.eval(), (torch.randn(2, 1, 16, 16), torch.tensor([0.3, 0.3]), torch.tensor([1, 2]))


def no_hooks_left(model: torch.nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_a_plugin_needing_received_attention_that_merges_the_attention_is_refused_before_any_call(tmp_path):
    name = unique()
    [module] = load_plugins([str(write(tmp_path / "attended.py", ATTENTION_PLUGIN.format(name=name)))])
    model, inputs = native_dit()
    # The block's attention has not run when its merge is planned: refused by check_options and apply, before
    # the model runs, saying what to change.
    for refused in (lambda: check_options(name, ratio=0.5),
                    lambda: tomerge.apply(model, name, ratio=0.5),
                    lambda: tomerge.apply(model, module.MostAttendedKept(), ratio=0.5, merge_mlp=True)):
        with pytest.raises(ValueError, match=re.escape(f"strategy {name!r} {ATTENTION_MERGED_FIRST}")) as info:
            refused()
        assert "merge_attn=False" in str(info.value) and "'received_attention' in the strategy's needs" in str(
            info.value)
        assert no_hooks_left(model) and "_tomerge_handle" not in model.__dict__
    # Merging only what runs after the probed attention works.
    assert check_options(name, ratio=0.5, merge_attn=False).sublayers == {"mlp"}
    with tomerge.merging(model, name, ratio=0.5, merge_attn=False) as handle, torch.no_grad():
        model(*inputs)
        records = handle.state.records
    assert len(records) == 2 and all(r.sublayers == ("mlp",) and r.num_removed == 32 for r in records)


def test_a_schedule_merging_the_attention_with_such_a_strategy_is_refused_at_its_first_block_call(tmp_path):
    name = unique()
    [module] = load_plugins([str(write(tmp_path / "attended.py", ATTENTION_PLUGIN.format(name=name)))])
    model, inputs = native_dit()
    # A schedule's sublayers are known only from its decisions: the same refusal at the first one, before a plan.
    with tomerge.merging(model, module.AttentionEveryCall()) as handle, torch.no_grad():
        with pytest.raises(ValueError, match=re.escape(f"strategy {name!r} (chosen by schedule "
                                                       f"'{name}_schedule' at step 0, layer 0) "
                                                       f"{ATTENTION_MERGED_FIRST}")) as info:
            model(*inputs)
        assert "refused at the first block call" in str(info.value) and handle.state.records == []
    assert no_hooks_left(model)


def test_the_cli_reports_that_refusal_in_one_line_before_any_image(tmp_path, capsys):
    name = unique()
    path = write(tmp_path / "attended.py", ATTENTION_PLUGIN.format(name=name))
    out = tmp_path / "out"
    assert cli.main(["--plugin", str(path), "generate", "--classes", "0", "--strategy", name, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tomerge generate: error: strategy {name!r} {ATTENTION_MERGED_FIRST}")
    assert len(err.splitlines()) == 1 and not out.exists()
