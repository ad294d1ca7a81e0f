"""`tomerge ablate` on single-stream and mixture-of-experts image pipelines, each a tiny random-weight pipeline
saved by ``local_pipelines`` and loaded from its folder (``DiffusionPipeline.from_pretrained(folder,
local_files_only=True)``): Lumina-Image 2.0, Z-Image, CogView4 and HiDream-I1.

Every merged block call is recorded in ``maps/<run>.json``; its ``num_tokens`` is what the merge saw, so a count of
64 (the 8 x 8 latent grid) in every block kind shows that the caption tokens of the joint sequences stayed context.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import yaml
from PIL import Image

import local_pipelines
from tomerge.experiments.ablate import run_ablation
from tomerge.experiments.config import load_config

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# FlowMatch schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

PROMPTS = ["a photo of a cat", "a red car in the city"]
IMAGE_TOKENS = 64  # every family's latent is an 8 x 8 token grid
TOMESD = "{strategy: tomesd, ratios: [0.5], options: {use_rand: false}}"
SSM = "{strategy: ssm, ratios: [0.5]}"
TOCA = "{strategy: toca, ratios: [0.0]}"


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("single_stream_ablation")
    (root / "prompts.txt").write_text("\n".join(PROMPTS) + "\n")
    return root


def overrides(root: Path, family: str, *grid: str) -> list[str]:
    folder = root / f"tiny-{family}"
    if not folder.exists():
        local_pipelines.save_tiny_pipeline(family, folder)
    call = yaml.safe_dump(local_pipelines.CURRENT_CALL_DEFAULTS[family], default_flow_style=True).strip()
    return [f"model.pipeline={folder}", f"model.call={call}", f"prompts={root / 'prompts.txt'}",
            f"out_dir={root / 'runs'}", f"name={family}", f"grid=[{', '.join(grid)}]", "batch_size=2",
            "timing_batch=1", "warmup=0", "repeats=1", "wandb=disabled"]


def ablate(root: Path, family: str, *grid: str) -> tuple[Path, list[dict]]:
    folder = run_ablation(load_config(None, overrides(root, family, *grid)), progress=False).path
    return folder, [json.loads(line) for line in (folder / "results.jsonl").read_text().splitlines()]


def check_runs(folder: Path, rows: list[dict], runs: list[str], size: int) -> None:
    """The grid's runs in order, the baseline's own PSNR, every run cheaper and different from it, and the images
    of the requested size."""
    baseline, *others = rows
    assert [r["run"] for r in others] == runs
    assert baseline["psnr"] == 100.0
    for r in others:
        assert r["psnr"] < 100.0 and r["flops"] < r["flops_base"] and r["n_images"] == 2, r["run"]
    for run in ("baseline", *runs):
        files = sorted((folder / "images" / run).glob("*.png"))
        assert [f.name for f in files] == ["00000_seed0.png", "00001_seed1.png"]
        for file in files:
            with Image.open(file) as image:
                assert image.size == (size, size) and image.mode == "RGB"


def merge_records(folder: Path, run: str) -> list[dict]:
    records = json.loads((folder / "maps" / f"{run}.json").read_text())
    assert records
    return records


def check_image_tokens_only(folder: Path, run: str, kinds: set[str]) -> None:
    """Every recorded block call of ``run`` merged the 8 x 8 image tokens alone, half of them, in each of ``kinds``."""
    records = merge_records(folder, run)
    assert {r["block_kind"] for r in records} == kinds
    assert all(r["num_tokens"] == IMAGE_TOKENS for r in records)
    assert all(r["num_removed"] == IMAGE_TOKENS // 2 for r in records)


def test_lumina2_pipeline_ablation(root):
    """Lumina-Image 2.0: the noise refiner on the image alone, then single-stream layers over ``[caption, image,
    padding]`` where each sample's image starts after its own caption (the two prompts differ in length)."""
    tokenizer = local_pipelines.t5_tokenizer()  # the pipeline's tokenizer
    lengths = {len(tokenizer(" <Prompt Start> " + p).input_ids) for p in PROMPTS}  # system_prompt "" + the prompt
    assert len(lengths) == 2 and max(lengths) < 32  # ragged captions, none truncated

    folder, rows = ablate(root, "lumina2", TOMESD, SSM)
    check_runs(folder, rows, ["tomesd-r0.5-use_rand=False", "ssm-r0.5"], size=128)
    for r in rows[1:]:
        assert r["tokens_removed_mean"] > 0
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"refiner", "joint"})


def test_z_image_pipeline_ablation_passes_each_call_a_fresh_prompt_list(root, monkeypatch):
    """Z-Image: image tokens first, then the caption, in refiner and joint blocks. ZImagePipeline's encode_prompt
    rewrites the caller's prompt list in place with its chat template: every call must still receive the
    original prompts (a list reused across calls would arrive templated)."""
    from diffusers import ZImagePipeline

    received: list[tuple[list[str], list[str]]] = []  # (prompts on entry, the same list after the call)
    encode_prompt = ZImagePipeline.encode_prompt

    @functools.wraps(encode_prompt)
    def spy(self, prompt, *args, **kwargs):
        on_entry = list(prompt)
        out = encode_prompt(self, prompt, *args, **kwargs)
        received.append((on_entry, prompt))
        return out

    monkeypatch.setattr(ZImagePipeline, "encode_prompt", spy)
    folder, rows = ablate(root, "z_image", TOMESD, SSM)
    check_runs(folder, rows, ["tomesd-r0.5-use_rand=False", "ssm-r0.5"], size=32)
    for r in rows[1:]:
        assert r["tokens_removed_mean"] > 0
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"refiner", "joint"})

    # Every call (generation batches of 2 prompts, timing calls of 1) saw untemplated prompts, and the pipeline did
    # template them in place (so a list reused by a later call would have arrived templated).
    assert [p for p, _ in received].count(PROMPTS) == 3  # the baseline's batch and each run's
    assert PROMPTS[:1] in [p for p, _ in received]
    for on_entry, after in received:
        assert on_entry in (PROMPTS, PROMPTS[:1])
        assert after == [f"user: {p}" for p in on_entry]
    index = [json.loads(line) for line in (folder / "images" / "baseline" / "prompts.jsonl").read_text().splitlines()]
    assert [i["prompt"] for i in index] == PROMPTS


def test_cogview4_pipeline_ablation_with_merging_and_token_wise_caching(root):
    """CogView4: joint ``[text, image]`` attention with image-only RoPE and a feed-forward called twice per block
    (image, then text: only the image call is merged); token-wise caching reuses the joint attention's output."""
    folder, rows = ablate(root, "cogview4", TOMESD, TOCA)
    check_runs(folder, rows, ["tomesd-r0.5-use_rand=False", "toca-r0"], size=32)
    assert rows[1]["tokens_removed_mean"] > 0
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"cogview4"})


def test_hidream_pipeline_ablation_merges_before_the_routed_experts(root, monkeypatch):
    """HiDream-I1: double-stream then single-stream blocks whose feed-forwards are mixtures of experts (4 routed,
    2 active, one shared); SSM merges the image tokens before the feed-forward, so the router sees the merged
    slots, in both block kinds."""
    from diffusers import HiDreamImagePipeline

    # Quirk: HiDreamImagePipeline.__call__ rescales height and width to the fixed area (default_sample_size *
    # vae_scale_factor) ** 2, with default_sample_size = 128 set in __init__ (256 x 256 with the tiny VAE, 1024 x
    # 1024 with the real one). Setting it to 16 after __init__ keeps the requested 32 x 32.
    init = HiDreamImagePipeline.__init__

    @functools.wraps(init)  # from_pretrained reads the components from __init__'s signature
    def init_at_32(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.default_sample_size = 16

    monkeypatch.setattr(HiDreamImagePipeline, "__init__", init_at_32)
    folder, rows = ablate(root, "hidream", TOMESD, SSM)
    check_runs(folder, rows, ["tomesd-r0.5-use_rand=False", "ssm-r0.5"], size=32)
    for r in rows[1:]:
        assert r["tokens_removed_mean"] > 0
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"double", "single"})
    ssm = merge_records(folder, "ssm-r0.5")
    assert {r["block_kind"] for r in ssm} == {"double", "single"} and all(r["num_tokens"] == IMAGE_TOKENS for r in ssm)
    assert all("mlp" in r["sublayers"] for r in ssm)  # SSM merges before the mixture-of-experts feed-forward
