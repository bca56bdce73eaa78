"""``hs.overlay``: a map drawn over its image in RGB, with a matplotlib colormap."""

from __future__ import annotations

import os

import torch
from torch import Tensor

from .._extras import require
from .._png import save_png
from ..errors import UsageError
from ._base import normalize

__all__ = ["overlay"]


def _rgb(image: Tensor) -> Tensor:
    """``(3, H, W)`` / ``(H, W, 3)`` / ``(H, W)``, float in 0..1 or uint8 -> float ``(H, W, 3)``."""
    x = image.detach().cpu()
    if x.dim() == 2:
        x = x[..., None].expand(*x.shape, 3)
    elif x.dim() == 3 and x.shape[0] in (1, 3) and x.shape[-1] not in (1, 3):
        x = x.permute(1, 2, 0)
    if x.dim() != 3 or x.shape[-1] not in (1, 3):
        raise UsageError(
            f"image must be (3, H, W), (H, W, 3) or (H, W), got shape {tuple(image.shape)}"
        )
    x = x.expand(*x.shape[:2], 3)
    if x.dtype == torch.uint8:
        return x.double() / 255
    lo, hi = float(x.min()), float(x.max())
    if lo < 0 or hi > 1:  # e.g. a normalised tensor: show its range
        return normalize(x[None].double(), per="image")[0]
    return x.double()


def overlay(
    image: Tensor,
    heatmap: Tensor,
    *,
    cmap: str = "jet",
    alpha: float = 0.5,
    save: str | os.PathLike[str] | None = None,
) -> Tensor:
    """Blend a map (scaled to 0..1 on its own) in a colormap over an image.

    Args:
        image: ``(3, H, W)`` or ``(H, W, 3)`` (or grayscale ``(H, W)``), uint8 or float in
            0..1 (other float ranges are min-max scaled for display).
        heatmap: ``(H, W)`` map of the same size (an :class:`Explanation`'s ``maps[i]``).
        cmap: a matplotlib colormap name (the ``plots`` extra).
        alpha: weight of the colored map, 0..1.
        save: also write the result as PNG (the ``images`` extra).

    Returns:
        An RGB ``uint8`` tensor ``(H, W, 3)``.
    """
    if not 0 <= alpha <= 1:
        raise UsageError(f"alpha must be in 0..1, got {alpha!r}")
    rgb = _rgb(image)
    if heatmap.dim() != 2 or tuple(heatmap.shape) != tuple(rgb.shape[:2]):
        raise UsageError(
            f"heatmap must be (H, W) = {tuple(rgb.shape[:2])} like the image, got "
            f"{tuple(heatmap.shape)}"
        )
    colormaps = require("matplotlib", "plots", purpose="coloring maps").colormaps
    if cmap not in colormaps:
        raise UsageError(f"unknown matplotlib colormap {cmap!r}")
    scaled = normalize(heatmap.detach().cpu().double()[None])[0].numpy()
    colored = torch.from_numpy(colormaps[cmap](scaled)[..., :3]).double()
    out = ((1 - alpha) * rgb + alpha * colored).mul(255).round().clamp(0, 255).to(torch.uint8)
    if save is not None:
        save_png(out, save, purpose="saving overlays as PNG")
    return out
