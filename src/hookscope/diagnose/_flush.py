"""A :class:`~hookscope.Monitor` logging step's end: parameter statistics for every watched
layer at once (``torch._foreach_norm``), every value gathered on the device, combined across
ranks under ``torch.distributed``, read with one host transfer and turned into records.

The step's end (:func:`end_step`) does the device work while the parameters and gradients are
those of the step; the transfer (:meth:`Ended.read`) may come later, so that scalars the user
logs after the optimizer step (:meth:`Ended.log`) are read with the rest. Across processes,
the values cross each process group in one all-reduce (sums, and extremes in per-rank slots:
:class:`~hookscope.diagnose._stats.Reduction`), started and not waited: at the step's end
for sharded parameters' groups, at :meth:`Ended.send` for the world; :meth:`Ended.read`
waits for them, so the Monitor reads a step when training has moved on. Everything comes in
as a :class:`StepEnd`: this module never sees the Monitor.

Sharded parameters (``DTensor``: FSDP2, HSDP) are measured on each rank's piece and combined
over the process group that shards them (:func:`_sharded_parameters`, through
:class:`~hookscope.diagnose._sharded.Plan`); plain ones (DDP's) keep the path above.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..core import _torch
from . import _sharded, _stats
from ._stats import MAX, SUM, Moments, merged, summary

__all__ = ["Ended", "StepEnd", "end_step", "zero64"]

MEAN = 4  # parameter statistics, the same on every rank up to rounding: averaged
KEPT = 5  # the same on every rank (combined already, or never split): this rank's value
_ZERO64: dict[torch.device, Tensor] = {}


def zero64(device: torch.device) -> Tensor:
    """A float64 zero on ``device``, made once (it makes the gathered vector float64)."""
    if device not in _ZERO64:
        _ZERO64[device] = torch.zeros((), dtype=torch.float64, device=device)
    return _ZERO64[device]


#: a value to read: a device tensor, or a function giving one once this step's group
#: combinations have finished (it waits for them)
Value = Tensor | Callable[[], Tensor]


class _Gather:
    """Device values to read in one transfer, with how each combines across ranks: scalars
    are stacked and vectors concatenated (no operator per value). :meth:`send` starts the
    combination across ranks (one all-reduce, not waited), :meth:`read` waits and reads.
    Values coded :data:`KEPT` are not sent: they are read as they are, after the rest."""

    def __init__(self) -> None:
        self.scalars: list[Tensor] = []
        self.vectors: list[Tensor] = []
        self.kept: list[Value] = []
        self._codes: tuple[list[int], list[int]] = ([], [])
        self._where: list[tuple[int, int, int]] = []  # (section, start, length) per add
        self._sizes = [0, 0, 0]  # values per section: scalars, vectors, kept
        self._sent: Tensor | _stats.Reduction | None = None
        self._world = 1

    def add(self, t: Value, code: int, n: int = 1) -> int:
        """Gather ``t`` (a function: a kept vector of ``n`` values, made at :meth:`read`)."""
        if callable(t) or code == KEPT:
            section, n = 2, (n if callable(t) else t.numel())
            self.kept.append(t if callable(t) else t.reshape(-1))
        else:
            section, n = (1, t.numel()) if t.dim() > 0 else (0, 1)
            (self.vectors if section else self.scalars).append(t)
            self._codes[section].extend([code] * n)
        self._where.append((section, self._sizes[section], n))
        self._sizes[section] += n
        return len(self._where) - 1

    def moments(self, m: Moments) -> list[int]:
        return [self.add(t, code) for t, code in m.parts()]

    @property
    def pending(self) -> bool:
        """Whether :meth:`read` waits for a collective (started but not waited)."""
        return isinstance(self._sent, _stats.Reduction) or any(callable(k) for k in self.kept)

    def send(self, world: int) -> None:
        """Start combining the values across ``world`` processes (once; nothing with one)."""
        if self._sent is not None or not (self.scalars or self.vectors):
            return
        device = (self.scalars or self.vectors)[0].device
        # a float64 zero first makes everything float64 (counts above 2**24 stay exact); it
        # is read too, and skipped at the read rather than sliced off on the device
        parts = [torch.stack([zero64(device), *(t.to(device) for t in self.scalars)])]
        parts += [t.to(device) for t in self.vectors]
        values = torch.cat(parts) if len(parts) > 1 else parts[0]
        self._world = world
        if world > 1:
            codes = torch.tensor([SUM, *self._codes[0], *self._codes[1]], dtype=torch.float64)
            sent = torch.where(codes == MEAN, float(SUM), codes)
            self._sent = _stats.Reduction(values, sent.to(torch.int64))
        else:
            self._sent = values

    def read(self, world: int) -> list[list[float]]:
        """The values of each :meth:`add`, in order (a list per add), combined across
        ``world`` processes when there are several (sent first if they were not)."""
        if not self._where:
            return []
        self.send(world)
        parts = []
        if self._sent is not None:
            parts.append(self._combined())
        parts += [(k() if callable(k) else k).to(torch.float64).reshape(-1) for k in self.kept]
        devices = {p.device for p in parts}
        if len(devices) > 1:
            parts = [p.to(parts[0].device) for p in parts]
        flat = (torch.cat(parts) if len(parts) > 1 else parts[0]).tolist()
        head = 1 if self._sent is not None else 0  # (the zero)
        base = [head, head + self._sizes[0], head + self._sizes[0] + self._sizes[1]]
        return [flat[base[s] + start : base[s] + start + n] for s, start, n in self._where]

    def _combined(self) -> Tensor:
        sent = self._sent
        if not isinstance(sent, _stats.Reduction):
            assert sent is not None
            return sent
        values = sent.result()
        codes = torch.tensor([SUM, *self._codes[0], *self._codes[1]], device=values.device)
        return torch.where(codes == MEAN, values / self._world, values)


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
    #: tensor parallelism: the layers whose outputs are this rank's slice of their features
    #: (where it starts, the whole width), and the size of the tensor-parallel group, over
    #: which every other layer's output is the same (1: none)
    shards: Mapping[str, tuple[int, int]] = field(default_factory=dict)
    replicas: int = 1


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
        sharded = any(_sharded.is_sharded(p) for ps in inputs.params.values() for p in ps)
        self._hists: list[tuple[str, str, Any]] = []
        if not sharded:
            self._params = _parameters(inputs.params, inputs.before, gather)
        else:  # (parameter histograms come with the sharded statistics)
            self._params, self._hists = _sharded_parameters(inputs, gather)
        if inputs.histograms:
            self._hists += _histograms(inputs, gather, parameters=not sharded)
        self._scalars: dict[str, Slot | float] = {}

    def log(self, scalars: Mapping[str, Scalar]) -> None:
        """Add the user's scalars (tensors join the transfer; a name given again replaces)."""
        for k, v in scalars.items():
            self._scalars[k] = (
                (self._gather.add(v.detach().float(), MEAN),) if isinstance(v, Tensor) else float(v)
            )

    def send(self) -> None:
        """Start combining the values across ranks (one all-reduce over the world, not
        waited): the step's scalars are all in."""
        self._gather.send(self._world)

    @property
    def pending(self) -> bool:
        """Whether :meth:`read` waits for a collective started at the step's end or by
        :meth:`send`."""
        return self._gather.pending

    def read(self) -> tuple[list[dict[str, Any]], list[Any]]:
        """``(records, histograms)``: one host transfer, after waiting for the collectives
        (:meth:`send`'s, if it was not called: it is then)."""
        host = self._gather.read(self._world)
        step, records = self.step, []
        for name, kind, count, slices, channels, centered in self._entries:
            numel = round(host[count[0]][0]) if isinstance(count, tuple) else count
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
                count = float(m.numel)
                if across and inputs.replicas > 1:  # (tensor parallelism: see _spread)
                    m, count = _spread(m, inputs.shards.get(name), inputs.replicas)
                if across:  # every rank's count of values, added up with the rest
                    numel = (gather.add(torch.full((), count, device=m.total.device), SUM),)
                channels = (
                    "alive"
                    if m.alive is not None
                    else "nonzero_finite"
                    if m.nonzero_finite.dim()
                    else None
                )
                entries.append((name, kind, numel, gather.moments(m), channels, m.centered))
    return entries


def _spread(m: Moments, piece: tuple[int, int] | None, replicas: int) -> tuple[Moments, float]:
    """Under tensor parallelism, a layer's uncentered moments (and its count of values) as
    this rank adds them to the sum over every rank: a slice of the output features
    (``piece``) is the only copy of its values, and its per-channel counts go to their place
    in a vector of the whole width (concatenated, not added, over the tensor-parallel group);
    a whole output is held by each of the ``replicas`` ranks of the group, so each adds
    ``1 / replicas`` of its sums and counts (its norm: of the sum of squares)."""
    if piece is not None:
        start, width = piece

        def placed(v: Tensor | None) -> Tensor | None:
            if v is None or v.dim() == 0:
                return v
            whole = v.new_zeros(width)
            whole[start : start + v.shape[0]] = v
            return whole

        alive = placed(m.alive)
        nonzero_finite = placed(m.nonzero_finite)
        assert nonzero_finite is not None
        return dataclasses.replace(m, nonzero_finite=nonzero_finite, alive=alive), float(m.numel)
    share = 1.0 / replicas

    def part(v: Tensor, by: float = share) -> Tensor:
        return v.to(torch.float64) * by  # (float64: counts above 2**24 stay exact)

    spread = dataclasses.replace(
        m,
        total=part(m.total),
        norm=part(m.norm, math.sqrt(share)),
        nonzero=part(m.nonzero),
        nonzero_finite=part(m.nonzero_finite),
        alive=None if m.alive is None else part(m.alive),
    )
    return spread, m.numel * share


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


#: a sharded statistics row (:func:`_sharded_parameters`): sum of squares, non-finite count,
#: the update's sum of squares, then (with histograms) the moments and the bucket counts
_SQ, _BAD, _USQ, _HIST = 0, 1, 2, 3


def _sharded_parameters(
    inputs: StepEnd, gather: _Gather
) -> tuple[
    list[tuple[str, Callable[[list[list[float]]], dict[str, float]]]],
    list[tuple[str, str, Any]],
]:
    """:func:`_parameters` (and the parameter histograms) when some parameters are sharded
    (``DTensor``): every statistic is taken on each rank's piece (``plan.values``) as additive
    partials, one row per parameter and per gradient, and combined over the process group
    that shards it (:class:`_sharded.Plan`): one packed sum all-reduce per group (the
    ``-min`` and ``max`` of histograms in per-rank slots), started here and waited when the
    step is read. Where every group spans the whole world whose values are reduced anyway
    (``ranks="reduce"`` under plain FSDP2), the rows join that reduction instead and no
    all-reduce is added."""
    flat = [p for ps in inputs.params.values() for p in ps]
    with_grad = [p for p in flat if p.grad is not None]
    grads: list[Tensor] = [p.grad for p in with_grad if p.grad is not None]
    plan = _sharded.Plan([*flat, *grads])
    values = plan.values
    n, hist = len(flat), bool(inputs.histograms)
    with torch.no_grad():
        sums, highs = _sharded_rows(values, flat, inputs.before, hist)
    rows = range(len(values))
    # rows combined over the world at once join the world's reduction where there is one
    # ("reduce" across processes); the rest are combined over their groups from now on
    joins = {i for i in rows if inputs.world > 1 and plan.over_world(i)}
    later = [i for i in rows if plan.combined(i) and i not in joins]
    combining = plan.start(sums, highs, skip=joins) if later else None

    def row_of(i: int, part: int) -> Callable[[], Tensor]:
        assert combining is not None
        return lambda: combining.result()[part][i]

    def add(i: int, part: int) -> int:
        if i in joins:
            return gather.add((sums, highs)[part][i], (SUM, MAX)[part])
        if combining is not None and plan.combined(i):  # (waits at the read)
            return gather.add(row_of(i, part), KEPT, (sums, highs)[part].shape[1])
        return gather.add((sums, highs)[part][i], KEPT)  # the same on every rank

    at = [add(i, 0) for i in rows]
    high_at = [add(i, 1) for i in rows] if hist else []
    row = {id(p): i for i, p in enumerate(flat)}
    grad_row = {id(p): n + i for i, p in enumerate(with_grad)}
    moved = {id(p) for p in flat if id(p) in inputs.before}

    def record(ps: Sequence[Tensor]) -> Callable[[list[list[float]]], dict[str, float]]:
        def make(host: list[list[float]]) -> dict[str, float]:
            norm = math.sqrt(sum(host[at[row[id(p)]]][_SQ] for p in ps))
            grads = [host[at[grad_row[id(p)]]] for p in ps if id(p) in grad_row]
            update = [host[at[row[id(p)]]][_USQ] for p in ps if id(p) in moved]
            u = math.sqrt(sum(update)) if update else math.nan
            return {
                "norm": norm,
                "grad_norm": math.sqrt(sum(g[_SQ] for g in grads)) if grads else math.nan,
                "grad_nonfinite": sum(g[_BAD] for g in grads) if grads else math.nan,
                "update_norm": u,
                "update_ratio": u / norm if norm and update else math.nan,
            }

        return make

    def histogram(ts: list[Tensor], rows: list[int]) -> Any:
        numel = sum(t.numel() for t in ts)  # (a DTensor's: the whole tensor's)

        def make(host: list[list[float]]) -> tuple[dict[str, float], list[float]]:
            parts = [host[at[r]][_HIST:] for r in rows]
            total, sumsq, nonzero, finite = (sum(p[k] for p in parts) for k in range(4))
            stats = {
                "num": numel - (nonzero - finite),
                "sum": total,
                "sum_squares": sumsq,
                "min": min(-host[high_at[r]][0] for r in rows),
                "max": max(host[high_at[r]][1] for r in rows),
            }
            return stats, [sum(c) for c in zip(*(p[4:] for p in parts), strict=True)]

        return make

    layers = [(name, ps) for name, ps in inputs.params.items() if ps]
    hists: list[tuple[str, str, Any]] = []
    for name, ps in layers if hist else []:
        hists.append((name, "parameter", histogram(list(ps), [row[id(p)] for p in ps])))
        gs = [p for p in ps if id(p) in grad_row]
        if gs:
            made = histogram([p.grad for p in gs], [grad_row[id(p)] for p in gs])  # type: ignore[misc]
            hists.append((name, "parameter_gradient", made))
    return [(name, record(ps)) for name, ps in layers], hists


def _sharded_rows(
    values: list[Tensor], flat: list[Tensor], before: Mapping[int, Tensor], hist: bool
) -> tuple[Tensor, Tensor]:
    """Each rank's rows of additive partials (float64): per parameter (``flat``, whose pieces
    come first in ``values``) and per gradient (the rest), the sum of squares, the non-finite
    count (gradients), the update's sum of squares (parameters), and with ``hist`` the
    histogram's sums and counts; and the ``(-min, max)`` rows (empty pieces: ``-inf``)."""
    n = len(flat)
    sq = [v.to(torch.float64).square() for v in _torch.foreach_norm(values)]
    grads = values[n:]
    bad = _torch.foreach_norm(_torch.foreach_mul(grads, 0.0), 0) if grads else []
    moved = [i for i, p in enumerate(flat) if id(p) in before]
    usq: dict[int, Tensor] = {}
    if moved:
        diffs = _torch.foreach_sub([values[i] for i in moved], [before[id(flat[i])] for i in moved])
        usq = {
            i: u.to(torch.float64).square()
            for i, u in zip(moved, _torch.foreach_norm(diffs), strict=True)
        }
    zero = zero64(values[0].device)
    sums, highs = [], []
    for i, v in enumerate(values):
        head = [sq[i], bad[i - n].to(torch.float64) if i >= n else zero, usq.get(i, zero)]
        if not hist:
            sums.append(torch.stack(head))
            continue
        part, high = _histogram_partials(v)
        sums.append(torch.cat([torch.stack(head), part]))
        highs.append(high)
    empty = torch.empty(len(values), 0, dtype=torch.float64, device=zero.device)
    return torch.stack(sums), torch.stack(highs) if highs else empty


def _histogram_partials(x: Tensor) -> tuple[Tensor, Tensor]:
    """A piece's histogram partials: (sum, sum of squares, non-zeros, finite non-zeros, bucket
    counts) and (-min, max), non-finite values counted as 0 in the moments as
    :class:`Moments` does (and not counted in the buckets)."""
    x = x.detach().reshape(-1)
    counts = _stats.histogram([x])
    if x.numel() == 0:
        nothing = torch.zeros(4, dtype=torch.float64, device=x.device)
        return torch.cat([nothing, counts]), torch.full(
            (2,), -math.inf, dtype=torch.float64, device=x.device
        )
    x0 = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0).to(torch.float64)
    low, high = torch.aminmax(x0)
    moments = torch.stack(
        [
            x0.sum(),
            x0.square().sum(),
            torch.count_nonzero(x).to(torch.float64),
            torch.count_nonzero(x0).to(torch.float64),
        ]
    )
    return torch.cat([moments, counts]), torch.stack([-low, high])


def _root_sum_squares(host: list[list[float]], slices: list[int]) -> float:
    return math.sqrt(sum(host[s][0] ** 2 for s in slices))


def _histograms(
    inputs: StepEnd, gather: _Gather, parameters: bool = True
) -> list[tuple[str, str, Any]]:
    """Per (layer, kind), a function of the values read giving (statistics, bucket counts);
    ``parameters``: those of the parameters and their gradients too."""
    out: list[tuple[str, str, Any]] = []
    for name in inputs.layers:
        ps = inputs.params[name] if parameters else []
        parts: dict[str, list[Tensor]] = {"parameter": [p.detach() for p in ps]}
        parts["parameter_gradient"] = [p.grad for p in ps if p.grad is not None]
        for kind in ("activation", "gradient"):
            if (name, kind) in inputs.hist:
                found = inputs.moments.get((name, kind))
                if found:
                    made, share = merged(found).uncentered(), 1.0
                    if inputs.world > 1 and inputs.replicas > 1 and name not in inputs.shards:
                        made, _ = _spread(made, None, inputs.replicas)  # (a whole output, on
                        share = 1.0 / inputs.replicas  # every rank of the TP group: once)
                    counts = inputs.hist[name, kind]
                    out.append(_histogram_entry(name, kind, made, counts, gather, share))
        for kind, tensors in parts.items():
            if tensors:
                found = [m for t in tensors if (m := Moments.of(t)) is not None]
                moments, share = merged([m.uncentered() for m in found]), 1.0
                if inputs.world > 1:  # (plain parameters, DDP's: the same on every rank)
                    moments, _ = _spread(moments, None, inputs.world)
                    share = 1.0 / inputs.world
                counts = [_stats.histogram(tensors)]
                out.append(_histogram_entry(name, kind, moments, counts, gather, share))
    return out


def _histogram_entry(
    name: str, kind: str, m: Moments, counts: list[Tensor], gather: _Gather, share: float = 1.0
) -> tuple[str, str, Any]:
    """A histogram's moments and bucket counts, gathered (``share``: the part of its counts
    this rank adds, where other ranks hold the same values); its ``num``, the finite values,
    is the sum of the counts (every finite value is in a bucket), so that it is every
    rank's where the counts are combined."""
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
    counted = gather.add(total if share == 1.0 else total * share, SUM)

    def make(host: list[list[float]]) -> tuple[dict[str, float], list[float]]:
        total_, norm, _, _, low, high = (host[s][0] for s in slices)
        num = round(sum(host[counted]))
        stats = {"num": num, "sum": total_, "sum_squares": norm * norm, "min": low, "max": high}
        return stats, host[counted]

    return name, kind, make
