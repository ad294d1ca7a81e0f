"""`tomerge ablate` and `tomerge generate` on text-to-image pipeline folders, end to end and offline.

The folders are tiny random-weight pipelines of each family with their text encoders and locally built
tokenizers (tests/helpers/local_pipelines.py), loaded with ``from_pretrained(..., local_files_only=True)`` as a
researcher's weights are. Checked: a 2-strategy x 2-prompt x 2-step ablation on every family (rows,
PNGs, prompt index, table), resume after an interruption without losing finished images, 2 gloo ranks
producing every prompt once and the same pixels as one process, CLIP score from a local CLIP folder,
W&B captions, figures, and clear errors on bad inputs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from helpers import local_pipelines
from tomerge.experiments.generation import generate as gen
from tomerge.experiments.runs.ablation import run_ablation
from tomerge.experiments.cli import main as cli
from tomerge.experiments.config.load import load_config

pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk"]
# SDXL has no attention at full latent resolution (as the released model): merge one level down.
ADAPTER = {"sdxl": {"max_downsample": 2}}


def _pixels(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im)


def write_config(tmp_path: Path, family: str, name: str, **extra) -> Path:
    """A config file as a researcher writes one: pipeline folder, call arguments, prompt file, grid."""
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    options = ADAPTER.get(family, {})
    config = {
        "name": name, "out_dir": str(tmp_path / "runs"), "wandb": "disabled",
        "model": {"pipeline": str(local_pipelines.pipeline_folder(family)), "dtype": "fp32",
                  "call": local_pipelines.CALL_DEFAULTS[family]},
        "prompts": str(prompts), "seed": 5, "batch_size": 2, "timing_batch": 1, "warmup": 0, "repeats": 2,
        "grid": [{"strategy": "tomesd", "ratios": [0.5], "options": {"use_rand": False, **options}},
                 {"strategy": "ssm", "ratios": [0.5], "options": {"round_windows": 1, **options}}],
        **extra,
    }
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rows(folder: Path) -> list[dict]:
    return [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("family", local_pipelines.FAMILIES)
def test_ablation_on_every_family_from_a_prompt_file(tmp_path, family):
    folder = run_ablation(load_config(write_config(tmp_path, family, family)), progress=False).path
    written = rows(folder)
    extra = "-max_downsample=2" if family == "sdxl" else ""  # options are sorted into the run id
    assert [r["run"] for r in written] == ["baseline", f"tomesd-r0.5{extra}-use_rand=False",
                                           f"ssm-r0.5{extra}-round_windows=1"]
    files = ["00000_seed5.png", "00001_seed6.png"]
    index = [json.loads(line) for line in (folder / "images" / "baseline" / "prompts.jsonl").read_text().splitlines()]
    assert [(i["file"], i["prompt"], i["seed"]) for i in index] == [(files[0], PROMPTS[0], 5), (files[1], PROMPTS[1], 6)]
    baseline = [_pixels(folder / "images" / "baseline" / f) for f in files]
    assert baseline[0].shape == (32, 32, 3)
    for r in written[1:]:
        merged = [_pixels(folder / "images" / r["run"] / f) for f in files]
        assert any(not np.array_equal(a, b) for a, b in zip(merged, baseline))  # merging changed pixels
        assert r["flops"] < r["flops_base"] and r["flop_speedup"] == pytest.approx(r["flops_base"] / r["flops"])
        assert r["time_s"] > 0 and r["time_per_image_s"] == pytest.approx(r["time_s"])  # timing batch of 1
        assert r["denoiser_time_s"] < r["time_s"] and r["timing_spread"] >= 0
        assert r["denoiser_calls_per_image"] == _calls_per_step(family) * 2  # 2 steps
        assert 0 < r["ssim"] < 1 and 0 < r["psnr"] < 100 and r["feat_cos_dist"] > 0 and r["fd_effnetlite0"] > 0
        assert (folder / "images" / f"{r['run']}.png").is_file()
    assert written[0]["psnr"] == 100.0
    assert written[0]["denoiser_calls_per_image"] == _calls_per_step(family) * 2
    table = (folder / "table.md").read_text()
    assert all(r["run"] in table for r in written) and "timing spread" in table


def _calls_per_step(family: str) -> int:
    return 1  # every tiny pipeline batches guidance into one denoiser call (Flux: guidance-distilled)


def test_generate_resumes_after_an_interruption_without_losing_finished_images(tmp_path, monkeypatch):
    config = write_config(tmp_path, "sd3", "gen")
    prompts = tmp_path / "four.jsonl"
    prompts.write_text("".join(json.dumps({"caption": f"a photo of object {k}"}) + "\n" for k in range(4)))
    common = ["generate", "--config", str(config), "--prompts", str(prompts), "--batch-size", "1",
              "--strategy", "tomesd", "--set", "use_rand=false", "--no-progress"]
    full = tmp_path / "full"
    assert cli([*common, "--out", str(full)]) == 0
    names = [f"{k:05d}_seed{5 + k}.png" for k in range(4)]
    assert sorted(p.name for p in full.glob("*.png")) == names

    # interrupted after two images: they stay, the rest is produced on the rerun, pixels as uninterrupted
    out = tmp_path / "interrupted"
    real = gen.process_batch
    done = []

    def crash_after_two(source, batch, spec, folder, rank=0):
        if len(done) == 2:
            raise KeyboardInterrupt
        done.append(batch[0].index)
        return real(source, batch, spec, folder, rank)

    monkeypatch.setattr(gen, "process_batch", crash_after_two)
    assert cli([*common, "--out", str(out)]) == 130  # Ctrl-C: one line, "rerun the same command to resume"
    assert sorted(p.name for p in out.glob("*.png")) == names[:2]
    kept = {n: (out / n).stat().st_mtime_ns for n in names[:2]}
    monkeypatch.setattr(gen, "process_batch", real)
    assert cli([*common, "--out", str(out)]) == 0
    assert {n: (out / n).stat().st_mtime_ns for n in names[:2]} == kept  # finished images not redone
    for n in names:
        np.testing.assert_array_equal(_pixels(out / n), _pixels(full / n), err_msg=n)
    log = [json.loads(line)["file"] for line in (out / "generated.jsonl").read_text().splitlines()]
    assert sorted(log) == names  # each image written once over both invocations


def test_two_gloo_ranks_produce_every_prompt_once_and_the_same_pixels(tmp_path):
    config = write_config(tmp_path, "pixart", "ddp")
    prompts = tmp_path / "three.txt"
    prompts.write_text("a cat\na dog\na bird\n")
    common = ["generate", "--config", str(config), "--prompts", str(prompts), "--batch-size", "1",
              "--strategy", "ssm", "--set", "round_windows=1", "--no-progress", "--threads", "1"]
    single, ddp = tmp_path / "single", tmp_path / "ddp"
    assert cli([*common, "--out", str(single)]) == 0
    assert cli([*common, "--out", str(ddp), "--devices", "2", "--accelerator", "cpu", "--launcher", "ddp_fork"]) == 0
    log = [json.loads(line) for line in (ddp / "generated.jsonl").read_text().splitlines()]
    names = [f"{k:05d}_seed{5 + k}.png" for k in range(3)]
    assert sorted(r["file"] for r in log) == names  # every prompt exactly once
    assert {r["file"]: r["rank"] for r in log} == {names[0]: 0, names[1]: 1, names[2]: 0}  # batches r, r + 2
    for n in names:
        np.testing.assert_array_equal(_pixels(ddp / n), _pixels(single / n), err_msg=n)


def test_ablation_generates_on_two_ranks_and_scores_once(tmp_path):
    one = run_ablation(load_config(write_config(tmp_path, "sd", "one")), progress=False).path
    two = run_ablation(load_config(write_config(tmp_path, "sd", "two", devices=2)), progress=False).path
    for run in ("baseline", "tomesd-r0.5-use_rand=False"):
        for f in ("00000_seed5.png", "00001_seed6.png"):
            np.testing.assert_array_equal(_pixels(two / "images" / run / f), _pixels(one / "images" / run / f))
        ranks = [json.loads(line)["rank"] for line in (two / "images" / run / "generated.jsonl").read_text().splitlines()]
        assert ranks == [0, 0]  # one batch of 2 images: rank 0 writes both once, rank 1 has nothing to do
    a, b = rows(one), rows(two)
    assert [r["run"] for r in b] == [r["run"] for r in a]  # one row per run: metrics computed once
    for ra, rb in zip(a, b):
        assert rb["psnr"] == pytest.approx(ra["psnr"]) and rb["ssim"] == pytest.approx(ra["ssim"])


def test_clip_score_from_a_local_clip_folder_and_wandb_captions(tmp_path):
    config = write_config(tmp_path, "flux", "clip", wandb="offline",
                          metrics={"clip_model": str(local_pipelines.clip_folder())})
    folder = run_ablation(load_config(config), progress=False).path
    written = rows(folder)
    for r in written:
        assert 0 <= r["clip_score"] <= 100
    assert "CLIP score" in (folder / "table.md").read_text()

    from tomerge.experiments.generation.files import load_image_files
    from tomerge.experiments.measure.metrics import clip_score

    files = [folder / "images" / "baseline" / f for f in ("00000_seed5.png", "00001_seed6.png")]
    assert written[0]["clip_score"] == pytest.approx(float(clip_score(load_image_files(files), PROMPTS,
                                                                      local_pipelines.clip_folder()).mean()), rel=1e-5)
    media = list((folder / "wandb").rglob("*.png"))
    assert media  # images logged to the offline W&B run
    captions = set()
    for meta in (folder / "wandb").rglob("wandb-summary.json"):
        captions |= set(json.dumps(json.loads(meta.read_text())).split('"'))
    for run_dir in (folder / "wandb").glob("offline-run-*"):
        import subprocess

        out = subprocess.run(["wandb", "leet", "inspect", "--json", str(run_dir)], capture_output=True, text=True,
                             timeout=120)
        captions |= set(out.stdout.replace("\\", "").split('"'))
    assert set(PROMPTS) <= captions  # every image logged with its prompt as caption


def test_figures_for_a_text_to_image_run(tmp_path):
    folder = run_ablation(load_config(write_config(tmp_path, "sd", "fig")), progress=False).path
    out = tmp_path / "figs"
    assert cli(["figures", str(folder), "--out", str(out), "--k", "2"]) == 0
    for name in ("ablation.md", "pareto_psnr.png", "pareto_psnr.pdf", "fig/grid.png", "fig/schedules.png",
                 "fig/schedules.pdf"):
        assert (out / name).is_file(), name


def test_bad_inputs_give_clear_errors_when_the_config_is_loaded(tmp_path, capsys):
    """Before any weights are loaded: load_config checks the folder, the call arguments and the prompts."""
    from tomerge.experiments.config.schema import ConfigError

    config = write_config(tmp_path, "sd", "bad")
    with pytest.raises(ConfigError, match="model.pipeline .* not a local folder"):
        load_config(config, [f"model.pipeline={tmp_path / 'missing'}"])
    with pytest.raises(ConfigError, match="hub id"):
        load_config(config, ["model.pipeline=stabilityai/stable-diffusion-3-medium"])
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(ConfigError, match="no prompts"):
        load_config(config, [f"prompts={empty}"])
    with pytest.raises(ConfigError, match=r"unknown model.call argument\(s\) \['num_stepz'\]"):
        load_config(config, ["model.call.num_stepz=3"])
    with pytest.raises(ConfigError) as info:  # several problems at once
        load_config(config, ["prompts=null", "model.call.num_stepz=3", "batch_size=0"])
    assert len(info.value.problems) == 3
    with pytest.raises(ValueError, match="model.dtype"):
        load_config(config, ["model.dtype=fp8"])
    broken = tmp_path / "broken_strategy.py"
    broken.write_text("import tomerge\nraise RuntimeError('the plugin is broken')\n")
    assert cli(["ablate", "--config", str(config), "--plugin", str(broken)]) == 2
    assert "the plugin is broken" in capsys.readouterr().err


PAPERS = {"sdtm_sd3_medium": "sd3", "toma_flux_dev": "flux", "toma_sdxl": "sdxl", "tomesd_sd15": "sd"}


@pytest.mark.parametrize("paper", sorted(PAPERS))
def test_paper_configs_load_and_every_run_attaches_to_its_family(tmp_path, paper):
    """The paper protocols are ready to run: with a local folder of the right family and a prompt file of
    the configured format, the config validates and every grid cell attaches (options exist)."""
    from tomerge.experiments.config.schema import CONFIG_DIR
    from tomerge.experiments.generation.generate import merging

    family = PAPERS[paper]
    coco = tmp_path / "captions.json"
    coco.write_text(json.dumps({"annotations": [{"image_id": 1, "id": 1, "caption": "a cat"},
                                                {"image_id": 2, "id": 2, "caption": "a dog on a mat"}]}))
    classes = tmp_path / "imagenet_class_index.json"
    classes.write_text(json.dumps({"0": ["n01440764", "tench"], "1": ["n01443537", "goldfish"]}))
    prompts = classes if paper == "tomesd_sd15" else coco
    config = load_config(CONFIG_DIR / "papers" / f"{paper}.yaml", [
        f"model.pipeline={local_pipelines.pipeline_folder(family)}", "model.device=cpu", "model.dtype=fp32",
        f"prompts.file={prompts}", "num_prompts=2"])
    items = config.items()
    assert len(items) == 2 * config.images_per_prompt and all(i.prompt for i in items)
    if paper == "tomesd_sd15":
        assert items[0].prompt == "A high quality photograph of a tench." and items[1].seed == items[0].seed + 1
    source = config.model.load()
    assert config.runs()
    for run in config.runs():
        with merging(source, run) as handle:  # the run's flat options sorted into apply's keyword groups
            assert handle.adapter.name == ("unet" if family in ("sd", "sdxl") else family)


def test_examples_in_the_experiment_modules_run():
    import doctest

    from tomerge.experiments.config import help as config_help, load as config_load
    from tomerge.experiments.generation import generate
    from tomerge.experiments.sources import call_arguments, devices, items, models, reference_model, training

    for module in (config_load, config_help, generate, items, models, call_arguments, devices, reference_model,
                   training):
        result = doctest.testmod(module)
        assert result.attempted > 0 and result.failed == 0, module.__name__


def test_setting_a_pipeline_on_the_default_config_starts_a_new_model_mapping(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    folder = local_pipelines.pipeline_folder("sd")
    config = load_config(None, [f"model.pipeline={folder}", "model.call.height=32", f"prompts={prompts}"])
    assert (config.model.kind, config.model.path, config.model.call) == ("pipeline", str(folder), {"height": 32})
    assert [i.prompt for i in config.items()] == ["a cat"]


def test_bench_times_a_pipeline_folder_from_a_config(tmp_path, capsys):
    config = write_config(tmp_path, "pixart", "bench")
    out = tmp_path / "bench.csv"
    assert cli(["bench", "--config", str(config), "--set", "repeats=2", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    import csv

    with out.open() as f:
        rows = list(csv.DictReader(f))
    assert [r["run"] for r in rows] == ["tomesd-r0.5-use_rand=False", "ssm-r0.5-round_windows=1"]
    for r in rows:
        assert float(r["time_s"]) > 0 and float(r["flops"]) < float(r["flops_base"])
        assert float(r["timing_spread"]) >= 0 and r["run"] in printed
    assert not (tmp_path / "runs").exists()  # speed only: no run folder, no images
