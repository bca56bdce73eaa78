"""``hookscope demo``: train the shapes CNN here, measure it honestly, write the report and
the trained weights.

Accuracy is measured on held-out images (chance: 1/3). The pointing game counts a Grad-CAM map
whose maximum lies within a tolerance of the object, scaled with the image (TorchRay's 15 px at
224 px is 6.7 % of the side); it is printed beside three baselines that a large tolerance or
object makes high: the image's center, a random point, and Grad-CAM of the untrained model.
"""

from __future__ import annotations

import html
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from ..errors import UsageError
from ..explain import GradCAM, metrics
from ._report import report
from ._shapes import CLASSES, ShapesCNN, shapes, train

__all__ = ["DemoResult", "demo"]

_CAM_LAYER = "7"  # the last ReLU, before global average pooling


@dataclass(frozen=True)
class DemoResult:
    """What the demo measured, and where its report is."""

    report: Path
    weights: Path
    accuracy: float
    pointing: float
    center: float
    random: float
    untrained: float
    tolerance: float
    seconds: float


def demo(
    out: str | os.PathLike[str] = "hookscope-demo",
    *,
    quick: bool = False,
    progress: bool | None = None,
    seed: int = 0,
) -> DemoResult:
    """Train, measure, and write ``out/report.html`` and ``out/weights.pt``, the trained
    model's ``state_dict``: ``ShapesCNN().load_state_dict(torch.load(path))`` gives back the
    model the report describes. ``quick``: 32 px images and a shorter training (a few
    seconds), as CI runs it. ``seed``: the weights and the training batches (the held-out
    images stay the same)."""
    if not isinstance(quick, bool):
        raise UsageError(f"quick must be True or False, got {quick!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise UsageError(f"seed must be an int, got {seed!r}")
    torch.manual_seed(seed)
    size, steps = (32, 300) if quick else (64, 400)
    start = time.perf_counter()
    model = train(steps, size=size, seed=seed, progress_bar=progress)
    seconds = time.perf_counter() - start
    x, y, masks = shapes(600, torch.Generator().manual_seed(12345), size=size)
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    tolerance = 0.067 * size
    pointing = _pointing(GradCAM(model, _CAM_LAYER)(x, targets=y).maps, masks, tolerance)
    torch.manual_seed(1)
    untrained = _pointing(
        GradCAM(ShapesCNN().eval(), _CAM_LAYER)(x, targets=y).maps, masks, tolerance
    )
    center = torch.zeros_like(masks, dtype=torch.float32)
    center[:, size // 2, size // 2] = 1
    random = torch.rand(masks.shape, generator=torch.Generator().manual_seed(7))
    result = DemoResult(
        report=Path(out) / "report.html",
        weights=Path(out) / "weights.pt",
        accuracy=accuracy,
        pointing=pointing,
        center=_pointing(center, masks, tolerance),
        random=_pointing(random, masks, tolerance),
        untrained=untrained,
        tolerance=tolerance,
        seconds=seconds,
    )
    sample = torch.cat([x[y == k][:3] for k in range(len(CLASSES))])  # 3 of each class
    report(
        model,
        sample,
        result.report,
        title="hookscope demo: a CNN trained on synthetic shapes",
        cam_layer=_CAM_LAYER,
        classes=CLASSES,
        max_images=9,
        sections=[("training", "Training and faithfulness", _training_html(result, steps, size))],
    )
    partial = result.weights.with_name(result.weights.name + ".partial")
    torch.save(model.state_dict(), partial)
    partial.replace(result.weights)  # never half-written weights under the final name
    return result


def _pointing(maps: Tensor, masks: Tensor, tolerance: float) -> float:
    return metrics.pointing_game(maps, masks, tolerance=tolerance).float().mean().item()


def _training_html(r: DemoResult, steps: int, size: int) -> str:
    rows = [
        ("Grad-CAM of the trained model", r.pointing),
        ("the image's center", r.center),
        ("a random point", r.random),
        ("Grad-CAM of the untrained model", r.untrained),
    ]
    cells = "".join(f"<tr><td>{html.escape(k)}</td><td class=n>{v:.3f}</td></tr>" for k, v in rows)
    return (
        f"<p>{steps} Adam steps on freshly generated batches of 64 {size}x{size} images "
        f"(squares, disks, triangles at random positions and sizes on noise) in "
        f"{r.seconds:.1f} s. Accuracy on 600 held-out images: <b>{r.accuracy:.3f}</b> "
        f"(chance 0.333).</p><p>Pointing game on the same images (a hit: the map's maximum "
        f"lies within {r.tolerance:.1f} px of the shape), beside its baselines:</p>"
        f"<table><tr><th>pointer</th><th class=n>hits</th></tr>{cells}</table>"
    )


def describe(r: DemoResult) -> str:
    """The lines ``hookscope demo`` prints."""
    return (
        f"trained in {r.seconds:.1f} s: accuracy {r.accuracy:.3f} on 600 held-out images "
        f"(chance 0.333)\n"
        f"pointing game {r.pointing:.3f} (tolerance {r.tolerance:.1f} px); baselines: center "
        f"{r.center:.3f}, random {r.random:.3f}, untrained model {r.untrained:.3f}\n"
        f"report: {r.report.resolve()}\n"
        f"weights: {r.weights.resolve()}\n"
        f"open it: a browser on file://{r.report.resolve()}"
    )
