"""What :func:`hookscope.summary` returns: plain data, rendered only when asked."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor

__all__ = ["UNITS", "Summary", "SummaryRow", "argument_shapes", "shapes"]

UNITS = (
    "FLOPs count matrix products, convolutions and attention at the operator level; "
    "1 multiply-accumulate = 2 FLOPs, MACs = FLOPs / 2"
)
_SHOWN = 4  # container elements shown before "..."


def shapes(obj: Any, depth: int = 0) -> str:
    """Compact shape notation: ``[8, 3, 224, 224]``, ``([2, 4], None)``, ``{logits: [2, 9]}``.

    A mapping of call arguments (``depth=0``) renders as ``x=[2, 4], mask=[2, 1]``, leaving
    out arguments that hold no tensor (``None``, flags, numbers).
    """
    if isinstance(obj, Tensor):
        return f"[{', '.join(map(str, obj.shape))}]"
    if obj is None:
        return "None"
    kids = _children(obj)
    if kids is None:
        return type(obj).__name__
    if depth >= 3:
        return "(...)" if isinstance(obj, (tuple, list)) else "{...}"
    parts = [
        f"{k}: {shapes(v, depth + 1)}" if keyed else shapes(v, depth + 1)
        for k, v, keyed in kids[:_SHOWN]
    ]
    if len(kids) > _SHOWN:
        parts.append(f"... {len(kids)} in all")
    body = ", ".join(parts)
    if isinstance(obj, (tuple, list)):
        return f"({body},)" if len(kids) == 1 else f"({body})"
    return f"{{{body}}}"


def argument_shapes(arguments: Mapping[str, Any]) -> dict[str, str]:
    """``{name: shapes(value)}`` for the call arguments that hold at least one tensor."""
    return {k: shapes(v, 1) for k, v in arguments.items() if _has_tensor(v)}


def _has_tensor(obj: Any) -> bool:
    if isinstance(obj, Tensor):
        return True
    kids = _children(obj)
    return kids is not None and any(_has_tensor(v) for _, v, _ in kids)


def _children(obj: Any) -> list[tuple[Any, Any, bool]] | None:
    if isinstance(obj, (tuple, list)):
        if hasattr(obj, "_fields"):  # namedtuple: show field names
            return [(k, v, True) for k, v in zip(obj._fields, obj, strict=True)]
        return [(i, v, False) for i, v in enumerate(obj)]
    if isinstance(obj, Mapping):
        return [(k, v, True) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name), True) for f in dataclasses.fields(obj)]
    return None


@dataclass
class SummaryRow:
    """One module call, in execution order.

    ``flops`` are the operators that ran in this call but in none of its sub-calls (self);
    ``flops_total`` includes the sub-calls. ``call`` / ``calls``: this is use ``call`` of
    ``calls`` uses of the module in the forward. ``params`` are the module's own parameters,
    ``params_total`` those under it (each tensor once). ``raised``: the call did not return.
    ``time_ms`` (inclusive) and ``peak_bytes`` (bytes allocated by operators during the call
    above what was live when it started) are set with ``time=True``; both are approximate.
    """

    name: str
    type: str
    depth: int
    parent: int | None = None
    call: int = 1
    calls: int = 1
    inputs: dict[str, str] = field(default_factory=dict)
    output: str = ""
    dtype: str | None = None
    params: int = 0
    params_total: int = 0
    trainable: str = "-"
    flops: int = 0
    flops_total: int = 0
    output_bytes: int = 0
    uncounted: dict[str, int] = field(default_factory=dict)
    raised: bool = False
    time_ms: float | None = None
    peak_bytes: int | None = None

    @property
    def macs(self) -> int:
        return self.flops // 2

    @property
    def macs_total(self) -> int:
        return self.flops_total // 2

    @property
    def reused(self) -> bool:
        return self.calls > 1


@dataclass(repr=False)
class Summary:
    """A model's forward, one :class:`SummaryRow` per module call, and its totals.

    ``str(summary)`` is a plain-text table; ``summary.to_json()`` / ``Summary.from_json``
    round-trip; printing it with ``rich`` gives a rich table. Totals: parameters and their
    bytes count each tensor once (tied weights once, as ``model.parameters()`` does);
    ``output_bytes`` sums the outputs of calls with no sub-calls; ``uncounted`` lists the
    operators that do arithmetic but have no FLOP formula, with their call counts.
    """

    model: str
    rows: list[SummaryRow]
    total_params: int
    trainable_params: int
    param_bytes: int
    output_bytes: int
    total_flops: int
    uncounted: dict[str, int]
    inputs: dict[str, str] = field(default_factory=dict)
    units: str = UNITS

    @property
    def total_macs(self) -> int:
        return self.total_flops // 2

    def __repr__(self) -> str:
        return (
            f"<Summary of {self.model}: {len(self.rows)} calls, {self.total_params:,} params, "
            f"{self.total_flops:,} FLOPs>"
        )

    def fold(self, depth: int) -> Summary:
        """The same summary with calls deeper than ``depth`` folded into their caller.

        A folded call's FLOPs and uncounted operators move to its nearest shown caller, so
        ``sum(row.flops for row in rows)`` and every total stay the same.
        """
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            from ..errors import UsageError

            raise UsageError(f"depth must be an int >= 0, got {depth!r}")
        keep: dict[int, int] = {}  # old index -> new index
        rows: list[SummaryRow] = []
        owner: list[int] = []  # old index -> new index of the row that absorbs it
        for i, row in enumerate(self.rows):
            if row.depth <= depth or row.parent is None:
                keep[i] = len(rows)
                parent = None if row.parent is None else owner[row.parent]
                rows.append(dataclasses.replace(row, parent=parent, uncounted=dict(row.uncounted)))
                owner.append(keep[i])
            else:
                target = owner[row.parent]
                owner.append(target)
                rows[target].flops += row.flops
                for op, n in row.uncounted.items():
                    rows[target].uncounted[op] = rows[target].uncounted.get(op, 0) + n
        return dataclasses.replace(self, rows=rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``macs`` included for convenience)."""
        out = dataclasses.asdict(self)
        out["total_macs"] = self.total_macs
        return out

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["rows"] = [SummaryRow(**row) for row in data["rows"]]
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        return cls.from_dict(json.loads(text))

    def to_text(self, *, max_width: int | None = None) -> str:
        """The plain-text table; names longer than fit in ``max_width`` wrap at dots."""
        from ._render import text

        return text(self, max_width=max_width)

    def __str__(self) -> str:
        return self.to_text()

    def __rich__(self) -> Any:
        from ._render import rich_table

        return rich_table(self)
