"""The template every layer-attribution method (the CAM family) fills in.

The base owns the forward (eval mode, restored after; gradients on even under ``no_grad``
when the method needs them), the layer's output (through a :class:`~._session.Tap`), where
its channels are (``_layout``), targets, batching, the gradient and post-processing. A method
adds only :meth:`LayerMethod.combine`, which gets everything it may use in a
:class:`Context`: activations ``(N, C, h, w)`` and gradients -> maps ``(N, h, w)``.

Gradients come from ``torch.autograd.grad`` to the layer only: the backward stops at the
layer and no parameter's ``.grad`` is touched. Nothing is read back from the device on the
way (targets are checked on the host, see ``_targets``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import LayerSelector, call_model, leaves, map_tensors, run_eagerly, training_mode
from ..errors import UsageError
from ._layout import Grid, grid_for, spatial_size
from ._session import Tap
from ._targets import Resolved, Target, resolve

__all__ = ["Context", "Explanation", "LayerMethod", "normalize"]


@dataclass(frozen=True)
class Explanation:
    """Maps for a batch: ``raw`` at the layer's resolution ``(N, h, w)``, as the method defines
    it (ReLU where the paper applies one; signed otherwise), and ``maps`` upsampled to the
    input's size ``(N, H, W)`` (for a 1-D signal ``(N, L)`` and ``(N, L_in)``; input-space
    methods give ``(N, C, H, W)`` for both; token maps of text ``(N, T)``); ``targets`` are
    the class indices used (None for callable targets) and ``scores`` each sample's target
    score.

    The path and perturbation methods also fill ``attributions``: one value per feature of
    the tensor they explain, in its own layout, as Captum returns them (the input's shape for
    input methods, the layer's output shape for layer methods, ``(N, T)`` over every token for
    attention maps); and, when asked, ``delta``: integrated gradients' convergence delta per
    sample, ``sum(attributions) - (S(x) - S(baseline))``, as Captum computes it."""

    raw: Tensor
    maps: Tensor
    targets: Tensor | None
    scores: Tensor
    method: str
    layer: str
    attributions: Tensor | None = None
    delta: Tensor | None = None

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


@dataclass(frozen=True)
class Context:
    """Everything :meth:`LayerMethod.combine` may use for one batch.

    Attributes:
        acts: the layer's output as maps ``(N, C, h, w)`` (1-D signals: ``h = 1``).
        grads: the target scores' gradient w.r.t. it, same shape; None for gradient-free
            methods.
        targets: the class indices explained ``(N,)``; None for callable targets.
        scores: each sample's target score ``(N,)``, detached.
        inputs: the model's inputs as given.
        image: the image tensor in them ``(N, C, H, W)`` (or ``(N, C, L)``).
        target: the checked targets, to score the outputs of extra forwards.
        grid: how the layer's output became ``acts`` (Ablation-CAM changes the output itself).
    """

    acts: Tensor
    grads: Tensor | None
    targets: Tensor | None
    scores: Tensor
    inputs: Any
    image: Tensor
    target: Resolved
    grid: Grid

    @property
    def gradient(self) -> Tensor:
        """``grads``, for the methods that declare ``needs_grad`` (always computed then)."""
        if self.grads is None:
            raise RuntimeError("this method needs gradients: set needs_grad = True on it")
        return self.grads

    @property
    def classes(self) -> Tensor:
        """``targets``, for the methods that declare ``class_targets`` (never None then)."""
        if self.targets is None:
            raise RuntimeError("this method needs class targets: set class_targets = True")
        return self.targets


class LayerMethod:
    """Base of the CAM family: ``Method(model, layers)(x, targets=...) -> Explanation``.

    Args:
        model: the model (left as found: eval mode during the call, restored after).
        layers: the layer to explain: its name, or any selector matching exactly one layer
            (a module: a CAM's map layout comes from the module that makes it). The first
            floating-point tensor it returns is explained (tuple and dict outputs work).
        reshape: turn the layer's output into maps yourself: a function returning
            ``(N, C, h, w)`` for images, or ``(N, C, L)`` for 1-D signals (inputs
            ``(N, C, L_in)``), e.g. ``lambda t: t.permute(0, 3, 1, 2)`` for channels-last
            maps. Default: decided from the layer's type and the shapes (see
            ``hookscope.explain._layout``); a layout neither decides is refused, asking for
            it.

    Raises:
        UsageError: the selector matches no layer or several.
    """

    name: ClassVar[str] = ""
    relu: ClassVar[bool] = True  # the paper's ReLU on the weighted sum
    needs_grad: ClassVar[bool] = True
    class_targets: ClassVar[bool] = False  # only class indices make sense (CAM's weights)

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        reshape: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        self._tap = Tap(model, layers, type(self).__name__)
        self.layer, self.module = self._tap.name, self._tap.module
        self.model = model
        self.reshape = reshape

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs; the
        first floating-point tensor is the image) for ``targets`` (see ``_targets``).

        Raises:
            UsageError: bad targets; a layer that does not run exactly once, whose layout
                is ambiguous, or (gradient methods) that does not influence the target.
        """
        image = image_of(x)
        target = resolve(targets, image.shape[0]).to(image.device)
        if self.class_targets and target.fn is not None:
            raise UsageError(
                f"{type(self).__name__} explains classes: pass class indices as targets= "
                "(or None for each image's top class), not a callable"
            )
        with run_eagerly(self.model), evaluating(self._tap):
            ctx = self._forward(x, image, target)
            cam = self.combine(ctx)
        if self.relu:
            cam = cam.clamp_min(0)
        return self._explanation(cam, ctx)

    def combine(self, ctx: Context) -> Tensor:
        """The method itself: ``ctx.acts`` (and ``ctx.grads``) -> maps ``(N, h, w)``."""
        raise NotImplementedError

    def _forward(self, x: Any, image: Tensor, target: Resolved) -> Context:
        tap, grad = self._tap, self.needs_grad
        tap.state.values = True
        inputs = with_grad(x, image)[0] if grad else x
        with torch.set_grad_enabled(grad):
            try:
                with tap:
                    output = call_model(self.model, inputs)
            except BaseException:
                tap.state.seen = []  # what it holds keeps the forward's graph alive
                raise
            act, edge, shape = tap.take()
            s, index = target.score(output)
            grid = self._grid(shape, image)
            grads = grid.place(self._gradient(s, edge)) if grad else None
        assert act is not None  # tap.values is set
        return Context(grid.place(act), grads, index, s.detach(), x, image, target, grid)

    def _grid(self, shape: tuple[int, ...], image: Tensor) -> Grid:
        return grid_for(shape, self.module, self.layer, spatial_size(image), self.reshape)

    def _gradient(self, s: Tensor, edge: Any) -> Tensor:
        """d sum(scores) / d (layer output), by ``autograd.grad`` to the layer only."""
        if edge is None:
            why = self._tap.state.why
            fix = (
                ""
                if "Fix:" in why
                else (
                    ". Fix: run the method outside torch.inference_mode(), and check that the "
                    "model does not detach what reaches the layer"
                )
            )
            raise UsageError(f"layer {self.layer!r}'s output has no gradient: {why}{fix}")
        grad = None
        if s.requires_grad:
            (grad,) = torch.autograd.grad(s.sum(), inputs=[edge], allow_unused=True)
        if grad is None:
            raise UsageError(
                f"layer {self.layer!r} does not influence the target scores: its output never "
                "reaches them (a branch whose result the model does not use, e.g. a last "
                "stage the classifier does not read), so its gradient does not exist. "
                "Explain a layer on the path from the input to the output"
            )
        return grad.detach()

    def _explanation(self, cam: Tensor, ctx: Context) -> Explanation:
        size = spatial_size(ctx.image)
        grid = size if len(size) == 2 else (1, size[0])
        maps = F.interpolate(cam[:, None], size=grid, mode="bilinear", align_corners=False)
        maps = maps[:, 0]
        if ctx.grid.line:  # 1-D: (N, 1, L) -> (N, L)
            cam, maps = cam[:, 0], maps[:, 0]
        return Explanation(cam, maps, ctx.targets, ctx.scores, self.name, self.layer)


def evaluating(session: Any) -> contextlib.AbstractContextManager[None]:
    """Eval mode for the call, every module's flag restored after (shared with the calls
    other threads make at the same time, see ``training_mode``)."""
    return training_mode(session.model, False)


def image_of(x: Any) -> Tensor:
    """The image in the inputs: ``x`` itself, or their first floating-point tensor."""
    if isinstance(x, Tensor):
        image = x
    else:
        image = next((t for _, t in leaves(x) if t.is_floating_point()), None)  # type: ignore[assignment]
        if image is None:
            raise UsageError("the inputs hold no floating-point image tensor to explain")
    if image.dim() < 3:
        raise UsageError(
            f"expected a batch of images (N, C, H, W) or signals (N, C, L), got shape "
            f"{tuple(image.shape)}"
        )
    if image.shape[0] == 0:
        raise UsageError(
            f"the batch is empty (shape {tuple(image.shape)}): give at least one image or signal"
        )
    return image


def with_grad(x: Any, image: Tensor) -> tuple[Any, Tensor]:
    """``(inputs, copy)``: the inputs with the image, wherever it sits in them, replaced by a
    copy that requires grad (the layer then has a gradient even when every parameter is
    frozen), and that copy."""
    copy = (image.clone() if image.is_inference() else image.detach()).requires_grad_(True)
    return map_tensors(lambda _, t: copy if t is image else t, x), copy
