"""The template every layer-attribution method (the CAM family) fills in.

The base owns the forward (eval mode, restored after; gradients on even under ``no_grad``),
the activation of the target layer, targets, batching, the gradient and post-processing. A
method adds only :meth:`LayerMethod.combine`: activations ``(N, C, h, w)`` and gradients ->
maps ``(N, h, w)``.

Gradients come from ``torch.autograd.grad`` to the layer only: the backward stops at the
layer and no parameter's ``.grad`` is touched. The activation's gradient edge is taken in the
forward hook, so an in-place change of the layer's output further on (``h += residual``) does
not redirect the gradient to the changed tensor.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import HookSet, Layers, call_model, leaves, map_tensors, training_mode
from ..errors import UsageError
from ._targets import Target, scores

__all__ = ["Explanation", "LayerMethod", "normalize", "to_grid"]


@dataclass(frozen=True)
class Explanation:
    """Maps for a batch: ``raw`` at the layer's resolution ``(N, h, w)``, as the method defines
    it (ReLU where the paper applies one; signed otherwise), and ``maps`` upsampled to the
    input's size ``(N, H, W)``; ``targets`` are the class indices used (None for callable
    targets) and ``scores`` each sample's target score."""

    raw: Tensor
    maps: Tensor
    targets: Tensor | None
    scores: Tensor
    method: str
    layer: str

    def normalized(self, *, per: Literal["image", "batch"] = "image") -> Tensor:
        """``maps`` scaled to 0..1 per image or with one scale for the batch (see
        :func:`normalize`)."""
        return normalize(self.maps, per=per)


def normalize(maps: Tensor, *, per: Literal["image", "batch"] = "image") -> Tensor:
    """Min-max scale ``(N, ...)`` maps to 0..1; a constant map becomes zeros, never NaN."""
    if per not in ("image", "batch"):
        raise UsageError(f"per must be 'image' or 'batch', got {per!r}")
    flat = maps.reshape(maps.shape[0], -1) if per == "image" else maps.reshape(1, -1)
    lo = flat.amin(1, keepdim=True)
    span = flat.amax(1, keepdim=True) - lo
    out = torch.where(span > 0, (flat - lo) / torch.where(span > 0, span, 1), 0)
    return out.reshape(maps.shape)


def to_grid(act: Tensor, size: tuple[int, int] | None) -> Tensor:
    """Layer output as ``(N, C, h, w)``: conv maps as they are; tokens ``(N, T, C)`` on the
    patch grid of an input of ``size`` (H, W), leading CLS / distillation / register tokens
    dropped; ``(N, h, w, C)`` channels-last maps (Swin, ConvNeXt stages) moved to channels
    first."""
    if act.dim() == 4:
        if size is not None and act.shape[1] != act.shape[3]:
            h, w = act.shape[1], act.shape[2]
            if math.isclose(h / w, size[0] / size[1]) and act.shape[3] > act.shape[1]:
                return act.permute(0, 3, 1, 2)  # channels last
        return act
    if act.dim() != 3:
        raise UsageError(
            f"the layer's output has shape {tuple(act.shape)}: CAMs need (N, C, h, w) maps or "
            "(N, tokens, C) token sequences; pick another layer or pass reshape="
        )
    n, t, c = act.shape
    grid = _token_grid(t, size)
    if grid is None:
        raise UsageError(
            f"cannot place {t} tokens on a grid for an input of size {size}: pass reshape= "
            "(a function (N, T, C) -> (N, C, h, w))"
        )
    prefix, (h, w) = grid
    return act[:, prefix:].reshape(n, h, w, c).permute(0, 3, 1, 2)


def _token_grid(tokens: int, size: tuple[int, int] | None) -> tuple[int, tuple[int, int]] | None:
    """(prefix tokens, (h, w)): the fewest leading tokens (CLS, distillation, registers) whose
    removal leaves an h x w grid with the input's aspect ratio."""
    for prefix in range(0, min(tokens, 9)):
        rest = tokens - prefix
        for h in range(1, rest + 1):
            if rest % h:
                continue
            w = rest // h
            if size is None and h == w:
                return prefix, (h, w)
            if size is not None and h * size[1] == w * size[0]:
                return prefix, (h, w)
    return None


class LayerMethod:
    """Base of the CAM family: ``Method(model, layer)(x, targets=...) -> Explanation``.

    Args:
        model: the model (left as found: eval mode during the call, restored after).
        layer: one layer's name (or any selector matching exactly one layer).
        reshape: turn the layer's output into ``(N, C, h, w)`` yourself (default: inferred,
            see :func:`to_grid`).
    """

    name: ClassVar[str] = ""
    relu: ClassVar[bool] = True  # the paper's ReLU on the weighted sum
    needs_grad: ClassVar[bool] = True
    reference: ClassVar[str] = ""

    def __init__(
        self,
        model: nn.Module,
        layer: Any,
        *,
        reshape: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        found = Layers(model).select(layer)
        if len(found) != 1:
            raise UsageError(
                f"{type(self).__name__} explains one layer; {layer!r} matches {len(found)}: "
                f"{sorted(found)[:5]}"
            )
        ((self.layer, self.module),) = found.items()
        self.model = model
        self.reshape = reshape

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs; the
        first tensor is the image) for ``targets`` (see :mod:`._targets`)."""
        image = _image(x)
        acts, grads, s, index = self._forward(x, image, targets)
        self.call = (x, image, targets, s.detach())  # for methods that run the model again
        try:
            cam = self.combine(acts, grads, index)
        finally:
            del self.call
        if self.relu:
            cam = cam.clamp_min(0)
        size = tuple(image.shape[-2:])
        maps = F.interpolate(cam[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
        return Explanation(cam, maps, index, s.detach(), self.name, self.layer)

    def combine(self, acts: Tensor, grads: Tensor | None, targets: Tensor | None) -> Tensor:
        """The method itself: ``(N, C, h, w)`` activations and gradients -> ``(N, h, w)``."""
        raise NotImplementedError

    def _forward(
        self, x: Any, image: Tensor, targets: Target
    ) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
        seen: list[tuple[Tensor, Any]] = []

        def grab(module: nn.Module, args: Any, output: Any) -> None:
            tensor = next((t for _, t in leaves(output)), None)
            if tensor is None:
                raise UsageError(f"layer {self.layer!r} returned no tensor to explain")
            edge = torch.autograd.graph.get_gradient_edge(tensor) if tensor.requires_grad else None
            seen.append((tensor.detach().clone(), edge))

        hooks = HookSet()
        try:
            hooks.forward(self.module, grab)
            with training_mode(self.model, False), torch.enable_grad():
                output = call_model(self.model, _with_grad(x, image)[0])
                if len(seen) != 1:
                    raise UsageError(
                        f"layer {self.layer!r} ran {len(seen)} times in one forward; a CAM needs "
                        "a layer that runs once"
                    )
                s, index = scores(output, targets, image.shape[0])
                grads = None
                if self.needs_grad:
                    if seen[0][1] is None:
                        raise UsageError(
                            f"layer {self.layer!r}'s output does not require grad (was the "
                            "model run under torch.inference_mode()?), so it has no gradient"
                        )
                    (grads,) = torch.autograd.grad(s.sum(), inputs=[seen[0][1]])
        finally:
            hooks.close()
        size = (image.shape[-2], image.shape[-1])
        shape = self.reshape or (lambda t: to_grid(t, size))
        acts = shape(seen[0][0])
        return acts, None if grads is None else shape(grads.detach()), s, index


def _image(x: Any) -> Tensor:
    if isinstance(x, Tensor):
        image = x
    else:
        image = next((t for _, t in leaves(x) if t.is_floating_point()), None)  # type: ignore[assignment]
        if image is None:
            raise UsageError("the inputs hold no floating-point image tensor to explain")
    if image.dim() < 3:
        raise UsageError(f"expected a batch of images (N, C, H, W), got shape {tuple(image.shape)}")
    return image


def _with_grad(x: Any, image: Tensor) -> tuple[Any, Tensor]:
    """``(inputs, copy)``: the inputs with the image, wherever it sits in them, replaced by a
    copy that requires grad (the layer then has a gradient even when every parameter is
    frozen), and that copy."""
    copy = (image.clone() if image.is_inference() else image.detach()).requires_grad_(True)
    return map_tensors(lambda _, t: copy if t is image else t, x), copy
