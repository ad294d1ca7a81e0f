"""`tomerge ablate` on pipelines with long skip connections, diffusion forcing and a second (audio) stream, each a
tiny saved pipeline of ``local_pipelines`` loaded from its folder as a researcher's weights are:

* ``hunyuan_dit``: Hunyuan-DiT (BERT + T5 text, long skip connections): merging happens inside every block, after
  the skip is fused, so all four blocks see the full 8 x 8 grid and the skips stay full length;
* ``skyreels_v2``: SkyReels-V2 diffusion forcing, asynchronous (a timestep per latent frame, each frame one step
  behind the previous one): the step is the largest frame timestep, so the 5 denoising calls map onto the
  scheduler's 3 steps;
* ``ltx2``: LTX-2 (video and audio streams; CFG on a doubled batch, then STG and modality guidance on the single
  batch, every step): the video stream is merged, the audio tokens are context; token-wise caching keeps the
  received attention of each call size (``MergeState.attention_by_size``).
"""

from __future__ import annotations

import pytest
import torch

from helpers import local_pipelines
import tomerge
from tomerge.probe import ReceivedAttention
from helpers.pipeline_ablation import SSM, TOCA, TOMESD, block_records, check_rows, run_family
from helpers.pipeline_ablation import offline, root  # noqa: F401 (fixtures)

pytest.importorskip("transformers", reason="the text pipelines of diffusers import transformers")

# DPMSolver/Euler schedulers build numpy arrays the way numpy 2 deprecates; not ours.
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation:DeprecationWarning")


def test_hunyuan_dit_pipeline_ablation_merges_inside_the_blocks_and_keeps_the_long_skips_full_length(root,
                                                                                                   monkeypatch):
    from diffusers.models.transformers.hunyuan_transformer_2d import HunyuanDiTBlock

    skips: list[tuple[int, int]] = []  # (tokens of the block input, tokens of the skip) at each skip-fusing call
    forward = HunyuanDiTBlock.forward

    def recording_forward(self, hidden_states, *args, skip=None, **kwargs):
        if skip is not None:
            skips.append((hidden_states.shape[1], skip.shape[1]))
        return forward(self, hidden_states, *args, skip=skip, **kwargs)

    monkeypatch.setattr(HunyuanDiTBlock, "forward", recording_forward)
    folder, rows = run_family(root, "hunyuan_dit", TOMESD, SSM)
    runs = ["tomesd-r0.5-use_rand=False", "ssm-r0.5"]
    check_rows(folder, rows, runs, size=(64, 64), merging=runs)

    # Batched guidance, 2 steps, 4 blocks: every block merges half of the 64 tokens, the skip-fusing block 3 too.
    tomesd_records = block_records(folder, "tomesd-r0.5-use_rand=False")
    assert [(r["step"], r["layer"]) for r in tomesd_records] == [(s, layer) for s in (0, 1) for layer in range(4)]
    assert all(r["num_tokens"] == 64 and r["num_removed"] == 32 for r in tomesd_records)
    assert skips and set(skips) == {(64, 64)}  # merged runs included: the skips stay full length


def test_skyreels_v2_diffusion_forcing_pipeline_ablation(root, monkeypatch):
    from diffusers import SkyReelsV2Transformer3DModel

    # The SkyReels-V2 pipelines call ftfy.fix_text whether ftfy is installed or not: ftfy is an install dependency.
    frame_timesteps: list[list[float]] = []  # the timestep of each latent frame, per transformer call
    forward = SkyReelsV2Transformer3DModel.forward

    def recording_forward(self, hidden_states, timestep, *args, **kwargs):
        frame_timesteps.append(timestep[0].tolist())  # [B, F]: one timestep per latent frame
        return forward(self, hidden_states, timestep, *args, **kwargs)

    monkeypatch.setattr(SkyReelsV2Transformer3DModel, "forward", recording_forward)
    frames = local_pipelines.CURRENT_CALL_DEFAULTS["skyreels_v2"]["num_frames"]
    folder, rows = run_family(root, "skyreels_v2", TOMESD, TOCA)
    runs = ["tomesd-r0.5-use_rand=False", "toca-r0"]
    check_rows(folder, rows, runs, size=(64, 64), frames=frames, merging=runs)
    assert any(len(set(t)) > 1 for t in frame_timesteps)  # asynchronous: the frames are at different timesteps

    # 3 steps + (3 latent frames - 1) * ar_step = 5 denoising calls, each a split guidance pair: the first 3 still
    # have a frame at the first timestep, so they share step 0 (the step is the largest frame timestep).
    tomesd_records = block_records(folder, "tomesd-r0.5-use_rand=False")
    assert [r["step"] for r in tomesd_records] == [0] * 12 + [1] * 4 + [2] * 4  # 2 blocks per call
    assert all(r["num_tokens"] == 48 and r["num_removed"] == 24 for r in tomesd_records)  # 3 x 4 x 4 tokens
    assert {r["label"] for r in block_records(folder, "toca-r0") if r["step"] == 1} == {"toca"}  # the cached step


def test_ltx2_pipeline_ablation_merges_the_video_stream_and_caches_across_guidance_calls_of_two_sizes(root):
    """CFG on a doubled batch, then STG and modality guidance on the single batch, every step: the token-wise cached
    step needs the received attention of each call size (the single-batch calls come last in every step)."""
    frames = local_pipelines.CURRENT_CALL_DEFAULTS["ltx2"]["num_frames"]
    folder, rows = run_family(root, "ltx2", TOMESD, TOCA)
    runs = ["tomesd-r0.5-use_rand=False", "toca-r0"]
    check_rows(folder, rows, runs, size=(32, 32), frames=frames, merging=runs)

    # 3 model calls per step, 2 blocks: each merges the 3 x 8 x 8 video tokens only (the 9 audio tokens are context).
    tomesd_records = block_records(folder, "tomesd-r0.5-use_rand=False")
    assert [r["step"] for r in tomesd_records] == [0] * 6 + [1] * 6 + [2] * 6
    assert all(r["num_tokens"] == 192 and r["num_removed"] == 96 for r in tomesd_records)
    cached = [r for r in block_records(folder, "toca-r0") if r["label"] == "toca"]
    assert len(cached) == 6 and all(0 < r["num_removed"] < 192 for r in cached)  # every call of step 1 cached


def test_received_attention_is_kept_per_call_size():
    """A model called with a guidance pair, then with one sample, at every timestep (as LTX-2's guidance does): each
    call size reads the attention its own size recorded, so each size's outputs are those of its calls alone."""
    from helpers.compiled import build, call, inputs, times

    model = build("native_dit", depth=2)
    pairs = [inputs("native_dit", t) for t in times(4)]  # toca's fresh steps: 0 and 3
    singles = [{k: v[1:] for k, v in kwargs.items()} for kwargs in pairs]

    def trajectory(calls_per_step: list[list[dict]]) -> tuple[list[list[torch.Tensor]], set[tuple[int, int]]]:
        """The outputs of every call, and the (batch, tokens) sizes whose received attention the state kept."""
        with tomerge.merging(model, "toca", num_steps=len(calls_per_step)) as handle:
            outputs = [[call(model, kwargs) for kwargs in step] for step in calls_per_step]
            return outputs, {key[1:] for key in handle.state.technique(ReceivedAttention).by_size}

    both, sizes = trajectory([[p, s] for p, s in zip(pairs, singles)])
    assert sizes == {(2, 64), (1, 64)}
    pairs_alone, _ = trajectory([[p] for p in pairs])
    singles_alone, _ = trajectory([[s] for s in singles])
    for step in range(4):
        assert torch.equal(both[step][0], pairs_alone[step][0])
        assert torch.equal(both[step][1], singles_alone[step][0])
    assert not torch.equal(both[1][1], call(model, singles[1]))  # step 1 is a cached step: it differs unmerged


def test_the_state_looks_received_attention_up_by_layer_batch_and_tokens():
    from tomerge.state import MergeState
    from tomerge.strategies.toca import ToCa

    state = MergeState(ToCa(), num_layers=2)
    received = state.technique(ReceivedAttention)
    state.begin_model_call(900.0)
    pair, single, other_layer = torch.rand(2, 16), torch.rand(1, 16), torch.rand(2, 16)
    received.store(0, pair)
    received.store(0, single)  # a later call of another batch in the same step
    received.store(1, other_layer)
    assert torch.equal(received.latest(0, 2, 16), pair)
    assert torch.equal(received.latest(0, 1, 16), single)
    assert received.latest(0, 2, 8) is None and received.latest(1, 1, 16) is None
    assert torch.equal(state.attention[0], single)  # the layer's latest call, whatever its size
    received.store(0, pair + 1)
    assert torch.equal(received.latest(0, 2, 16), pair + 1)  # the latest of a size replaces it
    state.begin_model_call(950.0)  # a noisier timestep: a new trajectory forgets every size
    assert received.latest(0, 2, 16) is None and received.latest(0, 1, 16) is None
