"""CAM (Zhou et al., 2016): channels weighted by the classifier's weights for the class.

For networks whose head is global pooling then one linear layer: pass that layer as ``fc=``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...core import Layers
from ...errors import UsageError
from .._base import LayerMethod
from .._registry import MethodInfo, register


class CAM(LayerMethod):
    """``ReLU(sum_c W[class, c] * A_c)`` with ``W`` the weight of the linear layer ``fc``."""

    name = "cam"
    needs_grad = False

    def __init__(self, model: nn.Module, layer: Any, *, fc: Any, **kwargs: Any) -> None:
        super().__init__(model, layer, **kwargs)
        ((self.fc_name, fc_module),) = Layers(model).select(fc).items()
        if not isinstance(fc_module, nn.Linear):
            raise UsageError(
                f"fc={fc!r} is a {type(fc_module).__name__}; CAM needs the nn.Linear head"
            )
        self.fc = fc_module

    def combine(self, acts: Tensor, grads: Tensor | None, targets: Tensor | None) -> Tensor:
        if targets is None:
            raise UsageError("CAM weights come from a class's row of fc: give class targets")
        weight = self.fc.weight.detach()
        if weight.shape[1] != acts.shape[1]:
            raise UsageError(
                f"fc has {weight.shape[1]} inputs but the layer has {acts.shape[1]} channels"
            )
        return (weight[targets][:, :, None, None] * acts).sum(1)


register(
    MethodInfo(
        "cam",
        CAM,
        "layer",
        gradients=False,
        perturbation=False,
        requires=("fc",),
        reference="Zhou et al., Learning Deep Features for Discriminative Localization, CVPR 2016",
    )
)
