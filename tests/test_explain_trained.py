"""A CNN trained inside the test, in seconds, on synthetic shapes (a bright square, a bright
disk, or nothing, at a random position on noise; the class is the shape): the object's pixels
are the right answer, so Grad-CAM must point at them and deleting its pixels first must hurt
the score most. The empty class makes each shape's own pixels the evidence for it (with two
classes a model may learn "square or not", and the disk's evidence is then the absence of
corners)."""

from __future__ import annotations

import pytest
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


def train() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
        nn.Conv2d(32, 32, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 3),
    )  # fmt: skip
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(1)
    for _ in range(250):
        x, y, _ = shapes(64, g)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.fixture(scope="module")
def trained() -> nn.Module:
    return train()


@pytest.mark.slow
def test_gradcam_points_at_the_object_and_deletion_prefers_it(trained: nn.Module) -> None:
    x, y, masks = shapes(150, torch.Generator().manual_seed(2))
    with torch.no_grad():
        accuracy = (trained(x).argmax(1) == y).float().mean()
    assert accuracy >= 0.9  # the model learned the task
    x, y, masks = x[y < 2], y[y < 2], masks[y < 2]  # images with an object to point at
    exp = hs.GradCAM(trained, "6")(x, targets=y)
    hits = metrics.pointing_game(exp.maps, masks).float().mean()
    noise = torch.rand(masks.shape, generator=torch.Generator().manual_seed(3))
    chance = metrics.pointing_game(noise, masks).float().mean()
    assert hits >= 0.9 and chance < 0.3, (hits, chance)
    ours = metrics.deletion(trained, x, exp.maps, y, steps=10).auc.mean()
    random = metrics.deletion(trained, x, noise, y, steps=10).auc.mean()
    assert ours < random, (ours, random)
