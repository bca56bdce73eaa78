"""Grad-CAM (Selvaraju et al., 2017): channels weighted by their spatially averaged gradient."""

from __future__ import annotations

from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class GradCAM(LayerMethod):
    """``ReLU(sum_c mean_hw(dS/dA_c) * A_c)``.

    From Selvaraju et al., *Grad-CAM: Visual Explanations from Deep Networks via Gradient-based
    Localization*, ICCV 2017.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> hs.GradCAM(net, "0")(torch.randn(2, 3, 8, 8), targets=[0, 1]).maps.shape
        torch.Size([2, 8, 8])
    """

    name = "gradcam"

    def combine(self, ctx: Context) -> Tensor:
        """The spatially averaged gradient of each channel times its activation, summed over
        channels."""
        return (ctx.gradient.mean((2, 3), keepdim=True) * ctx.acts).sum(1)


register(
    MethodInfo(
        "gradcam",
        GradCAM,
        "layer",
        gradients=True,
        perturbation=False,
        requires=(),
        reference="Selvaraju et al., Grad-CAM, ICCV 2017",
    )
)
