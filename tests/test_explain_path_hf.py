"""Integrated gradients (input and layer), layer conductance, gradient x input, occlusion and
feature ablation against Captum on a Hugging Face ViT and BERT built from small configs
(random weights, offline), with the same baselines, steps, rule and internal batch size:
within 1e-5 of the largest attribution (float32), and the same convergence delta.

Captum gets the models as functions of tensors (``Logits``) and runs on deep copies (it fills
the parameters' ``.grad``); hookscope gets the models and their keyword inputs as users hold
them."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")
attr = pytest.importorskip("captum.attr")

pytestmark = pytest.mark.hf

SMALL = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2}
SMALL |= {"intermediate_size": 64, "num_labels": 3}


def close(ours: Tensor | None, theirs: Tensor, tol: float = 1e-5) -> None:
    assert ours is not None and ours.shape == theirs.shape
    scale = float(theirs.detach().abs().max())
    assert scale > 0
    assert float((ours - theirs.detach()).abs().max()) <= tol * scale


class Logits(nn.Module):
    """A HF classifier as Captum takes it: tensors in, logits out."""

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model, self.name = model, name

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        kwargs = {} if mask is None else {"attention_mask": mask}
        return self.model(**{self.name: x}, **kwargs).logits  # type: ignore[no-any-return]


@pytest.fixture(autouse=True)
def _quiet() -> Iterator[None]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input Tensor 0 did not already require")
        yield


@pytest.fixture(scope="module")
def vit() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(**SMALL, image_size=32, patch_size=8)
    return transformers.ViTForImageClassification(config).eval()


@pytest.fixture(scope="module")
def bert() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.BertConfig(**SMALL, vocab_size=100, initializer_range=0.2)
    return transformers.BertForSequenceClassification(config).eval()


def _pixels() -> Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def _text() -> tuple[Tensor, Tensor, Tensor]:
    """Token ids (the second text right-padded), their mask and the reference ids: [CLS],
    [PAD]s, [SEP] (Captum's BERT tutorial)."""
    ids = torch.randint(3, 100, (2, 8), generator=torch.Generator().manual_seed(2))
    ids[:, 0], ids[:, -1] = 1, 2
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    reference = torch.zeros_like(ids)
    reference[:, 0], reference[:, -1] = 1, 2
    return ids, mask, reference


def test_vit_input_methods_equal_captums(vit: nn.Module) -> None:
    x, targets = _pixels(), [2, 0]
    theirs = Logits(copy.deepcopy(vit), "pixel_values")
    ours = hs.IntegratedGradients(
        vit, baselines=0.1, n_steps=12, internal_batch_size=8, return_convergence_delta=True
    )(x, targets=targets)
    want, delta = attr.IntegratedGradients(theirs).attribute(
        x,
        baselines=0.1,
        target=targets,
        n_steps=12,
        internal_batch_size=8,
        return_convergence_delta=True,
    )
    close(ours.raw, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    ours = hs.InputXGradient(vit)(x, targets=targets)
    close(
        ours.raw, attr.InputXGradient(theirs).attribute(x.clone().requires_grad_(), target=targets)
    )
    ours = hs.Occlusion(vit, (3, 8, 8), strides=(3, 4, 4), batch_size=16)(x, targets=targets)
    want = attr.Occlusion(theirs).attribute(x, (3, 8, 8), strides=(3, 4, 4), target=targets)
    close(ours.raw, want)
    patches = torch.arange(16).view(1, 1, 4, 4).repeat_interleave(8, 2).repeat_interleave(8, 3)
    ours = hs.FeatureAblation(vit, feature_mask=patches, baselines=-1.0)(x, targets=targets)
    want = attr.FeatureAblation(theirs).attribute(
        x, feature_mask=patches, baselines=-1.0, target=targets
    )
    close(ours.raw, want)
    assert all(p.grad is None for p in vit.parameters())


@pytest.mark.parametrize("method", ["gausslegendre", "riemann_trapezoid"])
def test_vit_layer_methods_equal_captums(vit: nn.Module, method: str) -> None:
    x, targets = _pixels(), [1, 1]
    theirs = Logits(copy.deepcopy(vit), "pixel_values")
    layer = "vit.layers.0"
    options: dict[str, Any] = {"n_steps": 6, "method": method, "return_convergence_delta": True}
    ours = hs.LayerIntegratedGradients(vit, layer, **options)(x, targets=targets)
    want, delta = attr.LayerIntegratedGradients(theirs, theirs.model.vit.layers[0]).attribute(
        x, target=targets, **options
    )
    close(ours.attributions, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    assert ours.raw.shape == (2, 4, 4) and ours.maps.shape == (2, 32, 32)  # CLS dropped
    torch.testing.assert_close(ours.raw, want.detach()[:, 1:].sum(2).view(2, 4, 4))
    ours = hs.LayerConductance(vit, layer, **options)(x, targets=targets)
    want, delta = attr.LayerConductance(theirs, theirs.model.vit.layers[0]).attribute(
        x, target=targets, **options
    )
    close(ours.attributions, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)


def test_bert_token_ids_through_the_embeddings_equal_captums(bert: nn.Module) -> None:
    """Captum's BERT recipe: layer integrated gradients at the embeddings, from reference ids;
    and occlusion / feature ablation of the ids themselves (ablated tokens become [PAD])."""
    ids, mask, reference = _text()
    theirs = Logits(copy.deepcopy(bert), "input_ids")
    inputs = {"input_ids": ids, "attention_mask": mask}
    options: dict[str, Any] = {"n_steps": 16, "internal_batch_size": 6}
    lig = hs.LayerIntegratedGradients(
        bert, "bert.embeddings", baselines=reference, return_convergence_delta=True, **options
    )
    ours = lig(inputs, targets=[0, 2])
    want, delta = attr.LayerIntegratedGradients(theirs, theirs.model.bert.embeddings).attribute(
        ids,
        baselines=reference,
        target=[0, 2],
        additional_forward_args=(mask,),
        n_steps=16,
        internal_batch_size=6,
        return_convergence_delta=True,
    )
    close(ours.attributions, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    assert ours.raw.shape == ours.maps.shape == (2, 8)  # one value per token
    torch.testing.assert_close(ours.raw, want.detach().sum(2))
    occluded = hs.Occlusion(bert, (1,), baselines=0, batch_size=5)(inputs, targets=[0, 2])
    want = attr.Occlusion(theirs).attribute(
        ids, (1,), baselines=0, target=[0, 2], additional_forward_args=(mask,)
    )
    close(occluded.raw, want)
    words = torch.tensor([[0, 1, 1, 2, 3, 3, 4, 5]])  # tokens grouped into words
    ablated = hs.FeatureAblation(bert, feature_mask=words)(inputs, targets=[0, 2])
    want = attr.FeatureAblation(theirs).attribute(
        ids, feature_mask=words, target=[0, 2], additional_forward_args=(mask,)
    )
    close(ablated.raw, want)


def test_bert_embeddings_as_inputs_equal_captums(bert: nn.Module) -> None:
    """Integrated gradients and conductance over ``inputs_embeds``: token maps for layers."""
    ids, mask, _ = _text()
    with torch.no_grad():
        embeds = bert.bert.embeddings.word_embeddings(ids)
    theirs = Logits(copy.deepcopy(bert), "inputs_embeds")
    inputs = {"inputs_embeds": embeds, "attention_mask": mask}
    options: dict[str, Any] = {"n_steps": 10, "return_convergence_delta": True}
    ours = hs.IntegratedGradients(bert, **options)(inputs, targets=[1, 2])
    want, delta = attr.IntegratedGradients(theirs).attribute(
        embeds, target=[1, 2], additional_forward_args=(mask,), **options
    )
    close(ours.raw, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    layer = "bert.encoder.layer.0"
    ours = hs.LayerConductance(bert, layer, internal_batch_size=8, **options)(inputs, [1, 2])
    want, delta = attr.LayerConductance(theirs, theirs.model.bert.encoder.layer[0]).attribute(
        embeds, target=[1, 2], additional_forward_args=(mask,), internal_batch_size=8, **options
    )
    close(ours.attributions, want)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    assert ours.raw.shape == ours.maps.shape == (2, 8)
