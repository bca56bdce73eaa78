"""HiResCAM (Draelos & Carin, 2020): gradient times activation, element-wise, no averaging."""

from __future__ import annotations

from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class HiResCAM(LayerMethod):
    """``ReLU(sum_c g_c * A_c)``.

    From Draelos & Carin, *Use HiResCAM instead of Grad-CAM for faithful explanations of
    convolutional neural networks*, arXiv:2011.08891, 2020.
    """

    name = "hirescam"

    def combine(self, ctx: Context) -> Tensor:
        """The gradient times the activation, position by position, summed over channels."""
        return (ctx.gradient * ctx.acts).sum(1)


register(
    MethodInfo(
        "hirescam",
        HiResCAM,
        "layer",
        gradients=True,
        perturbation=False,
        requires=(),
        reference="Draelos & Carin, HiResCAM, 2020",
    )
)
