"""What the `ltx2` adapter (backbones/ltx2.py, LTX-2) does beyond the family contract: the audio stream and the
video-to-audio attention at full length, the block cache of both streams, the interleaved RoPE and the video
self-attention mask. The checks every declared family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import torch

import tomerge
from helpers import no_hooks_left, seeded
from helpers.family import ALL_SUBLAYERS, check_permutation_is_exact, run
from helpers.video_families import LTX2_AUDIO, audio_video_trajectory, build_ltx2, ltx2_inputs


def test_ltx2_video_to_audio_attention_reads_the_full_length_video_stream(models):
    """v2a (audio queries, video keys/values) runs at full length on the video stream, a2v (video queries) on the
    merged slots; the audio stream keeps its length; the audio output changes only through the merged video."""
    model = models["ltx2"]
    inputs = ltx2_inputs(model)
    block = model.transformer_blocks[0]
    seen: dict[str, tuple[int, int]] = {}

    def record(name: str):
        def hook(module, args, kwargs):
            queries = kwargs.get("hidden_states", args[0] if args else None)
            keys = kwargs.get("encoder_hidden_states")
            seen[name] = (queries.shape[1], (queries if keys is None else keys).shape[1])
        return hook

    with torch.no_grad():
        plain = model(**inputs)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS):
        hooks = [getattr(block, name).register_forward_pre_hook(record(name), with_kwargs=True)
                 for name in ("attn1", "audio_to_video_attn", "video_to_audio_attn", "audio_attn1")]
        try:
            with torch.no_grad():
                merged = model(**inputs)
        finally:
            for h in hooks:
                h.remove()
    N, M, Na = 32, 16, LTX2_AUDIO
    assert seen == {"attn1": (M, M), "audio_to_video_attn": (M, Na), "video_to_audio_attn": (Na, N),
                    "audio_attn1": (Na, Na)}
    assert merged.audio_sample.shape == plain.audio_sample.shape and torch.isfinite(merged.audio_sample).all()
    assert not torch.equal(merged.audio_sample, plain.audio_sample)  # v2a reads the merged blocks' video output


def test_ltx2_block_cache_reuses_the_video_and_audio_streams(models):
    """The block returns ``(hidden_states, audio_hidden_states)``: interval 1 is the plain model bit for bit (video
    and audio); on a reused step (block_cache, interval 2) each block returns each stream's input plus that stream's
    residual of the last full step, and the full steps are the plain model's."""
    model = models["ltx2"]
    inputs = ltx2_inputs(model, batch=1)
    blocks = list(model.transformer_blocks)
    # the block's video [B, N, C] and audio [B, Na, Ca] inputs
    streams = lambda args, kwargs: (kwargs["hidden_states"], kwargs["audio_hidden_states"])  # noqa: E731
    base, _ = audio_video_trajectory(model, inputs, blocks, streams)
    every_step, _ = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=1)
    outs, cached_io = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=2)
    assert all(torch.equal(x, y) for step in range(3) for x, y in zip(every_step[step], base[step]))
    assert all(torch.equal(x, y) for step in (0, 2) for x, y in zip(outs[step], base[step]))
    assert all(torch.isfinite(x).all() and not torch.equal(x, y) for x, y in zip(outs[1], base[1]))
    for layer in range(len(blocks)):
        (x0, y0), (x1, y1) = cached_io[0][layer], cached_io[1][layer]
        for stream in range(2):  # video, audio
            assert torch.equal(y1[stream], x1[stream] + (y0[stream] - x0[stream])), (layer, stream)
    assert no_hooks_left(model)


def test_ltx2_interleaved_rope_and_video_self_attention_mask_follow_the_slots():
    """LTX-2's interleaved RoPE ([B, N, C]) and the video self-attention mask ([B, N, N], the IC-LoRA pipelines')
    are gathered per slot: the permutation is exact with both."""
    model = build_ltx2(rope_type="interleaved")
    inputs = ltx2_inputs(model, seed=4)
    g = seeded(7)
    inputs["video_self_attention_mask"] = (torch.rand(2, 32, 32, generator=g) < 0.6).float() + torch.eye(32)
    inputs["video_self_attention_mask"] = inputs["video_self_attention_mask"].clamp(max=1.0)
    check_permutation_is_exact(model, inputs, None, 32)
    unmasked = run(model, dict(inputs, video_self_attention_mask=None))
    assert (unmasked - run(model, inputs)).abs().max() > 1e-3  # the mask matters
