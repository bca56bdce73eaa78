"""What captures and edits do with the operations their selectors pick (``_ops``).

An operation site is recorded and edited by the same code as a layer: the capture's
``_on_input`` / ``_on_output`` and the editor's ``_pre`` / ``_post`` (stores, ``keep=``,
``max_bytes``, gradients, checkpoint replays, ``patch``), with the operation's function in
the role of the module's ``forward``: its arguments are bound to the function's parameters
where Python can read them (``F.softmax``: ``input``, ``dim``...; SDPA: ``query``, ``key``,
``value``, ``attn_mask``...), else named ``arg0``, ``arg1``... An ``attention_weights`` site
is handled by :func:`_capture_weights` / :func:`_edited_sdpa` (see ``_attention``).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import Tensor

from ..errors import EditError, UsageError
from . import _tree
from ._attention import WAITING, chain_of, explicit, probabilities, sdpa_signature, weights_grad
from ._autograd import backward_id, why_no_grad
from ._bind import Binder
from ._ops import SDPA, WEIGHTS, OpSelector, forward_op, op_name
from ._opwatch import OpWatch
from ._records import _OUTPUT, Call
from ._session import ModuleCall, Session
from ._watch import PENDING

if TYPE_CHECKING:
    from ._capture import Capture, _Site
    from ._editor import Editor, _Layer

__all__ = ["OpSession", "capture_op", "check_edits", "edit_op", "op_binder", "op_plan"]

S = TypeVar("S")
Key = tuple[str, int | None]  # (operation, k)
_BINDERS: dict[Any, Binder] = {}
_NO_INPUT_GRADS = (
    "attention weights are computed from the call's inputs, not part of its graph: select "
    "'...::scaled_dot_product_attention' (grads=True) for the gradients of its inputs"
)


def op_binder(func: Any) -> Binder:
    """The binder of an operation's arguments (cached per function)."""
    python = type(func) is types.FunctionType
    key = func.__code__ if python else func
    binder = _BINDERS.get(key)
    if binder is None:
        target = sdpa_signature if not python and op_name(func) == SDPA else func
        binder = _BINDERS[key] = Binder(target)
    return binder


class OpSession(Session):
    """A session that may select operations: the calls of the modules that hold operation
    sites, and only those (``_ops`` is None otherwise), open and close its ``OpWatch``."""

    _ops: OpWatch | None = None

    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._ops is not None
        self._ops.enter(call)

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        assert self._ops is not None
        self._ops.leave(call)

    def _raised(self, call: ModuleCall) -> None:
        assert self._ops is not None
        self._ops.leave(call)

    def _needs_python(self) -> bool:
        return self._ops is not None

    def _close_ops(self) -> None:
        if self._ops is not None:
            self._ops.close()


def op_plan(sites: Iterable[tuple[OpSelector | None, S]]) -> dict[str, dict[Key, S]]:
    """``{module name: {(op, k): site}}`` of the operation sites among ``(op, site)`` pairs."""
    plan: dict[str, dict[Key, S]] = {}
    for op, site in sites:
        if op is not None:
            plan.setdefault(op.module, {})[op.op, op.k] = site
    return plan


def _no_arguments() -> None:
    """The signature of an attention-weights site's own call: it takes nothing."""


_NO_ARGUMENTS = Binder(_no_arguments)


# -- capture ----------------------------------------------------------------------------------
Run = Callable[[tuple[Any, ...], dict[str, Any]], Any]


def capture_op(
    cap: Capture,
    call: ModuleCall,
    sites: list[_Site],
    weights: list[_Site],
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The capture's handler (``OpWatch``): record the call for each of ``sites`` and, for an
    SDPA call, its attention weights for each of ``weights`` (the first selector outermost)."""
    run: Run = functools.partial(forward_op, func)
    for site in reversed(sites):
        run = functools.partial(_capture_value, cap, site, func, run)
    for wsite in reversed(weights):
        run = functools.partial(_capture_weights, cap, wsite, func, run)
    return run(args, kwargs)


def _capture_value(
    cap: Capture, site: _Site, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if cap._inputs or cap._grads:
        site.binder = op_binder(func)
        cap._on_input(site, site.module, args, kwargs)
    out = run(args, kwargs)
    new = cap._on_output(site, site.module, args, out)
    return out if new is None else new


def _capture_weights(
    cap: Capture, wsite: _Site, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    bound = op_binder(func).bind(args, kwargs)
    if backward_id() != -1:  # a checkpoint's replay: only gradients may still be wanted
        found = cap._watch.replayed(wsite.name) if cap._grads else None
        out = run(args, kwargs)
        if found is not None:
            _hook_grad(cap, found, bound, out)
        return out
    call = cap._new_call(wsite)
    eager = cap._store._reduce is not None  # reduce= applies to the weights, not to Q, K, V
    if cap._inputs or not eager:
        call._set_inputs(bound)
    slot: list[Tensor] = []
    at = len(WAITING)
    WAITING.append(slot)  # an edit below fills it with the probabilities it produces
    try:
        out = run(args, kwargs)
    finally:
        del WAITING[at:]
    if slot:
        call._set_output(slot[0])
    elif eager:
        with torch.no_grad():
            call._set_output(probabilities(**_attention_args(bound)))
    else:
        call._set_lazy(_lazy_weights)
    if cap._grads:
        _weights_grads(cap, wsite, call, bound, out)
    wsite.record._add(call)
    cap._last_done = wsite.name
    if cap._stop:
        cap._finished(wsite)
    return out


def _attention_args(bound: dict[str, Any]) -> dict[str, Any]:
    keys = ("query", "key", "attn_mask", "is_causal", "scale", "enable_gqa")
    return {k: bound[k] for k in keys if k in bound}


def _lazy_weights(call: Call) -> Tensor:
    return probabilities(**_attention_args(call.inputs))


def _weights_grads(cap: Capture, wsite: _Site, call: Call, bound: dict[str, Any], out: Any) -> None:
    call._expect_grads(None)
    for path, _ in _tree.leaves(bound):
        call._no_grad(("input", *path), _NO_INPUT_GRADS)
    if float(bound.get("dropout_p", 0.0)) > 0:
        why = "the call applied dropout (dropout_p > 0), whose mask the fused kernel hides"
        call._no_grad(_OUTPUT, why)
        return
    boundary = cap._watch.start(wsite.name, call, {})  # notes a reentrant checkpoint's call
    if isinstance(boundary, str):
        if boundary != PENDING:
            call._no_grad(_OUTPUT, boundary)
        return
    _hook_grad(cap, call, bound, out)


def _hook_grad(cap: Capture, call: Call, bound: dict[str, Any], out: Any) -> None:
    if not isinstance(out, Tensor) or not out.requires_grad:
        call._no_grad(_OUTPUT, why_no_grad())
        return
    value: Tensor = bound["value"].detach()
    heads = bound["query"].size(-3) if bound.get("enable_gqa") else None

    def on_grad(grad: Tensor) -> None:
        call._set_grad(_OUTPUT, weights_grad(value, heads, grad))

    cap.hooks.tensor(out, on_grad)


# -- edit -------------------------------------------------------------------------------------
def check_edits(op: OpSelector, edits: list[Any]) -> None:
    """Refuse edits an operation cannot take, before anything is hooked."""
    for edit in edits:
        if edit.on == "param_grad":
            raise UsageError(
                f"{edit.name} applies to a layer's parameter gradients; the operation "
                f"{op.name!r} has no parameters: give it the layer ({op.module!r})"
            )
        if op.op == WEIGHTS and edit.on in ("input", "input_grad"):
            raise EditError(
                f"edit {edit.name!r} on {op.name!r}: attention weights have no inputs of their "
                f"own; edit the SDPA call's inputs with "
                f"'{op.module}::{SDPA}{f'#{op.k}' if op.k else ''}' instead"
            )


def edit_op(
    ed: Editor,
    call: ModuleCall,
    layers: list[_Layer],
    weights: list[_Layer],
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """The editor's handler (``OpWatch``): apply each of ``layers``' edits to the call (the
    first selector outermost) and, for an SDPA call whose ``weights`` are edited, run it
    explicitly with those edits."""
    if weights:
        func = _edited_sdpa(ed, weights, func)
    run: Run = functools.partial(forward_op, func)
    for layer in reversed(layers):
        run = functools.partial(_edit_value, ed, layer, func, run)
    return run(args, kwargs)


def _edit_value(
    ed: Editor, layer: _Layer, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if layer.pre:
        layer.binder = op_binder(func)
        new = ed._pre(layer, layer.module, args, kwargs)
        if new is not None:
            args, kwargs = new
    out = run(args, kwargs)
    new_out = ed._post(layer, layer.module, args, out)
    return out if new_out is None else new_out


def _edited_sdpa(ed: Editor, weights: list[_Layer], func: Any) -> Callable[..., Tensor]:
    """The SDPA call made explicit, with the edits of ``weights`` applied to its
    probabilities before those of sessions opened later (already in ``func`` if it is
    explicit)."""
    waiting = list(WAITING)  # the captures above this edit see its result
    own = [(functools.partial(_edit_weights, ed, layer), waiting) for layer in weights]
    return explicit([*own, *chain_of(func)])


def _edit_weights(ed: Editor, layer: _Layer, probs: Tensor) -> Tensor:
    if layer.pre:  # gradient edits: mark where the call starts
        layer.binder = _NO_ARGUMENTS
        ed._pre(layer, layer.module, (), {})
    new = ed._post(layer, layer.module, (), probs)
    return probs if new is None else new
