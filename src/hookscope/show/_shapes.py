"""The demo's data and model: squares, disks and triangles at random positions and sizes on
noise, generated in code (no download), and a small CNN that learns them in seconds on a CPU.

The class is the shape, so the object's pixels are the right answer for an attribution map;
the masks are returned with the images to score that (pointing game).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .._progress import progress

__all__ = ["CLASSES", "ShapesCNN", "shapes", "train"]

CLASSES = ("square", "disk", "triangle")


def shapes(
    n: int, generator: torch.Generator, *, size: int = 64, noise: float = 0.3
) -> tuple[Tensor, Tensor, Tensor]:
    """``n`` images ``(n, 1, size, size)``, labels (indices into :data:`CLASSES`) and object
    masks ``(n, size, size)``: one bright shape (radius 10 to 20 % of the side) on Gaussian
    noise."""
    grid = torch.arange(float(size))
    yy, xx = grid[:, None], grid[None, :]
    labels = torch.randint(0, 3, (n,), generator=generator)
    radius = (torch.rand(n, generator=generator) * 0.1 + 0.1) * size
    margin = radius.ceil() + 1
    cy, cx = (margin + torch.rand(2, n, generator=generator) * (size - 2 * margin)).unbind()
    dy = yy - cy[:, None, None]
    dx = xx - cx[:, None, None]
    r = radius[:, None, None]
    square = (dy.abs() <= r * 0.85) & (dx.abs() <= r * 0.85)
    disk = dy**2 + dx**2 <= r**2
    # upward triangle: below its apex, above its base, inside both slanted sides
    triangle = (dy >= -r) & (dy <= r) & (dx.abs() <= (dy + r) * 0.6)
    masks = torch.stack([square, disk, triangle], 1)[torch.arange(n), labels]
    images = torch.randn(n, size, size, generator=generator) * noise + masks.float()
    return images[:, None], labels, masks


class ShapesCNN(nn.Sequential):
    """Three conv blocks, global average pooling and a linear classifier (~14k parameters)."""

    def __init__(self, classes: int = len(CLASSES)) -> None:
        super().__init__(
            nn.Conv2d(1, 16, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, classes),
        )


def train(
    steps: int = 300, *, size: int = 64, seed: int = 0, progress_bar: bool | None = None
) -> ShapesCNN:
    """A :class:`ShapesCNN` trained with Adam on freshly generated batches of 64 (about 15 s
    for 300 steps on 2 CPU cores), returned in eval mode."""
    torch.manual_seed(seed)
    model = ShapesCNN()
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(seed + 1)
    with progress(steps, "training", progress_bar) as advance:
        for _ in range(steps):
            x, y, _ = shapes(64, g, size=size)
            loss: Tensor = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            torch.autograd.backward(loss)
            opt.step()
            advance()
    return model.eval()
