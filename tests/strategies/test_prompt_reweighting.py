"""Prompt token reweighting (docs/schedules.md, "Prompt token reweighting"): categorizers, the exact text-key bias,
SD3 and Flux.

The bias must equal an explicit additive mask (``+log(a_p)`` on the chosen text keys' logits, image
queries only) while the SDPA call itself gets no mask; on tiny random-weight SD3/Flux models ``a_p = 1``
and ``remove()`` are bit-identical and ``a_p = 2`` changes the output.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

import tomerge
from tomerge.strategies.sdtm_prompts import (JSONLabelsCategorizer, PromptCategories, PromptCategorizer,
                                             WordListCategorizer, group_words, token_bias)
from tomerge.text_bias import bias_text_keys, key_bias_attention

S, D, N = "structure", "detail", "none"


# ====================================================================== categorizers
PROMPT = "Three fluffy puppies sitting on a wooden bench, golden hour lighting"
CLIP_TOKENS = ["<|startoftext|>", "three</w>", "fluffy</w>", "pupp", "ies</w>", "sitting</w>", "on</w>", "a</w>",
               "wooden</w>", "bench</w>", ",</w>", "golden</w>", "hour</w>", "lighting</w>", "<|endoftext|>",
               "<|endoftext|>"]
CLIP_LABELS = [N, S, D, S, S, S, S, N, D, N, N, D, N, D, N, N]
T5_TOKENS = ["▁Three", "▁fluffy", "▁pu", "ppies", "▁sitting", "▁on", "▁a", "▁wooden", "▁bench", ",", "▁golden",
             "▁hour", "▁lighting", "</s>", "<pad>", "<pad>"]
T5_LABELS = [S, D, S, S, S, S, N, D, N, N, D, N, D, N, N, N]


def test_word_list_categorizer_labels_clip_and_t5_sub_word_tokens():
    cat = WordListCategorizer()
    assert isinstance(cat, PromptCategorizer)
    assert cat.categorize(PROMPT, CLIP_TOKENS) == CLIP_LABELS
    assert cat.categorize(PROMPT, T5_TOKENS) == T5_LABELS
    # the concatenated sequence SD3 sees (CLIP then T5) labels each part the same way
    assert cat.categorize(PROMPT, CLIP_TOKENS + T5_TOKENS) == CLIP_LABELS + T5_LABELS
    # plain words: case and punctuation; GPT-2 and WordPiece pieces
    assert cat.categorize("", ["A", "RED", "car.", "!"]) == [N, D, S, N]
    assert cat.categorize("", ["Ġtwo", "Ġbl", "ue", "Ġcats"]) == [S, D, D, S]
    assert cat.categorize("", ["[CLS]", "a", "shiny", "robot", "##s", "[SEP]"]) == [N, N, D, S, S, N]
    assert group_words(["▁pu", "ppies", "▁", "3d"]) == [([0, 1], "puppies"), ([2, 3], "3d")]


def test_word_list_categorizer_custom_lists_and_conflicts():
    cat = WordListCategorizer(structure=["Bench"], detail=["fluffy"])
    assert cat.categorize("", ["▁fluffy", "▁benches", "▁red"]) == [D, S, N]
    with pytest.raises(ValueError, match="both lists"):
        WordListCategorizer(structure=["red"], detail=["RED"])


def test_shipped_word_lists_are_package_data():
    import importlib.resources

    data = json.loads((importlib.resources.files("tomerge.strategies") / "data" / "prompt_words.json").read_text())
    words = [w for c in (S, D) for group in data[c].values() for w in group]
    assert len(words) > 300 and len(set(words)) == len(words)


def test_json_categorizer_reads_every_layout(tmp_path):
    tokens = ["▁a", "▁red", "▁car", "</s>"]
    per_token = tmp_path / "per_token.json"
    per_token.write_text(json.dumps({"a red car": [N, D, S, N]}))
    per_word = tmp_path / "per_word.json"
    per_word.write_text(json.dumps({"a red car": {"red": D, "car": S}}))
    words = tmp_path / "words.json"
    words.write_text(json.dumps({"red": D, "CAR": S}))
    for path in (per_token, per_word, words):
        assert JSONLabelsCategorizer(path).categorize("a red car", tokens) == [N, D, S, N]
    assert JSONLabelsCategorizer(words).categorize("other prompt", ["red</w>", "cars</w>"]) == [D, S]


@pytest.mark.parametrize("content, match", [
    ("not json", "cannot read"),
    ("[]", "non-empty JSON object"),
    ('{"red": "detail", "a car": ["none"]}', "all strings"),
    ('{"red": "colour"}', "not one of"),
    ('{"a car": ["none", "objects"]}', "not one of"),
])
def test_json_categorizer_errors_say_what_is_wrong(tmp_path, content, match):
    path = tmp_path / "labels.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=match):
        JSONLabelsCategorizer(path)


def test_json_categorizer_errors_for_unknown_prompt_and_wrong_length(tmp_path):
    path = tmp_path / "labels.json"
    path.write_text(json.dumps({"a red car": [N, D, S]}))
    cat = JSONLabelsCategorizer(path)
    with pytest.raises(ValueError, match="no labels for prompt 'a blue car'"):
        cat.categorize("a blue car", ["a", "blue", "car"])
    with pytest.raises(ValueError, match="3 labels but its tokenisation has 4 tokens"):
        cat.categorize("a red car", ["a", "red", "car", "</s>"])
    with pytest.raises(ValueError, match="cannot read"):
        JSONLabelsCategorizer(tmp_path / "missing.json")


def test_token_bias_and_batch_rows():
    cats = [S, D, N, S]
    torch.testing.assert_close(token_bias(cats, S, 2.0), torch.tensor([math.log(2), 0, 0, math.log(2)]))
    torch.testing.assert_close(token_bias(cats, D, 3.0), torch.tensor([0, math.log(3), 0, 0]))
    assert not token_bias(cats, S, 1.0).any()
    with pytest.raises(ValueError, match="phase"):
        token_bias(cats, "none")
    with pytest.raises(ValueError, match="a_p"):
        token_bias(cats, S, 0.0)
    rows = PromptCategories([[N] * 4, cats])  # classifier-free guidance: negative first
    b = rows.bias(S, 2.0, batch=4, text_len=4, device=torch.device("cpu"))  # 2 images per prompt
    assert b.shape == (4, 4) and not b[:2].any() and torch.equal(b[2], b[3]) and b[2, 0] > 0
    assert rows.bias(D, 1.0, 2, 4, torch.device("cpu")) is None  # zero everywhere: run unchanged
    with pytest.raises(ValueError, match="multiple"):
        rows.bias(S, 2.0, 3, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="model attends to 5"):
        rows.bias(S, 2.0, 2, 5, torch.device("cpu"))
    with pytest.raises(ValueError, match="wrap a single prompt"):
        PromptCategories(cats)
    with pytest.raises(ValueError, match="different lengths"):
        PromptCategories([cats, cats[:3]])


# ====================================================================== the exact key bias
def masked_reference(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, query_mask: Tensor, scale: float) -> Tensor:
    """``softmax(q k^T * scale + M) v`` with ``M[b, i, j] = bias[b, j]`` for the masked queries, in float64."""
    q, k, v = q.double(), k.double(), v.double()
    mask = bias.double()[:, None, None, :] * query_mask.double()[None, None, :, None]  # [B, 1, Lq, Lk]
    return ((q @ k.transpose(-1, -2)) * scale + mask).softmax(-1) @ v


@pytest.mark.parametrize("d, scale", [(8, None), (16, 0.3), (13, None)])
def test_key_bias_attention_equals_an_explicit_mask(d, scale):
    g = torch.Generator().manual_seed(0)
    B, h, L, T = 2, 3, 11, 4
    q, k, v = (torch.randn(B, h, L, d, generator=g) for _ in range(3))
    bias = torch.zeros(B, L)
    bias[0, -T:] = torch.tensor([math.log(2), 0, math.log(2), 0])
    bias[1, -T:] = torch.tensor([0, math.log(3), 0, -1.5])
    image = torch.arange(L) < L - T  # image queries first, text last (SD3)
    calls: list[dict] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is F.scaled_dot_product_attention:
                calls.append({"shape": tuple(args[0].shape), **(kwargs or {})})
            return func(*args, **(kwargs or {}))

    with Spy():
        out = key_bias_attention(q, k, v, bias, query_mask=image, scale=scale)
    expected = masked_reference(q, k, v, bias, image, scale if scale is not None else d ** -0.5)
    torch.testing.assert_close(out.double(), expected, rtol=0, atol=1e-5)
    assert calls[0]["attn_mask"] is None and calls[0]["shape"][-1] % 8 == 0  # no mask: a fused kernel can run
    # text queries are untouched; a zero bias is the plain attention
    plain = F.scaled_dot_product_attention(q, k, v, scale=scale)
    torch.testing.assert_close(out[:, :, ~image], plain[:, :, ~image], rtol=0, atol=1e-6)
    zero = key_bias_attention(q, k, v, torch.zeros(B, L), query_mask=image, scale=scale)
    torch.testing.assert_close(zero, plain, rtol=0, atol=1e-6)


def test_key_bias_attention_low_precision_keeps_the_bias():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 9, 16, generator=g) for _ in range(3))
    bias = torch.zeros(1, 9)
    bias[0, :3] = math.log(2)
    image = torch.arange(9) >= 3  # text first (Flux)
    out = key_bias_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), bias, query_mask=image)
    ref = key_bias_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), bias, query_mask=image)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref, rtol=0, atol=2e-2)  # bf16 output rounding only


# ====================================================================== SD3
def tiny_sd3(seed: int = 0):
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=8, patch_size=1, in_channels=4, out_channels=4, num_layers=2, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=24, caption_projection_dim=16, pooled_projection_dim=16,
        pos_embed_max_size=16, dual_attention_layers=(0,), qk_norm="rms_norm").eval()


TEXT = 7
LABELS = [N, S, D, S, N, D, N]


def sd3_inputs(batch: int = 2, t: float = 900.0) -> dict:
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(batch, 4, 8, 8, generator=g),
                encoder_hidden_states=torch.randn(batch, TEXT, 24, generator=g),
                pooled_projections=torch.randn(batch, 16, generator=g), timestep=torch.full((batch,), t))


def run(model, inputs: dict) -> Tensor:
    with torch.no_grad():
        return model(**inputs).sample


@pytest.fixture(scope="module")
def sd3():
    return tiny_sd3()


def no_hooks_left(model) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


def test_sd3_reweighting_a_p_one_is_identity_two_changes_remove_restores(sd3):
    inputs = sd3_inputs()
    before = run(sd3, inputs)
    with tomerge.merging(sd3, "sdtm", ratio=0.5, num_steps=10) as handle:
        merged = run(sd3, inputs)
    with tomerge.merging(sd3, "sdtm", ratio=0.5, num_steps=10, prompt_reweight=1.0, text_labels=[LABELS]):
        assert torch.equal(run(sd3, inputs), merged)
    with tomerge.merging(sd3, "sdtm", ratio=0.5, num_steps=10, text_labels=[LABELS]) as handle:
        handle.set_text_labels(None)  # off again (its hooks stay, idle): same as never given
        assert torch.equal(run(sd3, inputs), merged)
    handle = tomerge.apply(sd3, "sdtm", ratio=0.5, num_steps=10, text_labels=[LABELS])
    reweighted = run(sd3, inputs)
    assert torch.isfinite(reweighted).all() and (reweighted - merged).abs().max() > 1e-4
    handle.remove()
    assert torch.equal(run(sd3, inputs), before) and no_hooks_left(sd3)
    # without merging (ratio 0) the reweighting alone still changes the output
    with tomerge.merging(sd3, "sdtm", ratio=0.0, num_steps=10, text_labels=[LABELS]):
        assert (run(sd3, inputs) - before).abs().max() > 1e-4
    assert torch.equal(run(sd3, inputs), before)


def test_sd3_phase_picks_the_category(sd3):
    only_detail = [N, N, D, N, N, D, N]
    structure_step, detail_step = sd3_inputs(t=900.0), sd3_inputs(t=100.0)
    outs = {}
    for cats in (None, only_detail):
        with tomerge.merging(sd3, "sdtm", ratio=0.0, text_labels=cats and [cats]) as handle:
            outs[cats is None, "s"] = run(sd3, structure_step)  # first call: progress 0, structure phase
            outs[cats is None, "d"] = run(sd3, detail_step)  # t decreases, no step count: progress 0.9
            phases = {r.step: r.label for r in handle.state.records}
    assert phases == {0: "structure", 1: "detail"}
    assert torch.equal(outs[False, "s"], outs[True, "s"])  # no structure tokens: nothing to reweight
    assert (outs[False, "d"] - outs[True, "d"]).abs().max() > 1e-4


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class ExplicitMask(TorchFunctionMode):
    """The reference: the module's own SDPA call with an additive mask, ``bias`` on image queries -> text keys."""

    def __init__(self, bias: Tensor, text_first: bool) -> None:
        super().__init__()
        self.bias, self.text_first = bias, text_first  # [B, T]

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is not F.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        call = {**dict(zip(_SDPA_ARGS, args)), **(kwargs or {})}
        L, T = call["query"].shape[-2], self.bias.shape[1]
        text = torch.zeros(L, dtype=torch.bool)
        text[slice(0, T) if self.text_first else slice(L - T, L)] = True
        full = torch.zeros(self.bias.shape[0], L)
        full[:, text] = self.bias
        call["attn_mask"] = full[:, None, None, :] * (~text).float()[None, None, :, None]  # [B, 1, L, L]
        return func(**call)


def tiny_flux(layers: int = 1):
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(0)
    return FluxTransformer2DModel(patch_size=1, in_channels=8, num_layers=layers, num_single_layers=layers,
                                  attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                  pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)).eval()


@pytest.mark.parametrize("where", ["sd3", "flux_double", "flux_single"])
def test_attention_matches_an_explicit_mask_reference(sd3, where):
    """The adapter's text keys + the hooks = the same attention with an explicit additive mask (image queries)."""
    from tomerge.backbones.flux import FluxAdapter
    from tomerge.backbones.sd3 import SD3Adapter, SD3Options

    g = torch.Generator().manual_seed(2)
    if where == "sd3":
        adapter = SD3Adapter(sd3, SD3Options())
        block = adapter.blocks()[0]
        image, text = torch.randn(2, 64, 16, generator=g), torch.randn(2, TEXT, 16, generator=g)
        kwargs = dict(hidden_states=image, encoder_hidden_states=text)
    else:
        adapter = FluxAdapter(tiny_flux(), None)
        blocks = adapter.blocks()
        block = blocks[0] if where == "flux_double" else blocks[1]
        image, text = torch.randn(2, 36, 32, generator=g), torch.randn(2, TEXT, 32, generator=g)
        if where == "flux_double":
            kwargs = dict(hidden_states=image, encoder_hidden_states=text)
        else:
            block.lengths.text, block.lengths.image = TEXT, 36  # as the block call would record them
            kwargs = dict(hidden_states=torch.cat([text, image], 1))
    point = next(p for p in block.points if type(p).__name__ != "SingleStreamPoint")  # the attention
    keys = adapter.text_keys(block, point)
    assert keys.module is point.module and keys.text_first == (where != "sd3")
    attn = keys.module
    bias = torch.stack([token_bias(LABELS, S, 2.0), token_bias(LABELS, D, 3.0)])  # [B, T]
    with torch.no_grad():
        with ExplicitMask(bias, keys.text_first):
            expected = attn(**kwargs)
        hooks = bias_text_keys(keys, lambda batch, T, device: bias)
        got = attn(**kwargs)
        for h in hooks:
            h.remove()
        plain = attn(**kwargs)
    expected, got, plain = ((o,) if isinstance(o, Tensor) else o for o in (expected, got, plain))
    for e, o in zip(expected, got):
        torch.testing.assert_close(o, e, rtol=0, atol=1e-5)
    assert (got[0] - plain[0]).abs().max() > 1e-4
    if where != "flux_single":
        torch.testing.assert_close(got[1], plain[1], rtol=0, atol=1e-6)  # text queries untouched
    else:
        torch.testing.assert_close(got[0][:, :TEXT], plain[0][:, :TEXT], rtol=0, atol=1e-6)


def test_sd3_guidance_rows_and_errors(sd3):
    inputs = sd3_inputs()
    with tomerge.merging(sd3, "sdtm", ratio=0.0) as handle:
        plain = run(sd3, inputs)
        handle.set_text_labels([[N] * TEXT, LABELS])  # [negative, prompt]
        out = run(sd3, inputs)
        torch.testing.assert_close(out[0], plain[0], rtol=0, atol=1e-5)  # unlabelled negative: unchanged
        assert (out[1] - plain[1]).abs().max() > 1e-4
        handle.set_text_labels([LABELS[:5]])
        with pytest.raises(ValueError, match="model attends to 7"):
            run(sd3, inputs)
        with pytest.raises(ValueError, match="not one of"):
            handle.set_text_labels([["object"] * TEXT])
    with pytest.raises(TypeError, match="takes no text labels"):
        tomerge.apply(sd3, "tomesd", ratio=0.5, text_labels=[LABELS])
    with pytest.raises(TypeError, match="takes no text labels"):
        tomerge.apply(sd3, "sdtm", ratio=0.5, prompt_reweight=None, text_labels=[LABELS])
    assert no_hooks_left(sd3)


def test_sd3_processor_without_torch_sdpa_raises(sd3):
    attn = sd3.transformer_blocks[0].attn
    original = attn.processor

    class MathProcessor:  # the same processor, but its SDPA is computed by hand (as another kernel would)
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
            class Manual(TorchFunctionMode):
                def __torch_function__(self, func, types, args=(), kwargs=None):
                    if func is F.scaled_dot_product_attention:
                        q, k, v = args[:3]
                        return (q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5).softmax(-1) @ v
                    return func(*args, **(kwargs or {}))

            with Manual():
                return original(attn, hidden_states, encoder_hidden_states, attention_mask)

    attn.set_processor(MathProcessor())
    try:
        with tomerge.merging(sd3, "sdtm", ratio=0.0, text_labels=[LABELS]):
            with pytest.raises(RuntimeError, match="scaled_dot_product_attention"):
                run(sd3, sd3_inputs())
    finally:
        attn.set_processor(original)
    assert no_hooks_left(sd3)


def test_models_without_text_tokens_refuse_categories():
    from diffusers import DiTTransformer2DModel

    torch.manual_seed(0)
    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                sample_size=8, patch_size=1, num_embeds_ada_norm=10).eval()
    with pytest.raises(ValueError, match="no text tokens"):
        tomerge.apply(dit, "sdtm", ratio=0.3, text_labels=[[S]])
    assert no_hooks_left(dit)
    with tomerge.merging(dit, "sdtm", ratio=0.3):  # no categories: sdtm runs as before
        pass


def test_sd3_text_tokens_lists_clip_then_t5():
    from tomerge.backbones.sd3 import text_tokens

    class Tokenizer:
        def __init__(self, pieces, pad):
            self.pieces, self.pad = pieces, pad

        def __call__(self, prompt, padding, max_length, truncation, **kwargs):
            ids = list(range(len(self.pieces)))[:max_length]
            return type("Out", (), {"input_ids": ids + [-1] * (max_length - len(ids))})()

        def convert_ids_to_tokens(self, ids):
            return [self.pieces[i] if i >= 0 else self.pad for i in ids]

    pipe = type("Pipe", (), {})()
    pipe.tokenizer, pipe.tokenizer_max_length = Tokenizer(CLIP_TOKENS[:-1], "<|endoftext|>"), 20
    pipe.tokenizer_3, pipe.text_encoder_3 = Tokenizer(T5_TOKENS[:-2], "<pad>"), object()
    tokens = text_tokens(pipe, PROMPT, max_sequence_length=18)
    assert len(tokens) == 20 + 18 and tokens[:15] == CLIP_TOKENS[:15] and tokens[20:34] == T5_TOKENS[:14]
    labels = WordListCategorizer().categorize(PROMPT, tokens)
    assert labels[:16] == CLIP_LABELS and labels[20:36] == T5_LABELS
    pipe.text_encoder_3 = None
    assert text_tokens(pipe, PROMPT, max_sequence_length=18)[20:] == ["<pad>"] * 18


# ====================================================================== Flux
def test_flux_reweighting_a_p_one_is_identity_two_changes_remove_restores():
    flux = tiny_flux()
    g = torch.Generator().manual_seed(1)
    rows, cols = torch.meshgrid(torch.arange(6), torch.arange(6), indexing="ij")
    inputs = dict(hidden_states=torch.randn(2, 36, 8, generator=g),
                  encoder_hidden_states=torch.randn(2, TEXT, 32, generator=g),
                  pooled_projections=torch.randn(2, 32, generator=g), timestep=torch.full((2,), 0.9),
                  img_ids=torch.stack([torch.zeros(36), rows.flatten().float(), cols.flatten().float()], 1),
                  txt_ids=torch.zeros(TEXT, 3))
    before = run(flux, inputs)
    with tomerge.merging(flux, "sdtm", ratio=0.5, num_steps=10) as handle:
        merged = run(flux, inputs)
        assert {b.kind for b in handle.adapter.blocks()} == {"double", "single"}
    with tomerge.merging(flux, "sdtm", ratio=0.5, num_steps=10, prompt_reweight=1.0, text_labels=[LABELS]):
        assert torch.equal(run(flux, inputs), merged)
    calls = []
    with tomerge.merging(flux, "sdtm", ratio=0.5, num_steps=10, text_labels=[LABELS]):
        hooks = [blk.attn.register_forward_pre_hook(lambda m, a: calls.append(m)) for blk in
                 (flux.transformer_blocks[0], flux.single_transformer_blocks[0])]
        reweighted = run(flux, inputs)
        for h in hooks:
            h.remove()
    assert len(calls) == 2 and torch.isfinite(reweighted).all() and (reweighted - merged).abs().max() > 1e-4
    assert torch.equal(run(flux, inputs), before) and no_hooks_left(flux)
