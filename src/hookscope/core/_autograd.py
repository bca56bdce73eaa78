"""Gradients at a layer's boundary, observed on the autograd graph without changing it.

A full backward hook defines a layer's gradients as: w.r.t. each output, what comes back from
*downstream* (not from the layer's own later uses of that tensor); w.r.t. each input, what
flows *through the layer* (not through a skip connection). PyTorch gets them by wrapping
inputs and outputs in views of an identity Function, which breaks in-place ops on them
(pytorch/pytorch#61519) and skips dict outputs. hookscope reads the same values from the
graph the model built anyway:

* an output's gradient comes from a tensor hook on the output itself (in-place ops after the
  layer keep it firing: hooks stay on the node the tensor had when hooked);
* an input's gradient is the sum of what the layer's own graph nodes send to that input's
  gradient edge, read by post-hooks on those nodes. They are found by walking back from the
  outputs over nodes created during the call (autograd sequence numbers tell which).

Nothing is copied and no tensor the model sees is replaced, so a capture cannot change the
model's results. A stand-in copy (same strides, same values) is substituted only where the
graph cannot tell two uses apart: an output that existed before the call (``nn.Identity``,
eval-mode ``Dropout``, a returned parameter), the same tensor returned twice, or an output
the layer also used itself (``return h, fc(h)``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import _torch, _tree
from ._checkpoint import REENTRANT, find_segments
from ._types import Path

__all__ = [
    "Boundary",
    "Edge",
    "backward_id",
    "can_have_grad",
    "edge_of",
    "queue_after_backward",
    "recomputing",
    "stand_in",
    "why_no_grad",
]

#: The sequence number of nodes that were not created by an op (AccumulateGrad of leaves).
_NEVER = 2**64 - 1
Edge = tuple[Any, int]  # (autograd Node, output_nr)

backward_id: Callable[[], int] = _torch.backward_id
"""The id of the backward pass running on this thread, -1 outside backward."""


def recomputing() -> bool:
    """Whether a forward is running inside backward: activation checkpointing recomputing a
    segment (or a forward inside a backward hook). Its module calls are not new calls."""
    return backward_id() != -1


def queue_after_backward(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (only valid inside backward)."""
    _torch.queue_callback(fn)


def why_no_grad() -> str:
    """Why a tensor produced right now cannot have a gradient."""
    if torch.is_inference_mode_enabled():
        return "the forward ran under torch.inference_mode()"
    if not torch.is_grad_enabled():
        if any(kind == REENTRANT for _, kind in find_segments()[2]):
            return (
                "it runs inside a reentrant activation checkpoint (torch.utils.checkpoint with "
                "use_reentrant=True), whose forward runs without gradients; its gradient "
                "exists only inside a .backward() that also writes every parameter's .grad. "
                "Fix: checkpoint with use_reentrant=False (PyTorch's recommendation), or turn "
                "checkpointing off for this call (Hugging Face: "
                "model.gradient_checkpointing_disable())"
            )
        return "the forward ran with gradients disabled (torch.no_grad())"
    if _torch.functorch_level() is not None and "jvp" in _torch.functorch_transforms():
        return (
            "it runs inside torch.func.jvp (jvp, jacfwd: forward-mode differentiation), where "
            "no backward runs. Fix: take gradients with torch.func.grad, vjp or jacrev, or "
            "edit the output instead"
        )
    return (
        "nothing upstream of it requires grad (the inputs have requires_grad=False and no "
        "parameter before this point requires grad)"
    )


def can_have_grad(t: Tensor) -> bool:
    """Whether autograd can give ``t`` a gradient (floating-point and complex tensors)."""
    return t.is_floating_point() or t.is_complex()


def edge_of(t: Tensor) -> Edge:
    """Where ``t``'s gradient goes: its grad_fn (or its leaf's accumulator) and output slot."""
    e = torch.autograd.graph.get_gradient_edge(t)
    return e.node, e.output_nr


def _created_since(node: Any, start: int) -> bool:
    return start <= _torch.node_sequence_nr(node) < _NEVER


def stand_in(t: Tensor) -> Tensor:
    """A copy of ``t`` with the same strides (so later kernels take the same path) whose
    gradient edge is new: a hook on it sees only the gradient of this one use."""
    try:
        return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=t.device).copy_(t)
    except RuntimeError:  # overlapping memory (an expanded tensor) cannot be written so
        return t.clone()


class Boundary:
    """The gradient edges crossing one layer call: opened when the call starts (after the
    inputs are final), finished when it returns (see the module docstring)."""

    __slots__ = ("_inputs", "inputs", "start")

    def __init__(self, inputs: Any) -> None:
        #: the inputs, passed on unchanged: a tensor given as several arguments
        #: (``attention(x, x, x)``) stays one tensor, since layers test ``query is key``; the
        #: gradient through the layer w.r.t. it is then reported under each of its names
        self.inputs = inputs
        self._inputs: dict[Edge, list[Path]] = {}
        for path, t in _tree.leaves(inputs):
            if t.requires_grad:
                self._inputs.setdefault(edge_of(t), []).append(path)
        self.start = _torch.sequence_nr()  # nodes made from here on belong to the call

    def finish(
        self, output: Any, *, inputs: bool = True, separate: bool = False
    ) -> tuple[Any, list[tuple[Path, Tensor]], Consumers]:
        """Return ``(output, hook_on, consumers)``: the output with stand-ins where needed,
        for each output leaf that requires grad the tensor whose hook sees its gradient, and
        per input path the (node, slot) pairs through which the layer sends it gradient
        (only with ``inputs``; without, a single new output needs no graph walk).
        ``separate``: a stand-in for every output leaf, so that its hook sees nothing but
        what comes from downstream, even in a second-order backward, where the layer's own
        backward formula (``tanh``'s, which saved its output) sends gradient to the output
        too (gradient edits, whose changes must not reach that path)."""
        leaves = [(p, t) for p, t in _tree.leaves(output) if t.requires_grad]
        out_edges = [edge_of(t) for _, t in leaves]
        simple = len(leaves) == 1 and _created_since(out_edges[0][0], self.start)
        if not inputs and not separate and simple:
            return output, leaves, {}  # one new output: nothing inside can have used it
        watched: dict[Edge, list[Path | int]] = {e: list(p) for e, p in self._inputs.items()}
        for k, e in enumerate(out_edges):  # outputs are keyed by position, inputs by path
            watched.setdefault(e, []).append(k)
        roots = [e[0] for e in out_edges if _created_since(e[0], self.start)]
        found = _consumers(roots, self.start, watched)
        # a tensor returned twice gets a stand-in for each of its places: a hook on the
        # tensor itself would see the sum of both places' gradients
        twice = {e for e in out_edges if out_edges.count(e) > 1}
        hook_on: list[tuple[Path, Tensor]] = []
        for k, ((path, t), e) in enumerate(zip(leaves, out_edges, strict=True)):
            if separate or e in twice or k in found or not _created_since(e[0], self.start):
                t = stand_in(t)
                output = _tree.replace_at(output, path, t)
                for slot, nxt in enumerate(t.grad_fn.next_functions):  # type: ignore[union-attr]
                    for key in watched.get(nxt, ()):
                        found.setdefault(key, []).append((t.grad_fn, slot))
            hook_on.append((path, t))
        consumers = {k: v for k, v in found.items() if isinstance(k, tuple)}
        return output, hook_on, consumers

    def input_paths(self) -> list[Path]:
        return [p for paths in self._inputs.values() for p in paths]


Consumers = dict[Path, list[tuple[Any, int]]]


def _consumers(
    roots: list[Any], start: int, watched: dict[Edge, list[Path | int]]
) -> dict[Path | int, list[tuple[Any, int]]]:
    """Walk back from ``roots`` over nodes created since ``start``; for every edge in
    ``watched`` found, the (node, slot) pairs that send gradient along it."""
    found: dict[Path | int, list[tuple[Any, int]]] = {}
    seen: set[Any] = set()
    stack = list(roots)
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        for slot, nxt in enumerate(node.next_functions):
            if nxt[0] is None:
                continue
            for key in watched.get(nxt, ()):
                found.setdefault(key, []).append((node, slot))
            if _created_since(nxt[0], start):
                stack.append(nxt[0])
    return found
