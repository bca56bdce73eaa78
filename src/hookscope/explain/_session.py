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


class _OneLayer(Session):
    """A session on one layer, named by any selector that matches exactly one."""

    def __init__(self, model: nn.Module, layer: LayerSelector, method: str) -> None:
        super().__init__(model, recompile=True)
        found = self.layers.select(layer)
        if len(found) != 1:
            raise UsageError(
                f"{method} explains one layer; {layer!r} matches {len(found)}: {sorted(found)[:5]}"
            )
        ((self.name, self.module),) = found.items()

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, {self.name: self.module})


class Tap(_OneLayer):
    """The layer's output in one forward: a detached copy (``values``), its gradient edge,
    and its shape (see the module docstring)."""

    def __init__(self, model: nn.Module, layer: LayerSelector, method: str) -> None:
        super().__init__(model, layer, method)
        self.values = True
        self.seen: list[tuple[Tensor | None, Any, tuple[int, ...]]] = []
        self.why = ""  # why the output has no gradient edge, when it has none

    def _new_pass(self) -> None:
        self.seen.clear()

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        t = first_float(output, self.name)
        edge = torch.autograd.graph.get_gradient_edge(t) if t.requires_grad else None
        self.why = "" if t.requires_grad else why_no_grad()
        # a copy: the model may change its output in place later (ReLU(inplace=True))
        value = t.detach().clone() if self.values else None
        self.seen.append((value, edge, tuple(t.shape)))

    def take(self) -> tuple[Tensor | None, Any, tuple[int, ...]]:
        """What the layer's only call in the forward gave, forgotten here (a gradient edge
        keeps the forward's whole graph alive); refuses zero or several calls."""
        seen, self.seen = self.seen, []
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
        self.change: Callable[[Tensor], Tensor] | None = None

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        if self.change is None:
            return None
        t = first_float(output, self.name)
        new = self.change(t)
        return map_tensors(lambda _, u: new if u is t else u, output)


class Plain(Session):
    """A session that hooks nothing but the model's root (see the module docstring)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, recompile=True)

    def _install(self, hooks: HookSet) -> None:
        return None
