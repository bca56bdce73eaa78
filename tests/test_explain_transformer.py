"""Attention rollout and transformer relevance on Hugging Face ViT, DeiT, DINOv2, CLIP's vision
tower, BERT, GPT-2 and Llama (built from small configs, random weights, offline): hookscope runs
each model with SDPA and must give what a rollout and Chefer et al.'s rule, written here, give
on transformers' own eager attention (``attn_implementation="eager"``,
``output_attentions=True``) with the same weights: rollout within 1e-6, relevance within 1e-5.
"""

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

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
SMALL |= {"intermediate_size": 64}
VISION = {**SMALL, "image_size": 32, "patch_size": 8}


def rollout_by_hand(attentions: tuple[Tensor, ...], fusion: str, residual: float) -> Tensor:
    """Abnar & Zuidema's rollout: heads fused, mixed with I, rows normalised, multiplied."""
    r = None
    for a in attentions:
        fused = {"mean": a.mean(1), "max": a.max(1).values, "min": a.min(1).values}[fusion]
        eye = torch.eye(fused.shape[-1])
        mixed = (1 - residual) * fused + residual * eye
        mixed = mixed / mixed.sum(-1, keepdim=True)
        r = mixed if r is None else torch.bmm(mixed, r)
    assert r is not None
    return r


def relevance_by_hand(attentions: tuple[Tensor, ...], grads: tuple[Tensor, ...]) -> Tensor:
    """Chefer et al.: R = I; R += mean_h((dS/dA * A)^+) @ R, layer by layer."""
    n, _, t, _ = attentions[0].shape
    r = torch.eye(t).repeat(n, 1, 1)
    for a, g in zip(attentions, grads, strict=True):
        cam = torch.clamp(g * a, min=0).mean(dim=1)
        r = r + torch.bmm(cam, r)
    return r


@dataclass(frozen=True)
class Case:
    model: str
    config: str
    options: dict[str, Any]
    inputs: Callable[[], dict[str, Any]]
    targets: Any  # class indices, or a callable on the output
    token: int  # the row the map is: CLS (0), or the last token of a decoder LM
    score: Callable[[Any], Tensor]  # the target scores, written out


def _pixels(size: tuple[int, int] = (32, 32)) -> Callable[[], dict[str, Any]]:
    def make() -> dict[str, Any]:
        x = torch.randn(2, 3, *size, generator=torch.Generator().manual_seed(1))
        return {"pixel_values": x} | (
            {"interpolate_pos_encoding": True} if size[0] != size[1] else {}
        )

    return make


def _ids(pad: str | None = None) -> Callable[[], dict[str, Tensor]]:
    def make() -> dict[str, Tensor]:
        ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
        mask = torch.ones(2, 9, dtype=torch.long)
        if pad == "right":
            mask[1, 6:] = 0
        elif pad == "left":
            mask[1, :3] = 0
        return {"input_ids": ids, "attention_mask": mask}

    return make


def _classes(out: Any) -> Tensor:
    return out.logits[[0, 1], [2, 0]]


def _next_token(out: Any) -> Tensor:
    return out.logits[:, -1][[0, 1], [7, 3]]


def _pooled(out: Any) -> Tensor:
    return 10 * out.pooler_output[:, 0] - out.pooler_output[:, 1]


CASES = {
    "vit": Case(
        "ViTForImageClassification",
        "ViTConfig",
        {**VISION, "num_labels": 3},
        _pixels(),
        [2, 0],
        0,
        _classes,
    ),
    "vit-wide": Case(
        "ViTForImageClassification",
        "ViTConfig",
        {**VISION, "num_labels": 3},
        _pixels((32, 48)),
        [2, 0],
        0,
        _classes,
    ),
    "deit": Case(
        "DeiTForImageClassificationWithTeacher",
        "DeiTConfig",
        {**VISION, "num_labels": 3},
        _pixels(),
        [2, 0],
        0,
        _classes,
    ),
    "dinov2": Case(
        "Dinov2ForImageClassification",
        "Dinov2Config",
        {**VISION, "num_labels": 3},
        _pixels(),
        [2, 0],
        0,
        _classes,
    ),
    "clip-vision": Case(
        "CLIPVisionModel", "CLIPVisionConfig", VISION, _pixels(), _pooled, 0, _pooled
    ),
    "bert-padded": Case(
        "BertForSequenceClassification",
        "BertConfig",
        {**SMALL, "vocab_size": 100, "num_labels": 3, "initializer_range": 0.5},
        _ids("right"),
        [2, 0],
        0,
        _classes,
    ),
    "gpt2-padded": Case(
        "GPT2LMHeadModel",
        "GPT2Config",
        {
            "n_layer": 2,
            "n_embd": 32,
            "n_head": 2,
            "vocab_size": 100,
            "bos_token_id": 0,
            "eos_token_id": 0,
        },
        _ids("left"),
        [7, 3],
        -1,
        _next_token,
    ),
    "llama-gqa": Case(
        "LlamaForCausalLM",
        "LlamaConfig",
        {**SMALL, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100},
        _ids(),
        [7, 3],
        -1,
        _next_token,
    ),
}


def pair(case: Case) -> tuple[nn.Module, nn.Module]:
    """(SDPA model, eager model) with the same random weights."""
    cls, config = getattr(transformers, case.model), getattr(transformers, case.config)
    torch.manual_seed(0)
    fused = cls(config(attn_implementation="sdpa", **case.options)).eval()
    eager = cls(config(attn_implementation="eager", **case.options)).eval()
    eager.load_state_dict(fused.state_dict())
    return fused, eager


def eager_attention(eager: nn.Module, case: Case) -> tuple[tuple[Tensor, ...], tuple[Tensor, ...]]:
    """Eager attention weights of every layer and the target scores' gradient w.r.t. them."""
    out = eager(**case.inputs(), output_attentions=True)
    grads = torch.autograd.grad(case.score(out).sum(), out.attentions)
    return tuple(a.detach() for a in out.attentions), grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_rollout_and_relevance_equal_hand_written_ones_on_eager_attention(name: str) -> None:
    case = CASES[name]
    fused, eager = pair(case)
    attentions, grads = eager_attention(eager, case)
    inputs = case.inputs()
    rollout = hs.AttentionRollout(fused)(inputs, targets=case.targets)
    want = rollout_by_hand(attentions, "mean", 0.5)[:, case.token]
    torch.testing.assert_close(rollout.attributions, want, rtol=0, atol=1e-6)
    relevance = hs.TransformerRelevance(fused)(inputs, targets=case.targets)
    want = relevance_by_hand(attentions, grads)[:, case.token]
    torch.testing.assert_close(relevance.attributions, want, rtol=0, atol=1e-5)
    eye = torch.eye(want.shape[1])[case.token]
    assert float((want - eye).abs().max()) > 1e-3  # the gradient part is not negligible
    with torch.no_grad():
        torch.testing.assert_close(relevance.scores, case.score(fused(**inputs)))
    assert all(p.grad is None for p in fused.parameters())


@pytest.mark.parametrize("name", ["vit", "vit-wide", "deit", "dinov2", "clip-vision"])
def test_image_maps_are_the_patch_grid_without_the_leading_tokens(name: str) -> None:
    """CLS (DeiT: and the distillation token) dropped, the rest on the patch grid, upsampled."""
    case = CASES[name]
    fused, _ = pair(case)
    inputs = case.inputs()
    x = inputs["pixel_values"]
    exp = hs.AttentionRollout(fused)(inputs, targets=case.targets)
    grid = (x.shape[2] // 8, x.shape[3] // 8)
    prefix = 2 if name == "deit" else 1
    assert exp.attributions is not None
    assert exp.attributions.shape == (2, prefix + grid[0] * grid[1])
    torch.testing.assert_close(exp.raw, exp.attributions[:, prefix:].reshape(2, *grid))
    assert exp.maps.shape == (2, *x.shape[2:])


def test_head_fusion_residual_token_and_layers_are_as_written() -> None:
    case = CASES["vit"]
    fused, eager = pair(case)
    attentions, _ = eager_attention(eager, case)
    inputs = case.inputs()
    for fusion, residual in (("max", 0.5), ("min", 0.3), ("mean", 0.0), ("mean", 1.0)):
        exp = hs.AttentionRollout(fused, head_fusion=fusion, residual=residual)(inputs, targets=0)
        want = rollout_by_hand(attentions, fusion, residual)[:, 0]
        torch.testing.assert_close(exp.attributions, want, rtol=0, atol=1e-6)
    third = hs.AttentionRollout(fused, token=3)(inputs, targets=0)
    torch.testing.assert_close(
        third.attributions, rollout_by_hand(attentions, "mean", 0.5)[:, 3], rtol=0, atol=1e-6
    )
    last = hs.AttentionRollout(fused, "vit.layers.1.attention")(inputs, 0)
    only = rollout_by_hand(attentions[1:], "mean", 0.5)[:, 0]
    torch.testing.assert_close(last.attributions, only, rtol=0, atol=1e-6)


def test_text_maps_are_per_token_and_frozen_embeddings_still_have_relevance() -> None:
    """Token ids: relevance ends its backward at the embeddings' output (replaced by a leaf),
    so it works with every parameter frozen and computes no parameter's gradient."""
    case = CASES["bert-padded"]
    fused, eager = pair(case)
    attentions, grads = eager_attention(eager, case)
    fused.requires_grad_(False)
    exp = hs.TransformerRelevance(fused)(case.inputs(), targets=case.targets)
    assert exp.raw.shape == exp.maps.shape == (2, 9)
    want = relevance_by_hand(attentions, grads)[:, 0]
    torch.testing.assert_close(exp.attributions, want, rtol=0, atol=1e-5)


def test_models_without_sdpa_and_bad_options_are_refused() -> None:
    _, eager = pair(CASES["vit"])
    x = CASES["vit"].inputs()
    with pytest.raises(hs.UsageError, match=r"no F.scaled_dot_product_attention call ran in "):
        hs.AttentionRollout(eager)(x, targets=0)
    with pytest.raises(hs.UsageError, match=r"head_fusion must be 'mean', 'max' or 'min'"):
        hs.AttentionRollout(eager, head_fusion="sum")  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match=r"residual must be a number in \[0, 1\], got 2"):
        hs.AttentionRollout(eager, residual=2)
    with pytest.raises(hs.UsageError, match=r"token must be a token index \(an int\)"):
        hs.TransformerRelevance(eager, token=0.5)  # type: ignore[arg-type]
    with pytest.raises(hs.LayerNotFoundError):
        hs.TransformerRelevance(eager, "vit.nowhere")
    with torch.inference_mode(), pytest.raises(hs.UsageError, match=r"takes gradients, which"):
        hs.TransformerRelevance(eager)(x, targets=0)
