"""CAM (Zhou et al., 2016): channels weighted by the classifier's weights for the class.

For networks whose head is global pooling then one linear layer: pass that layer as ``fc=``.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

from ...core import LayerSelector
from ...errors import UsageError
from .._base import Context, LayerMethod
from .._registry import MethodInfo, register


class CAM(LayerMethod):
    """``ReLU(sum_c W[class, c] * A_c)`` with ``W`` the weight of the linear layer ``fc``.

    From Zhou et al., *Learning Deep Features for Discriminative Localization*, CVPR 2016.
    """

    name = "cam"
    needs_grad = False
    class_targets = True

    def __init__(
        self, model: nn.Module, layers: LayerSelector, *, fc: LayerSelector, **kwargs: Any
    ) -> None:
        super().__init__(model, layers, **kwargs)
        found = self._tap.layers.select(fc)
        if len(found) != 1:
            raise UsageError(f"fc={fc!r} matches {len(found)} layers; CAM needs the one head")
        ((self.fc_name, fc_module),) = found.items()
        if not isinstance(fc_module, nn.Linear):
            raise UsageError(
                f"fc={fc!r} is a {type(fc_module).__name__}; CAM needs the nn.Linear head"
            )
        self.fc = fc_module

    def combine(self, ctx: Context) -> Tensor:
        """The classifier's weights for each image's class times the activations, summed over
        channels."""
        acts, targets = ctx.acts, ctx.classes
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
