"""Received-attention probes of joint text-image attention against the model's own attention.

The reference is independent of the probe (``helpers.probes``): it intercepts the ``scaled_dot_product_attention`` call
inside the attention module (the q, k, mask and scale the model attends with, after its norms and rotary rotation) and
computes, in float64, the probe's documented rule: the text queries' softmax over all keys, averaged over heads and the
text queries that the mask keeps, restricted to the image keys and renormalised per sample
(``backbones._diffusers.probe_joint_attention``). The probes that read the image queries where no text query sees the
image (``probe_queries="image"``: OmniGen, Qwen-Image 2.1, Z-Image's noise refiner) read that SDPA call themselves, so
their reference forms the attention by hand from the attention's projections, RoPE and mask, and checks it against the
attention's output.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn

import tomerge
from tomerge import registry
from tomerge.backbones._declared import Kind, Rope, Site
from tomerge.backbones._diffusers import call_arg, joint_key_mask, probe_sdpa_attention
from tomerge.backbones.wan import WanAdapter
from tomerge.registry import backbone_class
from helpers import no_hooks_left
from helpers.families import FAMILIES
from helpers.family import run, to_float64
from helpers.image_families import cogview3plus_inputs
from helpers.models import SIZE, flux_inputs, make_inputs, tiny_flux, tiny_sd3
from helpers.probes import attentions_of, check_probe_matches_the_model, idm_records
from helpers.reference_images import CASES as EDITS, GRID, REFERENCE


# ---------------------------------------------------------------------- FLUX.1 (hand-written adapter)
def test_joint_key_mask_text_and_joint_masks():
    bias, valid = joint_key_mask(torch.tensor([[True, False, True, True, True]]), 1, 2, 3, "first")
    assert bias.tolist() == [[0.0, -math.inf, 0.0, 0.0, 0.0]] and valid.tolist() == [[True, False]]
    bias, valid = joint_key_mask(torch.tensor([[1, 0]])[:, None, None, :], 2, 2, 3, "last")  # [1, 1, 1, T]
    assert bias.tolist() == [[0.0, 0.0, 0.0, 0.0, -math.inf]] * 2 and valid.tolist() == [[True, False]] * 2
    additive = torch.tensor([[0.5, -1.0]])
    bias, valid = joint_key_mask(additive, 1, 2, 1, "first")
    assert bias.tolist() == [[0.5, -1.0, 0.0]] and valid is None
    with pytest.raises(ValueError, match="over 4 keys"):
        joint_key_mask(torch.ones(1, 4, dtype=torch.bool), 1, 2, 3, "first")
    with pytest.raises(ValueError, match=r"\[B, L\] or \[B, 1, 1, L\]"):
        joint_key_mask(torch.ones(1, 2, 1, 5, dtype=torch.bool), 1, 2, 3, "first")
    pairs = torch.tensor([[1, 1, 0, 1, 1]]).bool()  # a query-by-key mask [B, 1, L, L] (Chroma): text first
    bias, valid = joint_key_mask((pairs[:, :, None] & pairs[:, None, :])[:, None], 1, 3, 2, "first")
    assert bias.shape == (1, 3, 5) and valid.tolist() == [[True, True, False]]  # the padded query attends nothing
    assert bias[0, 0].tolist() == [0.0, 0.0, -math.inf, 0.0, 0.0] and bias[0, 2].tolist() == [0.0] * 5
    # the image queries' rows and validity (probe_queries="image"): of a query-by-key mask, and of a key mask
    causal = torch.tril(torch.ones(5, 5, dtype=torch.bool)) | torch.tensor([False] * 3 + [True] * 2)[:, None]
    bias, valid = joint_key_mask((causal & pairs)[None, None], 1, 3, 2, "first", queries="image")
    assert bias.tolist() == [[[0.0, 0.0, -math.inf, 0.0, 0.0]] * 2] and valid.tolist() == [[True, True]]
    bias, valid = joint_key_mask(torch.tensor([[True, True, True, False, True]]), 1, 2, 3, "last", queries="image")
    assert valid.tolist() == [[True, True, True]]  # the image first: its 3 tokens attended


def test_image_queries_are_a_rule_of_the_sdpa_probe():
    with pytest.raises(ValueError, match=r"probe_queries='image' is a rule of probe='sdpa', not of probe=True"):
        Site("attn", "attn", probe=True, probe_queries="image")
    with pytest.raises(ValueError, match="queries are 'text' or 'image', not 'keys'"):
        probe_sdpa_attention(nn.Identity(), None, text_side="first", text_len=lambda: 0, queries="keys")


@pytest.mark.parametrize("masked", [False, True])
def test_flux_probe_equals_the_models_attention(masked):
    """FLUX.1: text first, text rows of the RoPE table first, double (separate text projections) and single
    (one projection of the joint sequence) blocks; a key mask over the joint sequence via joint_attention_kwargs."""
    text, grid = 5, (4, 6)
    inputs = flux_inputs(text=text, grid=grid)
    if masked:
        mask = torch.ones(2, 1, 1, text + 24, dtype=torch.bool)
        mask[1, ..., text - 2:text] = False  # the second prompt is 2 tokens shorter
        inputs["joint_attention_kwargs"] = {"attention_mask": mask}
    blocks = attentions_of("transformer_blocks", "single_transformer_blocks")
    check_probe_matches_the_model(tiny_flux(), inputs, blocks, 24, text_first=True, masked=masked)


def test_sd3_probe_equals_the_models_attention():
    """SD3 (hand-written adapter): text last, no rotary table, the processor's q/k norms on [B, heads, L, d];
    block 0 also has SD3.5's second (image-only) attention, which records nothing."""
    check_probe_matches_the_model(tiny_sd3(), make_inputs("sd3"), attentions_of("transformer_blocks"),
                                  SIZE[0] * SIZE[1], text_first=False, masked=False)


# ---------------------------------------------------------------------- declared joint families
@pytest.mark.parametrize("name", [name for name, family in FAMILIES.items() if family.joint])
def test_declared_joint_probe_equals_the_models_attention(models, name, monkeypatch):
    """Every Family row with a ``joint`` probe (``helpers.family.JointProbe``): FLUX.2 (double and single blocks,
    text-first RoPE rows), Qwen-Image (complex tables per stream, a text mask), HunyuanVideo (text last, RoPE on the
    image rows only, a [B, 1, 1, N + T] key mask; single blocks project the joint sequence at once) and HunyuanVideo 1.5
    (a [B, T] text mask the processor pads to a query-and-key mask); AuraFlow (register tokens with the text, separate
    text projections in the joint blocks); Chroma's query-by-key mask (additive 0/1, as ChromaPipeline passes it),
    FIBO's and HunyuanImage's key masks, Bria, LongCat-Image and Ovis-Image, FLUX.3 on its single blocks (its mode
    blocks' self-attention probe: test_flux3.py); from the SDPA call, CogView4 and GLM-Image (q/k norms over [B,
    heads, L, d] and [B, L, heads, d], RoPE on the image rows), CogView3-Plus, HiDream (text last, its own projections
    and rotary function) and ERNIE-Image (text last, a [B, 1, 1, N + T] key mask over padded text); CogVideoX (the
    joint [text, video] sequence projected at once, q/k normalised as [B, heads, L, d], the video rows rotated),
    ConsisID, and EasyAnimate (its first block with its own text projections, its second projecting the joint
    sequence)."""
    family, model = FAMILIES[name], models[name]
    joint = family.joint
    if joint.kinds is not None:  # the other kinds' probes are checked elsewhere
        adapter = backbone_class(family.backbone)
        monkeypatch.setattr(adapter, "kinds", tuple(adapter.kinds[i] for i in joint.kinds))
    check_probe_matches_the_model(model, to_float64(family.inputs(model)), joint.attentions, math.prod(family.grid),
                                  text_first=joint.text_first, masked=joint.masked)


@pytest.mark.parametrize("name", ["flux_kontext", "flux2_reference", "flux2_reference_first", "flux2_kv_extract",
                                  "qwenimage_edit"])
def test_joint_probe_with_reference_images_records_the_targets_share(name):
    """Editing calls: the reference-image tokens around the target are keys like the text (the model's softmax
    over text, target and reference keys); the record is the target's keys' share. FLUX.2 klein's KV-cache
    extract call masks the reference queries' view of the target, not the text queries'."""
    case = EDITS[name]
    model = case.build()
    before = case.before
    context = (before, math.prod(REFERENCE) - before)
    containers = ("transformer_blocks",) if name == "qwenimage_edit" else ("transformer_blocks",
                                                                           "single_transformer_blocks")
    check_probe_matches_the_model(model, case.inputs(model), attentions_of(*containers), math.prod(GRID),
                                  text_first=True, masked=name == "qwenimage_edit", context=context)


# ---------------------------------------------------------------------- image queries: no text query sees the image
def _omnigen_attention(attn: nn.Module, x: Tensor, kwargs: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """OmniGenAttnProcessor2_0 by hand: q, k, v ``[B, h, L, d]`` (RoPE on q and k) and its additive mask ``[B, 1, L,
    L]`` (causal condition rows, image rows over every unpadded key)."""
    from diffusers.models.embeddings import apply_rotary_emb

    q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)).transpose(1, 2) for proj in (attn.to_q, attn.to_k, attn.to_v))
    rope = kwargs["image_rotary_emb"]
    return (apply_rotary_emb(q, rope, use_real_unbind_dim=-2), apply_rotary_emb(k, rope, use_real_unbind_dim=-2), v,
            kwargs["attention_mask"])


def _qwenimage21_attention(attn: nn.Module, x: Tensor, kwargs: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """QwenImage21AttnProcessor by hand for the target's queries: q, k, v ``[B, h, L, d]`` (q/k norms, complex
    RoPE; on a cached step the cached prefix's keys and values first) and the target rows' mask, the key mask ``[B,
    1, 1, L]`` (the prefix rows are block-causal, not compared)."""
    from diffusers.models.transformers.transformer_qwenimage21 import apply_rotary_emb_qwen

    q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))  # [B, L, h, d]
    q, k = (apply_rotary_emb_qwen(norm(t), kwargs["rotary_emb"], use_real=False)
            for norm, t in ((attn.norm_q, q), (attn.norm_k, k)))
    if kwargs.get("kv_cache_mode") == "cached":
        cached_k, cached_v = kwargs["layer_cache"].get()  # [B, P, h, d]: the prefix keys the first step stored
        k, v = torch.cat([cached_k, k], dim=1), torch.cat([cached_v, v], dim=1)
    valid = kwargs["attention_mask"] if kwargs.get("kv_cache_mode") == "cached" else kwargs["key_valid"][:, None, None]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), valid


def _z_image_attention(attn: nn.Module, x: Tensor, kwargs: dict) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """ZSingleStreamAttnProcessor by hand: q, k, v ``[B, h, L, d]`` (q/k norms, the complex RoPE in float32 as the
    processor rotates) and its key mask ``[B, 1, 1, L]`` (``None``: samples of one length, as in the refiner)."""
    freqs = kwargs["freqs_cis"][:, :, None]  # [B, L, 1, d/2]

    def rotate(t: Tensor) -> Tensor:  # [B, L, h, d]
        pairs = torch.view_as_complex(t.float().reshape(*t.shape[:-1], -1, 2))  # [B, L, h, d/2]
        return torch.view_as_real(pairs * freqs).flatten(3).type_as(t)

    q, k, v = (proj(x).unflatten(-1, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))  # [B, L, h, d]
    q, k = rotate(attn.norm_q(q)), rotate(attn.norm_k(k))
    mask = kwargs["attention_mask"]
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None if mask is None else mask[:, None, None]


@dataclasses.dataclass(frozen=True)
class ImageQueryCase:
    """A family whose probe reads image queries in some blocks: where its attentions are (``{layer: module}``), its
    processor by hand (``(attn, x, kwargs) -> q, k, v [B, h, L, d], mask``), the side of the text (the other keys)
    and the layers whose probe reads the text queries instead (Z-Image's joint blocks)."""

    attentions: Callable[[nn.Module], dict[int, nn.Module]]
    by_hand: Callable[[nn.Module, Tensor, dict], tuple[Tensor, Tensor, Tensor, Tensor]]
    text_first: bool
    grid: tuple[int, int] = (8, 8)
    text_query_layers: tuple[int, ...] = ()
    cached: bool = False  # Qwen-Image 2.1: the second, cached step of its prefix KV cache (the first stores it)


IMAGE_QUERIES = {
    "omnigen": ImageQueryCase(attentions_of("layers", path="self_attn"), _omnigen_attention, text_first=True),
    "qwenimage21": ImageQueryCase(attentions_of("transformer_blocks"), _qwenimage21_attention, text_first=True),
    "qwenimage21_cached": ImageQueryCase(attentions_of("transformer_blocks"), _qwenimage21_attention, text_first=True,
                                         cached=True),
    # 35 image tokens padded to 64: the refiner's other keys are the image's padding
    "z_image": ImageQueryCase(attentions_of("noise_refiner", "layers", path="attention"), _z_image_attention,
                              text_first=False, grid=(5, 7), text_query_layers=(1, 2)),
}


@pytest.mark.parametrize("name", IMAGE_QUERIES)
def test_image_query_probe_equals_the_models_attention(name):
    """float64, where no text query sees the image (OmniGen's causal condition, Qwen-Image 2.1's block-causal
    prompt, also on its cached steps, Z-Image's noise refiner): the record is the softmax of the image queries over
    every key, averaged over heads and queries, restricted to the image keys and renormalised per sample. The
    probabilities are formed here from each attention's own projections, RoPE and mask, and reproduce the model's
    attention output for those queries; without the mask they differ (the probe used it). Z-Image's joint blocks
    read the text queries (every token after the image), the batch's padding not counted."""
    case = IMAGE_QUERIES[name]
    family = FAMILIES[name.removesuffix("_cached")]
    model = family.build().double()
    inputs = to_float64(family.inputs(model, grid=case.grid))
    if case.cached:  # the first step stores the prefix keys (unmerged), the second attends to them
        from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache

        cache = QwenImage21KVCache(len(model.transformer_blocks))
        with torch.no_grad():
            model(**inputs, kv_cache=cache, kv_cache_mode="extract")
        inputs = dict(inputs, timestep=inputs["timestep"] * 0.6, kv_cache=cache, kv_cache_mode="cached")
    attentions = case.attentions(model)
    seen: dict[int, tuple[Tensor, dict, list]] = {}  # layer: (x, the call's keywords, [the attention's output])

    def keep(layer: int):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen[layer] = (call_arg(args, kwargs, "hidden_states", 0), kwargs, [])
        return hook

    hooks = [m.register_forward_pre_hook(keep(layer), with_kwargs=True) for layer, m in attentions.items()]
    hooks += [m.to_out[0].register_forward_pre_hook(lambda _, args, layer=layer: seen[layer][2].append(args[0]))
              for layer, m in attentions.items()]  # [B, Lq, h * d]
    recorded = idm_records(model, inputs, hooks)
    assert sorted(recorded) == sorted(attentions)
    N = math.prod(case.grid)
    for layer, (x, kwargs, (out,)) in seen.items():
        with torch.no_grad():
            q, k, v, mask = case.by_hand(attentions[layer], x, kwargs)
        B, h, Lq, d = q.shape
        Lk = k.shape[2]
        image = torch.arange(Lk - N, Lk) if case.text_first else torch.arange(N)  # the image keys
        # the probe's queries (positions among the Lq): the image's, or Z-Image's joint text queries after it
        rows = torch.arange(N, Lq) if layer in case.text_query_layers else image - (Lk - Lq)
        unpadded = torch.ones(B, Lq, dtype=torch.bool) if mask is None or mask.is_floating_point() else \
            mask[:, 0, 0, Lk - Lq:]  # [B, Lq]: a query whose token is masked as a key is not counted
        queries = [rows[unpadded[b, rows]] for b in range(B)]

        def probabilities(mask: Tensor | None) -> Tensor:
            logits = q @ k.transpose(-1, -2) * d ** -0.5  # [B, h, Lq, Lk]
            if mask is not None:
                logits = logits.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else logits + mask
            return logits.softmax(-1)

        def reference(p: Tensor) -> Tensor:
            a = torch.stack([p[b][:, queries[b]].mean(dim=(0, 1))[image] for b in range(B)])  # [B, N]
            return a / a.sum(-1, keepdim=True)

        p = probabilities(mask)
        attended = (p @ v).transpose(1, 2).flatten(2)  # [B, Lq, h * d]
        for b in range(B):  # the model's own attention, for the probe's queries
            torch.testing.assert_close(attended[b, queries[b]], out[b, queries[b]], rtol=1e-10, atol=1e-12)
        expected = reference(p)
        torch.testing.assert_close(recorded[layer].double(), expected, rtol=1e-5, atol=1e-8)
        assert (expected.max(-1).values - expected.min(-1).values > 1e-3).all()  # not uniform: real q/k
        if mask is not None:  # the probe used the mask (a difference far above the tolerance)
            assert (reference(probabilities(None)) - expected).abs().max() > 1e-5


# ---------------------------------------------------------------------- SANA: linear attention
def test_sana_probe_equals_the_normalised_linear_attention_weights():
    """float64: SANA's recorded received attention is the mean over heads and every query of the linear
    attention's normalised weights ``relu(q_i) . relu(k_j) / sum_j' relu(q_i) . relu(k_j')``, here formed as the
    full N x N matrix from attn1's own projections, renormalised per sample."""
    family = FAMILIES["sana"]
    model = family.build().double()
    inputs = {k: v.double() if isinstance(v, Tensor) and v.is_floating_point() else v
              for k, v in family.inputs(model).items()}
    seen: dict[int, Tensor] = {}
    hooks = [block.attn1.register_forward_pre_hook(lambda m, args, layer=layer: seen.setdefault(layer, args[0]))
             for layer, block in enumerate(model.transformer_blocks)]
    recorded = idm_records(model, inputs, hooks)
    assert sorted(recorded) == sorted(seen) == [0, 1]
    N = math.prod(family.grid)
    for layer, x in seen.items():
        attn = model.transformer_blocks[layer].attn1
        with torch.no_grad():
            q, k = attn.to_q(x), attn.to_k(x)  # [B, N, H*d]
            if attn.norm_q is not None:
                q, k = attn.norm_q(q), attn.norm_k(k)
        B = x.shape[0]
        phi_q = q.view(B, N, attn.heads, -1).transpose(1, 2).relu()  # [B, H, N, d]
        phi_k = k.view(B, N, attn.heads, -1).transpose(1, 2).relu()
        weights = phi_q @ phi_k.transpose(-1, -2)  # [B, H, N, N]
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-15)
        reference = weights.mean(dim=(1, 2))  # [B, N]
        reference = reference / reference.sum(-1, keepdim=True)
        torch.testing.assert_close(recorded[layer].double(), reference, rtol=1e-5, atol=1e-9)
        assert (reference.max(-1).values - reference.min(-1).values > 0.2 / N).all()  # not uniform: the model's weights


# ---------------------------------------------------------------------- strategies that read the probes
@pytest.mark.parametrize("name", ["wan", "ltx", "hunyuan_video", "hunyuan_video15"])
def test_idm_and_sdtm_record_received_attention(models, name):
    """Every video family declares a probe (Wan and LTX-Video on their image self-attention, HunyuanVideo on
    its joint attention): idm (the attention variant) gets the received attention of the
    same block call and merges, and so does sdtm's detail phase."""
    family, model = FAMILIES[name], models[name]
    inputs = family.inputs(model)
    before = run(model, inputs)
    with tomerge.merging(model, "idm", ratio=0.5) as handle:
        out = run(model, inputs)
        assert set(handle.state.attention) == {0, 1}  # both blocks recorded, [B, N] each
        assert all(a.shape == (2, math.prod(family.grid)) for a in handle.state.attention.values())
        assert all(r.num_removed > 0 for r in handle.state.records)
    assert torch.isfinite(out).all() and not torch.equal(out, before)
    assert torch.equal(run(model, inputs), before)
    with tomerge.merging(model, "sdtm", ratio=0.5, order="detail_first", switch=1.0, num_steps=2) as handle:
        run(model, inputs)
        assert {r.label for r in handle.state.records} == {"detail"}


def test_the_sdpa_probe_refuses_an_attention_without_one_sdpa_call(models, monkeypatch):
    """The SDPA probe reads the processor's torch SDPA call: an attention that makes none (another kernel) raises
    instead of leaving idm without received attention."""
    import torch.nn.functional as F

    model = models["cogview3plus"]
    monkeypatch.setattr(F, "scaled_dot_product_attention", _sdpa_by_hand)
    with tomerge.merging(model, "idm", ratio=0.5):
        with pytest.raises(RuntimeError, match="expected one call of torch.nn.functional.scaled_dot_product_attention"):
            run(model, cogview3plus_inputs(model))
    assert no_hooks_left(model)


def _sdpa_by_hand(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
    """Attention without torch's SDPA (as a kernel of another library would run)."""
    weights = (query @ key.transpose(-1, -2) * (scale or query.shape[-1] ** -0.5)).softmax(-1)
    return weights @ value


# ---------------------------------------------------------------------- who can run a strategy that needs something
@dataclasses.dataclass(frozen=True, kw_only=True)
class MostAttendedKept(tomerge.MergeStrategy):
    """A strategy outside tomerge that needs received attention: the most attended tokens are the destinations
    (slots), every other token merges into the first slot."""

    name = "test_most_attended_kept"

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({"received_attention"})

    def select_destinations(self, x: Tensor, ctx: tomerge.MergeContext) -> Tensor:
        M = x.shape[1] - ctx.tokens_to_remove(x.shape[1])
        return ctx.received_attention.topk(M, dim=1).indices.sort(dim=1).values  # [B, M]

    def merge_matrix(self, x: Tensor, dst: Tensor, ctx: tomerge.MergeContext) -> tomerge.MergePlan:
        B, N = x.shape[:2]
        assign = torch.zeros(B, N, dtype=torch.long)  # [B, N]: sources into slot 0
        assign.scatter_(1, dst, torch.arange(dst.shape[1]).expand(B, -1))  # destinations into their own slots
        return tomerge.MergePlan.hard(assign, dst, backend="index")


@dataclasses.dataclass(frozen=True, kw_only=True)
class NeedsGradients(MostAttendedKept):
    name = "test_needs_gradients"

    @property
    def needs(self) -> frozenset[str]:
        return frozenset({"gradients"})


class WanWithoutProbe(WanAdapter):
    """Wan declared without its attention probe."""

    kinds = (Kind("wan", "blocks", ("WanTransformerBlock",), (
        Site("attn", "attn1", rope=Rope("rotary_emb", 3, "wan")), Site("mlp", "ffn"))),)


class WanMlpOnly(WanAdapter):
    """Wan declared with its feed-forward alone: no attention point to record received attention at."""

    kinds = (Kind("wan", "blocks", ("WanTransformerBlock",), (Site("mlp", "ffn"),)),)


@pytest.fixture
def test_backbones():
    """The two adapters above, registered for one test and removed again (other tests list the backbones, and
    these would also claim every Wan model)."""
    names = {"test_wan_without_probe": WanWithoutProbe, "test_wan_mlp_only": WanMlpOnly}
    for name, cls in names.items():
        tomerge.register_backbone(name)(cls)
    yield list(names)
    for name in names:
        del registry._backbones._classes[name]


def test_a_strategy_that_needs_received_attention_runs_where_a_probe_is_declared_and_is_refused_elsewhere(
        test_backbones):
    family = FAMILIES["wan"]
    model = family.build()
    inputs = family.inputs(model)
    with torch.no_grad():
        before = model(**inputs).sample
    with tomerge.merging(model, MostAttendedKept(), ratio=0.5, merge_attn=False, backbone="wan") as handle, \
            torch.no_grad():
        out = model(**inputs).sample
        attention = handle.state.attention
        records = handle.state.records
    assert sorted(attention) == [0, 1] and all(r.num_removed == 16 for r in records)
    assert out.shape == before.shape and torch.isfinite(out).all() and not torch.equal(out, before)
    for name in ("test_wan_without_probe", "test_wan_mlp_only"):  # no probe on its attention, no attention point
        with pytest.raises(NotImplementedError,
                           match=f"strategy 'test_most_attended_kept' needs received attention: backbone {name!r} "
                                 "cannot record received attention in its 'wan' blocks"):
            tomerge.apply(model, MostAttendedKept(), ratio=0.5, merge_attn=False, backbone=name)
        assert no_hooks_left(model) and "_tomerge_handle" not in model.__dict__
    with pytest.raises(ValueError, match="'test_needs_gradients' needs 'gradients', which no backbone adapter records"):
        tomerge.apply(model, NeedsGradients(), ratio=0.5, backbone="wan")
    assert no_hooks_left(model)
