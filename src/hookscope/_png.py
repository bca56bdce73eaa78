"""PNG files from ``uint8`` image tensors, with Pillow (the ``images`` extra) and no numpy."""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

from torch import Tensor

from ._extras import require

__all__ = ["pillow", "save_png"]


def pillow(purpose: str) -> ModuleType:
    """``PIL.Image``, or ImportError naming the ``images`` extra (call it early to fail fast)."""
    return require("PIL.Image", "images", purpose=purpose)


def save_png(image: Tensor, path: str | os.PathLike[str], *, purpose: str) -> None:
    """Write a ``uint8`` ``(H, W)`` grayscale or ``(H, W, 3)`` RGB tensor as a PNG file,
    creating missing folders."""
    mode = "L" if image.dim() == 2 else "RGB"
    height, width = image.shape[:2]
    data = bytes(image.contiguous().flatten().tolist())
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    pillow(purpose).frombytes(mode, (width, height), data).save(Path(path), format="PNG")
