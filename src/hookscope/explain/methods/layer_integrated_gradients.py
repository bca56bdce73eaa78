"""Layer integrated gradients: integrated gradients in the space of a layer's output, along the
straight path from the layer's output at the baseline to its output at the input, as
Captum's ``LayerIntegratedGradients`` computes it (the model runs on the input while the
layer's output is replaced by each point of the path)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...core import LayerSelector, call_model
from ...errors import UsageError
from .._layerpath import LayerPath, Scored
from .._path import delta_of, fixed, for_steps, repeated, rule, steps_of
from .._registry import MethodInfo, register
from .._session import Ablate
from .._targets import Resolved


class LayerIntegratedGradients(LayerPath):
    """``(A - A') * sum_i w_i dS/dA(A' + a_i (A - A'))`` for the layer's output ``A`` at the
    input and ``A'`` at the baseline; ``raw`` sums it over channels.

    From Sundararajan et al., *Axiomatic Attribution for Deep Networks*, ICML 2017, at a layer
    (Captum's ``LayerIntegratedGradients``). The layer's output needs no gradient path from
    the input: a text model's token ids are explained through its embeddings layer.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> exp = hs.LayerIntegratedGradients(net, "0", n_steps=8)(torch.randn(2, 3, 6, 6), 1)
        >>> exp.attributions.shape, exp.raw.shape, exp.maps.shape
        (torch.Size([2, 4, 4, 4]), torch.Size([2, 4, 4]), torch.Size([2, 6, 6]))
    """

    name = "layer_integrated_gradients"

    def __init__(self, model: nn.Module, layers: LayerSelector, **kwargs: Any) -> None:
        super().__init__(model, layers, **kwargs)
        self._swap = Ablate(model, self.layer, type(self).__name__)

    def _attribute(self, x: Any, image: Tensor, base: Tensor, target: Resolved) -> Scored:
        """The layer's output at the input and at the baseline, then the path between them."""
        acts, s, index = self._no_grad_at(x, target)
        chosen = fixed(target, index)
        start, s_base, _ = self._no_grad_at(repeated(x, image, 1, base), chosen)
        attr = self._integral(x, image, acts, start, chosen) * (acts - start)
        delta = delta_of(attr, s, s_base) if self.path.return_convergence_delta else None
        return attr, s, index, delta

    def _integral(
        self, x: Any, image: Tensor, acts: Tensor, start: Tensor, target: Resolved
    ) -> Tensor:
        sizes, alphas = rule(self.path.method, self.path.n_steps)
        total, diff = torch.zeros_like(acts), acts - start
        n, ones = acts.shape[0], [1] * acts.dim()
        for part in steps_of(self.path.n_steps, n, self.path.internal_batch_size):
            a = alphas[part].to(acts.device, acts.dtype, non_blocking=True)
            k = len(a)
            scaled = (start + a.view(k, *ones) * diff).flatten(0, 1).requires_grad_(True)
            grad = self._through(repeated(x, image, k, _rows(image, k)), scaled, target, k)
            w = sizes[part].to(grad.device, grad.dtype, non_blocking=True)
            total += (grad.reshape(k, -1) * w.view(k, 1)).reshape(k, *acts.shape).sum(0)
        return total

    def _through(self, inputs: Any, scaled: Tensor, target: Resolved, k: int) -> Tensor:
        """dS/d(layer output) with the output replaced by ``scaled`` (a copy of it: the
        model may change the output in place further on)."""
        swap = self._swap
        swap.state.change = lambda _: scaled.clone()
        try:
            with swap, torch.enable_grad():
                s, _ = for_steps(target, k).score(call_model(self.model, inputs))
        finally:
            swap.state.change = None
        grad = (
            torch.autograd.grad(s.sum(), scaled, allow_unused=True)[0] if s.requires_grad else None
        )
        if grad is None:
            raise UsageError(
                f"layer {self.layer!r} does not influence the target scores: its output never "
                "reaches them, so its gradient does not exist. Explain a layer on the path "
                "from the input to the output"
            )
        return grad


def _rows(image: Tensor, k: int) -> Tensor:
    """The input repeated for ``k`` steps (the model runs on the input itself)."""
    return image.repeat(k, *[1] * (image.dim() - 1))


register(
    MethodInfo(
        "layer_integrated_gradients",
        LayerIntegratedGradients,
        "layer",
        gradients=True,
        reference="Sundararajan et al., Axiomatic Attribution for Deep Networks, ICML 2017 "
        "(at a layer, as Captum's LayerIntegratedGradients)",
    )
)
