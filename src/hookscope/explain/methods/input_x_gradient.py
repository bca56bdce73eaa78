"""Gradient times input (Shrikumar et al., 2016), Captum's ``InputXGradient``."""

from __future__ import annotations

from torch import Tensor

from .._input import InputMethod
from .._registry import MethodInfo, register


class InputXGradient(InputMethod):
    """``x * dS/dx``: the gradient of the score w.r.t. the input times the input, signed.

    From Shrikumar et al., *Not Just a Black Box: Learning Important Features Through
    Propagating Activation Differences*, 2016.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
        >>> hs.InputXGradient(net)(torch.randn(2, 3, 2, 2), targets=1).raw.shape
        torch.Size([2, 3, 2, 2])
    """

    name = "input_x_gradient"

    def _attribute(self, grad: Tensor, image: Tensor) -> Tensor:
        return image.detach() * grad


register(
    MethodInfo(
        "input_x_gradient",
        InputXGradient,
        "input",
        gradients=True,
        reference="Shrikumar et al., Not Just a Black Box, 2016 (gradient x input)",
        per_channel=True,
    )
)
