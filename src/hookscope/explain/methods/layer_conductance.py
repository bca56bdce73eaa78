"""Layer conductance (Dhamdhere et al., 2018): the flow of integrated gradients through each
value of a layer's output, as Captum's ``LayerConductance`` computes it."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .._layerpath import LayerPath, Scored
from .._path import delta_of, fixed, for_steps, repeated, rule, scalable, scores_at, steps_of
from .._registry import MethodInfo, register
from .._targets import Resolved


class LayerConductance(LayerPath):
    """``sum_i dS/dA(x_i) * (A(x_{i+1}) - A(x_i))`` over the ``n_steps + 1`` points ``x_i`` of
    the rule between the baseline and the input; ``raw`` sums it over channels.

    From Dhamdhere, Sundararajan & Yan, *How Important Is a Neuron?*, ICLR 2019
    (arXiv:1805.12233). As Captum, the points are the rule's ``n_steps + 1`` points (for
    ``"gausslegendre"`` they are not the path's ends) and the step weights are not used. The
    input must be a floating-point tensor (the path scales it).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> hs.LayerConductance(net, "0", n_steps=8)(torch.randn(2, 3, 6, 6), 0).raw.shape
        torch.Size([2, 4, 4])
    """

    name = "layer_conductance"

    def _attribute(self, x: Any, image: Tensor, base: Tensor, target: Resolved) -> Scored:
        """The layer's output and gradient at each point, in forwards of a few steps."""
        scalable(x, type(self).__name__)  # the path scales the input: not token ids
        s, index = scores_at(self.model, x, target)
        chosen = fixed(target, index)
        attr = self._flow(x, image, base, chosen)
        delta = None
        if self.path.return_convergence_delta:
            start, _ = scores_at(self.model, repeated(x, image, 1, base), chosen)
            delta = delta_of(attr, s, start)
        return attr, s, index, delta

    def _flow(self, x: Any, image: Tensor, base: Tensor, target: Resolved) -> Tensor:
        _, alphas = rule(self.path.method, self.path.n_steps + 1)
        n, ones, diff = image.shape[0], [1] * image.dim(), image - base
        total: Tensor | None = None
        last: tuple[Tensor, Tensor] | None = None  # output and gradient at the previous point
        for part in steps_of(self.path.n_steps + 1, n, self.path.internal_batch_size):
            a = alphas[part].to(image.device, image.dtype, non_blocking=True)
            k = len(a)
            scaled = (base + a.view(k, *ones) * diff).flatten(0, 1).requires_grad_(True)
            acts, grads = self._point(repeated(x, image, k, scaled), target, k)
            if last is not None:
                acts, grads = torch.cat([last[0][None], acts]), torch.cat([last[1][None], grads])
            flow = ((acts[1:] - acts[:-1]) * grads[:-1]).sum(0)
            total = flow if total is None else total + flow
            last = acts[-1], grads[-1]
        assert total is not None  # n_steps >= 1: at least two points
        return total

    def _point(self, inputs: Any, target: Resolved, k: int) -> tuple[Tensor, Tensor]:
        """The layer's output and its gradient at ``k`` points, ``(k, N, ...)`` each."""
        with torch.enable_grad():
            act, edge, s, _ = self._at(inputs, for_steps(target, k))
            grad = self._gradient(s, edge)
        return act.reshape(k, -1, *act.shape[1:]), grad.reshape(k, -1, *grad.shape[1:])


register(
    MethodInfo(
        "layer_conductance",
        LayerConductance,
        "layer",
        gradients=True,
        reference="Dhamdhere et al., How Important Is a Neuron?, ICLR 2019",
    )
)
