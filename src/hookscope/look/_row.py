"""One row of a summary: a module call, or an operation its own code called (plain data).

Its own module so that the renderer (``_render``) reads rows without importing the summary
(``_result``), which renders itself through ``_render``: no import circle.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias

from ._shapes import NestedShape, ShapeTree, tree_from_json, tree_to_json  # noqa: F401 (type hints)

__all__ = ["UNITS", "RowKind", "SummaryRow"]

#: a row is a module call, or (``summary(ops=True)``) an operation its own code called
RowKind: TypeAlias = Literal["module", "op"]

UNITS = (
    "FLOPs count matrix products, convolutions and attention per operator; "
    "1 multiply-accumulate = 2 FLOPs, MACs = FLOPs / 2"
)


@dataclass
class SummaryRow:
    """One module call (``kind="module"``) or one operation its own code called
    (``kind="op"``, with ``summary(ops=True)``), in the order they started.

    Shapes are data (see ``hookscope.look._shapes``): ``output`` is the tuple of the output's
    sizes for a tensor (``(8, 2048, 7, 7)``), a list / dict of those for nested outputs,
    ``None`` where the call returned nothing (or raised); ``inputs`` maps each argument that
    holds a tensor, named after ``forward``'s signature, to its shape tree.

    ``flops`` are the operators that ran in this call but in none of its sub-calls (self);
    ``flops_total`` includes the sub-calls. ``call`` / ``calls``: this is use ``call`` of
    ``calls`` uses of the module in the forward. ``params`` are the module's own parameters,
    ``params_total`` those under it (each tensor once). ``raised``: the call did not return.
    ``opaque``: a TorchScript module, which runs in C++ where PyTorch calls no Python hook,
    so its calls are not seen (its operators count in its caller); its parameters are listed.
    ``time_ms`` (inclusive) and ``peak_bytes`` (bytes allocated by operators during the call
    above what was live when it started) are set with ``time=True``; both are approximate.

    An operation row (``kind="op"``) is named as ``hs.names(model, ops=True)`` names it, the
    selector ``hs.capture`` takes (``"blocks.0.attn::softmax"``, ``"blocks.0::matmul#2"``,
    ``"::relu"`` for the model's own forward); ``type`` is how the code called it
    (``torch.nn.functional.softmax``); ``parent`` is its module call's row, ``depth`` one
    more than that row's, ``call`` / ``calls`` that call's. Its ``flops`` (= ``flops_total``)
    and ``uncounted`` are the operators it ran, already part of its module call's ``flops``:
    a breakdown, never added to totals again (they may add up to less than the module's:
    a TorchScript submodule's operators count in its caller, but calling it is no operation).
    It has no parameters, ``inputs`` nor ``peak_bytes``.
    """

    name: str
    type: str
    depth: int
    parent: int | None = None
    call: int = 1
    calls: int = 1
    inputs: dict[str, ShapeTree] = field(default_factory=dict)
    output: ShapeTree = None
    dtype: str | None = None
    params: int = 0
    params_total: int = 0
    trainable: str = "-"
    flops: int = 0
    flops_total: int = 0
    output_bytes: int = 0
    uncounted: dict[str, int] = field(default_factory=dict)
    raised: bool = False
    opaque: bool = False
    time_ms: float | None = None
    peak_bytes: int | None = None
    kind: RowKind = "module"

    @property
    def macs(self) -> int:
        """Multiply-accumulates of this call's own code: ``flops // 2``."""
        return self.flops // 2

    @property
    def macs_total(self) -> int:
        """Multiply-accumulates of this call and every call it made: ``flops_total // 2``."""
        return self.flops_total // 2

    @property
    def reused(self) -> bool:
        """Whether the module ran more than once in the forward (a shared or looped layer);
        ``call`` says which of its ``calls`` this row is."""
        return self.calls > 1

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data: every field (``kind`` too), shapes as lists."""
        out = dataclasses.asdict(self)
        out["inputs"] = {k: tree_to_json(v) for k, v in self.inputs.items()}
        out["output"] = tree_to_json(self.output)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SummaryRow:
        """The row :meth:`to_dict` gave (data without ``kind``, from before operation rows,
        reads as module rows)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["inputs"] = {k: tree_from_json(v) for k, v in data.get("inputs", {}).items()}
        values["output"] = tree_from_json(data.get("output"))
        return cls(**values)
