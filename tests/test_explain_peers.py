"""The CAM family against pytorch-grad-cam and Captum on a Hugging Face ResNet built from a
config, after the same post-processing.

pytorch-grad-cam is imported with torchvision stubbed out (see bench/_peers.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf


def _pytorch_grad_cam() -> Any:
    """pytorch-grad-cam imported as bench/_peers.py does (torchvision stubbed out meanwhile)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pytorch_grad_cam()


class Logits(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


@pytest.fixture(scope="module")
def resnet() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ResNetConfig(
        embedding_size=16, hidden_sizes=[16, 32, 48, 64], depths=[1, 1, 1, 1], num_labels=10
    )
    return transformers.ResNetForImageClassification(config).eval()


def _theirs_scaled(raw: Tensor, size: tuple[int, int]) -> np.ndarray:
    """pytorch-grad-cam's post-processing: min-max per image, then bilinear resize."""
    lo = raw.flatten(1).min(1).values[:, None, None]
    hi = raw.flatten(1).max(1).values[:, None, None]
    scaled = (raw - lo) / (1e-7 + hi - lo)
    return F.interpolate(scaled[:, None], size=size, mode="bilinear", align_corners=False)[
        :, 0
    ].numpy()


@pytest.mark.parametrize(
    "name", ["GradCAM", "GradCAMPlusPlus", "XGradCAM", "LayerCAM", "HiResCAM", "ScoreCAM"]
)
def test_matches_pytorch_grad_cam(resnet: nn.Module, name: str) -> None:
    pgc, model_targets = _pytorch_grad_cam()
    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))
    ours = getattr(hs, name)(resnet, "resnet.encoder.stages.3")(x, targets=[3, 7])
    assert all(p.grad is None for p in resnet.parameters())  # autograd.grad to the layer only
    layer = resnet.resnet.encoder.stages[3]
    with getattr(pgc, name)(model=Logits(resnet), target_layers=[layer]) as cam:
        targets = [model_targets.ClassifierOutputTarget(c) for c in (3, 7)]
        theirs = cam(input_tensor=x, targets=targets)
    assert np.abs(_theirs_scaled(ours.raw, (64, 64)) - theirs).max() < 1e-4
    resnet.zero_grad(set_to_none=True)  # pytorch-grad-cam's full backward filled .grad


def test_gradcam_matches_captum(resnet: nn.Module) -> None:
    from captum.attr import LayerGradCam

    x = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(2))
    ours = hs.GradCAM(resnet, "resnet.encoder.stages.3")(x, targets=[1, 4])
    layer = resnet.resnet.encoder.stages[3]
    theirs = LayerGradCam(Logits(resnet), layer).attribute(x, target=[1, 4], relu_attributions=True)
    torch.testing.assert_close(ours.raw, theirs[:, 0].detach(), rtol=1e-4, atol=1e-6)
    resnet.zero_grad(set_to_none=True)  # Captum's backward fills .grad; ours never does
