"""Integrated gradients (Sundararajan et al., 2017): the gradient averaged along the straight
path from a baseline to the input, times ``input - baseline``. The path, its rules and the
memory bound are ``_path``'s."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...core import call_model, run_eagerly
from .._base import Explanation, evaluating
from .._input import InputMethod
from .._path import (
    Path,
    delta_of,
    fixed,
    for_steps,
    need_grad,
    repeated,
    rule,
    scalable,
    scores_at,
    steps_of,
)
from .._registry import MethodInfo, register
from .._targets import Resolved, Target, resolve


class IntegratedGradients(InputMethod):
    """``(x - x') * sum_i w_i dS/dx(x' + a_i (x - x'))``, Captum's ``IntegratedGradients``.

    From Sundararajan, Taly & Yan, *Axiomatic Attribution for Deep Networks*, ICML 2017.

    Args:
        model: the model (left as found).
        baselines: ``x'``: a number, or a tensor of the input's shape or ``(1, C, H, W)``;
            None is zeros.
        n_steps: points of the integral.
        method: the rule giving the points ``a_i`` and weights ``w_i``: ``"gausslegendre"``,
            ``"riemann_left"``, ``"riemann_right"``, ``"riemann_middle"`` or
            ``"riemann_trapezoid"``, as Captum names them.
        internal_batch_size: images per forward-backward, rounded down to whole steps of the
            batch; None (default) runs one step (the batch) at a time, so memory is one
            forward-backward's whatever ``n_steps`` is.
        return_convergence_delta: also fill ``Explanation.delta`` (one more forward, at the
            baseline).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
        >>> ig = hs.IntegratedGradients(net, n_steps=20, return_convergence_delta=True)
        >>> exp = ig(torch.randn(2, 3, 2, 2), targets=[0, 2])
        >>> exp.raw.shape, bool(exp.delta.abs().max() < 1e-4)  # a linear model: exact
        (torch.Size([2, 3, 2, 2]), True)
    """

    name = "integrated_gradients"

    def __init__(
        self,
        model: nn.Module,
        *,
        baselines: float | Tensor | None = None,
        n_steps: int = 50,
        method: str = "gausslegendre",
        internal_batch_size: int | None = None,
        return_convergence_delta: bool = False,
    ) -> None:
        super().__init__(model)
        self.path = Path(baselines, n_steps, method, internal_batch_size, return_convergence_delta)

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs; the
        first floating-point tensor is explained) for ``targets`` (see ``_targets``)."""
        image = scalable(x, type(self).__name__)
        target = resolve(targets, image.shape[0]).to(image.device)
        need_grad(type(self).__name__)
        base = self.path.baseline(image)
        with run_eagerly(self.model), evaluating(self._session), self._session:
            s, index = scores_at(self.model, x, target)
            chosen = fixed(target, index)
            attr = self._integral(x, image, base, chosen) * (image - base)
            delta = None
            if self.path.return_convergence_delta:
                start, _ = scores_at(self.model, repeated(x, image, 1, base), chosen)
                delta = delta_of(attr, s, start)
        return Explanation(attr, attr, index, s, self.name, "<input>", attr, delta)

    def _integral(self, x: Any, image: Tensor, base: Tensor, target: Resolved) -> Tensor:
        """``sum_i w_i dS/dx`` at the path's points, a few steps per forward."""
        sizes, alphas = rule(self.path.method, self.path.n_steps)
        total = torch.zeros_like(image)
        diff = image - base
        n, ones = image.shape[0], [1] * image.dim()
        for part in steps_of(self.path.n_steps, n, self.path.internal_batch_size):
            a = alphas[part].to(image.device, image.dtype, non_blocking=True)
            k = len(a)
            scaled = (base + a.view(k, *ones) * diff).flatten(0, 1).requires_grad_(True)
            with torch.enable_grad():
                out = call_model(self.model, repeated(x, image, k, scaled))
                s, _ = for_steps(target, k).score(out)
                (grad,) = torch.autograd.grad(s.sum(), scaled)
            w = sizes[part].to(grad.device, grad.dtype, non_blocking=True)
            total += (grad.reshape(k, -1) * w.view(k, 1)).reshape(k, *image.shape).sum(0)
        return total


register(
    MethodInfo(
        "integrated_gradients",
        IntegratedGradients,
        "input",
        gradients=True,
        reference="Sundararajan et al., Axiomatic Attribution for Deep Networks, ICML 2017",
        per_channel=True,
    )
)
