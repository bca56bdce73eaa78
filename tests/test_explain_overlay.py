"""``hs.overlay`` takes images and maps as users hold them (PIL, NumPy, tensors in the usual
layouts) and gives the blend computed here by hand with NumPy:
``round(255 * ((1 - alpha) * rgb + alpha * gray(v)))``, ``v`` the map min-max scaled and
``gray`` matplotlib's colormap (a 256-entry table, so not exactly ``v``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import matplotlib
import numpy as np
import pytest
import torch
from PIL import Image

import hookscope as hs

H, W = 5, 7
RNG = np.random.default_rng(0)
PIXELS = RNG.integers(0, 256, size=(H, W, 3), dtype=np.uint8)  # the picture, RGB
PIXELS[0, 0, :2] = 0, 255  # its full range, for the min-max case
HEAT = RNG.random((H, W))  # the map
ALPHA = 0.4


def _by_hand(rgb01: np.ndarray, heat: np.ndarray = HEAT) -> np.ndarray:
    v = (heat - heat.min()) / (heat.max() - heat.min())
    gray = matplotlib.colormaps["gray"](v)[..., :3]
    return np.round(255 * ((1 - ALPHA) * rgb01 + ALPHA * gray)).astype(np.uint8)


RGB = PIXELS / 255.0
GRAY = PIXELS[..., 0] / 255.0

IMAGES: dict[str, tuple[Callable[[], Any], np.ndarray]] = {
    "PIL RGB": (lambda: Image.fromarray(PIXELS), RGB),
    "PIL RGBA": (lambda: Image.fromarray(np.dstack([PIXELS, PIXELS[..., :1]])), RGB),
    "PIL L": (lambda: Image.fromarray(PIXELS[..., 0]), np.repeat(GRAY[..., None], 3, 2)),
    "NumPy HWC uint8": (lambda: PIXELS.copy(), RGB),
    "NumPy HWC float 0..1": (lambda: PIXELS / 255.0, RGB),
    "NumPy HWC float32": (lambda: (PIXELS / 255.0).astype(np.float32), RGB),
    "NumPy HW uint8": (lambda: PIXELS[..., 0].copy(), np.repeat(GRAY[..., None], 3, 2)),
    "NumPy HWC int64 0..255": (lambda: PIXELS.astype(np.int64), RGB),
    "NumPy CHW float": (lambda: (PIXELS / 255.0).transpose(2, 0, 1), RGB),
    "tensor CHW float": (lambda: torch.from_numpy(PIXELS / 255.0).permute(2, 0, 1), RGB),
    "tensor HWC uint8": (lambda: torch.from_numpy(PIXELS.copy()), RGB),
    "tensor HW float": (lambda: torch.from_numpy(GRAY), np.repeat(GRAY[..., None], 3, 2)),
}

MAPS: dict[str, Callable[[], Any]] = {
    "tensor HW": lambda: torch.from_numpy(HEAT),
    "tensor 1HW float32": lambda: torch.from_numpy(HEAT).float()[None],
    "NumPy HW": lambda: HEAT.copy(),
    "NumPy HW1": lambda: HEAT[..., None].copy(),
}


@pytest.mark.parametrize("kind", sorted(IMAGES))
def test_every_kind_of_image_gives_the_blend_by_hand(kind: str) -> None:
    make, rgb01 = IMAGES[kind]
    out = hs.overlay(make(), torch.from_numpy(HEAT), cmap="gray", alpha=ALPHA)
    assert out.dtype == torch.uint8 and out.shape == (H, W, 3)
    expected = _by_hand(rgb01)
    if "float32" in kind:  # the image itself was rounded to float32
        assert np.abs(out.numpy().astype(int) - expected).max() <= 1
    else:
        assert np.array_equal(out.numpy(), expected)


@pytest.mark.parametrize("kind", sorted(MAPS))
def test_every_kind_of_map_gives_the_blend_by_hand(kind: str) -> None:
    out = hs.overlay(Image.fromarray(PIXELS), MAPS[kind](), cmap="gray", alpha=ALPHA)
    expected = _by_hand(RGB)
    tolerance = 1 if "float32" in kind else 0
    assert np.abs(out.numpy().astype(int) - expected).max() <= tolerance


def test_an_out_of_range_float_image_is_min_max_scaled() -> None:
    image = torch.from_numpy(PIXELS / 255.0 * 4 - 2)  # like a normalised tensor
    out = hs.overlay(image, HEAT, cmap="gray", alpha=ALPHA)
    assert np.array_equal(out.numpy(), _by_hand(RGB))  # 0 and 255 are in PIXELS


@pytest.mark.parametrize("size", [(3, 4), (10, 14), (7, 5)])
def test_a_map_of_another_size_is_resized_to_the_image(size: tuple[int, int]) -> None:
    """A layer's map, or one of the model's square input, on the original picture: it used
    to be refused. The oracle: the map resized by plain F.interpolate, then the blend."""
    small = np.random.default_rng(1).random(size)
    out = hs.overlay(Image.fromarray(PIXELS), small, cmap="gray", alpha=ALPHA)
    resized = torch.nn.functional.interpolate(
        torch.from_numpy(small)[None, None], size=(H, W), mode="bilinear", align_corners=False
    )[0, 0].numpy()
    assert out.shape == (H, W, 3)
    assert np.array_equal(out.numpy(), _by_hand(RGB, resized))


def test_what_cannot_be_drawn_is_refused() -> None:
    with pytest.raises(hs.UsageError, match="image must be a torch tensor, a NumPy array"):
        hs.overlay([[1, 2]], HEAT)
    with pytest.raises(hs.UsageError, match=r"image must be \(3, H, W\)"):
        hs.overlay(np.zeros((H, W, 5)), HEAT)
    with pytest.raises(hs.UsageError, match=r"heatmap must be \(H, W\) = \(5, 7\).*amax"):
        hs.overlay(PIXELS, np.zeros((3, H, W)))
