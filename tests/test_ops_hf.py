"""Attention weights from fused attention (``"layer::attention_weights"``) on Hugging Face
GPT-2, BERT, Llama (grouped-query attention) and ViT, against transformers' own eager
attention with ``output_attentions=True``: the same weights, loaded into both
implementations, the same inputs (padding masks included)."""

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


@dataclass(frozen=True)
class Case:
    model: str
    config: Callable[..., Any]
    options: dict[str, Any]
    attention: str  # the module whose own code calls SDPA, with {} for the layer index
    inputs: Callable[[], dict[str, Tensor]]


def _ids(pad: str | None = None) -> Callable[[], dict[str, Tensor]]:
    def make() -> dict[str, Tensor]:
        ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
        if pad is None:
            return {"input_ids": ids}
        mask = torch.ones(2, 7, dtype=torch.long)
        mask[1, :2] = 0 if pad == "left" else 1
        mask[1, 5:] = 0 if pad == "right" else 1
        return {"input_ids": ids, "attention_mask": mask}

    return make


SMALL = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4}
SMALL |= {"intermediate_size": 128}
CASES = {
    "gpt2": Case(
        "GPT2Model",
        transformers.GPT2Config,
        {"n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 100},
        "h.{}.attn",
        _ids("left"),
    ),
    "bert": Case(
        "BertModel",
        transformers.BertConfig,
        {**SMALL, "vocab_size": 100},
        "encoder.layer.{}.attention.self",
        _ids("right"),
    ),
    "llama-gqa": Case(  # no mask: SDPA's own enable_gqa=True
        "LlamaModel",
        transformers.LlamaConfig,
        {**SMALL, "num_key_value_heads": 2, "vocab_size": 100},
        "layers.{}.self_attn",
        _ids(),
    ),
    "llama-gqa-padded": Case(  # a mask: transformers repeats the key/value heads itself
        "LlamaModel",
        transformers.LlamaConfig,
        {**SMALL, "num_key_value_heads": 2, "vocab_size": 100},
        "layers.{}.self_attn",
        _ids("left"),
    ),
    "vit": Case(
        "ViTModel",
        transformers.ViTConfig,
        {**SMALL, "image_size": 32, "patch_size": 8},
        "layers.{}.attention",
        lambda: {"pixel_values": torch.randn(2, 3, 32, 32, generator=torch.manual_seed(1))},
    ),
}


def pair(case: Case) -> tuple[nn.Module, nn.Module]:
    """(SDPA model, eager model) with the same random weights."""
    cls = getattr(transformers, case.model)
    torch.manual_seed(0)
    fused = cls(case.config(attn_implementation="sdpa", **case.options)).eval()
    eager = cls(case.config(attn_implementation="eager", **case.options)).eval()
    eager.load_state_dict(fused.state_dict())
    return fused, eager


def attended(weights: Tensor) -> Tensor:
    """Rows whose keys are not all masked: there eager attention's large negative mask gives
    uniform weights where SDPA (and hookscope) give zeros; both are meaningless."""
    return weights.sum(-1) > 0.5


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("name", list(CASES))
def test_attention_weights_equal_eager_output_attentions(name: str) -> None:
    case = CASES[name]
    fused, eager = pair(case)
    inputs = case.inputs()
    ref = eager(**inputs, output_attentions=True)
    # a loss that is not constant through the final layer norm
    weight = torch.randn(ref.last_hidden_state.shape, generator=torch.manual_seed(2))
    (ref_grad,) = torch.autograd.grad((ref.last_hidden_state * weight).sum(), ref.attentions[1])
    plain = fused(**inputs).last_hidden_state
    selector = case.attention.format("*") + "::attention_weights"
    with hs.capture(fused, selector, grads=True) as cap:
        out = fused(**inputs).last_hidden_state
        (out * weight).sum().backward()
    assert torch.equal(out, plain)  # the fused kernel ran, untouched
    for i in range(2):
        got = cap[case.attention.format(i) + "::attention_weights"]
        live = attended(got.output)
        assert live.float().mean() > 0.7
        diff = (got.output - ref.attentions[i]).abs().amax(-1)[live]
        assert diff.max() <= 1e-6, (i, diff.max())
    # dL/dP = dL/dO · Vᵀ where it means the same in both: padded queries' rows differ (see
    # attended) and so do padded keys' values, computed from those rows one layer down
    weights = cap[case.attention.format(1) + "::attention_weights"]
    same = attended(weights.output)[..., None] & (weights.output > 0) & (ref.attentions[1] > 0)
    scale = float(ref_grad.abs().max())
    torch.testing.assert_close(weights.grad[same], ref_grad[same], rtol=1e-4, atol=2e-6 * scale)


def _head_mask_attention(heads: Tensor) -> Callable[..., tuple[Tensor, Tensor]]:
    """The oracle: GPT-2's eager attention written out, head ``heads`` multiplied in after
    the softmax (registered with transformers' AttentionInterface)."""

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        scores = query @ key.transpose(-1, -2) * (scaling or query.size(-1) ** -0.5)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(-1)
        if module.layer_idx == 1:
            probs = probs * heads[:, None, None]
        return (probs @ value).transpose(1, 2), probs

    return attention


@pytest.mark.slow
def test_head_ablation_through_attention_weights_equals_an_edited_eager_attention() -> None:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    case = CASES["gpt2"]
    fused, _ = pair(case)
    heads = torch.tensor([1.0, 0.0, 1.0, 0.0])  # knock out heads 1 and 3 of layer 1
    transformers.AttentionInterface.register("head_masked", _head_mask_attention(heads))
    AttentionMaskInterface.register("head_masked", eager_mask)  # eager's additive masks
    oracle = transformers.GPT2Model(case.config(attn_implementation="head_masked", **case.options))
    oracle.load_state_dict(fused.state_dict())
    inputs = case.inputs()
    want = oracle.eval()(**inputs).last_hidden_state
    sdpa = "h.0.attn::scaled_dot_product_attention"
    with hs.capture(fused, sdpa) as plain:
        fused(**inputs)
    edit = {"h.1.attn::attention_weights": lambda p: p * heads[:, None, None]}
    with hs.edit(fused, edit), hs.capture(fused, sdpa) as cap:
        got = fused(**inputs).last_hidden_state
    live = torch.ones_like(got, dtype=torch.bool)
    live[1, :2] = False  # the fully padded queries: uniform in eager, zeros in SDPA
    torch.testing.assert_close(got[live], want[live], rtol=1e-5, atol=1e-5)
    assert torch.equal(cap[sdpa].output, plain[sdpa].output)  # layer 0 still ran fused


@pytest.mark.slow
@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_under_gradient_checkpointing(reentrant: bool) -> None:
    """Hugging Face's gradient checkpointing replays each block in backward: the edit of the
    attention weights applies to the replay too, and the captured gradient arrives once."""
    case = CASES["gpt2"]
    options = {**case.options, "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
    torch.manual_seed(0)
    plain = transformers.GPT2Model(case.config(**options)).train()
    checkpointed = transformers.GPT2Model(case.config(**options)).train()
    checkpointed.load_state_dict(plain.state_dict())
    kwargs = {"use_reentrant": reentrant}
    if hasattr(checkpointed, "activation_checkpointing_enable"):  # the new name (transformers 5)
        checkpointed.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        checkpointed.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inputs = {**case.inputs(), "use_cache": False}
    edit = {"h.1.attn::attention_weights": hs.scale(0.5)}
    grads = []
    for model in (plain, checkpointed):
        with (
            hs.edit(model, edit),
            hs.capture(model, "h.*.attn::attention_weights", grads=True) as cap,
        ):
            model(**inputs).last_hidden_state.pow(2).sum().backward()
        grads.append([p.grad for p in model.parameters()] + [cap[k].grad for k in cap])
        assert [cap[k].count for k in cap] == [1, 1]
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# -- decoding: transformers packs grouped query heads into the query-length axis ---------------
DECODING = {
    "llama-gqa-padded": ("LlamaModel", transformers.LlamaConfig, {}, True),
    "mistral-sliding-window": (  # every decoding step of a sliding-window model has a mask
        "MistralModel",
        transformers.MistralConfig,
        {"sliding_window": 4},
        False,
    ),
}


def _decoding(name: str, implementation: str = "eager") -> tuple[nn.Module, nn.Module]:
    """(SDPA model, a model of ``implementation``) of a ``DECODING`` case, same weights."""
    model, config, extra, _ = DECODING[name]
    cls = getattr(transformers, model)
    options = {**SMALL, "num_key_value_heads": 2, "vocab_size": 100, **extra}
    torch.manual_seed(0)
    fused = cls(config(attn_implementation="sdpa", **options)).eval()
    other = cls(config(attn_implementation=implementation, **options)).eval()
    other.load_state_dict(fused.state_dict())
    return fused, other


def _one_step(model: nn.Module, name: str) -> dict[str, Any]:
    """The inputs of one decoding step after a prefill of 7 tokens (left padding if the case
    says so): the prefill runs here, without hookscope."""
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(2, 8, dtype=torch.long)
    if DECODING[name][3]:
        mask[1, :2] = 0
    with torch.no_grad():
        cache = model(input_ids=ids[:, :7], attention_mask=mask[:, :7], use_cache=True)
    return {"input_ids": ids[:, 7:], "attention_mask": mask, "cache": cache.past_key_values}


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("name", list(DECODING))
def test_attention_weights_while_decoding_are_in_eager_layout(name: str) -> None:
    """One query, 4 heads over 2 key/value heads: eager's ``(B, 4, 1, S)``, head by head, not
    the packed ``(B, 2, 2, S)`` the SDPA call sees; their gradients too."""
    fused, eager = _decoding(name)
    ref = eager(**_one_step(eager, name), output_attentions=True)
    weight = torch.randn(ref.last_hidden_state.shape, generator=torch.manual_seed(2))
    (ref_grad,) = torch.autograd.grad((ref.last_hidden_state * weight).sum(), ref.attentions[1])
    inputs = _one_step(fused, name)
    with hs.capture(fused, "layers.*.self_attn::attention_weights", grads=True) as cap:
        out = fused(**inputs).last_hidden_state
        (out * weight).sum().backward()
    for i in range(2):
        got = cap[f"layers.{i}.self_attn::attention_weights"]
        assert got.output.shape == ref.attentions[i].shape == (2, 4, 1, ref.attentions[i].size(-1))
        torch.testing.assert_close(got.output, ref.attentions[i], rtol=0, atol=1e-6)
    scale = float(ref_grad.abs().max())
    got_grad = cap["layers.1.self_attn::attention_weights"].grad
    live = ref.attentions[1] > 0  # masked keys: their values differ and do not matter
    torch.testing.assert_close(got_grad[live], ref_grad[live], rtol=1e-4, atol=2e-6 * scale)


def _head_mask_gqa_attention(heads: Tensor, layer: int) -> Callable[..., tuple[Tensor, Tensor]]:
    """The oracle: Llama's eager attention written out (key/value heads repeated), head
    ``heads`` multiplied in after the softmax in ``layer``."""

    def attention(
        module: nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Any,
        scaling: float | None = None,
        dropout: float = 0.0,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        groups = module.num_key_value_groups
        key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
        scores = query @ key.transpose(-1, -2) * (scaling or query.size(-1) ** -0.5)
        if attention_mask is not None:
            scores = scores + attention_mask
        probs = scores.softmax(-1)
        if module.layer_idx == layer:
            probs = probs * heads[:, None, None]
        return (probs @ value).transpose(1, 2), probs

    return attention


@pytest.mark.parametrize("name", list(DECODING))
def test_head_edit_while_decoding_addresses_eager_heads(name: str) -> None:
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    heads = torch.tensor([1.0, 0.0, 0.5, 0.0])  # heads 1 and 3 share no key/value head
    transformers.AttentionInterface.register("head_masked_gqa", _head_mask_gqa_attention(heads, 1))
    AttentionMaskInterface.register("head_masked_gqa", eager_mask)
    fused, oracle = _decoding(name, "head_masked_gqa")
    want = oracle(**_one_step(oracle, name)).last_hidden_state
    edit = {"layers.1.self_attn::attention_weights": lambda p: p * heads[:, None, None]}
    inputs = _one_step(fused, name)
    with hs.edit(fused, edit) as ed:
        got = fused(**inputs).last_hidden_state
    assert ed.applied == {"layers.1.self_attn::attention_weights": 1}
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
