"""``hs.overlay``: a map drawn over its image in RGB, with a matplotlib colormap.

It takes the image as users hold it: a PIL image (any mode), a NumPy array ``(H, W, C)`` or
``(H, W)`` (uint8, or float), a tensor ``(C, H, W)``, ``(H, W, C)`` or ``(H, W)``; and the map as
a tensor or NumPy array ``(h, w)`` (a leading or trailing axis of size 1 is allowed), resized
to the image's size when it has another (a map of the model's input drawn on the original
photo, or a layer's ``raw`` map), as the command line draws maps.
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from .._extras import require
from .._png import image_to_tensor, save_png
from ..errors import UsageError
from ._base import normalize

__all__ = ["overlay"]

_SHAPES = "(3, H, W), (H, W, 3) or (H, W) (RGBA and one-channel images too)"


def _tensor(value: Any, what: str) -> Tensor:
    """A tensor of ``value``: a tensor, a NumPy array (or anything with ``__array__``) or a
    PIL image (as float RGB ``(3, H, W)`` in 0..1)."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if hasattr(value, "getbands") and hasattr(value, "convert"):  # PIL, without importing it
        return image_to_tensor(value.convert("RGB"))
    if hasattr(value, "__array__"):
        import numpy as np  # present whenever a NumPy array is

        return torch.from_numpy(np.array(value, copy=True))
    raise UsageError(
        f"{what} must be a torch tensor, a NumPy array or a PIL image, got {type(value).__name__}"
    )


def _channels_last(x: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``(H, W, 3)`` from ``(H, W)``, ``(H, W, C)`` or ``(C, H, W)`` with C in 1, 3, 4."""
    if x.dim() == 2:
        x = x[..., None]
    elif x.dim() == 3 and x.shape[0] in (1, 3, 4) and x.shape[-1] not in (1, 3, 4):
        x = x.permute(1, 2, 0)
    if x.dim() != 3 or x.shape[-1] not in (1, 3, 4):
        raise UsageError(f"image must be {_SHAPES}, got shape {shape}")
    x = x[..., :3]  # RGBA: the alpha channel is not drawn
    return x.expand(*x.shape[:2], 3)


def _rgb(image: Any) -> Tensor:
    """The image as float ``(H, W, 3)`` in 0..1."""
    x = _tensor(image, "image")
    x = _channels_last(x, tuple(x.shape))
    if x.dtype == torch.uint8 or x.dtype == torch.bool:
        return x.double() / (255 if x.dtype == torch.uint8 else 1)
    integer = not x.dtype.is_floating_point
    x = x.double()
    lo, hi = float(x.min()), float(x.max())
    if integer and lo >= 0 and hi <= 255:  # an int array of 0..255 values
        return x / 255
    if lo < 0 or hi > 1:  # e.g. a normalised tensor: show its range
        return normalize(x[None], per="image")[0]
    return x


def _map(heatmap: Any) -> Tensor:
    """The map as float ``(H, W)``."""
    m = _tensor(heatmap, "heatmap")
    if m.dim() == 3 and m.shape[0] == 1:
        m = m[0]
    elif m.dim() == 3 and m.shape[-1] == 1:
        m = m[..., 0]
    return m.double()


def overlay(
    image: Any,
    heatmap: Any,
    *,
    cmap: str = "jet",
    alpha: float = 0.5,
    save: str | os.PathLike[str] | None = None,
) -> Tensor:
    """Blend a map (scaled to 0..1 on its own) in a colormap over an image.

    Args:
        image: a PIL image, a NumPy array or a tensor: ``(3, H, W)``, ``(H, W, 3)`` or
            ``(H, W)`` (RGBA and one-channel images too); uint8 (or other integers in
            0..255), or float in 0..1 (other float ranges are min-max scaled for display).
        heatmap: an ``(h, w)`` map, a tensor or a NumPy array (an :class:`Explanation`'s
            ``maps[i]``); of another size than the image, it is resized to ``(H, W)``
            (bilinear, corners not aligned: ``F.interpolate``'s default), stretched if the
            aspect ratio differs, as a model's square input stretches the photo.
        cmap: a matplotlib colormap name (the ``plots`` extra).
        alpha: weight of the colored map, 0..1.
        save: also write the result as PNG (the ``images`` extra).

    Returns:
        An RGB ``uint8`` tensor ``(H, W, 3)`` (``PIL.Image.fromarray(out.numpy())`` for PIL).

    Raises:
        UsageError: an image or map of another kind or shape (a per-channel map).

    Example:
        >>> import numpy as np, torch, hookscope as hs
        >>> image = np.zeros((4, 6, 3), dtype=np.uint8)
        >>> hs.overlay(image, torch.rand(4, 6), cmap="gray").shape
        torch.Size([4, 6, 3])
        >>> hs.overlay(image, torch.rand(2, 3), cmap="gray").shape   # resized to the image
        torch.Size([4, 6, 3])
    """
    if not 0 <= alpha <= 1:
        raise UsageError(f"alpha must be in 0..1, got {alpha!r}")
    rgb, heat = _rgb(image), _map(heatmap)
    if heat.dim() != 2 or not heat.numel():
        raise UsageError(
            f"heatmap must be (H, W) = {tuple(rgb.shape[:2])} like the image (or another size, "
            f"resized), got {tuple(heat.shape)} (per-channel maps (C, H, W) from saliency or "
            "guided backpropagation: reduce them first, e.g. maps[i].abs().amax(0))"
        )
    if tuple(heat.shape) != tuple(rgb.shape[:2]):
        heat = F.interpolate(heat[None, None], size=tuple(rgb.shape[:2]), mode="bilinear")[0, 0]
    colormaps = require("matplotlib", "plots", purpose="coloring maps").colormaps
    if cmap not in colormaps:
        raise UsageError(f"unknown matplotlib colormap {cmap!r}")
    scaled = normalize(heat[None])[0].numpy()
    colored = torch.from_numpy(colormaps[cmap](scaled)[..., :3]).double()
    out = ((1 - alpha) * rgb + alpha * colored).mul(255).round().clamp(0, 255).to(torch.uint8)
    if save is not None:
        save_png(out, save, purpose="saving overlays as PNG")
    return out
