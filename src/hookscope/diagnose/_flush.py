"""A :class:`~hookscope.Monitor` logging step's end: parameter statistics for every watched
layer at once (``torch._foreach_norm``), every value gathered on the device, combined across
ranks under ``torch.distributed``, read with one host transfer and turned into records.

The step's end (:func:`end_step`) does the device work while the parameters and gradients are
those of the step; the transfer (:meth:`Ended.read`) may come later, so that scalars the user
logs after the optimizer step (:meth:`Ended.log`) are read with the rest. Everything comes in
as a :class:`StepEnd`: this module never sees the Monitor.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core import _torch
from . import _stats
from ._stats import SUM, Moments, merged, summary

__all__ = ["Ended", "StepEnd", "end_step", "zero64"]

MEAN = 4  # parameter statistics, the same on every rank up to rounding: averaged
_ZERO64: dict[torch.device, Tensor] = {}


def zero64(device: torch.device) -> Tensor:
    """A float64 zero on ``device``, made once (it makes the gathered vector float64)."""
    if device not in _ZERO64:
        _ZERO64[device] = torch.zeros((), dtype=torch.float64, device=device)
    return _ZERO64[device]


class _Gather:
    """Device values to read in one transfer, with how each combines across ranks: scalars
    are stacked and vectors concatenated (no operator per value)."""

    def __init__(self) -> None:
        self.scalars: list[Tensor] = []
        self.vectors: list[Tensor] = []
        self._codes: tuple[list[int], list[int]] = ([], [])
        self._where: list[tuple[bool, int, int]] = []  # (vector?, start, length) per add

    def add(self, t: Tensor, code: int) -> int:
        vector = t.dim() > 0
        n = t.numel() if vector else 1
        start = sum(v.numel() for v in self.vectors) if vector else len(self.scalars)
        (self.vectors if vector else self.scalars).append(t)
        self._codes[vector].extend([code] * n)
        self._where.append((vector, start, n))
        return len(self._where) - 1

    @property
    def tensors(self) -> list[Tensor]:
        return self.scalars + self.vectors

    def moments(self, m: Moments) -> list[int]:
        return [self.add(t, code) for t, code in m.parts()]

    def read(self, world: int) -> list[list[float]]:
        """The values of each :meth:`add`, in order (a list per add), combined across
        ``world`` processes when there are several."""
        if not self._where:
            return []
        device = self.tensors[0].device
        # a float64 zero first makes everything float64 (counts above 2**24 stay exact); it
        # is read too, and skipped here rather than sliced off on the device
        parts = [torch.stack([zero64(device), *(t.to(device) for t in self.scalars)])]
        parts += [t.to(device) for t in self.vectors]
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if world > 1:
            codes = torch.tensor([SUM, *self._codes[0], *self._codes[1]], dtype=torch.float64)
            values = _reduce(values, codes.to(device), world)
        flat = values.tolist()[1:]
        offset = len(self.scalars)
        return [
            flat[offset + start : offset + start + n] if vector else [flat[start]]
            for vector, start, n in self._where
        ]


def _reduce(values: Tensor, codes: Tensor, world: int) -> Tensor:
    averaged = codes == MEAN
    combined = _stats.reduce(values, torch.where(averaged, float(SUM), codes), world)
    return torch.where(averaged, combined / world, combined)


@dataclass
class StepEnd:
    """What a logging step's end reads."""

    step: int
    layers: Sequence[str]  # the watched layers, in order
    moments: Mapping[tuple[str, str], list[Moments]]  # (layer, kind): one per forward
    hist: Mapping[tuple[str, str], list[Tensor]]  # (layer, kind): bucket counts per forward
    params: Mapping[str, Sequence[Tensor]]  # layer: its parameters
    before: Mapping[int, Tensor]  # id(parameter): its copy from before the optimizer step
    histograms: bool | str  # False, True (parameters) or "all" (activations too)
    world: int  # processes whose values are combined (1: none)
    rank: int | None  # the ``rank`` key of every record, or None


#: a device value waiting for the transfer: the position of its :meth:`_Gather.add`
Slot = tuple[int]
Scalar = float | Tensor


class Ended:
    """A logged step's values on the device, read in one transfer by :meth:`read`; scalars
    logged until then are read with them."""

    def __init__(self, inputs: StepEnd) -> None:
        self.step = inputs.step
        self._rank = inputs.rank
        self._world = inputs.world
        self._gather = gather = _Gather()
        self._entries = _moments(inputs, gather)
        self._params = _parameters(inputs.params, inputs.before, gather)
        self._hists = _histograms(inputs, gather) if inputs.histograms else []
        self._scalars: dict[str, Slot | float] = {}

    def log(self, scalars: Mapping[str, Scalar]) -> None:
        """Add the user's scalars (tensors join the transfer; a name given again replaces)."""
        for k, v in scalars.items():
            self._scalars[k] = (
                (self._gather.add(v.detach().float(), MEAN),) if isinstance(v, Tensor) else float(v)
            )

    def read(self) -> tuple[list[dict[str, Any]], list[Any]]:
        """``(records, histograms)``: one host transfer (and, across ranks, three
        all-reduces)."""
        host = self._gather.read(self._world)
        step, records = self.step, []
        for name, kind, count, slices, channels, centered in self._entries:
            numel = int(host[count[0]][0]) if isinstance(count, tuple) else count
            stats = summary(numel, [host[s] for s in slices], channels, centered)
            records.append({"step": step, "layer": name, "kind": kind, **stats})
        records += [
            {"step": step, "layer": n, "kind": "parameter", **p(host)} for n, p in self._params
        ]
        for key, value in self._scalars.items():
            v = host[value[0]][0] if isinstance(value, tuple) else value
            records.append({"step": step, "layer": key, "kind": "scalar", "value": v})
        if self._rank is not None:
            for r in records:
                r["rank"] = self._rank
        made = [(f"{n}/{k}", step, h(host)) for n, k, h in self._hists]
        return records, [(tag, s, *m) for tag, s, m in made if m[0]["num"]]


def end_step(inputs: StepEnd) -> Ended:
    """The device work of a logging step that ends now (nothing is read yet)."""
    return Ended(inputs)


_Entry = tuple[str, str, Slot | int, list[int], str | None, bool]


def _moments(inputs: StepEnd, gather: _Gather) -> list[_Entry]:
    """Per watched layer and kind, its forwards' moments merged and gathered."""
    entries: list[_Entry] = []
    across = inputs.world > 1
    for name in inputs.layers:
        for kind in ("activation", "gradient"):
            found = inputs.moments.get((name, kind))
            if found:
                m = merged(found)
                if across:  # sums and norms combine across ranks; means and variances do not
                    m = m.uncentered()
                numel: Slot | int = m.numel
                if across:  # every rank's count of values, added up with the rest
                    numel = (gather.add(torch.full((), m.numel, device=m.total.device), SUM),)
                channels = (
                    "alive"
                    if m.alive is not None
                    else "nonzero_finite"
                    if m.nonzero_finite.dim()
                    else None
                )
                entries.append((name, kind, numel, gather.moments(m), channels, m.centered))
    return entries


def _parameters(
    layer_params: Mapping[str, Sequence[Tensor]], before: Mapping[int, Tensor], gather: _Gather
) -> list[tuple[str, Callable[[list[list[float]]], dict[str, float]]]]:
    """Per layer, a function of the values read giving its parameter record."""
    layers = [(n, ps) for n, ps in layer_params.items() if ps]
    flat: list[Tensor] = [p for _, ps in layers for p in ps]
    if not flat:
        return []
    with torch.no_grad():
        norms = _torch.foreach_norm(flat)
        grads = [p.grad for p in flat if p.grad is not None]
        gnorms = _torch.foreach_norm(grads) if grads else []
        # NaN and Inf times 0 are NaN, everything else 0: the count of non-zeros is theirs
        gbad = _torch.foreach_norm(_torch.foreach_mul(grads, 0.0), 0) if grads else []
        moved: list[Tensor] = [p for p in flat if id(p) in before]
        unorms: Sequence[Tensor] = []
        if moved:
            unorms = _torch.foreach_norm(_torch.foreach_sub(moved, [before[id(p)] for p in moved]))
    at = {id(p): gather.add(n, MEAN) for p, n in zip(flat, norms, strict=True)}
    with_grad = [p for p in flat if p.grad is not None]
    g_at = {id(p): gather.add(n, MEAN) for p, n in zip(with_grad, gnorms, strict=True)}
    b_at = {id(p): gather.add(n, MEAN) for p, n in zip(with_grad, gbad, strict=True)}
    u_at = {id(p): gather.add(n, MEAN) for p, n in zip(moved, unorms, strict=True)}

    def record(ps: Sequence[Tensor]) -> Callable[[list[list[float]]], dict[str, float]]:
        def make(host: list[list[float]]) -> dict[str, float]:
            norm = _root_sum_squares(host, [at[id(p)] for p in ps])
            grad = [g_at[id(p)] for p in ps if id(p) in g_at]
            update = [u_at[id(p)] for p in ps if id(p) in u_at]
            u = _root_sum_squares(host, update) if update else math.nan
            return {
                "norm": norm,
                "grad_norm": _root_sum_squares(host, grad) if grad else math.nan,
                "grad_nonfinite": sum(host[b_at[id(p)]][0] for p in ps if id(p) in b_at)
                if grad
                else math.nan,
                "update_norm": u,
                "update_ratio": u / norm if norm and update else math.nan,
            }

        return make

    return [(name, record(ps)) for name, ps in layers]


def _root_sum_squares(host: list[list[float]], slices: list[int]) -> float:
    return math.sqrt(sum(host[s][0] ** 2 for s in slices))


def _histograms(inputs: StepEnd, gather: _Gather) -> list[tuple[str, str, Any]]:
    """Per (layer, kind), a function of the values read giving (statistics, bucket counts)."""
    out: list[tuple[str, str, Any]] = []
    for name in inputs.layers:
        ps = inputs.params[name]
        parts: dict[str, list[Tensor]] = {"parameter": [p.detach() for p in ps]}
        parts["parameter_gradient"] = [p.grad for p in ps if p.grad is not None]
        for kind in ("activation", "gradient"):
            if (name, kind) in inputs.hist:
                found = inputs.moments.get((name, kind))
                if found:
                    made = _histogram_entry(
                        name, kind, merged(found).uncentered(), inputs.hist[name, kind], gather
                    )
                    out.append(made)
        for kind, tensors in parts.items():
            if tensors:
                found = [m for t in tensors if (m := Moments.of(t)) is not None]
                moments = merged([m.uncentered() for m in found])
                counts = [_stats.histogram(tensors)]
                out.append(_histogram_entry(name, kind, moments, counts, gather))
    return out


def _histogram_entry(
    name: str, kind: str, m: Moments, counts: list[Tensor], gather: _Gather
) -> tuple[str, str, Any]:
    slices = gather.moments(
        Moments(
            m.numel,
            m.total,
            m.norm,
            m.nonzero,
            m.nonzero_finite.sum(),
            m.low,
            m.high,
        )
    )
    total = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)
    counted = gather.add(total, SUM)

    def make(host: list[list[float]]) -> tuple[dict[str, float], list[float]]:
        total_, norm, nonzero, nonzero_finite, low, high = (host[s][0] for s in slices)
        num = m.numel - (nonzero - nonzero_finite)
        stats = {"num": num, "sum": total_, "sum_squares": norm * norm, "min": low, "max": high}
        return stats, host[counted]

    return name, kind, make
