"""The sessions through which the attribution methods hook a model.

:class:`Tap` watches the explained layer during the method's own forward: its output (the
first floating-point tensor it returns, so HF layers' ``(hidden_states, ...)`` tuples work),
the gradient edge of that output (taken in the forward hook, so an in-place change of the
output further on, ``h += residual``, does not redirect the gradient), or only its shape.
:class:`Ablate` returns the layer's output with some channels set to zero, rebuilt in the
output's own structure. :class:`Plain` hooks nothing: methods that only run the model (saliency,
guided backpropagation) open it for the session's refusals and torch.compile policy.

Every method runs the model itself, so sessions pass ``recompile=True`` and the method calls
the model inside :func:`hookscope.core.run_eagerly`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import HookSet, LayerSelector, ModuleCall, Session, leaves, map_tensors, why_no_grad
from ..errors import UsageError

__all__ = ["Ablate", "Plain", "Tap", "first_float"]


def first_float(output: Any, layer: str) -> Tensor:
    """The tensor a CAM explains in a layer's output: its first floating-point tensor."""
    for _, t in leaves(output):
        if t.is_floating_point():
            return t
    raise UsageError(f"layer {layer!r} returned no floating-point tensor to explain")


_NO_OPS = (
    "{method} explains a layer's output map, whose layout (channels, positions) is known "
    "from the module that makes it, so its layer must be a module. Select the module (list "
    "them with hookscope.names(model)), or capture the operation's output and gradient with "
    "hookscope.capture(model, ..., grads=True) and weight it yourself."
)


class _OneLayer(Session):
    """A session on one layer, named by any selector that matches exactly one."""

    def __init__(self, model: nn.Module, layer: LayerSelector, method: str) -> None:
        super().__init__(model, recompile=True, this_thread=True)
        sites = self.layers.sites(layer, refuse_ops=_NO_OPS.format(method=method))
        found = {name: site.module for name, site in sites.items()}
        if len(found) != 1:
            raise UsageError(
                f"{method} explains one layer; {layer!r} matches {len(found)}: {sorted(found)[:5]}"
            )
        ((self.name, self.module),) = found.items()

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, {self.name: self.module})


class _Call(threading.local):
    """What one thread's call of a method set and saw (a method object serves any number of
    threads at once: each has its own)."""

    def __init__(self) -> None:
        self.values = True  # keep a copy of the output (else only its shape and edge)
        self.seen: list[tuple[Tensor | None, Any, tuple[int, ...]]] = []
        self.why = ""  # why the output has no gradient edge, when it has none
        self.change: Callable[[Tensor], Tensor] | None = None  # Ablate's


class Tap(_OneLayer):
    """The layer's output in one forward: a detached copy (``values``), its gradient edge,
    and its shape (see the module docstring). Per thread: :attr:`state`."""

    def __init__(self, model: nn.Module, layer: LayerSelector, method: str) -> None:
        super().__init__(model, layer, method)
        self.state = _Call()

    def _new_pass(self) -> None:
        self.state.seen.clear()

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        t = first_float(output, self.name)
        edge = torch.autograd.graph.get_gradient_edge(t) if t.requires_grad else None
        state = self.state
        state.why = "" if t.requires_grad else why_no_grad()
        # a copy: the model may change its output in place later (ReLU(inplace=True))
        value = t.detach().clone() if state.values else None
        state.seen.append((value, edge, tuple(t.shape)))

    def take(self) -> tuple[Tensor | None, Any, tuple[int, ...]]:
        """What the layer's only call in the forward gave, forgotten here (a gradient edge
        keeps the forward's whole graph alive); refuses zero or several calls."""
        seen, self.state.seen = self.state.seen, []
        if len(seen) != 1:
            why = "did not run" if not seen else f"ran {len(seen)} times"
            raise UsageError(
                f"layer {self.name!r} {why} in the forward; a CAM needs a layer that runs "
                "exactly once per forward"
            )
        return seen[0]


class Ablate(_OneLayer):
    """Returns the layer's output with ``change(tensor)`` in place of its explained tensor."""

    def __init__(self, model: nn.Module, layer: LayerSelector, method: str) -> None:
        super().__init__(model, layer, method)
        self.state = _Call()

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        change = self.state.change
        if change is None:
            return None
        t = first_float(output, self.name)
        new = change(t)
        return map_tensors(lambda _, u: new if u is t else u, output)


class Plain(Session):
    """A session that hooks nothing but the model's root (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, recompile=True, this_thread=True)

    def _install(self, hooks: HookSet) -> None:
        return None
