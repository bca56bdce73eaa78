"""Ablation-CAM (Desai & Ramaswamy, 2020): each channel weighted by the relative drop of the
score when that channel of the layer's output is set to zero."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...core import HookSet
from .._perturb import Perturbation, _first, _pairs
from .._registry import MethodInfo, register


class AblationCAM(Perturbation):
    """``ReLU(sum_k (S - S_k) / S * A_k)`` with ``S_k`` the score with channel k zeroed."""

    name = "ablationcam"

    def combine(self, acts: Tensor, grads: Tensor | None, targets: Tensor | None) -> Tensor:
        x, image, spec, base = self.call
        chosen = self._chosen(acts, grads)
        pairs = _pairs(chosen)

        def run(chunk: Tensor) -> object:
            rows, channels = chunk[:, 0], chunk[:, 1]

            def ablate(module: nn.Module, args: Any, out: Any) -> Any:
                t = _first(out).clone()
                dim = 1 if t.dim() == 4 and t.shape[1] == acts.shape[1] else t.dim() - 1
                index = torch.arange(len(t), device=t.device)
                t.movedim(dim, 1)[index, channels.to(t.device)] = 0
                return t if isinstance(out, Tensor) else out

            hooks = HookSet()
            try:
                hooks.forward(self.module, ablate)
                return self._run(x, image, rows, image[rows])
            finally:
                hooks.close()

        s = self._scores(spec, targets, run, pairs).view(chosen.shape)
        drop = (base[:, None] - s) / (base[:, None] + 1e-7)
        weights = torch.zeros(acts.shape[:2], dtype=acts.dtype, device=acts.device)
        weights.scatter_(1, chosen, drop.to(acts.dtype))
        return (weights[:, :, None, None] * acts).sum(1)


register(
    MethodInfo(
        "ablationcam",
        AblationCAM,
        "layer",
        gradients=False,
        perturbation=True,
        requires=(),
        reference="Desai & Ramaswamy, Ablation-CAM, WACV 2020",
    )
)
