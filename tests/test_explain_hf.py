"""CAMs on Hugging Face vision transformers and ConvNeXt/Swin built from small configs: the
token grid is inferred (CLS and register tokens dropped, non-square inputs), checked against a
Grad-CAM written here with the grid given by hand."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

SMALL = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "image_size": 32,
    "patch_size": 8,
    "num_labels": 3,
}


def _first(out: object) -> Tensor:
    return out if isinstance(out, Tensor) else out[0]  # type: ignore[index]


def _gradcam_by_hand(
    model: nn.Module, layer: nn.Module, x: Tensor, targets: list[int], prefix: int, grid: tuple
) -> Tensor:
    kept: list[Tensor] = []

    def keep(m: nn.Module, a: object, out: object) -> None:
        t = _first(out)
        t.retain_grad()
        kept.append(t)

    handle = layer.register_forward_hook(keep)
    try:
        logits = model(pixel_values=x, interpolate_pos_encoding=True).logits
    finally:
        handle.remove()
    logits[torch.arange(len(x)), targets].sum().backward()
    a, g = kept[0].detach(), kept[0].grad
    n, c = a.shape[0], a.shape[-1]
    a = a[:, prefix:].reshape(n, *grid, c).permute(0, 3, 1, 2)
    g = g[:, prefix:].reshape(n, *grid, c).permute(0, 3, 1, 2)
    return torch.relu((g.mean((2, 3), keepdim=True) * a).sum(1))


@pytest.mark.parametrize("size", [(32, 32), (32, 48)])
def test_vit_and_registers_non_square(size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 3, *size)
    grid = (size[0] // 8, size[1] // 8)
    cases = [
        (
            transformers.ViTForImageClassification(transformers.ViTConfig(**SMALL)),
            "vit.layers.1",
            1,
        ),
        (
            transformers.Dinov2WithRegistersForImageClassification(
                transformers.Dinov2WithRegistersConfig(**SMALL, num_register_tokens=4)
            ),
            "dinov2_with_registers.encoder.layer.1",
            5,  # CLS + 4 registers
        ),
    ]
    for model, name, prefix in cases:
        model.eval()
        inputs = {"pixel_values": x, "interpolate_pos_encoding": True}
        exp = hs.GradCAM(model, name)(inputs, targets=[0, 2])
        assert exp.raw.shape == (2, *grid) and exp.maps.shape == (2, *size)
        layer = model.get_submodule(name)
        ref = _gradcam_by_hand(model, layer, x, [0, 2], prefix, grid)
        model.zero_grad(set_to_none=True)
        torch.testing.assert_close(exp.raw, ref, rtol=1e-4, atol=1e-6)


def test_swin_and_convnext_channels_last_and_conv_stages() -> None:
    torch.manual_seed(0)
    swin = transformers.SwinForImageClassification(
        transformers.SwinConfig(
            image_size=32,
            patch_size=4,
            embed_dim=16,
            depths=[1, 1],
            num_heads=[1, 2],
            window_size=2,
            num_labels=3,
        )
    ).eval()
    convnext = transformers.ConvNextForImageClassification(
        transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=3)
    ).eval()
    x = torch.randn(2, 3, 32, 32)
    for model, name in ((swin, "swin.encoder.layers.1"), (convnext, "convnext.encoder.stages.1")):
        exp = hs.GradCAM(model, name)(x, targets=1)
        assert exp.raw.shape == (2, 4, 4) and exp.maps.shape == (2, 32, 32)
        assert torch.isfinite(exp.raw).all() and exp.raw.abs().sum() > 0
        assert all(p.grad is None for p in model.parameters())
