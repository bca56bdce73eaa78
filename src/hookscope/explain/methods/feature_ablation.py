"""Feature ablation: each feature (a group of a feature mask, or each value) set to the
baseline in turn, as Captum's ``FeatureAblation`` computes it (``_ablation`` runs the
forwards)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import UsageError
from .._ablation import Ablation, on
from .._registry import MethodInfo, register


class FeatureAblation(Ablation):
    """Each value's attribution is ``S(x) - S(x with its feature set to the baseline)``.

    Args:
        model: the model (left as found).
        feature_mask: an integer tensor giving each value of a sample its feature (values
            with the same id are ablated together: superpixels, tokens, channels), shaped as
            the explained tensor or broadcastable to it, with a first dimension of 1 (shared)
            or N (one per sample); None makes every value its own feature. Its ids are read
            once per call (a mask on a GPU costs one synchronisation).
        baselines, batch_size, progress: see :class:`~hookscope.explain.Ablation`.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(48, 3))
        >>> halves = torch.zeros(1, 1, 4, 4, dtype=torch.long)
        >>> halves[..., 2:] = 1                    # two features: left and right half
        >>> hs.FeatureAblation(net, feature_mask=halves).cost(torch.randn(2, 3, 4, 4))
        {'forwards': 4, 'calls': 1}
    """

    name = "feature_ablation"

    def __init__(
        self, model: nn.Module, *, feature_mask: Tensor | None = None, **kwargs: Any
    ) -> None:
        super().__init__(model, **kwargs)
        if feature_mask is not None and (
            not isinstance(feature_mask, Tensor)
            or feature_mask.dtype.is_floating_point
            or feature_mask.dtype == torch.bool
        ):
            raise UsageError(
                f"feature_mask must be an integer tensor of feature ids, got {feature_mask!r}"
            )
        self.feature_mask = feature_mask

    def _features(self, t: Tensor) -> _Each | _Groups:
        if self.feature_mask is None:
            return _Each(tuple(t.shape[1:]), t.device)
        mask = self.feature_mask.to(t.device)
        shape = tuple(t.shape)
        fits = mask.dim() == t.dim() and mask.shape[0] in (1, shape[0])
        if not fits or any(m not in (1, d) for m, d in zip(mask.shape[1:], shape[1:], strict=True)):
            raise UsageError(
                f"feature_mask has shape {tuple(mask.shape)}; the explained tensor has shape "
                f"{shape}: give one of that shape, or broadcastable to it with a first "
                "dimension of 1 (one mask for every sample)"
            )
        return _Groups(mask, shape)


class _Each:
    """Every value of a sample its own feature."""

    def __init__(self, shape: tuple[int, ...], device: torch.device) -> None:
        self.shape, self.device, self.count = shape, device, math.prod(shape)

    def masks(self, features: list[int], rows: Tensor) -> Tensor:
        hot = torch.zeros((len(features), self.count), dtype=torch.bool, device=self.device)
        index = on(torch.tensor(features), self.device)[:, None]
        return hot.scatter_(1, index, True).view(len(features), *self.shape)


class _Groups:
    """The groups of a feature mask: its ids, read once."""

    def __init__(self, mask: Tensor, shape: tuple[int, ...]) -> None:
        self.mask, self.shape = mask, shape
        self.ids: list[int] = torch.unique(mask).tolist()  # the one read of the mask
        self.count = len(self.ids)

    def masks(self, features: list[int], rows: Tensor) -> Tensor:
        mask = self.mask[rows] if self.mask.shape[0] > 1 else self.mask
        ids = on(torch.tensor([self.ids[f] for f in features]), mask.device)
        hit = mask == ids.view(-1, *[1] * (mask.dim() - 1))
        return hit.expand(len(features), *self.shape[1:])


register(
    MethodInfo(
        "feature_ablation",
        FeatureAblation,
        "input",
        gradients=False,
        perturbation=True,
        reference="Captum's FeatureAblation (ablation of groups of input features)",
        per_channel=True,
    )
)
