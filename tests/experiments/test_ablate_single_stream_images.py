"""`tomerge ablate` on single-stream and mixture-of-experts image pipelines, each a tiny random-weight pipeline
saved by ``local_pipelines`` and loaded from its folder (``DiffusionPipeline.from_pretrained(folder,
local_files_only=True)``): Lumina-Image 2.0, Z-Image, CogView4 and HiDream-I1.

Every merged block call is recorded in ``maps/<run>.json``; its ``num_tokens`` is what the merge saw, so a count of
64 (the 8 x 8 latent grid) in every block kind shows that the caption tokens of the joint sequences stayed context.
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from helpers import local_pipelines
from helpers.pipeline_ablation import PROMPTS, SSM, TOCA, TOMESD, block_records, check_rows, item_index, run_family
from helpers.pipeline_ablation import offline, root  # noqa: F401 (fixtures)

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# FlowMatch schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")

IMAGE_TOKENS = 64  # every family's latent is an 8 x 8 token grid


def check_image_tokens_only(folder: Path, run: str, kinds: set[str]) -> None:
    """Every recorded block call of ``run`` merged the 8 x 8 image tokens alone, half of them, in each of ``kinds``."""
    records = block_records(folder, run)
    assert {r["block_kind"] for r in records} == kinds
    assert all(r["num_tokens"] == IMAGE_TOKENS for r in records)
    assert all(r["num_removed"] == IMAGE_TOKENS // 2 for r in records)


def test_lumina2_pipeline_ablation(root):
    """Lumina-Image 2.0: the noise refiner on the image alone, then single-stream layers over ``[caption, image,
    padding]`` where each sample's image starts after its own caption (the two prompts differ in length)."""
    tokenizer = local_pipelines.t5_tokenizer()  # the pipeline's tokenizer
    lengths = {len(tokenizer(" <Prompt Start> " + p).input_ids) for p in PROMPTS}  # system_prompt "" + the prompt
    assert len(lengths) == 2 and max(lengths) < 32  # ragged captions, none truncated

    folder, rows = run_family(root, "lumina2", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(128, 128), merging=runs)
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
    folder, rows = run_family(root, "z_image", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(32, 32), merging=runs)
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"refiner", "joint"})

    # Every call (generation batches of 2 prompts, timing calls of 1) saw untemplated prompts, and the pipeline did
    # template them in place (so a list reused by a later call would have arrived templated).
    assert [p for p, _ in received].count(PROMPTS) == 3  # the baseline's batch and each run's
    assert PROMPTS[:1] in [p for p, _ in received]
    for on_entry, after in received:
        assert on_entry in (PROMPTS, PROMPTS[:1])
        assert after == [f"user: {p}" for p in on_entry]
    assert [i["prompt"] for i in item_index(folder, "baseline")] == PROMPTS


def test_cogview4_pipeline_ablation_with_merging_and_token_wise_caching(root):
    """CogView4: joint ``[text, image]`` attention with image-only RoPE and a feed-forward called twice per block
    (image, then text: only the image call is merged); token-wise caching reuses the joint attention's output."""
    folder, rows = run_family(root, "cogview4", TOMESD, TOCA)
    merged = "tomesd-r0.5-use_rand=False"
    check_rows(folder, rows, [merged, "toca-r0"], size=(32, 32), merging=[merged])
    check_image_tokens_only(folder, merged, {"cogview4"})


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
    folder, rows = run_family(root, "hidream", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(32, 32), merging=runs)
    check_image_tokens_only(folder, "tomesd-r0.5-use_rand=False", {"double", "single"})
    ssm = block_records(folder, "ssm-r0.5")
    assert {r["block_kind"] for r in ssm} == {"double", "single"} and all(r["num_tokens"] == IMAGE_TOKENS for r in ssm)
    assert all("mlp" in r["sublayers"] for r in ssm)  # SSM merges before the mixture-of-experts feed-forward
