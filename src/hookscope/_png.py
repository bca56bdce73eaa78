"""Pillow images and tensors: PNG files from ``uint8`` image tensors, and PIL images as float
tensors, with Pillow (the ``images`` extra) and no numpy."""

from __future__ import annotations

import io
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ._extras import require

__all__ = ["image_to_tensor", "pillow", "png_bytes", "save_png"]


def pillow(purpose: str) -> ModuleType:
    """``PIL.Image``, or ImportError naming the ``images`` extra (call it early to fail fast)."""
    return require("PIL.Image", "images", purpose=purpose)


def png_bytes(image: Tensor, *, purpose: str) -> bytes:
    """A ``uint8`` ``(H, W)`` grayscale or ``(H, W, 3)`` RGB tensor encoded as PNG."""
    mode = "L" if image.dim() == 2 else "RGB"
    height, width = image.shape[:2]
    data = bytes(image.contiguous().flatten().tolist())
    buffer = io.BytesIO()
    pillow(purpose).frombytes(mode, (width, height), data).save(buffer, format="PNG")
    return buffer.getvalue()


def save_png(image: Tensor, path: str | os.PathLike[str], *, purpose: str) -> None:
    """Write :func:`png_bytes` of ``image`` to ``path``, creating missing folders."""
    data = png_bytes(image, purpose=purpose)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_bytes(data)


def image_to_tensor(image: Any) -> Tensor:
    """A PIL image (mode ``L`` or ``RGB``) as a float ``(C, H, W)`` tensor in 0..1."""
    width, height = image.size
    channels = len(image.getbands())
    data = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8)
    return data.view(height, width, channels).permute(2, 0, 1).float() / 255
