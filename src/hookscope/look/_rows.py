"""Turn a :class:`Recorder`'s records into a :class:`Summary`, once the forward is over.

Parameters are counted here, after the forward, so lazy modules (``nn.LazyLinear``) show
the sizes their first call gave them, as torchinfo does.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

import torch
from torch import nn

from ._recorder import Record, Recorder
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
            found = {id(p): p for p in module._parameters.values() if p is not None}
            for child in module._modules.values():
                if child is not None:
                    found.update(self.under(child))
            self._under[id(module)] = found
        return found

    def info(self, module: nn.Module) -> _Module:
        params = list(self.under(module).values())
        own = {id(p): p for p in module._parameters.values() if p is not None}
        return _Module(
            type=_type_name(module),
            params=sum(p.numel() for p in own.values()),
            params_total=sum(p.numel() for p in params),
            trainable=_trainable(params),
        )


def _row(rec: Record, recorder: Recorder, info: _Module, calls: int) -> SummaryRow:
    return SummaryRow(
        name=rec.call.name,
        type=info.type,
        depth=rec.call.depth,
        parent=rec.parent,
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
    counts = collections.Counter(r.call.name for r in records)
    infos: dict[int, _Module] = {}
    params = _Params()
    rows = []
    for rec in records:
        info = infos.get(id(rec.module))
        if info is None:
            info = infos[id(rec.module)] = params.info(rec.module)
        rows.append(_row(rec, recorder, info, counts[rec.call.name]))
    callers = {r.parent for r in rows}
    rows = _opaque(rows, recorder, params)
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
