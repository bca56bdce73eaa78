"""Ablation-CAM (Desai & Ramaswamy, 2020): each channel weighted by the relative drop of the
score when that channel of the layer's output is set to zero.

The channel is zeroed in the layer's own output, whatever its structure (a tuple or dict is
rebuilt around the changed tensor) and layout (channels first or last; for token sequences
the channel is zeroed in every token, prefix tokens included, as pytorch-grad-cam's ViT
ablation does).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ...core import LayerSelector
from .._base import Context
from .._layout import Grid, positions
from .._perturb import Perturbation, pairs_of
from .._registry import MethodInfo, register
from .._session import Ablate


class AblationCAM(Perturbation):
    """``ReLU(sum_k (S - S_k) / S * A_k)`` with ``S_k`` the score with channel k zeroed.

    From Desai & Ramaswamy, *Ablation-CAM: Visual Explanations for Deep Convolutional Network
    via Gradient-free Localization*, WACV 2020.
    """

    name = "ablationcam"

    def __init__(self, model: nn.Module, layers: LayerSelector, **kwargs: Any) -> None:
        super().__init__(model, layers, **kwargs)
        self._ablate = Ablate(model, self.layer, type(self).__name__)

    def combine(self, ctx: Context) -> Tensor:
        """Each explored channel weighted by the relative drop of the score when it is zeroed
        (one extra forward per image and channel, batched), summed over channels."""
        chosen = self._chosen(ctx)
        session = self._ablate

        def run(chunk: Tensor) -> object:
            rows, channels = chunk[:, 0], chunk[:, 1]
            session.state.change = lambda t: zeroed(t, ctx.grid, channels)
            return self._run(ctx, rows, ctx.image[rows])

        try:
            with session:
                s = self._scores(ctx, pairs_of(chosen), run).view(chosen.shape)
        finally:
            session.state.change = None  # it holds this batch's context
        base = ctx.scores[:, None]
        drop = (base - s) / (base + 1e-7)
        weights = torch.zeros(ctx.acts.shape[:2], dtype=ctx.acts.dtype, device=ctx.acts.device)
        weights.scatter_(1, chosen, drop.to(ctx.acts.dtype))
        return (weights[:, :, None, None] * ctx.acts).sum(1)


def zeroed(t: Tensor, grid: Grid, channels: Tensor) -> Tensor:
    """A copy of the layer's tensor ``t`` (M samples) with channel ``channels[i]`` of sample
    ``i`` set to zero."""
    channels = channels.to(t.device)
    zero = torch.zeros((), dtype=t.dtype, device=t.device)
    if grid.channel_dim is not None:
        # a mask, not an indexed assignment: on CUDA index_put_ waited for the device
        moved = t.movedim(grid.channel_dim, 1)
        hit = channels[:, None] == torch.arange(moved.shape[1], device=t.device)  # (M, C)
        hit = hit.view(*hit.shape, *[1] * (moved.dim() - 2))
        return torch.where(hit, zero, moved).movedim(1, grid.channel_dim)
    # a reshape= given by the user: zero where it reads each channel from (flat offsets)
    where = positions(grid, tuple(t.shape)).to(t.device)
    out = t.clone(memory_format=torch.contiguous_format)
    flat = out.view(len(t), -1)
    flat.scatter_(1, where[channels], 0.0)
    return out


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
