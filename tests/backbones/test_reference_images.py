"""Editing and reference-image calls: FLUX.1 Kontext, FLUX.2 with reference images (appended, prepended, and
prepended in klein's KV-cache "extract" call, whose processor attends ``[text, reference, target]`` by the
``num_ref_tokens`` split) and Qwen-Image-Edit, on the tiny random-weight models of ``helpers.models`` (`flux`)
and ``helpers.image_families`` (`flux2`, `qwenimage`); the calls are ``helpers.reference_images.CASES``.

The reference images' latent tokens share the image stream with the generated image's (the target); only the
target is merged and the reference tokens are context (``tomerge.backbones._context``). Checks: ratio 0 and
``remove()`` bit-identical; at ratio 0.5 every merged sublayer gets the reference tokens unchanged in count and
value and hands them back as the sublayer computed them, while the target is merged and unmerged; a permutation
"merge" of the target gives the unpatched output (the target's RoPE rows gathered, the reference rows kept);
a batch equals its samples (float64); idm's received attention is the text queries' attention to the target
keys, computed by hand; a call whose generated image is not one grid is not merged.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge.adapter import MergePoint
from tomerge.backbones._context import ContextTokens
from tomerge.backbones._declared import DeclaredPoint
from tomerge.backbones._grid import split_ids
from tomerge.backbones.flux import SingleStreamPoint
from helpers.family import (ALL_SUBLAYERS, check_batch_equals_samples, check_bit_identical, check_permutation_is_exact,
                            grid_ids, run)
from helpers.image_families import build_flux2, build_qwenimage
from helpers.models import image_ids, tiny_flux
from helpers.reference_images import (CASES, GRID, REFERENCE, N, R, flux2_reference_inputs, kontext_inputs,
                                      qwen_edit_inputs)


@pytest.fixture(scope="module")
def models() -> dict[str, nn.Module]:
    built = {"flux": tiny_flux(), "flux2": build_flux2(), "qwenimage": build_qwenimage()}
    return {"flux_kontext": built["flux"], "flux2_reference": built["flux2"], "flux2_reference_first": built["flux2"],
            "flux2_kv_extract": built["flux2"], "qwenimage_edit": built["qwenimage"]}


def shuffle_target(before: int) -> Callable[[dict, Tensor], dict]:
    """Permutes the target's tokens in the stream (the reference tokens stay): the control of the permutation test."""
    def shuffle(inputs: dict, perm: Tensor) -> dict:
        x = inputs["hidden_states"].clone()
        x[:, before:before + N] = x[:, before:before + N][:, perm]
        return dict(inputs, hidden_states=x)
    return shuffle


# ---------------------------------------------------------------------- the layout of the calls
def test_split_ids_finds_the_target_and_the_reference_tokens_around_it():
    target, reference = image_ids(3, 4), image_ids(2, 2) + torch.tensor([1.0, 0.0, 0.0])
    assert split_ids(torch.cat([target, reference])) == ((3, 4), ContextTokens(after=4))
    assert split_ids(torch.cat([reference, target])) == ((3, 4), ContextTokens(before=4))
    assert split_ids(target) == ((3, 4), ContextTokens())
    assert split_ids(torch.cat([target[:6], reference, target[6:]]))[0] is None  # the target is not one run
    flux2 = torch.cat([grid_ids(1, 3, 4, 1), grid_ids(1, 2, 2, 1) + torch.tensor([10, 0, 0, 0])])
    assert split_ids(flux2[None].expand(2, -1, -1)) == ((3, 4), ContextTokens(after=4))


def test_context_tokens_take_and_put_back_the_target():
    ctx = ContextTokens(before=2, after=3)
    stream = torch.arange(10.0).view(1, 10, 1)  # [ref, ref, t0..t4, ref, ref, ref]
    assert ctx.target(stream).flatten().tolist() == [2.0, 3.0, 4.0, 5.0, 6.0]
    merged = ctx.with_target(stream, torch.tensor([[[-1.0], [-2.0]]]))
    assert merged.flatten().tolist() == [0.0, 1.0, -1.0, -2.0, 7.0, 8.0, 9.0]
    assert ctx.target(merged).flatten().tolist() == [-1.0, -2.0]  # a merged stream is read the same way
    assert ctx.stream_positions(torch.tensor([[4, 0], [1, 3]]), 5).tolist() == [[0, 1, 6, 2, 7, 8, 9],
                                                                                [0, 1, 3, 5, 7, 8, 9]]
    with pytest.raises(RuntimeError, match="context"):
        ctx.check(torch.zeros(1, 4, 1), "a block")
    assert not ContextTokens() and ContextTokens().target(stream) is stream


# ---------------------------------------------------------------------- every editing call
@pytest.mark.parametrize("name", CASES)
def test_ratio_zero_and_remove_are_bit_identical_with_reference_tokens(models, name):
    check_bit_identical(models[name], CASES[name].inputs(models[name]), "tomesd", use_rand=False, **ALL_SUBLAYERS)


@pytest.mark.parametrize("name", CASES)
def test_only_the_target_is_merged_and_reference_tokens_pass_every_merged_sublayer(models, name):
    """Hooks around every merge point see each call's tokens before and after tomerge's own hooks: the input
    loses ``N / 2`` target tokens (or came merged from an earlier point of the block) and keeps the text and
    reference tokens bit for bit; the output gets its ``N`` target tokens back (or stays merged for a later
    point) and keeps the reference tokens the sublayer computed."""
    model, case = models[name], CASES[name]
    inputs = case.inputs(model)
    calls: list[dict] = []
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False, **ALL_SUBLAYERS) as handle:
        hooks = [hook for block in handle._blocks for point in block.points for hook in _watch(point, calls)]
        try:
            out = run(model, inputs)
        finally:
            for hook in hooks:
                hook.remove()
        records = handle.state.records
    assert torch.isfinite(out).all() and out.shape[1] == (N if "kv_cache_mode" in inputs else N + R)  # extract: target
    assert records and all(r.num_tokens == N and r.num_removed == N // 2 for r in records)
    merged_here = {c["sublayer"] for c in calls if c["raw_in"].shape[1] > c["in"].shape[1]}
    assert merged_here == {"attn", "mlp"}
    for c in calls:
        ahead, behind = c["text"] + case.before, R - case.before  # rows before and after the target
        full, merged = ahead + N + behind, ahead + N // 2 + behind
        raw_in, new_in = c["raw_in"], c["in"]
        assert new_in.shape[1] == merged and raw_in.shape[1] in (full, merged), c["module"]
        assert torch.equal(new_in[:, :ahead], raw_in[:, :ahead]), c["module"]
        assert torch.equal(new_in[:, merged - behind:], raw_in[:, raw_in.shape[1] - behind:]), c["module"]
        raw_out, new_out = c["raw_out"], c["out"]
        if c["keeps"]:  # left as it is: a later point of the block unmerges (FLUX.2: to_out, inside the attention)
            assert new_out is raw_out
            continue
        assert raw_out.shape[1] == merged and new_out.shape[1] == full, c["module"]
        assert torch.equal(new_out[:, :ahead], raw_out[:, :ahead]), c["module"]
        assert torch.equal(new_out[:, full - behind:], raw_out[:, merged - behind:]), c["module"]


def _tokens_of(point: MergePoint, args: tuple, kwargs: dict) -> Tensor:
    """The tensor that holds a merge point's tokens (the image stream, or the joint sequence) in its call."""
    if isinstance(point, DeclaredPoint):
        return point._raw(args, kwargs)
    return MergePoint.get_input(point, args, kwargs)


def _output_of(point: MergePoint, out) -> Tensor:
    y = out if point.output is None else out[point.output]
    return y[0] if isinstance(y, tuple) else y  # FLUX.1's double-stream attention: (image, text)


def _text_ahead(point: MergePoint) -> int:
    """Text rows in front of a point's image stream: joint ``[text, image]`` sites."""
    if isinstance(point, DeclaredPoint):
        return point.info.text if point.site.tokens == "joint" else 0
    return point.lengths.text if isinstance(point, SingleStreamPoint) else 0


def _watch(point: MergePoint, calls: list[dict]) -> list:
    """Hooks before (``prepend``) and after tomerge's: the raw and the merged input, the raw and the unmerged
    output of every call of ``point``."""
    sublayers = frozenset({"attn", "crossattn", "mlp"})
    current: list[dict] = []  # this point's call in progress (points nest: FLUX.2's to_out inside attn)

    def raw_in(module, args, kwargs):
        current[:] = [{"module": type(module).__name__, "sublayer": point.sublayer,
                       "raw_in": _tokens_of(point, args, kwargs), "keeps": point.keeps_merged(sublayers)}]
        calls.append(current[0])

    def new_in(module, args, kwargs):
        current[0].update({"in": _tokens_of(point, args, kwargs), "text": _text_ahead(point)})

    def raw_out(module, args, kwargs, out):
        current[0]["raw_out"] = _output_of(point, out)

    def new_out(module, args, kwargs, out):
        current[0]["out"] = _output_of(point, out)

    return [point.module.register_forward_pre_hook(raw_in, with_kwargs=True, prepend=True),
            point.module.register_forward_pre_hook(new_in, with_kwargs=True),
            point.module.register_forward_hook(raw_out, with_kwargs=True, prepend=True),
            point.module.register_forward_hook(new_out, with_kwargs=True)]


@pytest.mark.parametrize("name", CASES)
def test_permuted_target_slots_give_the_unpatched_output(models, name):
    """Exact only if every target slot carries its token's RoPE row and the reference rows stay where they are."""
    model, case = models[name], CASES[name]
    check_permutation_is_exact(model, case.inputs(model, seed=4), shuffle_target(case.before), N)


@pytest.mark.tie_sensitive
@pytest.mark.parametrize("name", ["flux2_reference", "flux2_reference_first", "qwenimage_edit"])
def test_a_batch_with_reference_images_equals_its_samples_alone(models, name):
    check_batch_equals_samples(models[name], CASES[name].inputs(models[name], seed=5))


# ---------------------------------------------------------------------- FLUX.1 Kontext specifics
def test_kontext_received_attention_is_the_text_attention_to_the_target_keys(models):
    """idm on a Kontext call: the text queries' attention over text, target and reference keys (the model's own
    softmax), restricted to the target's keys and renormalised, written out by hand from the attention's inputs."""
    from diffusers.models.embeddings import apply_rotary_emb

    model = models["flux_kontext"]
    inputs = kontext_inputs(model)
    T = inputs["encoder_hidden_states"].shape[1]
    attn = model.transformer_blocks[1].attn
    seen = {}

    def keep(module, args, kwargs):
        seen.setdefault("kwargs", kwargs)  # the first call: before tomerge's hooks, at full length

    hook = attn.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        with tomerge.merging(model, "idm", ratio=0.5) as handle:
            run(model, inputs)
            recorded = handle.state.attention[1]
            assert all(r.num_tokens == N and r.num_removed == N // 2 for r in handle.state.records)
    finally:
        hook.remove()
    kwargs = seen["kwargs"]

    def heads(t):
        return t.unflatten(-1, (attn.heads, -1))  # [B, L, h, d]

    with torch.no_grad():
        h, c = kwargs["hidden_states"], kwargs["encoder_hidden_states"]  # [B, N + R, C], [B, T, C]
        assert h.shape[1] == N + R  # the probe's attention ran at full length
        q = torch.cat([attn.norm_added_q(heads(attn.add_q_proj(c))), attn.norm_q(heads(attn.to_q(h)))], dim=1)
        k = torch.cat([attn.norm_added_k(heads(attn.add_k_proj(c))), attn.norm_k(heads(attn.to_k(h)))], dim=1)
        q = apply_rotary_emb(q, kwargs["image_rotary_emb"], sequence_dim=1)[:, :T]  # text queries
        k = apply_rotary_emb(k, kwargs["image_rotary_emb"], sequence_dim=1)  # [B, T + N + R, h, d]
        p = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(q.shape[-1] ** -0.5).softmax(-1)  # [B, h, T, T + N + R]
        a = p.mean(dim=(1, 2))[:, T:T + N]  # [B, N]: the target's keys
    torch.testing.assert_close(recorded, a / a.sum(-1, keepdim=True))


def test_kontext_reference_tokens_keep_their_rotary_rows(models):
    """The RoPE table an attention gets in a merged Kontext call: text rows, the target's rows gathered per
    slot, the reference rows unchanged (read from the table of the unmerged call)."""
    model = models["flux_kontext"]
    inputs = kontext_inputs(model, batch=1)
    attn = model.single_transformer_blocks[0].attn
    tables = []

    def keep(module, args, kwargs):
        tables.append(kwargs["image_rotary_emb"])

    hook = attn.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        run(model, inputs)
    finally:
        hook.remove()
    with tomerge.merging(model, "tomesd", ratio=0.5, use_rand=False) as handle:
        slots = {}
        handle.state.observers.append(lambda call, plan: slots.setdefault(call.where.layer, plan.dst))
        hook = attn.register_forward_pre_hook(keep, with_kwargs=True)  # after tomerge's: the merged call's table
        try:
            run(model, inputs)
        finally:
            hook.remove()
    (full_cos, _), (merged_cos, _) = tables
    T = inputs["encoder_hidden_states"].shape[1]
    dst = slots[2][0]  # [M] the slots' representatives in the first single-stream block
    expected = torch.cat([full_cos[:T], full_cos[T:T + N][dst], full_cos[T + N:]])  # [T + M + R, d]
    assert merged_cos.shape == (T + N // 2 + R, full_cos.shape[1]) and torch.equal(merged_cos, expected)


def _target_split_by_the_reference(model: nn.Module) -> dict:
    inputs = flux2_reference_inputs(model)
    ids = inputs["img_ids"][0]
    inputs["img_ids"] = torch.cat([ids[:10], ids[N:], ids[10:N]])[None].expand(2, -1, -1)  # t = 0 in two runs
    return inputs


def _qwen_shapes_per_sample_differ(model: nn.Module) -> dict:
    inputs = qwen_edit_inputs(model)
    inputs["img_shapes"] = [[(1, *GRID), (1, *REFERENCE)], [(1, *GRID), (1, *REFERENCE[::-1])]]
    return inputs


@pytest.mark.filterwarnings("ignore:tomerge. no block")
@pytest.mark.parametrize("name, inputs, message", [
    ("flux2_reference", _target_split_by_the_reference, "no raster-ordered"),
    ("qwenimage_edit", _qwen_shapes_per_sample_differ, "img_shapes"),
])
def test_a_call_without_one_target_grid_is_not_merged(models, name, inputs, message):
    model = models[name]
    call = inputs(model)
    before = run(model, call)
    with tomerge.merging(model, "tomesd", ratio=0.5) as handle:
        with pytest.warns(UserWarning, match=message):
            out = run(model, call)
        assert handle.stats["tokens_removed"] == 0
    assert torch.equal(out, before)
