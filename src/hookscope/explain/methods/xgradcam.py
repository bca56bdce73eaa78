"""XGrad-CAM (Fu et al., 2020): gradients weighted by the normalised activation."""

from __future__ import annotations

from torch import Tensor

from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class XGradCAM(LayerMethod):
    """``w_c = sum_hw (A_c,hw / sum_hw A_c) * g_c,hw``."""

    name = "xgradcam"

    def combine(self, ctx: Context) -> Tensor:
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
