"""Heads and positions against TransformerLens 3.x (``HookedTransformer``): per-head outputs
(``hook_z``) and attention patterns (``hook_pattern``) of GPT-2 and of a grouped-query Llama,
random Hugging Face weights converted into TransformerLens with its own weight-conversion
functions, while hookscope runs the unmodified Hugging Face model with SDPA attention.

Activation patching sweeps (``hs.patching``) against TransformerLens' own patching helpers
(``get_act_patch_resid_pre``, ``..._attn_out``, ``..._mlp_out``) on the same GPT-2.

TransformerLens is in the dev extra (``transformer-lens>=3.9,<4``: 4.x removed
``HookedTransformer``), so CI runs this file; ``tests/test_units.py`` holds a second oracle,
eager attention written by hand from the same weights."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from test_logit_attribution import PARTS  # the keywords naming each model's parts

transformers = pytest.importorskip("transformers")
lens = pytest.importorskip("transformer_lens")
conversions = pytest.importorskip("transformer_lens.pretrained.weight_conversions")

pytestmark = [
    pytest.mark.hf,
    # 3.x's own notice that 4.x replaces HookedTransformer: the 3.x API is the oracle here
    pytest.mark.filterwarnings("ignore:HookedTransformer is deprecated:DeprecationWarning"),
]


def _noisy(model: nn.Module) -> nn.Module:
    """Every bias and norm weight random (Hugging Face starts them at 0 and 1, which would
    hide a bias put in the wrong place)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5 * (p.dim() == 1))
    return model


def _sharp(hf: nn.Module, factor: float = 6.0) -> None:
    """Queries and keys ``factor`` times larger, so that attention patterns are far from
    uniform and patching one head's pattern at one position moves the metric well beyond the
    tolerance (random initialisation leaves every head attending almost evenly)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith("c_attn.weight"):  # GPT-2: queries, keys, values side by side
                p[:, : 2 * p.size(0)] *= factor
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                p *= factor


def _gpt2(fold_ln: bool = False, noisy: bool = False, sharp: bool = False) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)
    ).eval()
    if noisy:
        _noisy(hf)
    if sharp:
        _sharp(hf)
    cfg = lens.HookedTransformerConfig(
        d_model=64,
        d_head=16,
        n_heads=4,
        d_mlp=256,
        n_layers=2,
        n_ctx=hf.config.n_positions,
        eps=hf.config.layer_norm_epsilon,
        d_vocab=100,
        act_fn="gelu_new",
        normalization_type="LN",
        original_architecture="GPT2LMHeadModel",
        default_prepend_bos=False,
    )
    return hf, _converted(cfg, conversions.convert_gpt2_weights(hf, cfg), fold_ln)


def _llama(
    fold_ln: bool = False, noisy: bool = False, sharp: bool = False
) -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=100,
    )
    hf = transformers.LlamaForCausalLM(config).eval()
    if noisy:
        _noisy(hf)
    if sharp:
        _sharp(hf)
    rope = getattr(config, "rope_parameters", None) or {}
    cfg = lens.HookedTransformerConfig(
        d_model=64,
        d_head=16,
        n_heads=4,
        n_key_value_heads=2,
        d_mlp=128,
        n_layers=2,
        n_ctx=config.max_position_embeddings,
        eps=config.rms_norm_eps,
        d_vocab=100,
        act_fn="silu",
        normalization_type="RMS",
        positional_embedding_type="rotary",
        rotary_adjacent_pairs=False,
        rotary_dim=16,
        rotary_base=rope.get("rope_theta", getattr(config, "rope_theta", 10000.0)),
        final_rms=True,
        gated_mlp=True,
        original_architecture="LlamaForCausalLM",
        default_prepend_bos=False,
    )
    return hf, _converted(cfg, conversions.convert_llama_weights(hf, cfg), fold_ln)


def _converted(cfg: Any, state: dict[str, Any], fold_ln: bool = False) -> Any:
    model = lens.HookedTransformer(cfg)
    model.load_and_process_state_dict(
        state,
        fold_ln=fold_ln,
        center_writing_weights=False,
        center_unembed=False,
        fold_value_biases=False,
    )
    return model.eval()


MODELS: dict[str, tuple[Callable[..., tuple[nn.Module, Any]], str]] = {
    "gpt2": (_gpt2, "transformer.h.{}.attn"),
    "llama": (_llama, "model.layers.{}.self_attn"),
}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_heads_and_positions_equal_transformer_lens_hook_z_and_hook_pattern(kind: str) -> None:
    make, attention = MODELS[kind]
    hf, tl = make()
    assert hf.config._attn_implementation == "sdpa"
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    heads, positions = [3, 0], [-1, 2]
    sites = {}
    for layer in (0, 1):
        sites[layer] = (
            f"{attention.format(layer)}::scaled_dot_product_attention",
            f"{attention.format(layer)}::attention_weights",
        )
    chosen = [s for pair in sites.values() for s in pair]
    with torch.no_grad():
        with hs.capture(hf, chosen, heads=heads, positions=positions) as cap:
            hf_logits = hf(ids).logits
        tl_logits, cache = tl.run_with_cache(ids)
    torch.testing.assert_close(hf_logits, tl_logits, rtol=0, atol=1e-5)  # the same model
    at = [p % 7 for p in positions]
    for layer, (z, pattern) in sites.items():
        hook_z = cache[f"blocks.{layer}.attn.hook_z"]  # (N, T, H, d)
        hook_pattern = cache[f"blocks.{layer}.attn.hook_pattern"]  # (N, H, Tq, Tk)
        expected_z = hook_z[:, at][:, :, heads].transpose(1, 2)
        torch.testing.assert_close(cap[z].output, expected_z, rtol=0, atol=1e-5)
        expected_pattern = hook_pattern[:, heads][:, :, at]
        torch.testing.assert_close(cap[pattern].output, expected_pattern, rtol=0, atol=1e-5)


def test_projection_heads_equal_transformer_lens_hook_q_k_v() -> None:
    """Heads of Llama's q_proj, k_proj and v_proj from its config: query heads 3 and 0, and
    the key/value heads they read (1 and 0), as TransformerLens' hook_q, hook_k, hook_v
    (before the rotary embedding; hook_k and hook_v hold the 2 key/value heads)."""
    hf, tl = _llama()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    site = "model.layers.1.self_attn.{}"
    with torch.no_grad():
        with hs.capture(hf, site.format("[qkv]_proj"), heads=[3, 0], positions=[-1, 2]) as cap:
            hf(ids)
        _, cache = tl.run_with_cache(ids)
    for proj, hook, heads in (
        ("q_proj", "q", [3, 0]),
        ("k_proj", "k", [0, 1]),
        ("v_proj", "v", [0, 1]),
    ):
        expected = cache[f"blocks.1.attn.hook_{hook}"][:, [6, 2]][:, :, heads].flatten(2)
        torch.testing.assert_close(cap[site.format(proj)].output, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patching_a_head_equals_transformer_lens_patching_hook_z(kind: str) -> None:
    """A clean run's head 1 at position 4, patched into a corrupted run: hookscope on the
    Hugging Face model, a ``hook_z`` hook on TransformerLens'."""
    make, attention = MODELS[kind]
    hf, tl = make()
    clean = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(2))
    corrupt = clean.flip(1)
    site = f"{attention.format(0)}::scaled_dot_product_attention"
    with torch.no_grad():
        with hs.capture(hf, site, heads=1, positions=4) as cap:
            hf(clean)
        with hs.edit(hf, {site: hs.patch(cap)}, heads=1, positions=4):
            got = hf(corrupt).logits
        _, cache = tl.run_with_cache(clean)

        def patch(z: torch.Tensor, hook: Any) -> torch.Tensor:
            z = z.clone()
            z[:, 4, 1] = cache["blocks.0.attn.hook_z"][:, 4, 1]
            return z

        expected = tl.run_with_hooks(corrupt, fwd_hooks=[("blocks.0.attn.hook_z", patch)])
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)


def _runs(length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Clean ids, corrupted ids (the same first token, the rest reversed) and a logit
    difference at the last position, as TransformerLens' metrics take it (logits)."""
    clean = torch.randint(0, 100, (2, length), generator=torch.Generator().manual_seed(seed))
    corrupt = torch.cat([clean[:, :1], clean[:, 1:].flip(1)], 1)
    a, b = int(clean[0, -1]), int(clean[1, -1])

    def logit_difference(logits: torch.Tensor) -> torch.Tensor:
        return (logits[:, -1, a] - logits[:, -1, b]).mean()

    return clean, corrupt, logit_difference


def _transformer_lens_sweep(tl: Any, helper: str, clean: Any, corrupt: Any, metric: Any) -> Any:
    with torch.no_grad():
        _, cache = tl.run_with_cache(clean)
        return getattr(lens.patching, helper)(tl, corrupt, cache, metric)


#: TransformerLens' helper -> the GPT-2 modules whose outputs are its activation, per layer
SWEEPS: dict[str, Callable[[int], str]] = {
    # resid_pre of block i: the embeddings' sum for i = 0, block i - 1's output after
    "get_act_patch_resid_pre": lambda i: "transformer.drop" if i == 0 else f"transformer.h.{i - 1}",
    "get_act_patch_attn_out": lambda i: f"transformer.h.{i}.attn.resid_dropout",
    "get_act_patch_mlp_out": lambda i: f"transformer.h.{i}.mlp",
}


@pytest.mark.parametrize("helper", list(SWEEPS))
def test_patching_sweeps_equal_transformer_lens_helpers(helper: str) -> None:
    """A layers x positions sweep on the unmodified Hugging Face GPT-2, 5 cells per forward,
    equals TransformerLens' helper (one forward per cell) on the converted model."""
    hf, tl = _gpt2()
    clean, corrupt, metric = _runs(6, seed=3)
    expected = _transformer_lens_sweep(tl, helper, clean, corrupt, metric)
    layers = [SWEEPS[helper](i) for i in range(2)]
    got = hs.patching(
        hf, clean, corrupt, lambda out: metric(out.logits), layers, cells_per_forward=5
    )
    assert got.layers == tuple(layers) and got.positions == tuple(range(6))
    torch.testing.assert_close(got.values, expected.float(), rtol=0, atol=1e-5)
    # the oracle tells cells apart far beyond the tolerance: a patch that did nothing fails
    assert expected.max() - expected.min() > 100 * 1e-5


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patching_heads_equals_transformer_lens_attn_head_out_by_pos(kind: str) -> None:
    """A layers x positions x heads sweep of each SDPA call's per-head output (hook_z),
    7 cells per forward, equals get_act_patch_attn_head_out_by_pos (grouped-query Llama too:
    the 4 query heads)."""
    make, attention = MODELS[kind]
    hf, tl = make()
    clean, corrupt, metric = _runs(5, seed=4)
    helper = "get_act_patch_attn_head_out_by_pos"
    expected = _transformer_lens_sweep(tl, helper, clean, corrupt, metric)
    layers = [f"{attention.format(i)}::scaled_dot_product_attention" for i in range(2)]
    got = hs.patching(
        hf, clean, corrupt, lambda out: metric(out.logits), layers, heads=True, cells_per_forward=7
    )
    assert got.values.shape == expected.shape == (2, 5, 4)
    assert got.heads == (0, 1, 2, 3)
    torch.testing.assert_close(got.values, expected.float(), rtol=0, atol=1e-5)
    assert expected.max() - expected.min() > 100 * 1e-5
    assert got.at(layers[1], 4, 2) == pytest.approx(float(expected[1, 4, 2]), abs=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patching_patterns_equals_transformer_lens_attn_head_pattern_by_pos(kind: str) -> None:
    """A layers x positions x heads sweep of each SDPA call's attention weights: a cell writes
    one head's clean pattern at one query position into the corrupted run, the head's output
    recomputed from it (pattern @ values), and equals get_act_patch_attn_head_pattern_by_pos
    (its grid is layer x head x position; grouped-query Llama: the 4 query heads)."""
    make, attention = MODELS[kind]
    hf, tl = make(sharp=True)
    clean, corrupt, metric = _runs(5, seed=4)
    helper = "get_act_patch_attn_head_pattern_by_pos"
    expected = _transformer_lens_sweep(tl, helper, clean, corrupt, metric).permute(0, 2, 1)
    layers = [f"{attention.format(i)}::attention_weights" for i in range(2)]
    got = hs.patching(
        hf, clean, corrupt, lambda out: metric(out.logits), layers, heads=True, cells_per_forward=7
    )
    assert got.values.shape == expected.shape == (2, 5, 4)
    assert got.heads == (0, 1, 2, 3) and got.layers == tuple(layers)
    torch.testing.assert_close(got.values, expected.float(), rtol=0, atol=1e-5)
    # a sweep that patched the next head, or the next position, would be far off
    for axis in (1, 2):
        assert (expected - expected.roll(1, axis)).abs().max() > 100 * 1e-5
    assert got.at(layers[1], 3, 2) == pytest.approx(float(expected[1, 3, 2]), abs=1e-5)


#: GPT-2's attention splits c_attn into q, k, v and makes each (N, H, T, d) with a view and a
#: transpose, keys first (transformers 5's GPT2Attention: k, v, then q): each transpose's
#: output is TransformerLens' hook_q / hook_k / hook_v, transposed
GPT2_QKV = {"q": "transpose#3", "k": "transpose#1", "v": "transpose#2"}


def test_heads_of_gpt2s_fused_projection_equal_transformer_lens_hook_q_k_v() -> None:
    """heads=[3, 0] on GPT-2's c_attn (queries | keys | values, each 4 heads of 16): each
    head's query, key and value columns, TransformerLens' hook_q, hook_k, hook_v side by side;
    and the operation sites that make each of them (N, H, T, d), their axes declared."""
    hf, tl = _gpt2()
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    fused = "transformer.h.1.attn.c_attn"
    parts = [f"transformer.h.1.attn::{GPT2_QKV[p]}" for p in "qkv"]
    with torch.no_grad():
        layout = dict.fromkeys(parts, "batch heads positions size")  # (N, H, T, d)
        with hs.capture(hf, [fused, *parts], heads=[3, 0], positions=[-1, 2], layout=layout) as cap:
            hf(ids)
        _, cache = tl.run_with_cache(ids)
    hooks = [cache[f"blocks.1.attn.hook_{p}"][:, [6, 2]][:, :, [3, 0]] for p in "qkv"]
    expected = torch.cat([h.flatten(2) for h in hooks], 2)
    torch.testing.assert_close(cap[fused].output, expected, rtol=0, atol=1e-5)
    for part, hook in zip(parts, hooks, strict=True):
        torch.testing.assert_close(cap[part].output, hook.transpose(1, 2), rtol=0, atol=1e-5)


@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_patching_gpt2_q_k_v_heads_equals_transformer_lens_by_pos(part: str) -> None:
    """GPT-2's queries, keys or values per head: the operation making each (N, H, T, d) out
    of c_attn's split, swept with heads=True, equals get_act_patch_attn_head_{q,k,v}_by_pos."""
    hf, tl = _gpt2(sharp=True)
    clean, corrupt, metric = _runs(5, seed=4)
    expected = _transformer_lens_sweep(
        tl, f"get_act_patch_attn_head_{part}_by_pos", clean, corrupt, metric
    )
    layers = [f"transformer.h.{i}.attn::{GPT2_QKV[part]}" for i in range(2)]
    got = hs.patching(
        hf, clean, corrupt, lambda out: metric(out.logits), layers, heads=True, cells_per_forward=7
    )
    assert got.values.shape == expected.shape == (2, 5, 4)
    torch.testing.assert_close(got.values, expected.float(), rtol=0, atol=1e-5)
    for axis in (1, 2):  # a sweep that patched the next head, or the next position, fails
        assert (expected - expected.roll(1, axis)).abs().max() > 100 * 1e-5


@pytest.mark.parametrize("part", ["q", "k", "v"])
def test_patching_projection_heads_equals_transformer_lens_q_k_v_by_pos(part: str) -> None:
    """A layers x positions x heads sweep of Llama's q_proj, k_proj or v_proj (the heads side
    by side in the last axis, from the config): get_act_patch_attn_head_{q,k,v}_by_pos, the
    keys and values over the 2 key/value heads of grouped-query attention."""
    hf, tl = _llama(sharp=True)
    clean, corrupt, metric = _runs(5, seed=4)
    expected = _transformer_lens_sweep(
        tl, f"get_act_patch_attn_head_{part}_by_pos", clean, corrupt, metric
    )
    layers = [f"model.layers.{i}.self_attn.{part}_proj" for i in range(2)]
    got = hs.patching(
        hf, clean, corrupt, lambda out: metric(out.logits), layers, heads=True, cells_per_forward=6
    )
    heads = 4 if part == "q" else 2
    assert got.values.shape == expected.shape == (2, 5, heads)
    assert got.heads == tuple(range(heads))
    torch.testing.assert_close(got.values, expected.float(), rtol=0, atol=1e-5)
    for axis in (1, 2):  # a sweep that patched the next head, or the next position, fails
        assert (expected - expected.roll(1, axis)).abs().max() > 100 * 1e-5


#: per model: its residual-stream layers (before each block, then after the last), final
#: norm, unembedding
LENS = {
    "gpt2": (["transformer.drop", "transformer.h.0", "transformer.h.1"], "transformer.ln_f"),
    "llama": (["model.embed_tokens", "model.layers.0", "model.layers.1"], "model.norm"),
}


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logit_lens_equals_transformer_lens_accumulated_resid(kind: str) -> None:
    """Each layer's stream through the final norm and the unembedding: TransformerLens'
    accumulated_resid(apply_ln=True) (3.x recomputes the final norm per layer) and, with
    scale="frozen", its apply_ln_to_stack (the scale of the full forward), each then
    @ W_U + b_U of a model whose final norm's weight and bias are folded into them
    (fold_ln=True). The last row is the model's own logits either way."""
    make = {"gpt2": _gpt2, "llama": _llama}[kind]
    hf, tl = make(fold_ln=True)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(5))
    layers, norm = LENS[kind]
    own = hs.logit_lens(hf, ids, layers, norm=norm, unembed="lm_head")
    frozen = hs.logit_lens(hf, ids, layers, norm=norm, unembed="lm_head", scale="frozen")
    with torch.no_grad():
        _, cache = tl.run_with_cache(ids)
        recomputed = cache.accumulated_resid(apply_ln=True) @ tl.W_U + tl.b_U
        stack = cache.accumulated_resid(apply_ln=False)
        kept = cache.apply_ln_to_stack(stack, layer=None) @ tl.W_U + tl.b_U
        logits = hf(ids).logits
    assert own.layers == tuple(layers) and own.positions == tuple(range(6))
    torch.testing.assert_close(own.logits, recomputed, rtol=0, atol=1e-5)
    torch.testing.assert_close(frozen.logits, kept, rtol=0, atol=1e-5)
    for lens_ in (own, frozen):
        torch.testing.assert_close(lens_.logits[-1], logits, rtol=0, atol=1e-5)
    assert (own.logits[0] - frozen.logits[0]).abs().max() > 0.1  # the conventions differ
    last = hs.logit_lens(hf, ids, layers, norm=norm, unembed="lm_head", positions=[-1])
    torch.testing.assert_close(last.logits, own.logits[:, :, -1:], rtol=0, atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_logit_attribution_equals_transformer_lens_logit_attrs(kind: str) -> None:
    """Direct logit attribution of a logit difference at two positions, every bias and norm
    weight random: each head equals TransformerLens' logit_attrs of stack_head_results, each
    MLP and embedding of decompose_resid, the output projections' biases together its
    get_full_resid_decomposition "bias" row (TransformerLens adds them into one), and the
    final norm's and unembedding's biases its b_U[a] - b_U[b]. TransformerLens' apply_ln_to_stack
    centres and divides by the cached final scale only, so its model folds the final norm's
    weight and bias into W_U and b_U (fold_ln=True): its logit_attrs is then the attribution
    through the whole norm. The heads' outputs are the SDPA calls' on the unmodified Hugging
    Face model."""
    make = {"gpt2": _gpt2, "llama": _llama}[kind]
    hf, tl = make(fold_ln=True, noisy=True)
    ids = torch.randint(0, 100, (2, 6), generator=torch.Generator().manual_seed(5))
    a, b, at = 7, 11, [5, 2]
    got = hs.logit_attribution(hf, ids, (a, b), positions=[-1, 2], **PARTS[kind])
    with torch.no_grad():
        _, cache = tl.run_with_cache(ids)

        def attrs(stack: torch.Tensor) -> torch.Tensor:
            return cache.logit_attrs(stack, torch.tensor(a), torch.tensor(b), pos_slice=at)

        heads = attrs(cache.stack_head_results(pos_slice=at))  # (L * H, N, P)
        mlps = attrs(cache.decompose_resid(mode="mlp", incl_embeds=False, pos_slice=at))
        full, labels = cache.get_full_resid_decomposition(
            expand_neurons=False, pos_slice=at, return_labels=True
        )
        full = attrs(full)
        logits = hf(ids).logits[:, at]
    embeddings = [full[labels.index(e)] for e in ("embed", "pos_embed") if e in labels]
    n = len(got.labels)
    torch.testing.assert_close(got.values[:8], heads, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.by_head.flatten(0, 1), heads, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.values[10:12], mlps, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.values[12 : n - 1], torch.stack(embeddings), rtol=0, atol=1e-5)
    torch.testing.assert_close(
        got.values[8:10].sum(0), full[labels.index("bias")], rtol=0, atol=1e-5
    )
    end = (tl.b_U[a] - tl.b_U[b]).expand(2, 2)
    torch.testing.assert_close(got.values[-1], end, rtol=0, atol=1e-5)
    # the identity, on both sides: the parts add up to the model's own logit difference
    difference = logits[..., a] - logits[..., b]
    torch.testing.assert_close(got.values.sum(0), difference, rtol=0, atol=1e-5)
    torch.testing.assert_close(full.sum(0) + end, difference, rtol=0, atol=1e-5)
    assert got.values[8:10].abs().max() > 1e-2 or kind == "llama"  # GPT-2's biases count
