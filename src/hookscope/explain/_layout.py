"""Where the channels are: a layer's output placed as maps ``(N, C, h, w)``.

A CAM weights the channels of a layer's output and sums them over its positions, so it must
know which axis holds the channels. hookscope decides it, in this order:

1. ``reshape=`` given by the user: its result is ``(N, C, h, w)`` for an image, ``(N, C, L)``
   for a 1-D signal.
2. The layer's own type, where it fixes the layout: convolutions, batch / instance / group
   norms, pooling, channel dropout, upsampling and padding put channels first; ``nn.Linear``
   and a ``LayerNorm`` over one dimension act on the last axis, so channels are last.
3. The shapes, when only one reading fits: a 4-D ``(N, a, b, c)`` is channels-first if
   ``(b, c)`` has the input's aspect ratio and ``(a, b)`` does not, channels-last in the
   opposite case; a 3-D output of an image model is a token sequence ``(N, T, C)`` placed on
   the input's patch grid (leading CLS / distillation / register tokens dropped).

When neither the type nor the shapes decide (``(N, 8, 8, 8)`` from a ReLU, both readings fit),
the call is refused with a UsageError asking for ``reshape=``, rather than guessed.

1-D signals. A ``Conv1d``-style output ``(N, C, L)`` of a model whose input is ``(N, C, L_in)``
is explained as a 1-D map over ``L``, upsampled (linearly) to ``L_in``. It is handled as
``(N, C, 1, L)`` inside, so every method's formula is the same. An ``(N, C, L)`` output of an
image model cannot be placed on the image and is refused.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import UsageError

__all__ = ["Grid", "grid_for", "spatial_size"]

_FIRST: tuple[type[nn.Module], ...] = (
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LazyBatchNorm1d,
    nn.LazyBatchNorm2d,
    nn.LazyBatchNorm3d,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.MaxPool1d,
    nn.MaxPool2d,
    nn.MaxPool3d,
    nn.AvgPool1d,
    nn.AvgPool2d,
    nn.AvgPool3d,
    nn.LPPool1d,
    nn.LPPool2d,
    nn.AdaptiveAvgPool1d,
    nn.AdaptiveAvgPool2d,
    nn.AdaptiveAvgPool3d,
    nn.AdaptiveMaxPool1d,
    nn.AdaptiveMaxPool2d,
    nn.AdaptiveMaxPool3d,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.Upsample,
    nn.PixelShuffle,
    nn.PixelUnshuffle,
    nn.ZeroPad1d,
    nn.ZeroPad2d,
    nn.ConstantPad1d,
    nn.ConstantPad2d,
    nn.ReflectionPad1d,
    nn.ReflectionPad2d,
    nn.ReplicationPad1d,
    nn.ReplicationPad2d,
)


@dataclass(frozen=True)
class Grid:
    """How one layer's output becomes maps.

    Attributes:
        kind: what was decided, for messages (``"channels first"``, ``"tokens"``, ...).
        place: the layer's tensor ``(N, ...)`` -> ``(N, C, h, w)`` (1-D: ``h = 1``).
        channel_dim: the axis of the layer's tensor that holds the channels; None for a
            ``reshape=`` given by the user.
        line: the maps are 1-D (``raw`` is ``(N, L)``).
    """

    kind: str
    place: Callable[[Tensor], Tensor]
    channel_dim: int | None
    line: bool = False


def spatial_size(image: Tensor) -> tuple[int, ...]:
    """The input's positions: ``(H, W)`` for ``(N, C, H, W)`` images, ``(L,)`` for
    ``(N, C, L)`` signals."""
    return tuple(image.shape[2:])


def grid_for(
    shape: tuple[int, ...],
    module: nn.Module,
    layer: str,
    size: tuple[int, ...],
    reshape: Callable[[Tensor], Tensor] | None,
) -> Grid:
    """Decide how a layer's output of ``shape`` becomes maps, for an input of ``size``
    (see the module docstring).

    Raises:
        UsageError: the layout is ambiguous or cannot be placed on the input.
    """
    if reshape is not None:
        return _custom(reshape, line=len(size) == 1)
    side = _side(module)
    if len(shape) == 4 and len(size) == 2:
        return _four(shape, side, layer, size)
    if len(shape) == 3 and len(size) == 1:
        return _line(shape, side, layer, size[0])
    if len(shape) == 3 and len(size) == 2 and side != "first":
        return _tokens(shape, layer, size)
    raise _refusal(layer, module, shape, size, "it is not a map of the input's positions")


def _side(module: nn.Module) -> str | None:
    """``"first"`` / ``"last"`` where the module's type fixes where channels are."""
    if isinstance(module, _FIRST):
        return "first"
    if isinstance(module, nn.Linear):
        return "last"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)) and len(module.normalized_shape) == 1:
        return "last"
    return None


def _fits(grid: tuple[int, int], size: tuple[int, ...]) -> bool:
    """A ``(h, w)`` grid has exactly the input's aspect ratio."""
    return grid[0] * size[1] == grid[1] * size[0]


def _close(grid: tuple[int, int], size: tuple[int, ...]) -> bool:
    """Within a quarter of the input's aspect ratio (convolutions without padding shrink
    both sides by the same few pixels)."""
    ratio = (grid[0] / grid[1]) / (size[0] / size[1])
    return 0.8 <= ratio <= 1.25


def _four(shape: tuple[int, ...], side: str | None, layer: str, size: tuple[int, ...]) -> Grid:
    if side is None:
        first, last = (shape[2], shape[3]), (shape[1], shape[2])
        for test in (_fits, _close):
            a, b = test(first, size), test(last, size)
            if a != b:
                side = "first" if a else "last"
                break
            if a and b:
                break
    if side == "first":
        return Grid("channels first", _same, 1)
    if side == "last":
        return Grid("channels last", _from_last, 3)
    raise UsageError(
        f"layer {layer!r} returns shape {tuple(shape)} for an input of {size[0]}x{size[1]}: it "
        f"could be channels first ({shape[1]} channels on {shape[2]}x{shape[3]}) or channels "
        f"last ({shape[3]} channels on {shape[1]}x{shape[2]}), and its type "
        "does not say which. Pass reshape=: `lambda t: t` if channels are first, "
        "`lambda t: t.permute(0, 3, 1, 2)` if they are last"
    )


def _line(shape: tuple[int, ...], side: str | None, layer: str, length: int) -> Grid:
    if side is None:
        first, last = shape[2] <= length, shape[1] <= length
        side = "first" if first and not last else "last" if last and not first else None
    if side == "first":
        return Grid("1-D, channels first", _line_first, 1, line=True)
    if side == "last":
        return Grid("1-D, channels last", _line_last, 2, line=True)
    raise UsageError(
        f"layer {layer!r} returns shape {tuple(shape)} for a 1-D input of length {length}: "
        f"it could be {shape[1]} channels over {shape[2]} positions or {shape[2]} channels "
        f"over {shape[1]}, and its type does not say which. Pass reshape=: "
        "`lambda t: t` if channels are first (N, C, L), `lambda t: t.transpose(1, 2)` if last"
    )


def _tokens(shape: tuple[int, ...], layer: str, size: tuple[int, ...]) -> Grid:
    grid = _token_grid(shape[1], size)
    if grid is None:
        raise UsageError(
            f"layer {layer!r} returns {shape[1]} tokens, which do not fit a patch grid of an "
            f"input of size {size[0]}x{size[1]}: pass reshape= (a function (N, T, C) -> "
            "(N, C, h, w))"
        )
    prefix, (h, w) = grid

    def place(t: Tensor) -> Tensor:
        return t[:, prefix:].reshape(t.shape[0], h, w, t.shape[2]).permute(0, 3, 1, 2)

    return Grid(f"tokens ({prefix} prefix, {h}x{w} grid)", place, 2)


def _token_grid(tokens: int, size: tuple[int, ...]) -> tuple[int, tuple[int, int]] | None:
    """(prefix tokens, (h, w)): the fewest leading tokens (CLS, distillation, registers) whose
    removal leaves an h x w grid with the input's aspect ratio."""
    for prefix in range(0, min(tokens, 9)):
        rest = tokens - prefix
        for h in range(1, math.isqrt(rest * max(size)) + 2):
            if rest % h == 0 and _fits((h, rest // h), size):
                return prefix, (h, rest // h)
    return None


def _custom(reshape: Callable[[Tensor], Tensor], line: bool) -> Grid:
    want = 3 if line else 4

    def place(t: Tensor) -> Tensor:
        out = reshape(t)
        if not isinstance(out, Tensor) or out.dim() != want:
            got = tuple(out.shape) if isinstance(out, Tensor) else type(out).__name__
            shape = "(N, C, L) for a 1-D input" if line else "(N, C, h, w) for an image"
            raise UsageError(f"reshape= must return {shape}, got {got}")
        return out[:, :, None] if line else out

    return Grid("reshape=", place, None, line=line)


def _same(t: Tensor) -> Tensor:
    return t


def _from_last(t: Tensor) -> Tensor:
    return t.permute(0, 3, 1, 2)


def _line_first(t: Tensor) -> Tensor:
    return t[:, :, None]


def _line_last(t: Tensor) -> Tensor:
    return t.transpose(1, 2)[:, :, None]


def _refusal(
    layer: str, module: nn.Module, shape: tuple[int, ...], size: tuple[int, ...], why: str
) -> UsageError:
    kind = "1-D signal" if len(size) == 1 else "image" if len(size) == 2 else "input"
    return UsageError(
        f"layer {layer!r} ({type(module).__name__}) returns shape {tuple(shape)} and the {kind} "
        f"has positions {tuple(size)}: {why}. CAMs need (N, C, h, w) maps of an image, "
        "(N, tokens, C) token sequences of an image, or (N, C, L) maps of a 1-D signal; pick "
        "another layer or pass reshape= (a function returning (N, C, h, w))"
    )


def positions(grid: Grid, shape: tuple[int, ...]) -> Tensor:
    """``(C, h * w)``: for each channel of the maps, where its values sit in one sample of
    the layer's tensor (flat offsets), found by placing the offsets themselves. Only
    rearranging ``reshape=`` functions (permute, reshape, slicing) can be followed so."""
    numel = math.prod(shape[1:])
    offsets = torch.arange(numel).reshape(1, *shape[1:])
    placed = grid.place(offsets)
    if placed.dtype != torch.long or (placed.numel() > 0 and int(placed.max()) >= numel):
        raise UsageError(
            "reshape= must only rearrange or select the layer's values (permute, reshape, "
            "slicing) for a method that changes the layer's output (Ablation-CAM)"
        )
    return placed[0].reshape(placed.shape[1], -1)
