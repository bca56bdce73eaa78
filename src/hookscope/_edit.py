"""``edit``: temporarily change what flows through selected layers.

An :class:`Edit` is a tensor -> tensor function plus where it applies: the layer's output
(default), an input, the gradient w.r.t. the output or an input, or the layer's parameter
gradients (clipping). Edits never modify tensors in place: they return new ones, and the
output keeps its structure (editing ``last_hidden_state`` of a ``ModelOutput`` keeps the rest).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from . import _tree
from ._capture import (
    Capture,
    bind_inputs,
    grad_alias,
    signature_of,
    unbind_inputs,
    why_no_grad,
)
from ._lifetime import HookSet
from ._records import LayerRecord
from ._session import Session
from ._types import Path, PathLike
from .errors import EditError

__all__ = [
    "Edit",
    "EditContext",
    "Editor",
    "ablate",
    "add",
    "call_checked",
    "clip_grad",
    "edit",
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
    """Where an edit is being applied: layer name, call index in this forward, path."""

    layer: str
    call: int
    path: Path


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
            raise ValueError(f"on={self.on!r}: use one of {', '.join(_TARGETS)}")


def transform(fn: Callable[[Tensor], Tensor], **where: Any) -> Edit:
    """Apply any function ``fn(tensor) -> tensor``; ``where``: ``on=``, ``at=``, ...."""
    return Edit(lambda t, ctx: fn(t), name=getattr(fn, "__name__", "transform"), **where)


def replace(value: Tensor | float, **where: Any) -> Edit:
    """Replace with ``value`` (broadcast to the original shape)."""

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        v = torch.as_tensor(value, dtype=t.dtype, device=t.device)
        return v.expand(t.shape).clone()

    return Edit(fn, name="replace", **where)


def add(delta: Tensor | float, **where: Any) -> Edit:
    """Add ``delta`` (e.g. a steering vector), broadcast."""
    return Edit(lambda t, ctx: t + _like(delta, t), name="add", **where)


def scale(factor: Tensor | float, **where: Any) -> Edit:
    """Multiply by ``factor``."""
    return Edit(lambda t, ctx: t * _like(factor, t), name="scale", **where)


def ablate(**where: Any) -> Edit:
    """Zero-ablate: replace with zeros."""
    return Edit(lambda t, ctx: torch.zeros_like(t), name="ablate", **where)


def mean_ablate(mean: Tensor | None = None, *, dims: Sequence[int] = (0,), **where: Any) -> Edit:
    """Replace with ``mean`` (broadcast), or by default with the mean over ``dims`` (batch)."""

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        m = _like(mean, t) if mean is not None else t.mean(dim=tuple(dims), keepdim=True)
        return m.expand(t.shape).clone()

    return Edit(fn, name="mean_ablate", **where)


def patch(source: Capture | LayerRecord, **where: Any) -> Edit:
    """Replace with the values a previous :func:`capture` recorded (activation patching).

    The n-th call of the layer in this forward gets the n-th captured call of the same layer
    (``source`` may be the whole capture or one layer's record).
    """

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        record = source if isinstance(source, LayerRecord) else source[ctx.layer]
        if ctx.call >= len(record.calls):
            raise EditError(
                f"patch for {ctx.layer!r}: the source captured {len(record.calls)} call(s) but "
                f"this is call {ctx.call} of the forward"
            )
        call = record.calls[ctx.call]
        kind = where.get("on", "output")
        tree = (
            call.output
            if kind == "output"
            else call.grad
            if kind == "grad"
            else call.inputs
            if kind == "input"
            else call.grad_inputs
        )
        value: Tensor = _tree.get(tree, ctx.path)
        return value.to(t.device).clone()

    return Edit(fn, name="patch", **where)


def clip_grad(*, value: float | None = None, norm: float | None = None) -> Edit:
    """Clip each of the layer's parameter gradients: elementwise to ``[-value, value]``
    and/or rescaled to at most ``norm`` (2-norm per parameter tensor), as each gradient
    arrives in backward (article 003's ``register_hook`` clipping)."""
    if value is None and norm is None:
        raise ValueError("clip_grad needs value= or norm= (or both)")

    def fn(g: Tensor, ctx: EditContext) -> Tensor:
        if value is not None:
            g = g.clamp(-value, value)
        if norm is not None:
            total = torch.linalg.vector_norm(g)
            g = g * torch.clamp(norm / (total + 1e-6), max=1.0)
        return g

    return Edit(fn, on="param_grad", name="clip_grad")


def _like(value: Any, t: Tensor) -> Any:
    return value.to(t.device) if isinstance(value, Tensor) else value


# -- applying ---------------------------------------------------------------------------


def _paths(edit: Edit, tree: Any, layer: str, first_input: bool) -> list[Path]:
    if edit.at == "*":
        return [p for p, _ in _tree.leaves(tree)]
    if edit.at is not None:
        path = _tree.as_path(edit.at)
        try:
            _tree.get(tree, path)
        except KeyError:
            raise EditError(
                f"edit {edit.name!r} on {layer!r}: no {_tree.path_str(path) or 'value'} in its "
                f"{edit.on} {_tree.describe(tree)}"
            ) from None
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


def _checked(edit: Edit, ctx: EditContext, old: Tensor, grad: bool) -> Tensor:
    where = f"edit {edit.name!r} on {ctx.layer!r} {edit.on}{_tree.path_str(ctx.path)}"
    new = call_checked(
        lambda t: edit.fn(t, ctx), old, where, grad=grad, allow_shape_change=edit.allow_shape_change
    )
    assert new is not None
    return new


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
    gradients). ``None`` means "unchanged" where ``allow_none``."""
    version = old._version
    new = fn(old)
    if old._version != version:
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
            else "; pass allow_shape_change=True if meant"
        )
    )


class Editor(Session):
    """Applies edits while open; see :func:`edit`."""

    def __init__(
        self,
        model: nn.Module,
        edits: Mapping[Any, Edit | Callable[[Tensor], Tensor] | Sequence[Edit]],
        *,
        recompile: bool = False,
    ) -> None:
        super().__init__(model, recompile=recompile)
        self._plan: dict[str, list[Edit]] = {}
        for selector, value in edits.items():
            for name in self._layers.select(selector):
                self._plan.setdefault(name, []).extend(_as_edits(value))
        #: how many times edits were applied per layer (forward edits; grads as they arrive)
        self.applied: dict[str, int] = dict.fromkeys(self._plan, 0)
        self._calls: dict[str, int] = {}

    def open(self) -> Editor:
        """Install the edits (``with`` does this); pair with :meth:`close`."""
        opened: Editor = super().open()
        return opened

    def __enter__(self) -> Editor:
        return self.open()

    def _new_pass(self) -> None:
        self._calls.clear()

    def _install(self, hooks: HookSet) -> None:
        for name, edits in self._plan.items():
            self._install_layer(hooks, name, self._layers.modules[name], edits)

    def _install_layer(
        self, hooks: HookSet, name: str, module: nn.Module, edits: list[Edit]
    ) -> None:
        on_in = [e for e in edits if e.on in ("input", "input_grad")]
        on_out = [e for e in edits if e.on in ("output", "grad")]
        if on_in:
            pre = functools.partial(self._pre, name, signature_of(module), on_in, not on_out)
            hooks.forward_pre(module, pre, with_kwargs=True)
        if on_out:
            hooks.forward(module, functools.partial(self._post, name, on_out))
        for edit in (e for e in edits if e.on == "param_grad"):
            for pname, param in module.named_parameters():
                if param.requires_grad:
                    ctx = EditContext(name, 0, (pname,))
                    hooks.tensor(param, functools.partial(self._grad, edit, ctx))

    # -- hooks ----------------------------------------------------------------------------
    def _call_index(self, name: str, bump: bool) -> int:
        index = self._calls.get(name, 0)
        if bump:
            self._calls[name] = index + 1
        return index

    def _pre(
        self,
        name: str,
        sig: Any,
        edits: list[Edit],
        bump: bool,
        module: nn.Module,
        args: Any,
        kwargs: Any,
    ) -> tuple[Any, Any]:
        index = self._call_index(name, bump)
        bound = bind_inputs(sig, args, kwargs)
        for edit in edits:
            bound = self._apply(edit, bound, name, index, first_input=True)
        return unbind_inputs(sig, args, kwargs, bound)

    def _post(self, name: str, edits: list[Edit], module: nn.Module, args: Any, output: Any) -> Any:
        index = self._call_index(name, bump=True)
        new = output
        for edit in edits:
            new = self._apply(edit, new, name, index, first_input=False)
        return None if new is output else new

    def _apply(self, edit: Edit, tree: Any, name: str, index: int, first_input: bool) -> Any:
        for path in _paths(edit, tree, name, first_input):
            old = _tree.get(tree, path)
            if not isinstance(old, Tensor):
                raise EditError(
                    f"edit {edit.name!r} on {name!r}: {edit.on}{_tree.path_str(path)} is "
                    f"{type(old).__name__}, not a tensor"
                )
            ctx = EditContext(name, index, path)
            if edit.on in ("grad", "input_grad"):
                new = self._hook_grad(edit, ctx, old)
            else:
                new = _checked(edit, ctx, old, grad=False)
                self.applied[name] += 1
            tree = _tree.replace_at(tree, path, new)
        return tree

    def _hook_grad(self, edit: Edit, ctx: EditContext, t: Tensor) -> Tensor:
        if not t.requires_grad:
            raise EditError(
                f"cannot edit the gradient of {ctx.layer!r} {edit.on}{_tree.path_str(ctx.path)}: "
                f"it has no gradient because {why_no_grad()}"
            )
        # A stand-in: the edit then changes only the gradient crossing this layer's boundary.
        alias = grad_alias(t)
        assert self._hooks is not None
        self._hooks.tensor(alias, functools.partial(self._grad, edit, ctx))
        return alias

    def _grad(self, edit: Edit, ctx: EditContext, grad: Tensor) -> Tensor:
        self.applied[ctx.layer] += 1
        return _checked(edit, ctx, grad, grad=True)


def _as_edits(value: Any) -> list[Edit]:
    if isinstance(value, Edit):
        return [value]
    if isinstance(value, (list, tuple)):
        return [e for v in value for e in _as_edits(v)]
    if callable(value):
        return [transform(value)]
    raise TypeError(
        f"cannot edit with {value!r}: give an Edit (hookscope.scale(...), ablate(), ...), a "
        "function tensor -> tensor, or a list of them"
    )


def edit(
    model: nn.Module,
    edits: Mapping[Any, Edit | Callable[[Tensor], Tensor] | Sequence[Edit]],
    *,
    recompile: bool = False,
) -> Editor:
    """Temporarily edit layers' outputs, inputs or gradients.

    Args:
        model: the model (wrappers are seen through).
        edits: ``{selector: edit}``; an edit is an :class:`Edit` (``hookscope.ablate()``,
            ``scale(k)``, ``add(v)``, ``replace(v)``, ``mean_ablate()``, ``patch(cap)``,
            ``transform(fn)``, ``clip_grad(...)``), a plain function tensor -> tensor (applied
            to the output), or a list of them (applied in order).
        recompile: see :func:`capture`.

    Returns:
        An :class:`Editor`, a context manager; edits apply only inside the ``with`` block.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> with hs.edit(model, {"1": hs.ablate()}):
        ...     out = model(torch.ones(2, 3))
        >>> torch.equal(out, model[2].bias.expand(2, 1))
        True
    """
    return Editor(model, edits, recompile=recompile)
