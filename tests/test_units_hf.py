"""``heads=`` and ``positions=`` across Hugging Face families (GPT-2, GPT-NeoX, Llama, Mistral,
Qwen2 with grouped-query attention, Gemma, BERT, ViT), each running its own SDPA attention,
against the same weights in transformers' eager attention: each head's output is the input of
the eager model's output projection (every head side by side, read by a plain pre-hook), each
head's pattern its ``output_attentions``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

HEADS, HEAD_SIZE = 4, 16
SMALL = {"num_hidden_layers": 2, "hidden_size": HEADS * HEAD_SIZE, "num_attention_heads": HEADS}
SMALL |= {"intermediate_size": 128}
GQA = {**SMALL, "num_key_value_heads": 2, "vocab_size": 100}


@dataclass(frozen=True)
class Family:
    model: str
    config: Callable[..., Any]
    options: dict[str, Any]
    attention: str  # the module whose own code calls SDPA, {} for the layer index
    projection: str  # the output projection: its input is every head's output side by side
    text: bool = True


FAMILIES = {
    "gpt2": Family(
        "GPT2Model",
        transformers.GPT2Config,
        {"n_layer": 2, "n_embd": 64, "n_head": HEADS, "vocab_size": 100},
        "h.{}.attn",
        "h.{}.attn.c_proj",
    ),
    "gpt_neox": Family(
        "GPTNeoXModel",
        transformers.GPTNeoXConfig,
        {**SMALL, "vocab_size": 100},
        "layers.{}.attention",
        "layers.{}.attention.dense",
    ),
    "llama": Family(
        "LlamaModel",
        transformers.LlamaConfig,
        GQA,
        "layers.{}.self_attn",
        "layers.{}.self_attn.o_proj",
    ),
    "mistral": Family(
        "MistralModel",
        transformers.MistralConfig,
        GQA,
        "layers.{}.self_attn",
        "layers.{}.self_attn.o_proj",
    ),
    "qwen2": Family(
        "Qwen2Model",
        transformers.Qwen2Config,
        GQA,
        "layers.{}.self_attn",
        "layers.{}.self_attn.o_proj",
    ),
    "gemma": Family(
        "GemmaModel",
        transformers.GemmaConfig,
        {**SMALL, "head_dim": HEAD_SIZE, "num_key_value_heads": 1, "vocab_size": 100},  # MQA
        "layers.{}.self_attn",
        "layers.{}.self_attn.o_proj",
    ),
    "bert": Family(
        "BertModel",
        transformers.BertConfig,
        {**SMALL, "vocab_size": 100},
        "encoder.layer.{}.attention.self",
        "encoder.layer.{}.attention.output.dense",
    ),
    "vit": Family(
        "ViTModel",
        transformers.ViTConfig,
        {**SMALL, "image_size": 32, "patch_size": 8},
        "layers.{}.attention",
        "layers.{}.attention.o_proj",
        text=False,
    ),
}


def _pair(family: Family) -> tuple[nn.Module, nn.Module]:
    """(SDPA model, eager model) with the same random weights."""
    cls = getattr(transformers, family.model)
    torch.manual_seed(0)
    fused = cls(family.config(attn_implementation="sdpa", **family.options)).eval()
    eager = cls(family.config(attn_implementation="eager", **family.options)).eval()
    eager.load_state_dict(fused.state_dict())
    return fused, eager


def _inputs(family: Family) -> dict[str, Tensor]:
    if not family.text:
        return {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.manual_seed(1))}
    ids = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    if family.model == "BertModel":
        mask[1, 5:], mask[2, 3:] = 0, 0  # right padding, as BERT is used
    else:
        mask[1, :2], mask[2, :4] = 0, 0  # left padding, as decoders generate
    return {"input_ids": ids, "attention_mask": mask}


def _eager_heads(eager: nn.Module, family: Family, layer: int, inputs: dict[str, Tensor]) -> Any:
    """``(Z, P)`` of the eager model: ``(N, H, T, d)`` from its output projection's input,
    ``(N, H, T, T)`` from ``output_attentions``."""
    seen: list[Tensor] = []
    proj = eager.get_submodule(family.projection.format(layer))
    handle = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            out = eager(**inputs, output_attentions=True)
    finally:
        handle.remove()
    n, t, _ = seen[0].shape
    return seen[0].view(n, t, HEADS, HEAD_SIZE).transpose(1, 2), out.attentions[layer]


def _last(inputs: dict[str, Tensor], length: int) -> list[int]:
    mask = inputs.get("attention_mask")
    if mask is None:
        return [length - 1] * 2
    return [max(i for i, keep in enumerate(row) if keep) for row in mask.tolist()]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_heads_at_the_last_real_token_equal_eager_attention(name: str) -> None:
    family = FAMILIES[name]
    fused, eager = _pair(family)
    assert fused.config._attn_implementation == "sdpa"
    inputs = _inputs(family)
    z = family.attention.format(1) + "::scaled_dot_product_attention"
    pattern = family.attention.format(1) + "::attention_weights"
    with torch.no_grad(), hs.capture(fused, [z, pattern], heads=[3, 1], positions="last") as cap:
        fused(**inputs)
    want_z, want_p = _eager_heads(eager, family, 1, inputs)
    last = _last(inputs, want_z.size(2))
    rows = torch.arange(len(last))
    expected_z = want_z[:, [3, 1]][rows, :, last].unsqueeze(2)  # (N, 2, 1, d)
    expected_p = want_p[:, [3, 1]][rows, :, last].unsqueeze(2)  # (N, 2, 1, T)
    torch.testing.assert_close(cap[z].output, expected_z, rtol=0, atol=1e-5)
    torch.testing.assert_close(cap[pattern].output, expected_p, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_ablating_a_head_equals_zeroing_it_before_the_eager_output_projection(name: str) -> None:
    family = FAMILIES[name]
    fused, eager = _pair(family)
    inputs = _inputs(family)
    z = family.attention.format(0) + "::scaled_dot_product_attention"
    with torch.no_grad(), hs.edit(fused, {z: hs.ablate()}, heads=[2], positions=[0, -1]):
        got = fused(**inputs).last_hidden_state

    def zero(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
        x = args[0].clone()
        x[:, [0, -1], 2 * HEAD_SIZE : 3 * HEAD_SIZE] = 0
        return (x,)

    proj = eager.get_submodule(family.projection.format(0))
    handle = proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            want = eager(**inputs).last_hidden_state
    finally:
        handle.remove()
    # padding queries' rows differ (SDPA: zeros, eager: uniform) and mean nothing: real tokens
    mask = inputs.get("attention_mask")
    live = torch.ones(got.shape[:2], dtype=torch.bool) if mask is None else mask.bool()
    torch.testing.assert_close(got[live], want[live], rtol=0, atol=1e-5)


#: the fused query/key/value projection of a family, and how its own code splits a head out
#: of it: GPT-2 splits q | k | v (each H·d), GPT-NeoX views (H, 3·d) and chunks q, k, v
FUSED = {"gpt2": "h.0.attn.c_attn", "gpt_neox": "layers.0.attention.query_key_value"}


def _fused_heads(name: str, full: Tensor, heads: list[int]) -> Tensor:
    """The columns of ``heads`` in a fused projection's output, by the model's own split."""
    n, t, _ = full.shape
    if name == "gpt2":
        parts = full.split(HEADS * HEAD_SIZE, dim=2)  # q, k, v
        return torch.cat([p.view(n, t, HEADS, HEAD_SIZE)[:, :, heads].flatten(2) for p in parts], 2)
    return full.view(n, t, HEADS, 3 * HEAD_SIZE)[:, :, heads].flatten(2)


@pytest.mark.parametrize("name", list(FUSED))
def test_heads_of_a_fused_projection_are_its_query_key_and_value_columns(name: str) -> None:
    """heads=[3, 1] on GPT-2's c_attn and GPT-NeoX's query_key_value: each head's query, key
    and value columns, in the projection's own layout, at the chosen positions."""
    family = FAMILIES[name]
    model, _ = _pair(family)
    inputs = _inputs(family)
    site = FUSED[name]
    with torch.no_grad():
        with hs.capture(model, site, heads=[3, 1], positions=[-1, 2]) as cap:
            model(**inputs)
        with hs.capture(model, site) as full:
            model(**inputs)
    expected = _fused_heads(name, full[site].output, [3, 1])[:, [6, 2]]
    assert cap[site].output.shape == (3, 2, 2 * 3 * HEAD_SIZE)
    torch.testing.assert_close(cap[site].output, expected, rtol=0, atol=0)


@pytest.mark.parametrize("name", list(FUSED))
def test_ablating_a_fused_projections_head_zeroes_that_heads_query_key_and_value(
    name: str,
) -> None:
    """The attention reads what the edit wrote where it reads head 1: the SDPA call gets zero
    query, key and value for head 1 (at every position), the other heads untouched."""
    family = FAMILIES[name]
    model, _ = _pair(family)
    inputs = _inputs(family)
    sdpa = family.attention.format(0) + "::scaled_dot_product_attention"
    with torch.no_grad():
        with hs.capture(model, sdpa, inputs=True) as plain:
            model(**inputs)
        with (
            hs.edit(model, {FUSED[name]: hs.ablate()}, heads=[1]),
            hs.capture(model, sdpa, inputs=True) as cap,
        ):
            model(**inputs)
    for part in ("query", "key", "value"):
        seen, before = cap[sdpa].inputs[part], plain[sdpa].inputs[part]
        assert seen[:, 1].abs().max() == 0  # (N, H, T, d): head 1 zeroed, rotary or not
        torch.testing.assert_close(seen[:, [0, 2, 3]], before[:, [0, 2, 3]], rtol=0, atol=0)
        assert before[:, 1].abs().max() > 0


def test_gpt2s_cross_attention_c_attn_keys_and_values_only_has_no_fused_heads() -> None:
    """GPT-2's cross-attention c_attn makes keys | values (2 x H·d), not the self-attention's
    queries | keys | values: refused rather than split in three."""
    options = {**FAMILIES["gpt2"].options, "add_cross_attention": True}
    model = transformers.GPT2Model(transformers.GPT2Config(**options)).eval()
    with pytest.raises(hs.UsageError, match="has no head axis"):
        hs.capture(model, "h.0.crossattention.c_attn", heads=[0])
    hs.capture(model, "h.0.attn.c_attn", heads=[0])  # the self-attention's: q | k | v
