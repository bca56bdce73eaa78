"""Eigen-CAM (Muhammad & Yeasin, 2020): the activations' first principal component.

Gradient-free and class-agnostic: targets only choose the scores reported. The SVD's sign is
arbitrary; hookscope picks the sign whose map correlates positively with the channel-summed
activation, and applies no ReLU (the map is signed, as the projection is).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class EigenCAM(LayerMethod):
    """``(A - mean_hw A) v_1``: each position's centred channel vector projected on the first
    right-singular vector ``v_1`` of the activations (signed, no ReLU).

    From Muhammad & Yeasin, *Eigen-CAM: Class Activation Map using Principal Components*, IJCNN
    2020.
    """

    name = "eigencam"
    relu = False
    needs_grad = False

    def combine(self, ctx: Context) -> Tensor:
        """Each position's centred channel vector projected on the activations' first
        right-singular vector, signed to correlate with the channel-summed activation."""
        acts = ctx.acts
        n, c, h, w = acts.shape
        x = acts.reshape(n, c, h * w).transpose(1, 2).double()  # (N, hw, C)
        x = x - x.mean(1, keepdim=True)
        _, _, vh = torch.linalg.svd(x, full_matrices=False)
        proj = x @ vh[:, 0, :, None]  # (N, hw, 1)
        total = acts.reshape(n, c, h * w).sum(1).double()
        sign = torch.sign((proj[..., 0] * (total - total.mean(1, keepdim=True))).sum(1))
        sign = torch.where(sign == 0, torch.ones_like(sign), sign)
        out: Tensor = (proj[..., 0] * sign[:, None]).reshape(n, h, w).to(acts.dtype)
        return out


register(
    MethodInfo(
        "eigencam",
        EigenCAM,
        "layer",
        gradients=False,
        perturbation=False,
        requires=(),
        reference="Muhammad & Yeasin, Eigen-CAM, IJCNN 2020",
    )
)
