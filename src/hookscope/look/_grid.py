"""Feature maps tiled into grayscale grids: saved as PNG files or sent to TensorBoard.

What one would otherwise build by hand (a hook on every ``Conv2d``, outputs grouped by kernel
shape, torchvision's ``make_grid(normalize=True, scale_each=True)``, ``writer.add_image``), without
torchvision. Every map becomes one tile of a ``uint8`` image:

* ``scale="each"`` (default) stretches each map on its own so its minimum is 0 and its
  maximum 255; ``scale="all"`` uses one minimum and maximum for every map of the grid. Pixels
  are rounded half up. A constant map is all 0 (black), as with ``make_grid``.
* Minimum and maximum are taken over finite values only; ``+inf`` is then 255, ``-inf`` and
  NaN are 0, so one bad value does not blank its map. A map with no finite value is all 0.
* Tiles fill rows left to right, each in a cell the size of the largest map, placed in the
  cell's top-left corner; cells are ``padding`` pixels apart and from the border, and every
  pixel that is not a map's (gaps, empty cells) is ``pad_value``.
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from .._png import pillow, save_png
from ..core import Layers, LayerSelector, features
from ..errors import UsageError

__all__ = ["feature_grid", "feature_grids"]


Scale = Literal["each", "all"]
Group = Literal["kernel", "layer"]
_PURPOSE = "saving feature grids as PNG"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class ImageWriter(Protocol):
    """What ``writer=`` needs: a ``torch.utils.tensorboard.SummaryWriter`` fits."""

    def add_image(
        self, tag: str, img_tensor: Tensor, *, global_step: int, dataformats: str
    ) -> Any: ...


def feature_grid(
    maps: Tensor,
    *,
    ncols: int | None = None,
    padding: int = 2,
    pad_value: int = 0,
    scale: Scale = "each",
    save: str | os.PathLike[str] | None = None,
) -> Tensor:
    """Tile feature maps into one grayscale ``uint8`` image (see the module notes).

    Args:
        maps: ``(C, H, W)`` (C tiles) or ``(N, C, H, W)`` (N*C tiles, sample by sample), of any
            real dtype and device; it is read, never modified.
        ncols: tiles per row (at most the number of tiles). Default: ``ceil(sqrt(C))`` for
            ``(C, H, W)`` and for ``N == 1``; ``C`` when ``N > 1``, one sample per row.
        padding: pixels between tiles and around the grid.
        pad_value: gray level (0..255) of the padding and of empty cells.
        scale: ``"each"``: every map stretched to 0..255 on its own; ``"all"``: one range
            for every map of the grid.
        save: also write the grid to this ``.png`` path (needs Pillow, the ``images`` extra);
            missing parent folders are created.

    Returns:
        A ``uint8`` CPU tensor ``(rows*(H+padding)+padding, ncols*(W+padding)+padding)``.

    Raises:
        UsageError: ``maps`` is not a non-empty 3-D or 4-D real tensor, or an option is bad.
        ImportError: ``save`` was given and Pillow is not installed.

    Example:
        >>> import torch, hookscope as hs
        >>> maps = torch.tensor([[[0.0, 1.0]], [[4.0, 2.0]]])  # two 1x2 maps
        >>> hs.feature_grid(maps, padding=1, pad_value=9).tolist()
        [[9, 9, 9, 9, 9, 9, 9], [9, 0, 255, 9, 255, 0, 9], [9, 9, 9, 9, 9, 9, 9]]
    """
    _check_options(ncols, padding, pad_value, scale)
    path = _png_path(save) if save is not None else None  # fail before any work
    tiles = _as_tiles(maps)
    if ncols is None:
        ncols = maps.shape[1] if maps.ndim == 4 and maps.shape[0] > 1 else _square(len(tiles))
    grid = _tile(list(_normalised([tiles], scale)[0]), ncols, padding, pad_value)
    if path is not None:
        save_png(grid, path, purpose=_PURPOSE)
    return grid


_GRID_OPS = (
    "feature grids draw layers' outputs grouped by their modules' kernels (group='kernel') or "
    "by module: select the module that runs the operation"
)


def feature_grids(
    model: nn.Module,
    inputs: Any,
    layers: LayerSelector = nn.Conv2d,
    *,
    group: Group = "kernel",
    out_dir: str | os.PathLike[str] | None = None,
    writer: ImageWriter | None = None,
    step: int = 0,
    sample: int = 0,
    ncols: int | None = None,
    padding: int = 2,
    pad_value: int = 0,
    scale: Scale = "each",
) -> dict[str, Tensor]:
    """One forward, then one grid of feature maps per layer or per kernel shape.

    Args:
        model: the model; left exactly as found (one forward, no_grad, eval mode, stopped
            after the last selected layer).
        inputs: a tensor, a tuple of positional arguments or a mapping of keyword arguments.
        layers: any layer selector (default: every ``nn.Conv2d``); outputs must be 4-D.
        group: ``"kernel"``: one grid per weight shape, keyed like ``"64x3x11x11"``, holding
            the maps of every layer with that shape (each tile in a cell the size of the
            group's largest map); ``"layer"``: one grid per layer, keyed by its name.
        out_dir: write each grid to ``<out_dir>/<key>.png`` (characters other than letters,
            digits, ``.``, ``_`` and ``-`` become ``_``); the folder is created.
        writer: call ``writer.add_image(f"feature maps/{key}", grid, global_step=step,
            dataformats="HW")`` for each grid (e.g. a TensorBoard ``SummaryWriter``).
        step: the ``global_step`` given to ``writer``.
        sample: which item of the batch to show.
        ncols, padding, pad_value, scale: as in :func:`feature_grid`, per grid (``"all"``:
            one range for a whole group); ``ncols`` defaults to ``ceil(sqrt(maps in grid))``.

    Returns:
        ``{key: uint8 grid}``, in selection order (a type selector such as the default
        follows ``named_modules()``, which is execution order for sequential CNNs).

    Raises:
        UsageError: a bad option, ``sample`` out of range, a layer without a ``weight`` under
            ``group="kernel"``, or a layer whose output is not a 4-D tensor.
        ImportError: ``out_dir`` was given and Pillow is not installed.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Conv2d(4, 4, 3))
        >>> {k: tuple(g.shape) for k, g in hs.feature_grids(model, torch.ones(1, 1, 8, 8)).items()}
        {'4x1x3x3': (18, 18), '4x4x3x3': (14, 14)}
    """
    _check_options(ncols, padding, pad_value, scale)
    _check_int("step", step, 0)
    _check_int("sample", sample, 0)
    if group not in ("kernel", "layer"):
        raise UsageError(f'group must be "kernel" or "layer", got {group!r}')
    if out_dir is not None:
        pillow(_PURPOSE)  # fail before the forward
    sites = Layers(model).sites(layers, refuse_ops=_GRID_OPS)
    modules = {name: site.module for name, site in sites.items()}
    keys = {name: _key(name, module, group) for name, module in modules.items()}
    outputs = features(model, inputs, list(modules), stop=True)
    groups: dict[str, list[Tensor]] = {}
    for name, out in outputs.items():
        groups.setdefault(keys[name], []).append(_sample_maps(name, modules[name], out, sample))
    grids = {}
    for key, maps in groups.items():
        tiles = [tile for stack in _normalised(maps, scale) for tile in stack]
        grids[key] = _tile(tiles, ncols or _square(len(tiles)), padding, pad_value)
        if out_dir is not None:
            path = _png_path(Path(out_dir) / f"{_UNSAFE.sub('_', key)}.png")
            save_png(grids[key], path, purpose=_PURPOSE)
        if writer is not None:
            writer.add_image(f"feature maps/{key}", grids[key], global_step=step, dataformats="HW")
    return grids


def _check_int(what: str, value: object, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise UsageError(f"{what} must be an int, got {value!r} ({type(value).__name__})")
    if value < low or (high is not None and value > high):
        top = f"..{high}" if high is not None else " or more"
        raise UsageError(f"{what} must be {low}{top}, got {value}")


def _check_options(ncols: int | None, padding: int, pad_value: int, scale: str) -> None:
    if ncols is not None:
        _check_int("ncols", ncols, 1)
    _check_int("padding", padding, 0)
    _check_int("pad_value", pad_value, 0, 255)
    if scale not in ("each", "all"):
        raise UsageError(f'scale must be "each" (per map) or "all" (shared), got {scale!r}')


def _as_tiles(maps: object) -> Tensor:
    """``maps`` as a ``(K, H, W)`` float64 CPU tensor (a copy or a read-only view)."""
    if not isinstance(maps, Tensor):
        raise UsageError(f"maps must be a torch.Tensor, got {type(maps).__name__}")
    if maps.ndim not in (3, 4) or maps.numel() == 0 or maps.is_complex():
        raise UsageError(
            f"maps must be a non-empty real (C, H, W) or (N, C, H, W) tensor, got "
            f"{maps.dtype} of shape {tuple(maps.shape)}; add a channel dimension with "
            "maps.unsqueeze(0) for a single (H, W) map"
        )
    return maps.detach().to("cpu", torch.float64).reshape(-1, *maps.shape[-2:])


def _square(n: int) -> int:
    return math.ceil(math.sqrt(n))


def _range(maps: Tensor, dims: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """Minimum and maximum of the finite values over ``dims`` (inf, -inf where none)."""
    finite = maps.isfinite()
    lo = torch.where(finite, maps, math.inf).amin(dims, keepdim=True)
    hi = torch.where(finite, maps, -math.inf).amax(dims, keepdim=True)
    return lo, hi


def _to_uint8(maps: Tensor, lo: Tensor, hi: Tensor) -> Tensor:
    """Float64 maps -> uint8: lo -> 0, hi -> 255, rounded half up; non-finite per the notes."""
    span = hi - lo
    unit = (maps - lo) / torch.where(span > 0, span, 1.0)  # a constant map: all 0
    unit = torch.where(maps.isfinite(), unit, (maps == math.inf).to(unit.dtype))
    return (unit.clamp(0, 1) * 255 + 0.5).floor().to(torch.uint8)


def _normalised(stacks: list[Tensor], scale: Scale) -> list[Tensor]:
    """Each ``(K, H, W)`` float64 stack as uint8, per map or with one range for all."""
    if scale == "each":
        return [_to_uint8(m, *_range(m, (-2, -1))) for m in stacks]
    ranges = [_range(m, (-3, -2, -1)) for m in stacks]
    lo = torch.stack([r[0].reshape(()) for r in ranges]).amin()
    hi = torch.stack([r[1].reshape(()) for r in ranges]).amax()
    return [_to_uint8(m, lo, hi) for m in stacks]


def _tile(tiles: list[Tensor], ncols: int, padding: int, pad_value: int) -> Tensor:
    """Place ``(H_i, W_i)`` uint8 tiles row by row in cells of the largest size."""
    ncols = min(ncols, len(tiles))
    rows = math.ceil(len(tiles) / ncols)
    cell_h, cell_w = max(t.shape[0] for t in tiles), max(t.shape[1] for t in tiles)
    size = (rows * (cell_h + padding) + padding, ncols * (cell_w + padding) + padding)
    grid = torch.full(size, pad_value, dtype=torch.uint8)
    for i, tile in enumerate(tiles):
        y = padding + (i // ncols) * (cell_h + padding)
        x = padding + (i % ncols) * (cell_w + padding)
        grid[y : y + tile.shape[0], x : x + tile.shape[1]] = tile
    return grid


def _key(name: str, module: nn.Module, group: Group) -> str:
    """The grid a layer goes to: its name, or its weight shape as ``"64x3x11x11"``."""
    if group == "layer":
        return name
    weight = getattr(module, "weight", None)
    if not isinstance(weight, Tensor):
        raise UsageError(
            f"layer {name!r} ({type(module).__name__}) has no weight tensor to group by "
            'kernel shape: use group="layer", or select only layers with weights'
        )
    return "x".join(str(d) for d in weight.shape)


def _sample_maps(name: str, module: nn.Module, out: object, sample: int) -> Tensor:
    """Item ``sample`` of a layer's ``(N, C, H, W)`` output as ``(C, H, W)`` float64."""
    if not isinstance(out, Tensor) or out.ndim != 4 or out.is_complex():
        what = f"{out.dtype} tensor of shape {tuple(out.shape)}" if isinstance(out, Tensor) else ""
        raise UsageError(
            f"layer {name!r} ({type(module).__name__}) returned {what or type(out).__name__}, "
            "not a real 4-D (N, C, H, W) tensor: select layers with image-like outputs"
        )
    if sample >= out.shape[0]:
        raise UsageError(
            f"sample={sample} is out of range for layer {name!r}'s batch of {out.shape[0]}: "
            f"use 0..{out.shape[0] - 1}"
        )
    return out[sample].to("cpu", torch.float64)


def _png_path(path: str | os.PathLike[str]) -> Path:
    """``path`` checked to end in ``.png``, once Pillow is known to be there."""
    if Path(path).suffix.lower() != ".png":
        raise UsageError(f"feature grids are saved as PNG: give a .png path, got {str(path)!r}")
    pillow(_PURPOSE)
    return Path(path)
