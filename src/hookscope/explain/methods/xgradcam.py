"""XGrad-CAM (Fu et al., 2020): gradients weighted by the normalised activation."""

from __future__ import annotations

from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class XGradCAM(LayerMethod):
    """``ReLU(sum_c w_c * A_c)`` with ``w_c = sum_hw (A_c,hw / sum_hw A_c) * g_c,hw``.

    From Fu et al., *Axiom-based Grad-CAM: Towards Accurate Visualization and Explanation of
    CNNs*, BMVC 2020.
    """

    name = "xgradcam"

    def combine(self, ctx: Context) -> Tensor:
        """The gradient averaged with the activation's normalised weights, per channel, times
        the activations, summed over channels."""
        acts = ctx.acts
        share = acts / (acts.sum((2, 3), keepdim=True) + 1e-7)
        return ((share * ctx.gradient).sum((2, 3), keepdim=True) * acts).sum(1)


register(
    MethodInfo(
        "xgradcam",
        XGradCAM,
        "layer",
        gradients=True,
        perturbation=False,
        requires=(),
        reference="Fu et al., Axiom-based Grad-CAM, BMVC 2020",
    )
)
