"""Occlusion (Zeiler & Fergus, 2014): a window slid over the input, set to the baseline at
each position, as Captum's ``Occlusion`` computes it (``_ablation`` runs the forwards)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from ...errors import UsageError
from .._ablation import Ablation, on
from .._registry import MethodInfo, register


class Occlusion(Ablation):
    """Each value's attribution is the mean, over the window positions that cover it, of
    ``S(x) - S(x with the window set to the baseline)``.

    From Zeiler & Fergus, *Visualizing and Understanding Convolutional Networks*, ECCV 2014.

    Args:
        model: the model (left as found).
        sliding_window_shapes: the window over one sample, every dimension but the batch's:
            ``(C, h, w)`` for images ``(N, C, H, W)``, ``(1,)`` or ``(k,)`` for token ids
            ``(N, T)``.
        strides: the step between window positions: an int for every dimension or one per
            dimension; None is 1. The last position of each dimension is clipped at the end
            (``ceil((D - w) / s) + 1`` positions), as Captum places them.
        baselines, batch_size, progress: see :class:`~hookscope.explain.Ablation`.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(48, 3))
        >>> occ = hs.Occlusion(net, (3, 2, 2), strides=2, batch_size=8)
        >>> occ.cost(torch.randn(2, 3, 4, 4))
        {'forwards': 8, 'calls': 1}
        >>> occ(torch.randn(2, 3, 4, 4), targets=1).raw.shape
        torch.Size([2, 3, 4, 4])
    """

    name = "occlusion"
    weighted = True

    def __init__(
        self,
        model: nn.Module,
        sliding_window_shapes: tuple[int, ...],
        *,
        strides: int | tuple[int, ...] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, **kwargs)
        if not _ints(sliding_window_shapes):
            raise UsageError(
                "sliding_window_shapes must be a tuple of ints >= 1, one per dimension of a "
                f"sample (e.g. (3, 8, 8) for images), got {sliding_window_shapes!r}"
            )
        if not (strides is None or _ints((strides,)) or _ints(strides)):
            raise UsageError(f"strides must be an int >= 1 or a tuple of them, got {strides!r}")
        self.sliding_window_shapes, self.strides = tuple(sliding_window_shapes), strides

    def _features(self, t: Tensor) -> _Windows:
        shape, window = tuple(t.shape[1:]), self.sliding_window_shapes
        strides = self.strides or 1
        steps = (strides,) * len(shape) if isinstance(strides, int) else tuple(strides)
        if len(window) != len(shape) or len(steps) != len(shape):
            raise UsageError(
                f"sliding_window_shapes {window} and strides {self.strides!r} need one value per "
                f"dimension of a sample, {shape}"
            )
        for d, w, s in zip(shape, window, steps, strict=True):
            if w > d or (s > w and d > w):
                raise UsageError(
                    f"window {window} with strides {steps} does not fit a sample of shape "
                    f"{shape}: each window side must be <= the sample's and each stride <= its "
                    "window side"
                )
        return _Windows(shape, window, steps, t.device)


def _ints(values: Any) -> bool:
    return isinstance(values, tuple) and all(
        isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values
    )


class _Windows:
    """Window positions, the first dimension's changing fastest (Captum's order)."""

    def __init__(
        self,
        shape: tuple[int, ...],
        window: tuple[int, ...],
        strides: tuple[int, ...],
        device: torch.device,
    ) -> None:
        self.shape, self.window, self.strides, self.device = shape, window, strides, device
        self.counts = [
            math.ceil((d - w) / s) + 1 for d, w, s in zip(shape, window, strides, strict=True)
        ]
        self.count = math.prod(self.counts)

    def masks(self, features: list[int], rows: Tensor) -> Tensor:
        distinct = {f: i for i, f in enumerate(dict.fromkeys(features))}  # a window per feature
        out = torch.zeros((len(distinct), *self.shape), dtype=torch.bool, device=self.device)
        for f, i in distinct.items():
            out[i][self._window(f)] = True
        if len(distinct) == len(features):
            return out
        return out[on(torch.tensor([distinct[f] for f in features]), self.device)]

    def _window(self, feature: int) -> tuple[slice, ...]:
        where = []
        for count, w, s in zip(self.counts, self.window, self.strides, strict=True):
            feature, k = divmod(feature, count)
            where.append(slice(k * s, k * s + w))
        return tuple(where)


register(
    MethodInfo(
        "occlusion",
        Occlusion,
        "input",
        gradients=False,
        perturbation=True,
        requires=("sliding_window_shapes",),
        reference="Zeiler & Fergus, Visualizing and Understanding Convolutional Networks, "
        "ECCV 2014",
        per_channel=True,
    )
)
