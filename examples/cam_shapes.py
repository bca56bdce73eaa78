"""Grad-CAM on a CNN trained here, in seconds, on synthetic shapes (a bright square, a bright
disk, or nothing, at a random position on noise; the class is the shape), and the maps drawn
over the images.

Run: python examples/cam_shapes.py [out.png]   (needs: pip install "hookscope[plots,images]")
The README's picture is ``python examples/cam_shapes.py docs/gradcam_shapes.png``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.explain import metrics


def shapes(n: int, generator: torch.Generator) -> tuple[Tensor, Tensor, Tensor]:
    """Images (n, 1, 32, 32), labels (0 square, 1 disk, 2 none), object masks (n, 32, 32)."""
    yy, xx = torch.meshgrid(torch.arange(32.0), torch.arange(32.0), indexing="ij")
    labels = torch.randint(0, 3, (n,), generator=generator)
    centers = torch.randint(6, 26, (n, 2), generator=generator).float()
    dy, dx = yy - centers[:, 0, None, None], xx - centers[:, 1, None, None]
    square = (dy.abs() <= 4) & (dx.abs() <= 4)
    disk = dy**2 + dx**2 <= 4.5**2
    masks = torch.where(labels[:, None, None] == 0, square, disk) & (labels[:, None, None] < 2)
    images = torch.randn(n, 32, 32, generator=generator) * 0.3 + masks.float()
    return images[:, None], labels, masks


def train(steps: int = 250) -> nn.Module:
    """A small CNN with global average pooling, trained with Adam (about 5 s on 2 cores)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y, _ = shapes(64, g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def main(out: Path) -> None:
    model = train()
    x, y, masks = shapes(8, torch.Generator().manual_seed(5))
    x, y, masks = x[y < 2][:4], y[y < 2][:4], masks[y < 2][:4]  # four images with an object
    exp = hs.GradCAM(model, "6")(x, targets=y)  # the last conv block's ReLU
    hits = metrics.pointing_game(exp.maps, masks)
    tiles = [hs.overlay(x[i, 0], exp.maps[i], alpha=0.45) for i in range(len(x))]
    pad = torch.zeros(32, 2, 3, dtype=torch.uint8)
    row = torch.cat([t for tile in tiles for t in (tile, pad)][:-1], dim=1)
    from PIL import Image

    big = row.repeat_interleave(4, 0).repeat_interleave(4, 1)  # 4x, nearest: crisp pixels
    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(big.numpy(), mode="RGB").save(out)
    print(f"classes {y.tolist()} (0 square, 1 disk), map maxima on the object: {hits.tolist()}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "gradcam.png")
