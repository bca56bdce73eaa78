"""Grad-CAM++ (Chattopadhyay et al., 2018): pixel-wise weights from second and third powers
of the gradient (the closed form for an exponential of the score, as usually implemented)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class GradCAMPlusPlus(LayerMethod):
    """``ReLU(sum_c w_c * A_c)`` with ``w_c = sum_hw a_c,hw * ReLU(g_c,hw)`` and
    ``a = g^2 / (2 g^2 + sum_hw(A_c) g^3)`` (0 where the gradient is 0).

    From Chattopadhyay et al., *Grad-CAM++: Improved Visual Explanations for Deep Convolutional
    Networks*, WACV 2018.
    """

    name = "gradcam++"

    def combine(self, ctx: Context) -> Tensor:
        """Channel weights from the positive gradients weighted by the closed-form ``alpha``,
        times the activations, summed over channels."""
        acts, grads = ctx.acts, ctx.gradient
        g2, g3 = grads.pow(2), grads.pow(3)
        total = acts.sum((2, 3), keepdim=True)
        alpha = g2 / (2 * g2 + total * g3 + 1e-6)  # the epsilon of pytorch-grad-cam
        alpha = torch.where(grads != 0, alpha, torch.zeros_like(alpha))
        weights = (alpha * grads.clamp_min(0)).sum((2, 3), keepdim=True)
        return (weights * acts).sum(1)


register(
    MethodInfo(
        "gradcam++",
        GradCAMPlusPlus,
        "layer",
        gradients=True,
        perturbation=False,
        requires=(),
        reference="Chattopadhyay et al., Grad-CAM++, WACV 2018",
    )
)
