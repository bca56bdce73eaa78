"""Where a layer's channels are: decided from its type, from the shapes when only one reading
fits, refused (asking for ``reshape=``) when neither decides; 1-D signals explained as 1-D
maps. Oracles: Grad-CAM written here with the layout given by hand."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs
from hookscope.explain import METHODS


def _gradcam_by_hand(
    model: nn.Module,
    layer: nn.Module,
    x: Tensor,
    targets: list[int],
    to_maps: Callable[[Tensor], Tensor],
) -> Tensor:
    """Grad-CAM with the layer's output turned into (N, C, ...) maps by ``to_maps``."""
    kept: list[Tensor] = []

    def keep(m: nn.Module, a: object, out: Tensor) -> None:
        out.retain_grad()
        kept.append(out)

    m = copy.deepcopy(model).eval()
    handle = dict(m.named_modules())[_name(model, layer)].register_forward_hook(keep)
    try:
        m(x)[torch.arange(len(x)), targets].sum().backward()
    finally:
        handle.remove()
    a, g = to_maps(kept[0].detach()), to_maps(kept[0].grad)
    dims = tuple(range(2, a.dim()))
    return torch.relu((g.mean(dims, keepdim=True) * a).sum(1))


def _name(model: nn.Module, layer: nn.Module) -> str:
    return next(n for n, m in model.named_modules() if m is layer)


def _conv_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


def test_a_non_square_conv_map_is_channels_first() -> None:
    """(N, 4, 8, 16) from a 16x32 input: 4x8 has the input's aspect ratio too, so the shapes
    alone would allow channels last; the convolution says channels first."""
    model, x = _conv_net(), torch.randn(2, 3, 16, 32)
    exp = hs.GradCAM(model, "0")(x, targets=[0, 2])
    assert exp.raw.shape == (2, 8, 16) and exp.maps.shape == (2, 16, 32)
    expected = _gradcam_by_hand(model, model[0], x, [0, 2], lambda t: t)
    torch.testing.assert_close(exp.raw, expected, rtol=1e-4, atol=1e-6)


def test_an_ambiguous_layout_is_refused_and_reshape_settles_it() -> None:
    """The ReLU after that convolution has the same shape and no layout of its own."""
    model, x = _conv_net(), torch.randn(2, 3, 16, 32)
    with pytest.raises(hs.UsageError, match=r"could be channels first .* Pass reshape="):
        hs.GradCAM(model, "1")(x, targets=0)
    first = hs.GradCAM(model, "1", reshape=lambda t: t)(x, targets=[0, 2])
    expected = _gradcam_by_hand(model, model[1], x, [0, 2], lambda t: t)
    torch.testing.assert_close(first.raw, expected, rtol=1e-4, atol=1e-6)
    # Guided Grad-CAM is refused the same way, and takes reshape= too (it had none)
    with pytest.raises(hs.UsageError, match=r"could be channels first .* Pass reshape="):
        hs.GuidedGradCAM(model, "1")(x, targets=0)
    guided = hs.GuidedGradCAM(model, "1", reshape=lambda t: t)(x, targets=[0, 2])
    backprop = hs.GuidedBackprop(model)(x, targets=[0, 2]).raw
    torch.testing.assert_close(guided.raw, backprop * first.maps[:, None])
    square = torch.randn(2, 3, 16, 16)  # (N, 4, 8, 8): only channels first fits 16x16
    assert hs.GradCAM(model, "1")(square, targets=0).raw.shape == (2, 8, 8)


class ChannelsLast(nn.Module):
    """Patches to (N, h, w, C), then a LayerNorm and a Linear over C (Swin / ConvNeXt style)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.patch = nn.Conv2d(3, 6, 4, stride=4)
        self.norm = nn.LayerNorm(6)
        self.mix = nn.Linear(6, 6)
        self.act = nn.GELU()
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        h = self.patch(x).permute(0, 2, 3, 1)
        return self.head(self.act(self.mix(self.norm(h))).mean((1, 2)))


@pytest.mark.parametrize("layer", ["norm", "mix", "act"])
def test_channels_last_from_the_type_or_the_shapes(layer: str) -> None:
    """LayerNorm and Linear act on the last axis; GELU has no layout, but (N, 6, 6, 6) from a
    24x24 input... would be ambiguous, so the input is 16x24: (N, 4, 6, 6) fits only as
    channels last (4x6 grid)."""
    model, x = ChannelsLast(), torch.randn(2, 3, 16, 24)
    exp = hs.GradCAM(model, layer)(x, targets=[1, 2])
    assert exp.raw.shape == (2, 4, 6)
    module = getattr(model, layer)
    expected = _gradcam_by_hand(model, module, x, [1, 2], lambda t: t.permute(0, 3, 1, 2))
    torch.testing.assert_close(exp.raw, expected, rtol=1e-4, atol=1e-6)


def test_ablation_through_a_given_reshape_equals_the_inferred_layout() -> None:
    """Ablation-CAM zeroes a channel in the layer's own output: through the inferred
    channels-last layout, or through the offsets a rearranging reshape= reads."""
    model, x = ChannelsLast(), torch.randn(2, 3, 16, 24)
    inferred = hs.AblationCAM(model, "act")(x, targets=[1, 2])
    given = hs.AblationCAM(model, "act", reshape=lambda t: t.permute(0, 3, 1, 2))
    torch.testing.assert_close(given(x, targets=[1, 2]).raw, inferred.raw)
    assert inferred.raw.abs().sum() > 0
    scaled = hs.AblationCAM(model, "act", reshape=lambda t: t.permute(0, 3, 1, 2) * 2)
    with pytest.raises(hs.UsageError, match="must only rearrange"):
        scaled(x, targets=1)


class Signal(nn.Module):
    """A 1-D CNN on (N, 2, 20) signals."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv1d(2, 6, 5, stride=2, padding=2)
        self.relu = nn.ReLU()
        self.head = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.relu(self.conv(x)).mean(2))


def test_a_conv1d_output_is_a_one_dimensional_map() -> None:
    model, x = Signal(), torch.randn(3, 2, 20)
    exp = hs.GradCAM(model, "conv")(x, targets=[0, 1, 2])
    assert exp.raw.shape == (3, 10) and exp.maps.shape == (3, 20)
    expected = _gradcam_by_hand(model, model.conv, x, [0, 1, 2], lambda t: t)
    torch.testing.assert_close(exp.raw, expected, rtol=1e-4, atol=1e-6)
    up = F.interpolate(expected[:, None], size=20, mode="linear", align_corners=False)[:, 0]
    torch.testing.assert_close(exp.maps, up, rtol=1e-4, atol=1e-6)
    # the ReLU's (N, 6, 10) could also be 10 channels over 6 positions: refused, then settled
    with pytest.raises(hs.UsageError, match=r"6 channels over 10 positions or 10 channels"):
        hs.GradCAM(model, "relu")(x, targets=0)
    relu = hs.GradCAM(model, "relu", reshape=lambda t: t)(x, targets=[0, 1, 2])
    expected = _gradcam_by_hand(model, model.relu, x, [0, 1, 2], lambda t: t)
    torch.testing.assert_close(relu.raw, expected, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", sorted(n for n, i in METHODS.items() if i.kind == "layer"))
def test_every_layer_method_explains_a_signal(name: str) -> None:
    info = METHODS[name]
    kwargs: dict[str, Any] = {"fc": "head"} if "fc" in info.requires else {}
    model, x = Signal(), torch.randn(3, 2, 20)
    method = info.cls(model, "conv", **kwargs)
    exp = method(x, targets=[0, 1, 2])
    shape = (3, 2, 20) if info.per_channel else (3, 20)
    assert exp.maps.shape == shape and torch.isfinite(exp.maps).all()
    for i in range(3):
        one = method(x[i : i + 1], targets=i)
        torch.testing.assert_close(exp.maps[i], one.maps[0], rtol=1e-4, atol=1e-6)


def test_a_conv1d_in_an_image_model_is_refused() -> None:
    class Rows(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv1d(3, 4, 3, padding=1)
            self.head = nn.Linear(4, 2)

        def forward(self, x: Tensor) -> Tensor:
            return self.head(self.conv(x.flatten(2)).mean(2))

    with pytest.raises(hs.UsageError, match=r"layer 'conv' \(Conv1d\) returns shape \(1, 4, 64\)"):
        hs.GradCAM(Rows(), "conv")(torch.randn(1, 3, 8, 8), targets=0)
