"""What :func:`hookscope.summary` returns: plain data, rendered only when asked."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._row import UNITS, RowKind, SummaryRow
from ._shapes import ShapeTree, tree_from_json, tree_to_json

__all__ = ["UNITS", "RowKind", "Summary", "SummaryRow"]


@dataclass(repr=False)
class Summary:
    """A model's forward, one :class:`SummaryRow` per module call, and its totals.

    ``str(summary)`` is a plain-text table at most 120 columns wide (names wrap at dots,
    optional columns are left out when they do not fit); ``summary.to_text(max_width=None)``
    is the full table, every column and full names. ``summary.to_json()`` /
    ``Summary.from_json`` round-trip; printing it with ``rich`` gives a rich table fitted
    to the console. Totals: parameters and their bytes count each tensor once (tied weights
    once, as ``model.parameters()`` does); ``output_bytes`` sums the outputs of calls with
    no sub-calls; ``uncounted`` lists the operators that do arithmetic but have no FLOP
    formula, with their call counts. Totals are the same with and without operation rows
    (``ops=True``): ``total_flops == sum(r.flops for r in rows if r.kind == "module")``.

    A sharded model (parameters that are ``DTensor``: FSDP2, HSDP, tensor parallelism) in an
    initialised process group, summarised on every rank as it must be run: parameter counts
    (``total_params``, each row's) are the whole model's; ``rank_params`` and
    ``rank_param_bytes`` what this rank holds (its pieces, and whole copies of what is not
    split); FLOPs (``total_flops``, each row's) are this rank's, counted on the operators it
    ran on its pieces, and ``world_flops`` those of all ``world_size`` ranks together (one
    all-reduce); ``global_rank`` is this rank's. Otherwise ``world_size`` is 1 and the four
    are None.
    """

    model: str
    rows: list[SummaryRow]
    total_params: int
    trainable_params: int
    param_bytes: int
    output_bytes: int
    total_flops: int
    uncounted: dict[str, int]
    inputs: dict[str, ShapeTree] = field(default_factory=dict)
    units: str = UNITS
    world_size: int = 1
    global_rank: int | None = None
    rank_params: int | None = None
    rank_param_bytes: int | None = None
    world_flops: int | None = None

    @property
    def total_macs(self) -> int:
        """Multiply-accumulates of the whole forward: ``total_flops // 2``."""
        return self.total_flops // 2

    def __repr__(self) -> str:
        ops = sum(r.kind == "op" for r in self.rows)
        return (
            f"<Summary of {self.model}: {len(self.rows) - ops} calls"
            + (f", {ops} operations" if ops else "")
            + f", {self.total_params:,} params, {self.total_flops:,} FLOPs>"
        )

    def fold(self, depth: int) -> Summary:
        """The same summary with calls deeper than ``depth`` folded into their caller.

        A folded call's FLOPs and uncounted operators move to its nearest shown caller, so
        ``sum(row.flops for row in rows if row.kind == "module")`` and every total stay the
        same. Operation rows are rows one deeper than their module call's: those deeper than
        ``depth`` go (their FLOPs are already their module call's), so every module shown
        with its operations also shows all its sub-calls.
        """
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            from ..errors import UsageError

            raise UsageError(f"depth must be an int >= 0, got {depth!r}")
        rows: list[SummaryRow] = []
        owner: list[int] = []  # old index -> new index of the row that absorbs it
        for row in self.rows:
            if row.kind == "op" and row.depth > depth:
                owner.append(-1)  # never a parent
            elif row.depth <= depth or row.parent is None:
                parent = None if row.parent is None else owner[row.parent]
                owner.append(len(rows))
                rows.append(dataclasses.replace(row, parent=parent, uncounted=dict(row.uncounted)))
            else:
                target = owner[row.parent]
                owner.append(target)
                rows[target].flops += row.flops
                for op, n in row.uncounted.items():
                    rows[target].uncounted[op] = rows[target].uncounted.get(op, 0) + n
        return dataclasses.replace(self, rows=rows)

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (``macs`` included for convenience)."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out["rows"] = [row.to_dict() for row in self.rows]
        out["inputs"] = {k: tree_to_json(v) for k, v in self.inputs.items()}
        out["uncounted"] = dict(self.uncounted)
        out["total_macs"] = self.total_macs
        return out

    def to_json(self, **kwargs: Any) -> str:
        """The summary as JSON text (:meth:`to_dict` through ``json.dumps``, which takes
        ``kwargs`` such as ``indent=2``); :meth:`from_json` reads it back."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Summary:
        """The summary that :meth:`to_dict` wrote: rows, shapes and totals as they were
        (keys it does not know are ignored)."""
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in data.items() if k in names}
        values["rows"] = [SummaryRow.from_dict(row) for row in data["rows"]]
        values["inputs"] = {k: tree_from_json(v) for k, v in data.get("inputs", {}).items()}
        return cls(**values)

    @classmethod
    def from_json(cls, text: str) -> Summary:
        """The summary that :meth:`to_json` wrote.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> s = hs.summary(nn.Linear(4, 2), torch.randn(3, 4))
            >>> hs.Summary.from_json(s.to_json()) == s
            True
        """
        return cls.from_dict(json.loads(text))

    def to_text(self, *, max_width: int | None = 120) -> str:
        """The plain-text table, at most ``max_width`` columns wide where the names allow it
        (names wrap at dots, never inside a segment); ``None``: the full table.

        Raises:
            UsageError: ``max_width`` is not None nor an int >= 40.
        """
        from ._render import text

        if max_width is not None and (
            isinstance(max_width, bool) or not isinstance(max_width, int) or max_width < 40
        ):
            from ..errors import UsageError

            raise UsageError(f"max_width must be None or an int >= 40, got {max_width!r}")

        return text(self, max_width=max_width)

    def __str__(self) -> str:
        return self.to_text()

    def __rich__(self) -> Any:
        """What ``rich.print(summary)`` draws: a table fitted to the console's width."""
        from ._render import rich_renderable

        return rich_renderable(self)
