"""Layer-CAM (Jiang et al., 2021): each position weighted by its own positive gradient."""

from __future__ import annotations

from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class LayerCAM(LayerMethod):
    """``ReLU(sum_c ReLU(g_c) * A_c)``.

    From Jiang et al., *LayerCAM: Exploring Hierarchical Class Activation Maps for
    Localization*, IEEE Transactions on Image Processing, 2021.
    """

    name = "layercam"

    def combine(self, ctx: Context) -> Tensor:
        """The positive part of the gradient times the activation, position by position, summed
        over channels."""
        return (ctx.gradient.clamp_min(0) * ctx.acts).sum(1)


register(
    MethodInfo(
        "layercam",
        LayerCAM,
        "layer",
        gradients=True,
        perturbation=False,
        requires=(),
        reference="Jiang et al., LayerCAM, IEEE TIP 2021",
    )
)
