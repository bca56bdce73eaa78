"""Edits: what to change at one place of a layer, and the factories that build them.

An :class:`Edit` is a tensor -> tensor function plus where it applies: the layer's output
(default), an input, the gradient w.r.t. the output or an input, or the layer's parameter
gradients (clipping, see ``_clip``). Edits never modify tensors in place: they return new
ones. Values given to an edit (``add(v)``, ``scale(t)``, ``mean_ablate(mean=m)``,
``replace(v)``) are cast to the dtype and device of the tensor they apply to when both are
floating point, so a float32 steering vector works on a bfloat16 model.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor

from ..errors import EditError, UsageError
from . import _torch, _tree
from ._records import LayerRecord
from ._types import EditTarget, Path, PathLike

__all__ = [
    "Edit",
    "EditContext",
    "ablate",
    "add",
    "call_checked",
    "mean_ablate",
    "patch",
    "replace",
    "scale",
    "transform",
]

Target = Literal["output", "input", "grad", "input_grad", "param_grad"]
_TARGETS = ("output", "input", "grad", "input_grad", "param_grad")


@dataclass(frozen=True)
class EditContext:
    """Where an edit is being applied: layer name, call index in this forward, path, and the
    forward's generation step (the editor's count of the model's forwards, from 0; None for a
    layer called outside a forward of the model)."""

    layer: str
    call: int
    path: Path
    step: int | None = None


@dataclass(frozen=True)
class Edit:
    """A tensor -> tensor change applied at one place of a layer.

    Attributes:
        fn: ``fn(tensor, context) -> new tensor``; must not modify ``tensor`` in place.
        on: ``"output"``, ``"input"``, ``"grad"`` (w.r.t. the output), ``"input_grad"``
            (w.r.t. an input, flowing through this layer) or ``"param_grad"``.
        at: which tensor: a key/index/attribute path into the output, or an input's
            parameter name; ``None`` = the only tensor (or the first argument for inputs);
            ``"*"`` = every tensor leaf.
        allow_shape_change: accept a result of another shape / dtype (not for gradients).
    """

    fn: Callable[[Tensor, EditContext], Tensor]
    on: Target = "output"
    at: PathLike = None
    allow_shape_change: bool = False
    name: str = field(default="transform", compare=False)

    def __post_init__(self) -> None:
        if self.on not in _TARGETS:
            raise UsageError(f"on={self.on!r}: use one of {', '.join(_TARGETS[:4])}")
        if self.allow_shape_change and self.on in ("grad", "input_grad", "param_grad"):
            raise UsageError("allow_shape_change=True applies to values; gradients keep shape")


def transform(
    fn: Callable[[Tensor], Tensor],
    *,
    on: EditTarget = "output",
    at: PathLike = None,
    allow_shape_change: bool = False,
) -> Edit:
    """Apply any function ``fn(tensor) -> tensor`` (it must return a new tensor)."""
    if not callable(fn):
        raise UsageError(f"transform needs a function tensor -> tensor, not {fn!r}")
    name = getattr(fn, "__name__", "transform")
    return Edit(lambda t, ctx: fn(t), on, at, allow_shape_change, name)


def replace(value: Tensor | float, *, on: EditTarget = "output", at: PathLike = None) -> Edit:
    """Replace with ``value`` (broadcast to the original shape, cast to its dtype).

    Raises:
        EditError: in the forward, naming the layer and both shapes, if ``value`` does not
            broadcast to the tensor it replaces (nothing is changed).
    """
    _check_value(value, "replace")

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        v = torch.as_tensor(value, dtype=t.dtype, device=t.device)
        _fits(v, t, ctx, "replace", on, "value")
        return v.expand(t.shape).clone()

    return Edit(fn, on, at, name="replace")


def add(delta: Tensor | float, *, on: EditTarget = "output", at: PathLike = None) -> Edit:
    """Add ``delta`` (e.g. a steering vector), broadcast to the tensor's shape (an
    :class:`~hookscope.EditError` naming both shapes if it does not broadcast)."""
    _check_value(delta, "add")

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        d = _like(delta, t)
        _fits(d, t, ctx, "add", on, "delta")
        out: Tensor = t + d
        return out

    return Edit(fn, on, at, name="add")


def scale(factor: Tensor | float, *, on: EditTarget = "output", at: PathLike = None) -> Edit:
    """Multiply by ``factor`` (a tensor broadcasts to the tensor's shape, or
    :class:`~hookscope.EditError`)."""
    _check_value(factor, "scale")

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        k = _like(factor, t)
        _fits(k, t, ctx, "scale", on, "factor")
        out: Tensor = t * k
        return out

    return Edit(fn, on, at, name="scale")


def ablate(*, on: EditTarget = "output", at: PathLike = None) -> Edit:
    """Zero-ablate: replace with zeros."""
    return Edit(lambda t, ctx: torch.zeros_like(t), on, at, name="ablate")


def mean_ablate(
    mean: Tensor | None = None,
    *,
    dims: Sequence[int] = (0,),
    on: EditTarget = "output",
    at: PathLike = None,
) -> Edit:
    """Replace with ``mean`` (broadcast), or by default with the mean over ``dims`` (batch)."""
    if mean is not None:
        _check_value(mean, "mean_ablate")

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        m = _like(mean, t) if mean is not None else t.mean(dim=tuple(dims), keepdim=True)
        _fits(m, t, ctx, "mean_ablate", on, "mean")
        return m.expand(t.shape).clone()

    return Edit(fn, on, at, name="mean_ablate")


def patch(source: Any, *, on: EditTarget = "output", at: PathLike = None) -> Edit:
    """Replace with the values a previous :func:`capture` recorded (activation patching).

    The n-th call of the layer in this forward gets the n-th captured call of the same layer
    (``source`` may be the whole capture or one layer's record) in the same generation step
    (:attr:`Call.step`, e.g. a capture and an edit each around a ``generate()`` call, the
    edit perhaps with ``steps=``); a source that recorded one forward patches every forward.
    A source of batch 1 is broadcast over the batch: one clean run patched into a batch of
    corrupted prompts. Values are cast to the dtype of the tensor they replace when both are
    floating point. For ``on="grad"`` / ``"input_grad"`` the source must have captured
    gradients (``grads=True``).

    Raises:
        EditError: in the forward, if the source has fewer calls of the layer, or recorded a
            shape that is neither this call's nor this call's with a batch of 1.
    """
    if not isinstance(source, LayerRecord) and not hasattr(source, "records"):
        raise UsageError(f"patch needs a Capture or a LayerRecord, not {type(source).__name__}")

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        record = source if isinstance(source, LayerRecord) else source[ctx.layer]
        calls = _calls_of_step(record, ctx)
        if ctx.call >= len(calls):
            raise EditError(
                f"patch for {ctx.layer!r}: the source captured {len(calls)} call(s) "
                f"but this is call {ctx.call} of the forward"
            )
        call = calls[ctx.call]
        tree = (
            call.output
            if on == "output"
            else call.grad
            if on == "grad"
            else call.inputs
            if on == "input"
            else call.grad_inputs
        )
        value: Tensor = _like(_tree.get(tree, ctx.path), t)
        if value.shape == t.shape:
            return value.clone()
        if value.dim() == t.dim() and value.size(0) == 1 and value.shape[1:] == t.shape[1:]:
            return value.expand(t.shape).clone()  # one clean run, over the whole batch
        raise EditError(
            f"patch for {ctx.layer!r} {on}{_tree.path_str(ctx.path)}: the source recorded "
            f"{tuple(value.shape)} for call {ctx.call}, but this call has {tuple(t.shape)}. "
            "A patch takes the same shape, or a source of batch 1 (broadcast over the "
            "batch): capture the source with inputs of this shape (the same sequence length, "
            "padded), or patch chosen positions with hs.transform(lambda h: ...)"
        )

    return Edit(fn, on, at, name="patch")


def _calls_of_step(record: LayerRecord, ctx: EditContext) -> list[Any]:
    """The source's calls for this forward: those of the same step, or of its only one."""
    steps = record.steps
    if len(steps) <= 1:
        return record.calls
    if ctx.step in steps:
        return steps[ctx.step]
    raise EditError(
        f"patch for {ctx.layer!r}: the source recorded steps {list(steps)} and this is "
        f"step {ctx.step}; capture the source over the steps you patch (the same steps= as "
        "the edit's), or a single forward to patch into every one"
    )


def _fits(value: Any, t: Tensor, ctx: EditContext, edit: str, on: str, what: str) -> None:
    """Refuse a value that does not broadcast to ``t``'s shape, before anything is written."""
    if not isinstance(value, Tensor):
        return
    small, big = value.shape, t.shape
    fits = len(small) <= len(big) and all(
        a in (1, b) for a, b in zip(reversed(small), reversed(big), strict=False)
    )
    if not fits:
        raise EditError(
            f"{edit} on {ctx.layer!r} {on}{_tree.path_str(ctx.path)}: its {what} of shape "
            f"{tuple(value.shape)} does not broadcast to the {tuple(t.shape)} it edits; give "
            f"a {what} of that shape, or one that broadcasts to it (sizes 1 or missing in "
            "front)"
        )


def _check_value(value: Any, what: str) -> None:
    if not isinstance(value, (Tensor, numbers.Number)):
        raise UsageError(f"{what}({value!r}): use a number or a tensor")


def _like(value: Any, t: Tensor) -> Any:
    if not isinstance(value, Tensor):
        return value
    if value.is_floating_point() and t.is_floating_point():
        return value.to(device=t.device, dtype=t.dtype)
    return value.to(t.device)


def call_checked(
    fn: Callable[[Tensor], Any],
    old: Tensor,
    where: str,
    *,
    grad: bool,
    allow_shape_change: bool = False,
    allow_none: bool = False,
) -> Tensor | None:
    """``fn(old)``, refused if ``fn`` changed ``old`` in place or returned something that
    cannot stand in for it (another shape / dtype / device, unless allowed; never for
    gradients). ``None`` means "unchanged" where ``allow_none``. Inference tensors have no
    version counter, so an in-place change of one cannot be detected."""
    version = None if old.is_inference() else _torch.version(old)
    new = fn(old)
    if version is not None and _torch.version(old) != version:
        raise EditError(
            f"{where} modified its argument in place; return a new tensor instead "
            "(in-place edits of a hook's argument are unreliable in PyTorch)"
        )
    if new is None and allow_none:
        return None
    if not isinstance(new, Tensor):
        raise EditError(f"{where} returned {type(new).__name__}, not a tensor")
    if (allow_shape_change and not grad) or (
        new.shape == old.shape and new.dtype == old.dtype and new.device == old.device
    ):
        return new
    raise EditError(
        f"{where} changed {_tree.describe(old)} on {old.device} into {_tree.describe(new)} on "
        f"{new.device}"
        + (
            "; gradients must keep their shape"
            if grad
            else "; to change it on purpose, give the function as "
            "hs.transform(fn, allow_shape_change=True)"
        )
    )


def paths(edit: Edit, tree: Any, layer: str, first_input: bool) -> list[Path]:
    """The paths of ``tree`` (an output, or bound inputs) that ``edit`` applies to."""
    if edit.at == "*":
        return [p for p, _ in _tree.leaves(tree)]
    if edit.at is not None:
        path = _tree.as_path(edit.at)
        try:
            _tree.get(tree, path)
        except KeyError:
            raise EditError(_no_such_path(edit, tree, layer, path)) from None
        return [path]
    if first_input:
        return [(next(iter(tree)),)] if tree else []
    found = [p for p, _ in _tree.leaves(tree)]
    if len(found) != 1:
        hint = f"at={found[0][0]!r}" if found and found[0] else "at=..."
        raise EditError(
            f"edit {edit.name!r} on {layer!r}: its {edit.on} is {_tree.describe(tree)} with "
            f"{len(found)} tensors; say which one with at= (e.g. {hint}), or at='*' for all"
        )
    return found


def _no_such_path(edit: Edit, tree: Any, layer: str, path: Path) -> str:
    msg = (
        f"edit {edit.name!r} on {layer!r}: no {_tree.path_str(path) or 'value'} in its "
        f"{edit.on} {_tree.describe(tree)}"
    )
    if path and isinstance(path[0], int) and isinstance(tree, dict):
        fields = ", ".join(repr(k) for k in list(tree)[:6])
        msg += f"; its entries are selected by key, not position: at= one of {fields}"
    return msg
