"""Plain-data records of what a capture saw: one :class:`Call` per module call."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from torch import Tensor

from . import _tree
from ._types import Inputs, Path
from .errors import CaptureError, GradientUnavailableError, StaleCaptureError

__all__ = ["Call", "LayerRecord"]


class Call:
    """What one call of one layer saw: inputs, output and (on request) their gradients.

    Attributes:
        layer: the layer's dotted name.
        index: position of this call among the layer's calls since the capture opened.
        pass_index: which top-level forward of the model this call belonged to.
    """

    __slots__ = (
        "_grad_inputs",
        "_grads",
        "_input_skeleton",
        "_inputs",
        "_output",
        "_refs",
        "_sync",
        "_why_no_grad",
        "index",
        "layer",
        "nbytes",
        "pass_index",
    )

    def __init__(self, layer: str, index: int, pass_index: int) -> None:
        self.layer = layer
        self.index = index
        self.pass_index = pass_index
        self.nbytes = 0
        self._output: Any = None
        self._inputs: Inputs | None = None
        self._input_skeleton: Inputs | None = None  # meta tensors: input structure for grads
        self._grads: dict[Path, Tensor] | None = None
        self._grad_inputs: dict[Path, Tensor] | None = None
        self._why_no_grad: dict[Path, str] | None = None  # only when grads are captured
        self._refs: list[tuple[Tensor, int, Path]] | None = None
        self._sync: Any = None  # CUDA event of a non-blocking device->host copy, until read

    # -- values -------------------------------------------------------------------------
    @property
    def output(self) -> Any:
        """The layer's output, same structure as the module returned (tuple, dict, ...)."""
        self._check_fresh()
        return self._output

    @property
    def inputs(self) -> Inputs:
        """The inputs bound to ``forward``'s signature, by parameter name."""
        if self._inputs is None:
            raise CaptureError(
                f"inputs of {self.layer!r} were not captured: open the capture with inputs=True"
            )
        self._check_fresh()
        return self._inputs

    @property
    def input(self) -> Any:
        """The first argument of ``forward`` (the usual single input)."""
        inputs = self.inputs
        if not inputs:
            raise CaptureError(f"{self.layer!r} was called without arguments")
        return next(iter(inputs.values()))

    @property
    def grad(self) -> Any:
        """Gradient of the loss w.r.t. the output tensors, same structure as the output.

        This is the gradient of each returned tensor itself: if the layer also used that
        tensor internally (``return h, fc(h)``) or returned an input unchanged, the
        gradient includes those uses, unlike a full backward hook's ``grad_output``.

        Leaves of a nested output that got no gradient are ``None``; if none got one, this
        raises GradientUnavailableError saying why.
        """
        self._check_fresh()
        return self._grad_tree(self._need_grads(self._grads, "output"), "output", self._output)

    @property
    def grad_inputs(self) -> Inputs:
        """Gradients w.r.t. the tensor inputs flowing *through this layer*, by parameter name
        (``None`` for inputs without one, e.g. an attention mask)."""
        grads = self._need_grads(self._grad_inputs, "inputs")
        tree = self._inputs if self._inputs is not None else self._input_skeleton
        named: Inputs = self._grad_tree(grads, "input", tree)
        return named

    @property
    def grad_input(self) -> Any:
        """Gradient w.r.t. the first argument of ``forward``; raises saying why if none."""
        grads = self._need_grads(self._grad_inputs, "inputs")
        tree = self._inputs if self._inputs is not None else self._input_skeleton
        if not tree:
            raise GradientUnavailableError(f"{self.layer!r} was called without arguments")
        first = next(iter(tree))
        return self._grad_tree(grads, "input", tree[first], (first,))

    def _grad_tree(self, grads: dict[Path, Tensor], side: str, tree: Any, prefix: Path = ()) -> Any:
        found: list[Path] = []

        def leaf(path: Path, t: Tensor) -> Tensor | None:
            key = (side, *prefix, *path)
            if key in grads:
                return grads[key]
            found.append(key)
            return None

        result = _tree.map_tensors(leaf, tree, other=lambda value: None)
        if found and len(found) == sum(1 for _ in _tree.leaves(tree)):
            self._grad_at(grads, found[0])  # raises, saying why
        return result

    # -- checks -------------------------------------------------------------------------
    def _need_grads(self, grads: dict[Path, Tensor] | None, what: str) -> dict[Path, Tensor]:
        if grads is None:
            raise GradientUnavailableError(
                f"gradients of {self.layer!r} {what} were not captured: "
                "open the capture with grads=True"
            )
        return grads

    def _grad_at(self, grads: dict[Path, Tensor], path: Path) -> Tensor:
        if path in grads:
            return grads[path]
        where = f"{self.layer!r} {path[0]}{_tree.path_str(path[1:])} (call {self.index})"
        why = self._why_no_grad.get(path) if self._why_no_grad else None
        if why is not None:
            raise GradientUnavailableError(f"no gradient for {where}: {why}")
        raise GradientUnavailableError(
            f"no gradient for {where} yet: backward has not reached it. Call .backward() on a "
            "loss that depends on this value while the capture is open."
        )

    def _check_fresh(self) -> None:
        if self._sync is not None:  # non-blocking copy to pinned memory: wait for it once
            self._sync.synchronize()
            self._sync = None
        if not self._refs:
            return
        for tensor, version, path in self._refs:
            if tensor._version != version:
                raise StaleCaptureError(
                    f"{self.layer!r} {path[0]}{_tree.path_str(path[1:])} (call {self.index}) "
                    "was modified in place after it was captured by reference (e.g. by a "
                    "later ReLU(inplace=True) or `x += residual`), so it no longer holds the "
                    "captured value. Capture with copy='clone' (the default) instead."
                )

    def __repr__(self) -> str:
        parts = [f"{self.layer!r}", f"call={self.index}", f"output={_tree.describe(self._output)}"]
        if self._inputs is not None:
            parts.append(f"inputs={_tree.describe(self._inputs)}")
        if self._grads is not None:
            parts.append(f"grads={len(self._grads)}")
        return f"Call({', '.join(parts)})"


class LayerRecord:
    """Every kept call of one layer, oldest first; ``.output`` etc. read the latest call.

    Attributes:
        name: the layer's dotted name.
        module_type: the module's class name.
        calls: the kept :class:`Call` records, in call order.
        count: how many times the layer ran while the capture was open (including calls
            no longer kept because of ``keep=``).
    """

    __slots__ = ("calls", "count", "module_type", "name")

    def __init__(self, name: str, module_type: str) -> None:
        self.name = name
        self.module_type = module_type
        self.calls: list[Call] = []
        self.count = 0

    @property
    def last(self) -> Call:
        """The most recent kept call."""
        if not self.calls:
            raise CaptureError(
                f"{self.name!r} ({self.module_type}) has not run while the capture was open: "
                "was the model called inside the `with` block, and does its forward reach "
                "this layer?"
            )
        return self.calls[-1]

    def only(self) -> Call:
        """The single call; raises if the layer ran more or less than once."""
        if len(self.calls) != 1:
            raise CaptureError(f"{self.name!r} has {len(self.calls)} kept calls, not 1")
        return self.calls[0]

    output = property(lambda self: self.last.output, doc="Output of the latest call.")
    inputs = property(lambda self: self.last.inputs, doc="Bound inputs of the latest call.")
    input = property(lambda self: self.last.input, doc="First argument of the latest call.")
    grad = property(lambda self: self.last.grad, doc="Output gradient of the latest call.")
    grad_inputs = property(lambda self: self.last.grad_inputs, doc="Input grads, latest call.")
    grad_input = property(lambda self: self.last.grad_input, doc="First input's grad, latest.")

    @property
    def outputs(self) -> list[Any]:
        """Outputs of every kept call, in order."""
        return [c.output for c in self.calls]

    def __len__(self) -> int:
        return len(self.calls)

    def __iter__(self) -> Iterator[Call]:
        return iter(self.calls)

    def __getitem__(self, i: int) -> Call:
        return self.calls[i]

    def __repr__(self) -> str:
        if not self.calls:
            return f"LayerRecord({self.name!r}, {self.module_type}, no calls)"
        shown = _tree.describe(self.calls[-1]._output)
        return (
            f"LayerRecord({self.name!r}, {self.module_type}, calls={len(self.calls)}/"
            f"{self.count}, output={shown})"
        )
