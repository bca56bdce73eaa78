"""Turn a :class:`Recorder`'s records into a :class:`Summary`, once the forward is over.

Parameters are counted here, after the forward, so lazy modules (``nn.LazyLinear``) show
the sizes their first call gave them, as torchinfo does. Operation rows (``ops=True``) are
named here too, as ``hs.names(ops=True)`` names them: ``op#k`` where some call of the module
ran ``op`` more than once, else ``op``; operations that never returned a tensor get no row.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..core import _torch
from ._recorder import OpRecord, Record, Recorder
from ._result import Summary, SummaryRow
from ._shapes import ShapeTree

__all__ = ["build"]


@dataclass(frozen=True)
class _Module:
    """What every row of one module shares."""

    type: str
    params: int
    params_total: int
    trainable: str


def _trainable(params: list[nn.Parameter]) -> str:
    flags = {p.requires_grad for p in params}
    if not flags:
        return "-"
    return "partial" if len(flags) == 2 else "yes" if True in flags else "no"


def _type_name(module: nn.Module) -> str:
    # a TorchScript module's class is RecursiveScriptModule: name the class it came from
    if isinstance(module, torch.jit.ScriptModule):
        return str(module.original_name)
    return type(module).__name__


class _Params:
    """Each module's parameters (each tensor once), worked out bottom-up once: walking
    every module's subtree again costs O(modules x depth) calls of ``named_modules``."""

    def __init__(self) -> None:
        self._under: dict[int, dict[int, nn.Parameter]] = {}

    def under(self, module: nn.Module) -> dict[int, nn.Parameter]:
        found = self._under.get(id(module))
        if found is None:
            found = {id(p): p for p in _torch.parameters_of(module).values() if p is not None}
            for child in _torch.children(module).values():
                if child is not None:
                    found.update(self.under(child))
            self._under[id(module)] = found
        return found

    def info(self, module: nn.Module) -> _Module:
        params = list(self.under(module).values())
        own = {id(p): p for p in _torch.parameters_of(module).values() if p is not None}
        return _Module(
            type=_type_name(module),
            params=sum(p.numel() for p in own.values()),
            params_total=sum(p.numel() for p in params),
            trainable=_trainable(params),
        )


def _row(
    rec: Record, recorder: Recorder, info: _Module, calls: int, parent: int | None
) -> SummaryRow:
    return SummaryRow(
        name=rec.call.name,
        type=info.type,
        depth=rec.call.depth,
        parent=parent,
        call=rec.call.index + 1,
        calls=calls,
        inputs=recorder.inputs_of(rec),
        output=None if rec.raised else rec.output,
        dtype=None if rec.raised or rec.dtype is None else str(rec.dtype).removeprefix("torch."),
        params=info.params,
        params_total=info.params_total,
        trainable=info.trainable,
        flops=rec.tally.flops,
        flops_total=rec.total_flops,
        output_bytes=0 if rec.raised else rec.nbytes,
        uncounted=dict(rec.tally.uncounted),
        raised=rec.raised,
        time_ms=rec.time_ms,
        peak_bytes=rec.peak - rec.live if rec.time_ms is not None else None,
    )


class _OpNames:
    """Names of operation rows after ``hs.names(ops=True)``: per module and operation, the
    most calls in one call of the module, and whether any call returned a tensor."""

    def __init__(self, ops: list[OpRecord]) -> None:
        self._most: dict[tuple[str, str], tuple[int, bool]] = {}
        for op in ops:
            key = (op.owner.call.name, op.name)
            most, tensor = self._most.get(key, (0, False))
            self._most[key] = (max(most, op.k), tensor or op.tensor)

    def name(self, op: OpRecord) -> str | None:
        """The row's name, None for no row (an operation that never returned a tensor)."""
        most, tensor = self._most[op.owner.call.name, op.name]
        if not (tensor or op.raised):
            return None
        return f"{op.owner.call.name}::{op.name}" + (f"#{op.k}" if most > 1 else "")


def _op_row(op: OpRecord, name: str, parent: int, calls: int) -> SummaryRow:
    rec = op.owner
    return SummaryRow(
        name=name,
        type=op.how,
        depth=rec.call.depth + 1,
        parent=parent,
        call=rec.call.index + 1,
        calls=calls,
        output=None if op.raised else op.output,
        dtype=None if op.raised or op.dtype is None else str(op.dtype).removeprefix("torch."),
        flops=op.flops,
        flops_total=op.flops,
        output_bytes=0 if op.raised else op.nbytes,
        uncounted=op.uncounted,
        raised=op.raised,
        time_ms=op.time_ms,
        kind="op",
    )


def _in_order(records: list[Record], ops: list[OpRecord]) -> Iterator[Record | OpRecord]:
    """Module calls and operations in the order they started."""
    pending = iter(ops)
    op = next(pending, None)
    for rec in records:
        while op is not None and op.after <= rec.index:
            yield op
            op = next(pending, None)
        yield rec
    if op is not None:
        yield op
        yield from pending


def _rows(recorder: Recorder, params: _Params) -> list[SummaryRow]:
    """A row per module call and per operation its own code ran (between its sub-calls'
    rows), in the order they started."""
    counts = collections.Counter(r.call.name for r in recorder.records)
    names = _OpNames(recorder.ops)
    infos: dict[int, _Module] = {}
    rows: list[SummaryRow] = []
    at: list[int] = []  # record index -> row index
    for item in _in_order(recorder.records, recorder.ops):
        if isinstance(item, OpRecord):
            name = names.name(item)
            if name is not None:
                owner = item.owner
                rows.append(_op_row(item, name, at[owner.index], counts[owner.call.name]))
            continue
        info = infos.get(id(item.module))
        if info is None:
            info = infos[id(item.module)] = params.info(item.module)
        parent = None if item.parent is None else at[item.parent]
        at.append(len(rows))
        rows.append(_row(item, recorder, info, counts[item.call.name], parent))
    return rows


def _opaque(rows: list[SummaryRow], recorder: Recorder, params: _Params) -> list[SummaryRow]:
    """Add a row for each outermost TorchScript submodule, as the last child of its parent's
    last call: its calls cannot be seen (no Python hook runs there), its parameters can."""
    layers = recorder.layers
    for name, module in layers.modules.items():
        parent = name.rpartition(".")[0]
        if not layers.in_script(name) or (parent and layers.in_script(parent)):
            continue
        owners = [i for i, r in enumerate(rows) if r.name == parent]
        if not owners:
            continue
        at, depth = owners[-1], rows[owners[-1]].depth
        end = at + 1
        while end < len(rows) and rows[end].depth > depth:
            end += 1
        info = params.info(module)
        row = SummaryRow(
            name=name,
            type=info.type,
            depth=depth + 1,
            parent=at,
            params=info.params,
            params_total=info.params_total,
            trainable=info.trainable,
            opaque=True,
        )
        for later in rows[end:]:
            if later.parent is not None and later.parent >= end:
                later.parent += 1
        rows.insert(end, row)
    return rows


def build(recorder: Recorder, model: str, inputs: dict[str, ShapeTree]) -> Summary:
    """The summary of what ran; calls still open (the forward raised) end as raised."""
    recorder.abandon_open()
    records = recorder.records
    params = _Params()
    rows = _opaque(_rows(recorder, params), recorder, params)
    callers = {r.parent for r in records}
    uncounted: dict[str, int] = {}
    for tally in [*(r.tally for r in records), recorder.outside]:
        for op, n in tally.uncounted.items():
            uncounted[op] = uncounted.get(op, 0) + n
    every = list(params.under(recorder.layers.root).values())
    return Summary(
        model=model,
        rows=rows,
        total_params=sum(p.numel() for p in every),
        trainable_params=sum(p.numel() for p in every if p.requires_grad),
        param_bytes=sum(p.numel() * p.element_size() for p in every),
        output_bytes=sum(
            r.nbytes for i, r in enumerate(records) if i not in callers and not r.raised
        ),
        total_flops=sum(r.tally.flops for r in records) + recorder.outside.flops,
        uncounted=dict(sorted(uncounted.items(), key=lambda kv: (-kv[1], kv[0]))),
        inputs=inputs,
    )
