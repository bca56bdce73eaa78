"""Maps of a fixed batch as images: a CAM overlaid on each image, or the attention weights
of a layer, drawn by the trainer callbacks every few epochs (``maps=``).

The forwards are hookscope's own (``own_forward``): the Monitor and the NaN tracer the
callback keeps open do not count them, and the model is left as found (eval mode for the
forward, each module's flag restored; no parameter's ``.grad`` touched).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..core import features, map_tensors, own_forward
from ..errors import UsageError
from ..explain import METHODS, overlay

__all__ = ["Maps"]

ATTENTION = "attention"
_GAP = 2  # white pixels between tiles
_ATTENTION_SIZE = 96  # an attention map is enlarged (nearest) to at least this many pixels


@dataclass
class Maps:
    """CAM or attention maps of a fixed batch, drawn every ``every`` epochs and logged as
    one image (the batch's maps side by side) to the trainer's loggers and to hookscope's
    sink objects that take images (``WandbSink``, ``MLflowSink``, ``TensorBoardSink``; a
    ``("tensorboard", dir)`` spec does not), at the optimizer step.

    Args:
        inputs: the batch: images ``(N, 3, H, W)`` for a CAM (moved to the model's device),
            or a model's inputs for attention (a tensor of token ids, a tuple, or a mapping
            such as a tokenizer's output).
        layer: the CAM's layer, or the layer whose attention weights to draw
            (``"transformer.h.1.attn"``: its ``::attention_weights``, see the operations
            guide).
        method: a CAM of ``hs.explain.METHODS`` (``"gradcam"``, ``"layercam"``, ...), or
            ``"attention"``.
        targets: the CAM's targets (one class, one per image, None for each top class).
        every: draw at the end of epochs 0, ``every``, ``2 * every``, ... (0-based).
        tag: the image's name; default ``"maps/{method}/{layer}"``.
        cmap: the matplotlib colormap (the ``plots`` extra).
        options: more arguments of the CAM's constructor (``fc=`` for ``"cam"``).

    Example:
        ``HookscopeCallback(maps=Maps(images, layer="net.3", method="gradcam", every=5))``.
    """

    inputs: Any
    layer: str
    method: str = "gradcam"
    targets: Any = None
    every: int = 1
    tag: str | None = None
    cmap: str = "jet"
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise UsageError(f"every must be an int >= 1, got {self.every!r}")
        if not isinstance(self.layer, str):
            raise UsageError(f"layer must be a layer's name, got {self.layer!r}")
        if self.method == ATTENTION:
            return
        info = METHODS.get(self.method)
        if info is None or info.kind != "layer" or info.per_channel:
            usable = sorted(
                n for n, i in METHODS.items() if i.kind == "layer" and not i.per_channel
            )
            raise UsageError(
                f"method must be a CAM of hs.explain.METHODS or 'attention', got "
                f"{self.method!r}: one of {[*usable, ATTENTION]}"
            )
        missing = [k for k in info.requires if k not in self.options]
        if missing:
            raise UsageError(f"method {self.method!r} needs options={{{missing[0]!r}: ...}}")
        if not isinstance(self.inputs, Tensor) or self.inputs.dim() != 4:
            raise UsageError(f"a CAM's inputs are images (N, C, H, W), got {_shown(self.inputs)}")

    @property
    def name(self) -> str:
        """The image's name (``tag``, or ``"maps/{method}/{layer}"``)."""
        return self.tag or f"maps/{self.method}/{self.layer}"

    def due(self, epoch: int) -> bool:
        """Whether the maps are drawn at the end of ``epoch`` (0-based)."""
        return epoch % self.every == 0

    def render(self, model: nn.Module) -> Any:
        """The maps of the batch, side by side: an RGB ``uint8`` NumPy array ``(H, W, 3)``."""
        device = _device(model)
        inputs = map_tensors(lambda _, t: t.to(device), self.inputs)
        with own_forward():
            tiles = (
                self._attention(model, inputs)
                if self.method == ATTENTION
                else self._cam(model, inputs)
            )
        return _side_by_side(tiles).numpy()

    def _cam(self, model: nn.Module, images: Tensor) -> list[Tensor]:
        method = METHODS[self.method].cls(model, self.layer, **self.options)
        maps = method(images, targets=self.targets).maps.detach().cpu()
        pictures = images.detach().float().cpu()
        return [overlay(p, m, cmap=self.cmap) for p, m in zip(pictures, maps, strict=True)]

    def _attention(self, model: nn.Module, inputs: Any) -> list[Tensor]:
        site = f"{self.layer}::attention_weights"
        weights = features(model, inputs, [site])[site]
        if not isinstance(weights, Tensor) or weights.dim() != 4:
            raise UsageError(f"{site} gave {_shown(weights)}, not (N, heads, L, L) weights")
        per_sample = weights.detach().float().mean(1).cpu()  # the heads' mean
        black = torch.zeros(*per_sample.shape[-2:], 3, dtype=torch.uint8)
        scale = max(1, math.ceil(_ATTENTION_SIZE / max(per_sample.shape[-2:])))
        tiles = [overlay(black, w, cmap=self.cmap, alpha=1.0) for w in per_sample]
        return [t.repeat_interleave(scale, 0).repeat_interleave(scale, 1) for t in tiles]


def _device(model: nn.Module) -> torch.device:
    first = next(model.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _shown(value: Any) -> str:
    if isinstance(value, Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return type(value).__name__


def _side_by_side(tiles: list[Tensor]) -> Tensor:
    """Tiles ``(h, w, 3)`` in a row, ``_GAP`` white pixels apart (shorter ones padded)."""
    height = max(t.shape[0] for t in tiles)
    parts: list[Tensor] = []
    for i, tile in enumerate(tiles):
        if i:
            parts.append(torch.full((height, _GAP, 3), 255, dtype=torch.uint8))
        pad = torch.full((height - tile.shape[0], tile.shape[1], 3), 255, dtype=torch.uint8)
        parts.append(torch.cat([tile, pad]))
    return torch.cat(parts, dim=1)
