"""Score-CAM (Wang et al., 2020): each channel weighted by the score of the input masked with
that channel's upsampled, min-max scaled activation (softmax over the channels explored)."""

from __future__ import annotations

import torch
from torch import Tensor

from .._base import Context
from .._perturb import Perturbation, pairs_of, upsampled_masks
from .._registry import MethodInfo, register


class ScoreCAM(Perturbation):
    """``ReLU(sum_k softmax_k(S(x * M_k)) * A_k)``; ``cost(x)`` tells the extra forwards.

    From Wang et al., *Score-CAM: Score-Weighted Visual Explanations for Convolutional Neural
    Networks*, CVPR Workshops 2020.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> hs.ScoreCAM(net, "1", batch_size=4).cost(torch.randn(2, 3, 8, 8))
        {'forwards': 8, 'calls': 2}
    """

    name = "scorecam"

    def combine(self, ctx: Context) -> Tensor:
        """Each explored channel weighted by the softmax, over channels, of the score of the
        input masked with that channel's upsampled activation (extra forwards, batched)."""
        chosen = self._chosen(ctx)

        def run(chunk: Tensor) -> object:
            rows, channels = chunk[:, 0], chunk[:, 1]
            masks = upsampled_masks(ctx.acts[rows, channels], ctx.image)
            return self._run(ctx, rows, ctx.image[rows] * masks[:, None])

        s = self._scores(ctx, pairs_of(chosen), run).view(chosen.shape)
        weights = torch.zeros(ctx.acts.shape[:2], dtype=ctx.acts.dtype, device=ctx.acts.device)
        weights.scatter_(1, chosen, s.softmax(1).to(ctx.acts.dtype))
        return (weights[:, :, None, None] * ctx.acts).sum(1)


register(
    MethodInfo(
        "scorecam",
        ScoreCAM,
        "layer",
        gradients=False,
        perturbation=True,
        requires=(),
        reference="Wang et al., Score-CAM, CVPR Workshops 2020",
    )
)
