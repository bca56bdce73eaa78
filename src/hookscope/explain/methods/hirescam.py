"""HiResCAM (Draelos & Carin, 2020): gradient times activation, element-wise, no averaging."""

from __future__ import annotations

from torch import Tensor

from .._base import LayerMethod
from .._registry import MethodInfo, register


class HiResCAM(LayerMethod):
    """``ReLU(sum_c g_c * A_c)``."""

    name = "hirescam"

    def combine(self, acts: Tensor, grads: Tensor | None, targets: Tensor | None) -> Tensor:
        assert grads is not None
        return (grads * acts).sum(1)


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
