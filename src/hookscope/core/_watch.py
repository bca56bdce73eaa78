"""A capture's gradients: where each call's will come from, and the hooks that record them.

:meth:`GradWatch.start` runs when a call starts (its inputs are final) and returns the call's
:class:`~hookscope.core._autograd.Boundary`, or the reason no gradient can exist.
:meth:`GradWatch.finish` runs when it returns: output gradients are recorded by tensor hooks
on the outputs, input gradients by post-hooks on the autograd nodes through which the call
sends gradient back to each input, summed over those nodes and stored once the backward pass
is over. Under a reentrant activation checkpoint the first run has no graph, so gradients are
hooked on its replay in backward instead (see ``_checkpoint``).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import Tensor

from . import _tree
from ._autograd import Boundary, backward_id, can_have_grad, queue_after_backward, why_no_grad
from ._checkpoint import REENTRANT, Replay, find_segments, maybe_in_segment
from ._lifetime import HookSet
from ._records import Call
from ._types import Inputs, Path

__all__ = ["PENDING", "GradWatch"]

#: A reentrant checkpoint's first run: the gradients come with its replay in backward.
PENDING = "pending"


class GradWatch:
    """The gradient side of one capture."""

    __slots__ = ("_replay", "_sums")

    def __init__(self) -> None:
        self._replay = Replay()
        #: per backward pass running (several threads may run one each): input gradients
        self._sums: dict[int, dict[tuple[Call, Path], Tensor]] = {}

    def start(self, layer: str, call: Call, bound: Inputs) -> Boundary | str:
        """Start watching a call's gradients; a string says why none can exist (or PENDING)."""
        if torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            boundary = Boundary(bound)
            for path, t in _tree.leaves(bound):
                if not t.requires_grad:
                    call._no_grad(("input", *path), _why(t))
            return boundary
        if maybe_in_segment():
            _, _, first_runs = find_segments()
            if any(kind == REENTRANT for _, kind in first_runs):
                self._replay.note([key for key, _ in first_runs], layer, call)
                return PENDING
        why = why_no_grad()
        for path, _ in _tree.leaves(bound):
            call._no_grad(("input", *path), why)
        return why

    def finish(
        self, hooks: HookSet, call: Call, boundary: Boundary | str | None, output: Any
    ) -> Any:
        """Hook the gradients of a finished call; return a new output if stand-ins were
        needed (see ``_autograd``), else None."""
        if not isinstance(boundary, Boundary):
            if boundary != PENDING:
                why = boundary or why_no_grad()
                for path, t in _tree.leaves(output):
                    call._no_grad(("output", *path), why if can_have_grad(t) else _why(t))
            return None
        for path, t in _tree.leaves(output):
            if not t.requires_grad:
                call._no_grad(("output", *path), _why(t))
        new_output, hook_on, consumers = boundary.finish(output)
        for path, t in hook_on:
            hooks.tensor(t, functools.partial(call._set_grad, ("output", *path)))
        by_node: dict[Any, list[tuple[int, Path]]] = {}
        for path, pairs in consumers.items():
            for node, slot in pairs:
                by_node.setdefault(node, []).append((slot, ("input", *path)))
        for node, slots in by_node.items():
            hooks.node(node, functools.partial(self._on_input_grad, call, slots))
        for path in boundary.input_paths():
            if path not in consumers:
                call._no_grad(("input", *path), "the layer's output does not depend on it")
        return new_output if new_output is not output else None

    def replayed(self, layer: str) -> Call | None:
        """The original of a call that a checkpoint replays in backward, if gradients are to
        be hooked on the replay (a reentrant checkpoint, gradients enabled), else None."""
        segment, kind, first_runs = find_segments()
        call = self._replay.find(segment, layer, backward_id()) if kind == REENTRANT else None
        if call is not None:  # a checkpoint nested in this replay replays it again later
            self._replay.note([key for key, _ in first_runs], layer, call)
        return call if call is not None and torch.is_grad_enabled() else None

    def _on_input_grad(
        self, call: Call, slots: list[tuple[int, Path]], grad_inputs: Any, grad_outputs: Any
    ) -> None:
        # A layer may use an input several times: sum what each use sends back, and store
        # the sum once this backward is over.
        pass_id = backward_id()
        sums = self._sums.get(pass_id)
        if sums is None:
            sums = self._sums[pass_id] = {}
            queue_after_backward(functools.partial(self._flush, pass_id))
        for slot, key in slots:
            g = grad_inputs[slot]
            if g is not None:
                old = sums.get((call, key))
                sums[call, key] = g if old is None else old + g

    def _flush(self, pass_id: int) -> None:
        for (call, key), g in self._sums.pop(pass_id, {}).items():
            call._set_grad(key, g)


def _why(t: Tensor) -> str:
    if not can_have_grad(t):
        return f"it is a {t.dtype} tensor; only floating-point tensors have gradients"
    return why_no_grad()
