"""Grad-CAM on a CNN trained here, in seconds, on synthetic shapes (a bright square, disk or
triangle at a random position and size on noise; the class is the shape: the data and model
of ``hookscope demo``), and the maps drawn over the images.

Run: python examples/cam_shapes.py [out.png]   (needs: pip install "hookscope[plots,images]")
The README's picture is ``python examples/cam_shapes.py docs/gradcam_shapes.png``.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

import hookscope as hs
from hookscope.explain import metrics
from hookscope.show import CLASSES, shapes, train


def main(out: Path) -> None:
    model = train(300, size=32, progress_bar=False)  # about 5 s on 2 cores
    x, y, masks = shapes(4, torch.Generator().manual_seed(5), size=32)
    exp = hs.GradCAM(model, "7")(x, targets=y)  # the last conv block's ReLU
    hits = metrics.pointing_game(exp.maps, masks, tolerance=0.067 * 32)
    tiles = [hs.overlay(x[i, 0], exp.maps[i], alpha=0.45) for i in range(len(x))]
    pad = torch.zeros(32, 2, 3, dtype=torch.uint8)
    row = torch.cat([t for tile in tiles for t in (tile, pad)][:-1], dim=1)
    big = row.repeat_interleave(4, 0).repeat_interleave(4, 1)  # 4x, nearest: crisp pixels
    from PIL import Image

    out.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(big.numpy(), mode="RGB").save(out)
    print(f"classes {[CLASSES[k] for k in y]}, map maxima on the shape: {hits.tolist()}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp()) / "gradcam.png")
