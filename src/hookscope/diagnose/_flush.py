"""A :class:`~hookscope.Monitor` logging step's end: parameter statistics for every watched
layer at once (``torch._foreach_norm``), every value gathered on the device, combined across
ranks under ``torch.distributed``, read with one host transfer and turned into records."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..core import _torch
from . import _stats
from ._stats import SUM, Moments, merged, summary

if TYPE_CHECKING:
    from ._monitoring import Monitor

__all__ = ["flush"]

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

    def read(self, ranks: str, world: int) -> list[list[float]]:
        """The values of each :meth:`add`, in order (a list per add)."""
        if not self._where:
            return []
        device = self.tensors[0].device
        # a float64 zero first makes everything float64 (counts above 2**24 stay exact); it
        # is read too, and skipped here rather than sliced off on the device
        parts = [torch.stack([zero64(device), *(t.to(device) for t in self.scalars)])]
        parts += [t.to(device) for t in self.vectors]
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        if ranks == "reduce" and world > 1:
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


def flush(mon: Monitor) -> tuple[list[dict[str, Any]], list[Any]]:
    """``(records, histograms)`` of the logging step that ends now."""
    from ._monitoring import _rank, _world

    gather = _Gather()
    entries: list[tuple[str, str, tuple[int] | int, list[int], str | None, bool]] = []
    ranks = mon.ranks == "reduce" and _world() > 1
    for name in mon.layers_watched:
        for kind in ("activation", "gradient"):
            found = mon._moments.get((name, kind))
            if found:
                m = merged(found)
                if ranks:  # sums and norms combine across ranks; means and variances do not
                    m = m.uncentered()
                numel: tuple[int] | int = m.numel
                if ranks:  # every rank's count of values, added up with the rest
                    numel = (gather.add(torch.full((), m.numel, device=m.total.device), SUM),)
                channels = (
                    "high" if m.high.dim() else "nonzero_finite" if m.nonzero_finite.dim() else None
                )
                entries.append((name, kind, numel, gather.moments(m), channels, m.centered))
    params = _parameters(mon, gather)
    hists = _histograms(mon, gather) if mon.histograms else []
    scalars: dict[str, tuple[int] | float] = {
        k: (gather.add(v.detach().float(), MEAN),) if isinstance(v, Tensor) else float(v)
        for k, v in mon._scalars.items()
    }
    host = gather.read(mon.ranks, _world())
    step, rank = mon.count, (_rank() if mon.ranks == "each" and _world() > 1 else None)
    records: list[dict[str, Any]] = []
    for name, kind, count, slices, channels, centered in entries:
        numel = int(host[count[0]][0]) if isinstance(count, tuple) else count
        stats = summary(numel, [host[s] for s in slices], channels, centered)
        records.append({"step": step, "layer": name, "kind": kind, **stats})
    records += [{"step": step, "layer": n, "kind": "parameter", **p(host)} for n, p in params]
    for key, value in scalars.items():
        v = host[value[0]][0] if isinstance(value, tuple) else value
        records.append({"step": step, "layer": key, "kind": "scalar", "value": v})
    if rank is not None:
        for r in records:
            r["rank"] = rank
    histograms = [(f"{n}/{k}", step, h(host)) for n, k, h in hists]
    return records, [(tag, s, *made) for tag, s, made in histograms if made[0]["num"]]


def _parameters(mon: Monitor, gather: _Gather) -> list[tuple[str, Any]]:
    """Per layer, a function of the values read giving its parameter record."""
    layers = [(n, ps) for n, ps in mon._params.items() if ps]
    flat: list[Tensor] = [p for _, ps in layers for p in ps]
    if not flat:
        return []
    with torch.no_grad():
        norms = _torch.foreach_norm(flat)
        grads = [p.grad for p in flat if p.grad is not None]
        gnorms = _torch.foreach_norm(grads) if grads else []
        # NaN and Inf times 0 are NaN, everything else 0: the count of non-zeros is theirs
        gbad = _torch.foreach_norm(_torch.foreach_mul(grads, 0.0), 0) if grads else []
        moved: list[Tensor] = [p for p in flat if id(p) in mon._before]
        unorms: Sequence[Tensor] = []
        if moved:
            before = [mon._before[id(p)] for p in moved]
            unorms = _torch.foreach_norm(_torch.foreach_sub(moved, before))
    at = {id(p): gather.add(n, MEAN) for p, n in zip(flat, norms, strict=True)}
    with_grad = [p for p in flat if p.grad is not None]
    g_at = {id(p): gather.add(n, MEAN) for p, n in zip(with_grad, gnorms, strict=True)}
    b_at = {id(p): gather.add(n, MEAN) for p, n in zip(with_grad, gbad, strict=True)}
    u_at = {id(p): gather.add(n, MEAN) for p, n in zip(moved, unorms, strict=True)}

    def record(ps: Sequence[Tensor]) -> Any:
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


def _histograms(mon: Monitor, gather: _Gather) -> list[tuple[str, str, Any]]:
    """Per (layer, kind), a function of the values read giving (statistics, bucket counts)."""
    out: list[tuple[str, str, Any]] = []
    for name in mon.layers_watched:
        ps = mon._params[name]
        parts: dict[str, list[Tensor]] = {"parameter": [p.detach() for p in ps]}
        parts["parameter_gradient"] = [p.grad for p in ps if p.grad is not None]
        for kind in ("activation", "gradient"):
            if (name, kind) in mon._hist:
                found = mon._moments.get((name, kind))
                if found:
                    made = _histogram_entry(
                        name, kind, merged(found).uncentered(), mon._hist[name, kind], gather
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
    slices = gather.moments(Moments(
        m.numel, m.total, m.norm, m.nonzero, m.nonzero_finite.sum(),
        m.low, m.high.amax() if m.high.dim() else m.high,
    ))  # fmt: skip
    total = counts[0] if len(counts) == 1 else torch.stack(counts).sum(0)
    counted = gather.add(total, SUM)

    def make(host: list[list[float]]) -> tuple[dict[str, float], list[float]]:
        total_, norm, nonzero, nonzero_finite, low, high = (host[s][0] for s in slices)
        num = m.numel - (nonzero - nonzero_finite)
        stats = {"num": num, "sum": total_, "sum_squares": norm * norm, "min": low, "max": high}
        return stats, host[counted]

    return name, kind, make
