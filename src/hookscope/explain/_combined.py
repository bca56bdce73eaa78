"""Methods built from others: SmoothGrad (any method averaged over noisy copies of the input)
and Guided Grad-CAM (guided backpropagation times the upsampled Grad-CAM map)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import LayerSelector
from ..errors import UsageError
from ._base import Explanation
from ._input import GuidedBackprop
from ._registry import MethodInfo, register
from ._targets import Resolved, Target
from .methods import GradCAM

__all__ = ["GuidedGradCAM", "SmoothGrad"]


class SmoothGrad:
    """Smilkov et al. (2017): the mean of ``method`` over ``samples`` copies of the input with
    Gaussian noise of standard deviation ``noise * (max - min)`` of each image. Runs the method
    ``samples`` times; targets are fixed from the clean input first, so every copy explains
    the same class.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
        >>> smooth = hs.SmoothGrad(hs.Saliency(net), samples=4, seed=0)
        >>> smooth(torch.randn(2, 3, 2, 2), targets=[0, 2]).raw.shape
        torch.Size([2, 3, 2, 2])
    """

    def __init__(
        self, method: Any, *, samples: int = 25, noise: float = 0.15, seed: int | None = None
    ) -> None:
        if not callable(method):
            raise UsageError(
                f"SmoothGrad wraps a method such as hs.Saliency(model), got {method!r}"
            )
        if not isinstance(samples, int) or samples < 1:
            raise UsageError(f"samples must be an int >= 1, got {samples!r}")
        if noise < 0:
            raise UsageError(f"noise must be >= 0, got {noise!r}")
        self.method, self.samples, self.noise, self.seed = method, samples, noise, seed

    def __call__(self, x: Tensor, targets: Target = None) -> Explanation:
        if not isinstance(x, Tensor):
            raise UsageError("SmoothGrad adds noise to an image tensor: pass x as a tensor")
        first = self.method(x, targets=targets)
        fixed = _same_targets(first, targets)
        span = (
            x.amax(dim=tuple(range(1, x.dim())), keepdim=True)
            - x.amin(dim=tuple(range(1, x.dim())), keepdim=True)
        ) * self.noise
        generator = torch.Generator(device=x.device)
        if self.seed is not None:
            generator.manual_seed(self.seed)
        else:
            generator.seed()
        raw = torch.zeros_like(first.raw)
        maps = torch.zeros_like(first.maps)
        for _ in range(self.samples):
            noisy = x + torch.randn(x.shape, generator=generator, device=x.device) * span
            e = self.method(noisy, targets=fixed)
            raw, maps = raw + e.raw, maps + e.maps
        n = self.samples
        return Explanation(
            raw / n,
            maps / n,
            first.targets,
            first.scores,
            f"smoothgrad({first.method})",
            first.layer,
        )


class GuidedGradCAM:
    """Selvaraju et al. (2017): guided backpropagation ``(N, C, H, W)`` times the Grad-CAM map
    of ``layers`` upsampled to the input ``(N, 1, H, W)``.

    Args:
        model: the model (left as found).
        layers: the Grad-CAM layer, as for :class:`GradCAM`.
        reshape: the layer's output as maps ``(N, C, h, w)`` (1-D signals: ``(N, C, L)``),
            where its type and shapes do not say where the channels are (see
            :class:`~hookscope.explain.LayerMethod`).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> hs.GuidedGradCAM(net, "1", reshape=lambda t: t)(torch.randn(2, 3, 6, 6)).raw.shape
        torch.Size([2, 3, 6, 6])
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        reshape: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self.guided = GuidedBackprop(model)
        self.gradcam = GradCAM(model, layers, reshape=reshape)

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        cam = self.gradcam(x, targets=targets)
        fixed = _same_targets(cam, targets)
        guided = self.guided(x, targets=fixed)
        raw = guided.raw * cam.maps[:, None].to(guided.raw)
        return Explanation(raw, raw, cam.targets, cam.scores, "guided_gradcam", cam.layer)


def _same_targets(first: Explanation, targets: Target) -> Any:
    """What makes the next passes explain what the first one did: its class indices (no need
    to check them again) or the same callable."""
    return Resolved.fixed(first.targets) if first.targets is not None else targets


register(
    MethodInfo(
        "smoothgrad",
        SmoothGrad,
        "wrapper",
        gradients=True,
        requires=("method",),
        reference="Smilkov et al., SmoothGrad, 2017",
    )
)
register(
    MethodInfo(
        "guided_gradcam",
        GuidedGradCAM,
        "layer",
        gradients=True,
        reference="Selvaraju et al., Grad-CAM, ICCV 2017 (Guided Grad-CAM)",
        per_channel=True,
    )
)
