"""What the `kandinsky6` adapter (backbones/kandinsky6.py, Kandinsky 6, video + audio) does beyond the family contract:
the video stream merged with the audio and the reference frame as context, text-to-video permutations, the probe's
target share, the block cache of both streams, token types other than a trailing reference. The checks every declared
family passes are in test_family_contract.py; these are the family's own.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import Tensor, nn

import tomerge
from helpers import no_hooks_left
from helpers.family import ALL_SUBLAYERS, Permute, to_float64
from helpers.probes import idm_attention_and_inputs
from helpers.video_families import KANDINSKY6_AUDIO, audio_video_trajectory, kandinsky6_inputs


def _kandinsky6_calls(model: nn.Module, inputs: dict, names: tuple[str, ...]) -> tuple[Tensor, dict[str, dict]]:
    """The output and, per submodule of the first fused block (dotted ``names``), its call's tokens, keys/values
    (``encoder_hidden_states``) and query RoPE (after tomerge's hooks, which run first)."""
    block = model.visual_transformer_blocks[0]
    seen: dict[str, dict] = {}

    def record(name: str):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[name] = dict(tokens=kwargs.get("hidden_states", args[0] if args else None),
                              keys=kwargs.get("encoder_hidden_states"),
                              rope=kwargs.get("rope_q", kwargs.get("rotary_emb")))
        return hook

    hooks = [block.get_submodule(name).register_forward_pre_hook(record(name), with_kwargs=True) for name in names]
    try:
        with torch.no_grad():
            out = model(**inputs)
    finally:
        for h in hooks:
            h.remove()
    return out, seen


def test_kandinsky6_merges_the_video_stream_and_keeps_audio_and_reference_frame_as_context(models):
    """The video sublayers get the merged target tokens and the reference frame's tokens unchanged after them (with
    their RoPE rows); the audio stream keeps its length and av_cross_attention reads the full-length video stream,
    which merging the cross-attention alone leaves as the plain model's in the first block; the audio output
    changes only through the merged video stream."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model)
    names = ("video_dec_block.self_attention", "video_dec_block.cross_attention", "va_cross_attention",
             "av_cross_attention", "audio_dec_block.self_attention", "video_dec_block.feed_forward")
    plain, before = _kandinsky6_calls(model, inputs, names)
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        merged, after = _kandinsky6_calls(model, inputs, names)
        assert handle.adapter.grid_size == (2, 4, 4) and handle.adapter.context.after == 16
    N, M, R, Na, T = 32, 16, 16, KANDINSKY6_AUDIO, 8
    shapes = {name: (call["tokens"].shape[1], None if call["keys"] is None else call["keys"].shape[1])
              for name, call in after.items()}
    assert shapes == {"video_dec_block.self_attention": (M + R, None), "video_dec_block.cross_attention": (M + R, T),
                      "va_cross_attention": (M + R, Na), "av_cross_attention": (Na, N + R),
                      "audio_dec_block.self_attention": (Na, None), "video_dec_block.feed_forward": (M + R, None)}
    attn, plain_attn = after["video_dec_block.self_attention"], before["video_dec_block.self_attention"]
    assert torch.equal(attn["tokens"][:, M:], plain_attn["tokens"][:, N:])  # the reference frame, as it is
    assert attn["rope"].shape == (2, M + R, 1, 64, 2, 2)  # per-sample [B, M + R, 1, d/2, 2, 2] rotations
    assert torch.equal(attn["rope"][:, M:], plain_attn["rope"][None, N:].expand(2, -1, -1, -1, -1, -1))
    assert after["va_cross_attention"]["rope"].shape[1] == M + R
    for name in ("av_cross_attention", "audio_dec_block.self_attention"):
        assert torch.equal(after[name]["tokens"], before[name]["tokens"])
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, merge_attn=False, merge_crossattn=True,
                         merge_mlp=False):
        _, crossattn_only = _kandinsky6_calls(model, inputs, names)
    assert crossattn_only["video_dec_block.cross_attention"]["tokens"].shape[1] == M + R
    assert torch.equal(crossattn_only["av_cross_attention"]["keys"], before["av_cross_attention"]["keys"])
    assert merged.audio_sample.shape == plain.audio_sample.shape and torch.isfinite(merged.audio_sample).all()
    assert not torch.equal(merged.audio_sample, plain.audio_sample)  # the second block reads the merged video


@pytest.mark.parametrize("audio", [True, False], ids=["audio", "video_only"])
def test_kandinsky6_text_to_video_permutation_is_exact(models, audio):
    """Without a reference frame (text-to-video), with and without audio: the permuted slots give the plain output,
    the video's and the audio's (the video RoPE of the self-attention and of va_cross_attention's queries gathered)."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model, seed=4, reference=False, audio=audio)
    with torch.no_grad():
        before = model(**inputs)
    with tomerge.merging(model, Permute(), ratio=0.5, **ALL_SUBLAYERS) as handle:
        with torch.no_grad():
            out = model(**inputs)
        assert handle.adapter.grid_size == (2, 4, 4) and not handle.adapter.context
        assert len(handle.state.records) == 2
    torch.testing.assert_close(out.sample, before.sample, rtol=1e-4, atol=1e-5)
    if audio:
        torch.testing.assert_close(out.audio_sample, before.audio_sample, rtol=1e-4, atol=1e-5)
    else:
        assert out.audio_sample is None


def test_kandinsky6_received_attention_is_the_target_queries_share_on_the_target_keys(models):
    """float64: the probe on ``query_norm``/``key_norm`` with the reference frame's keys attended but not recorded:
    every target query's softmax over the target and reference keys (after the per-head norms, before the rotation),
    averaged over heads and queries, restricted to the target keys and renormalised."""
    model = copy.deepcopy(models["kandinsky6"]).double()
    inputs = to_float64(kandinsky6_inputs(model))
    N, R = 32, 16
    attentions = [block.video_dec_block.self_attention for block in model.visual_transformer_blocks]
    recorded, seen = idm_attention_and_inputs(model, inputs, attentions)
    assert sorted(recorded) == sorted(seen) == [0, 1]
    for layer, x in seen.items():
        attn = attentions[layer]
        assert x.shape[1] == N + R
        with torch.no_grad():
            q = attn.query_norm(attn.to_query(x).unflatten(2, (attn.num_heads, -1)))  # [B, N + R, h, d]
            k = attn.key_norm(attn.to_key(x).unflatten(2, (attn.num_heads, -1)))
        p = torch.einsum("bqhd,bkhd->bhqk", q[:, :N], k).mul(q.shape[-1] ** -0.5).softmax(-1)  # target queries
        share = p.mean(dim=(1, 2))[:, :N]  # [B, N]: the target keys
        torch.testing.assert_close(recorded[layer].double(), share / share.sum(-1, keepdim=True), rtol=1e-5,
                                   atol=1e-8)
        assert (p[..., N:].sum(-1) > 1e-3).all()  # the reference keys take part of the target's attention


@pytest.mark.parametrize("audio", [True, False], ids=["audio", "video_only"])
def test_kandinsky6_block_cache_reuses_the_video_and_audio_streams(models, audio):
    """The fused block returns ``(vis, aud)``: on a reused step (block_cache, interval 2) each block returns each
    stream's input plus that stream's residual of the last full step; the full steps are the plain model's. A
    video-only call's blocks return ``(vis, None)``, kept as ``None``."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model, batch=1, audio=audio)
    blocks = list(model.visual_transformer_blocks)
    streams = lambda args, kwargs: args[:2]  # noqa: E731  (vis, aud)
    base, _ = audio_video_trajectory(model, inputs, blocks, streams)
    outs, cached_io = audio_video_trajectory(model, inputs, blocks, streams, "block_cache", interval=2)
    same = lambda a, b: a is b is None or torch.equal(a, b)  # noqa: E731
    assert all(same(x, y) for step in (0, 2) for x, y in zip(outs[step], base[step]))
    assert not torch.equal(outs[1][0], base[1][0])
    for layer in range(len(blocks)):
        (x0, y0), (x1, y1) = cached_io[0][layer], cached_io[1][layer]
        assert torch.equal(y1[0], x1[0] + (y0[0] - x0[0]))
        assert (y1[1] is None) if not audio else torch.equal(y1[1], x1[1] + (y0[1] - x0[1]))
    assert no_hooks_left(model)


@pytest.mark.filterwarnings("ignore:tomerge. no block")
def test_kandinsky6_token_types_other_than_a_trailing_reference_leave_the_call_unmerged(models):
    """Type ids that mark a frame before the target's last (not one grid followed by context) give no grid, with the
    adapter's warning saying why."""
    model = models["kandinsky6"]
    inputs = kandinsky6_inputs(model)
    inputs["visual_token_type_ids"] = inputs["visual_token_type_ids"].flip(1)  # [B, T + 1]: the first frame marked
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match="visual_token_type_ids"):
            handle.adapter.on_model_call((), inputs)
        assert handle.adapter.grid_size is None
