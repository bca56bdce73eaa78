"""Faithfulness of attribution maps: deletion / insertion curves and their AUC, average drop
and increase in confidence, and the pointing game.

Scores are the target's softmax probability for class targets (``prob=False`` for raw logits),
or what a target callable returns. Every function states the forwards it runs: deletion and
insertion ``N * (steps + 1)`` images, batched by ``batch_size``; average drop 2 N.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import call_model, training_mode
from ..errors import UsageError
from ._base import Explanation, normalize
from ._targets import Target, logits_of, resolve

__all__ = ["Curve", "average_drop", "deletion", "insertion", "plane", "pointing_game"]


@dataclass(frozen=True)
class Curve:
    """Scores as pixels are deleted (or inserted) most-important first: ``curve (N, steps+1)``
    at fractions ``fractions (steps+1,)``, ``auc (N,)`` by the trapezoid rule, and the number
    of image ``forwards`` it took."""

    auc: Tensor
    curve: Tensor
    fractions: Tensor
    forwards: int


def _score(
    model: nn.Module, images: Tensor, targets: Target, rows: Tensor, n: int, prob: bool
) -> Tensor:
    """Target scores of ``images``, which stand for images ``rows`` of a batch of ``n``."""
    if targets is None:
        raise UsageError("metrics need the classes the maps explain: pass targets=")
    with torch.no_grad(), training_mode(model, False):
        out = call_model(model, images)
    if callable(targets) and not isinstance(targets, Tensor):
        return targets(out).detach().float()
    logits = logits_of(out)
    values = logits.softmax(1) if prob else logits
    index = resolve(targets, n).indices(logits.shape[1], logits.device)[rows.to(logits.device)]
    return values.gather(1, index[:, None])[:, 0].float()


def plane(maps: Tensor | Explanation) -> Tensor:
    """The maps to rank positions by: an :class:`~hookscope.Explanation`'s ``maps``; a map per
    input channel ``(N, C, H, W)`` (saliency, integrated gradients, occlusion) summed over the
    channels, a pixel's attribution being the sum of its channels'; others as given."""
    if isinstance(maps, Explanation):
        maps = maps.maps
    if not isinstance(maps, Tensor):
        raise UsageError(f"maps must be a tensor or an Explanation, got {type(maps).__name__}")
    return maps.sum(1) if maps.dim() == 4 else maps


def _check(x: Tensor, maps: Tensor) -> None:
    tokens = x.dim() == 2 and not x.is_floating_point()
    if tokens and maps.shape != x.shape:
        raise UsageError(
            f"maps must be (N, T) for token ids (N, T): got maps {tuple(maps.shape)} for ids "
            f"{tuple(x.shape)} (use an Explanation's .maps)"
        )
    if not tokens and (x.dim() != 4 or maps.shape != (x.shape[0], *x.shape[-2:])):
        raise UsageError(
            f"maps must be (N, H, W) or (N, C, H, W) for images (N, C, H, W), (N, T) for token "
            f"ids (N, T): got maps {tuple(maps.shape)} for inputs {tuple(x.shape)} (use an "
            "Explanation's .maps)"
        )
    _finite(maps)


def _finite(maps: Tensor) -> None:
    """NaN or Inf in a map gives no order of importance (sorting NaN puts it first or last
    silently), so a number computed from it would mean nothing: refused, naming the images."""
    bad = (~torch.isfinite(maps.detach())).flatten(1).any(1)
    if bad.any():  # one read of the maps: the metrics read their scores back anyway
        images = bad.nonzero()[:, 0].tolist()
        raise UsageError(
            f"maps hold NaN or Inf (images {images}): they give no order of importance. "
            "Check the method that made them (e.g. a NaN in the model's gradients), or replace "
            "the values first (torch.nan_to_num)"
        )


def _curve(
    model: nn.Module,
    x: Tensor,
    maps: Tensor | Explanation,
    targets: Target,
    *,
    insert: bool,
    baseline: float | Tensor,
    steps: int,
    batch_size: int,
    prob: bool,
) -> Curve:
    """Pixels (or tokens) switched from ``x`` to ``baseline`` (deletion) or back
    (insertion), most important first, in ``steps`` equal parts."""
    maps = plane(maps)
    _check(x, maps)
    base = torch.as_tensor(baseline, dtype=x.dtype, device=x.device).expand_as(x)
    start, end = (base, x) if insert else (x, base)
    if not isinstance(steps, int) or steps < 1:
        raise UsageError(f"steps must be an int >= 1, got {steps!r}")
    n, where = x.shape[0], maps.shape[1:]
    size = math.prod(where)
    order = maps.detach().reshape(n, -1).argsort(1, descending=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(size).expand(n, -1))
    fractions = torch.linspace(0, 1, steps + 1)
    images, rows = [], []
    for f in fractions:
        channels = [1] * (x.dim() - 1 - len(where))  # images: one switch for every channel
        switched = (rank < round(float(f) * size)).reshape(n, *channels, *where)
        images.append(torch.where(switched, end, start))
        rows.append(torch.arange(n))
    batch, index = torch.cat(images), torch.cat(rows)
    scores = torch.cat(
        [
            _score(model, batch[i : i + batch_size], targets, index[i : i + batch_size], n, prob)
            for i in range(0, len(batch), batch_size)
        ]
    )
    curve = scores.reshape(steps + 1, n).T
    auc = torch.trapezoid(curve, fractions.to(curve), dim=1)
    return Curve(auc, curve, fractions, len(batch))


def deletion(
    model: nn.Module,
    x: Tensor,
    maps: Tensor | Explanation,
    targets: Target,
    *,
    steps: int = 20,
    baseline: float | Tensor = 0.0,
    batch_size: int = 32,
    prob: bool = True,
) -> Curve:
    """Delete pixels (set them to ``baseline``) in order of importance; a faithful map makes
    the score fall fast (low AUC).

    ``x`` is images ``(N, C, H, W)`` with maps ``(N, H, W)`` or ``(N, C, H, W)`` (summed over
    the channels), or token ids ``(N, T)`` with token maps ``(N, T)`` (deleted tokens become
    the id ``baseline``); ``maps`` may be an :class:`~hookscope.Explanation`."""
    return _curve(
        model,
        x,
        maps,
        targets,
        insert=False,
        baseline=baseline,
        steps=steps,
        batch_size=batch_size,
        prob=prob,
    )


def insertion(
    model: nn.Module,
    x: Tensor,
    maps: Tensor | Explanation,
    targets: Target,
    *,
    steps: int = 20,
    baseline: float | Tensor = 0.0,
    batch_size: int = 32,
    prob: bool = True,
) -> Curve:
    """Insert pixels into ``baseline`` in order of importance; a faithful map makes the score
    rise fast (high AUC). Inputs and maps as for :func:`deletion`."""
    return _curve(
        model,
        x,
        maps,
        targets,
        insert=True,
        baseline=baseline,
        steps=steps,
        batch_size=batch_size,
        prob=prob,
    )


def average_drop(
    model: nn.Module, x: Tensor, maps: Tensor | Explanation, targets: Target, *, prob: bool = True
) -> dict[str, Any]:
    """Chattopadhyay et al. (2018): keep only what the map highlights (``x * map`` with the map
    scaled to 0..1 per image). ``average_drop`` = mean of ``max(0, y - o) / y`` in percent,
    ``increase`` = percentage of images whose score rose. 2 N forwards."""
    maps = plane(maps)
    _check(x, maps)
    if x.dim() != 4:
        raise UsageError("average_drop multiplies images (N, C, H, W) by their maps: not tokens")
    n = x.shape[0]
    rows = torch.arange(n)
    y = _score(model, x, targets, rows, n, prob)
    o = _score(model, x * normalize(maps.detach())[:, None].to(x), targets, rows, n, prob)
    drop = (y - o).clamp_min(0) / y.abs().clamp_min(1e-12)
    return {
        "average_drop": float(drop.mean() * 100),
        "increase": float((o > y).float().mean() * 100),
        "forwards": 2 * x.shape[0],
    }


def pointing_game(maps: Tensor | Explanation, masks: Tensor, *, tolerance: float = 0.0) -> Tensor:
    """Zhang et al. (2016): whether each map's maximum falls on its object: inside its
    ``mask`` (``(N, H, W)`` bool) or, with ``tolerance`` > 0, closer than ``tolerance`` pixels to
    it (TorchRay's rule, 15 px at 224 px; scale it with the image). Ties count as hits if any
    maximum is on the object. ``.float().mean()`` is the accuracy; compare it with a center or
    random point's, which a large object or tolerance makes high.
    """
    maps = plane(maps)
    if maps.shape != masks.shape or maps.dim() != 3:
        raise UsageError(
            f"maps and masks must both be (N, H, W): got {tuple(maps.shape)} and "
            f"{tuple(masks.shape)}"
        )
    if tolerance < 0:
        raise UsageError(f"tolerance must be >= 0 pixels, got {tolerance!r}")
    _finite(maps)
    target = masks.bool()
    if tolerance > 0:  # grow the mask by a disk of radius < tolerance
        r = math.ceil(tolerance) - 1
        offsets = torch.arange(-r, r + 1, dtype=torch.float32, device=masks.device)
        disk = (offsets[:, None] ** 2 + offsets[None, :] ** 2 < tolerance**2).float()
        grown = nn.functional.conv2d(target[:, None].float(), disk[None, None], padding=r)
        target = grown[:, 0] > 0
    flat = maps.detach().reshape(maps.shape[0], -1)
    top = flat == flat.amax(1, keepdim=True)
    return (top & target.reshape(target.shape[0], -1).to(top.device)).any(1)
