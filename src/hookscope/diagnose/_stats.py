"""The statistics :class:`~hookscope.Monitor` computes on the device, and how they combine.

A tensor's :class:`Moments` take five operators and nothing else: non-finite values are
replaced by 0 once (``nan_to_num``) for the sum, the norm, the minimum and the maximum, and
counted as the difference of two ``count_nonzero`` (non-zero before the replacement, zero
after). That is on a GPU, where
each operator costs a launch (:func:`few_operators`). On the CPU an operator costs its
arithmetic, and ``var_mean`` (Welford's method in float64) and ``count_nonzero`` (a branch per
value) take 10 to 30 times a sum of the same tensor: there the mean and the norm around it
are two passes, and counts sum ``x != 0`` in int32 (six more operators, a third of the
time). The replacing zeros can only reach the minimum or the maximum if the tensor held
non-finite values and no zero of its own; then an extreme that came out 0 is unknown and
reported as NaN (:func:`summary`). Dead units are counted per channel: for a ReLU-like
activation the non-zero finite values (which the statistics count anyway), for one whose
flat regions are the bounds of its range (Tanh, ReLU6) the values strictly between them,
four operators more (``_dead.py`` says which is which). Everything is read on the host once
per logging step and combined there, so micro-batches, layers and kinds cost no extra device
work; under ``torch.distributed`` the values are combined across ranks first
(:class:`Reduction`).

Unusual tensors: a sparse tensor's statistics are those of the dense tensor it stands for,
computed on its stored values (the rest counted as zeros), without dead units; a nested
tensor's are its packed values'; a tensor on the meta device has no values
(:func:`has_values`) and is left out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "EDGES",
    "MAX",
    "MIN",
    "ROOT_SUM_SQUARES",
    "SUM",
    "Flat",
    "Moments",
    "Reduction",
    "few_operators",
    "has_values",
    "histogram",
    "stored",
]

#: how each value combines across ranks
SUM, MIN, MAX, ROOT_SUM_SQUARES = 0, 1, 2, 3


def few_operators(device: torch.device) -> bool:
    """Whether statistics on ``device`` take the fewest operators (each is a kernel launch)
    rather than the least arithmetic (the CPU; see the module docstring)."""
    return device.type != "cpu"


def has_values(t: Tensor) -> bool:
    """Whether ``t`` has values to measure: a tensor on the meta device has a shape only."""
    return not t.is_meta


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def stored(t: Tensor) -> tuple[Tensor, int]:
    """The values of ``t`` as a plain tensor, and how many zeros ``t`` holds besides them: a
    sparse tensor's stored values (duplicates summed) and its implicit zeros, a nested
    tensor's packed values; complex numbers as pairs of reals."""
    x, dense = t, 0
    if t.is_nested:  # (checked first: a jagged tensor's .layout runs an operator)
        x = t.values()
    elif t.layout == torch.sparse_coo:
        x = (t if t.is_coalesced() else t.coalesce()).values()
        dense = t.numel()
    elif t.layout in _COMPRESSED:
        x, dense = t.values(), t.numel()
    if x.is_complex():
        x, dense = torch.view_as_real(x), 2 * dense
    return x, max(dense - x.numel(), 0)


def _count_nonzero(x: Tensor, dim: tuple[int, ...] | None = None) -> Tensor:
    """``torch.count_nonzero``, as the CPU counts fastest where it is not a GPU's one launch."""
    if few_operators(x.device):
        return torch.count_nonzero(x, dim=dim)
    exact = torch.int32 if x.numel() < 2**31 else torch.int64  # int64 sums are 4x slower
    return (x != 0).sum(dim=dim, dtype=exact)


@dataclass(frozen=True)
class Flat:
    """Where an activation passes no gradient, told by its output: exactly 0 (``zero``), or
    ``low`` / ``high``, the bounds of its range (the gradient flows strictly between them)."""

    low: float = -math.inf
    high: float = math.inf
    zero: bool = False


def _alive(x: Tensor, flat: Flat, others: tuple[int, ...]) -> Tensor:
    """Per channel, the count of values strictly inside ``flat``'s bounds (NaN is not)."""
    exact = torch.int32 if x.numel() < 2**31 else torch.int64
    return ((x > flat.low) & (x < flat.high)).sum(dim=others, dtype=exact)


@dataclass
class Moments:
    """One tensor's statistics, as device tensors (``max`` per channel when asked for)."""

    numel: int
    total: Tensor  # sum of the finite values (their mean over all values when centered)
    norm: Tensor  # L2 norm of the finite values (their variance over all values, centered)
    nonzero: Tensor  # count of non-zero values (non-finite ones included)
    nonzero_finite: Tensor  # count of non-zero finite values
    low: Tensor  # minimum of the values, non-finite ones counted as 0
    high: Tensor  # maximum of the values, non-finite ones as 0
    #: ``total`` and ``norm`` hold ``torch.var_mean``'s mean and variance (one operator, for
    #: float32 and float64; half precision sums in float32 instead, with two)
    centered: bool = False
    #: per channel, the count of values a gradient passes through (dead units), when they
    #: are not ``nonzero_finite`` counted per channel (ReLU-like: non-zero means alive)
    alive: Tensor | None = None

    @staticmethod
    def of(t: Tensor, channels: int | None = None, flat: Flat | None = None) -> Moments | None:
        """The moments of ``t`` (see the module docstring for sparse and nested tensors; no
        channels for a sparse one). ``channels``: the dim whose entries are channels, and
        ``flat``: where the layer passes no gradient, for dead units (a channel is alive when
        it has one value elsewhere). For a ReLU-like layer the non-zero finite values are then
        counted per channel, which costs nothing more; otherwise ``alive`` counts the values
        inside the bounds. None for an empty tensor."""
        with torch.no_grad():  # no autograd record (and no detach() to dispatch)
            x, zeros = stored(t)
            if zeros:
                return _with_zeros(x, zeros)
            if x.numel() == 0:
                return None
            acc = torch.float64 if x.dtype == torch.float64 else torch.float32
            others: tuple[int, ...] = ()
            if channels is not None and flat is not None and x.dim() > 1:
                others = tuple(d for d in range(x.dim()) if d != channels % x.dim())
            x0 = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
            low, high = torch.aminmax(x0)
            per_channel = bool(others) and flat is not None and flat.zero
            alive = _alive(x, flat, others) if others and flat and not flat.zero else None
            centered = x0.dtype == acc
            if centered and few_operators(x0.device):
                total, norm = torch.var_mean(x0, correction=0)[::-1]
            elif centered:  # the same mean and variance, in two passes (module docstring)
                total = x0.mean()
                norm = torch.linalg.vector_norm(x0 - total).square() / x0.numel()
            else:
                total, norm = x0.sum(dtype=acc), torch.linalg.vector_norm(x0, dtype=acc)
            return Moments(
                numel=x.numel(),
                total=total,
                norm=norm,
                nonzero=_count_nonzero(x),
                nonzero_finite=_count_nonzero(x0, dim=others if per_channel else None),
                low=low,
                high=high,
                centered=centered,
                alive=alive,
            )

    def uncentered(self) -> Moments:
        """The same moments as a sum and a norm (device operators only when centered)."""
        if not self.centered:
            return self
        total = self.total * self.numel
        norm = ((self.norm + self.total * self.total) * self.numel).sqrt()
        return dataclasses.replace(self, total=total, norm=norm, centered=False)

    def scaled(self, factor: Tensor) -> Moments:
        """The moments of the tensor times ``factor``, a positive device scalar (a loss
        scaler's inverse scale): sums, norms and extremes scale, counts do not (device
        operators only, no read)."""
        total = self.total * factor
        norm = self.norm * factor * factor if self.centered else self.norm * factor
        return dataclasses.replace(
            self, total=total, norm=norm, low=self.low * factor, high=self.high * factor
        )

    def parts(self) -> list[tuple[Tensor, int]]:
        """``(values, how they combine)`` in a fixed order; ``nonzero_finite`` (counted per
        channel) may be a vector, and ``alive`` (per channel) comes last when there is one."""
        parts = [
            (self.total, SUM),
            (self.norm, ROOT_SUM_SQUARES),
            (self.nonzero, SUM),
            (self.nonzero_finite, SUM),
            (self.low, MIN),
            (self.high, MAX),
        ]
        return parts if self.alive is None else [*parts, (self.alive, SUM)]


def _with_zeros(x: Tensor, zeros: int) -> Moments:
    """The moments of the values ``x`` and ``zeros`` more zeros (a sparse tensor's), with no
    channels: the sum and norm of ``x``, extremes widened to 0."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    x0 = torch.nan_to_num(x.reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)
    zero = torch.zeros(1, dtype=x0.dtype, device=x0.device)
    low, high = torch.aminmax(torch.cat([x0, zero]))
    return Moments(
        numel=x.numel() + zeros,
        total=x0.sum(dtype=acc),
        norm=torch.linalg.vector_norm(x0, dtype=acc),
        nonzero=_count_nonzero(x),
        nonzero_finite=_count_nonzero(x0),
        low=low,
        high=high,
    )


def merged(moments: list[Moments]) -> Moments:
    """Several forwards' moments of one layer as one (device work only when there are
    several: one operation per part)."""
    if len(moments) == 1:
        return moments[0]
    moments = [m.uncentered() for m in moments]

    def stacked(part: str) -> Tensor:
        return torch.stack([getattr(m, part) for m in moments])

    return Moments(
        numel=sum(m.numel for m in moments),
        total=stacked("total").sum(0),
        norm=torch.linalg.vector_norm(stacked("norm"), dim=0),
        nonzero=stacked("nonzero").sum(0),
        nonzero_finite=stacked("nonzero_finite").sum(0),
        low=stacked("low").amin(0),
        high=stacked("high").amax(0),
        alive=None if moments[0].alive is None else stacked("alive").sum(0),
    )


def summary(
    numel: int, values: list[list[float]], channels: str | None, centered: bool
) -> dict[str, float]:
    """The record of one tensor's (or one layer's) moments read back: ``values`` per part as
    in :meth:`Moments.parts`; ``channels``: which part counts, per channel, the values a
    gradient passes through (``"nonzero_finite"`` or ``"alive"``), giving dead units."""
    (total,), (norm,), (nonzero,), counts, (low,), (high,), *alive = values
    if centered:  # var_mean's mean and variance over every value (NaN/Inf counted as 0)
        total, norm = total * numel, math.sqrt(max(numel * (norm + total * total), 0.0))
    nonzero_finite = sum(counts)
    nonfinite = nonzero - nonzero_finite
    count = numel - nonfinite
    mean = total / count if count else math.nan
    sumsq = norm * norm
    var = (sumsq - count * mean * mean) / (count - 1) if count > 1 else math.nan
    if nonfinite and nonzero == numel:  # zeros in the minimum or maximum stand for NaN/Inf
        low = math.nan if low == 0 else low
        high = math.nan if high == 0 else high
    record = {
        "norm": norm,
        "mean": mean,
        "std": math.sqrt(max(var, 0.0)) if count > 1 else math.nan,
        "min": low if count else math.nan,
        "max": high if count else math.nan,
        "zeros": (numel - nonzero) / numel if numel else math.nan,
        "nonfinite": int(nonfinite),
    }
    if channels is not None:
        per = alive[0] if channels == "alive" else counts
        record["dead"] = sum(1 for v in per if not v > 0) / len(per)
    return record


class Reduction:
    """Every rank's ``values`` (of one process group; None: the world) combined element by
    element as ``ops`` says (:data:`SUM`, :data:`MIN`, :data:`MAX`,
    :data:`ROOT_SUM_SQUARES`; ``ops`` on the host), with one sum all-reduce started now
    (``async_op``): :meth:`result` waits for it.

    One collective carries sums and extremes alike: each extreme travels in a slot per rank
    (a row of the group's size, zeros but this rank's value at its index), so that the sum of
    a slot is that rank's value exactly (``x + 0`` is ``x``, infinities included), and the
    minimum or maximum is taken over the slots afterwards. The buffer grows by the group's
    size per extreme (two per layer and kind): small beside the sums and histogram buckets,
    and it saves the second and third all-reduce a ``MIN`` and a ``MAX`` would take."""

    def __init__(self, values: Tensor, ops: Tensor, group: ProcessGroup | None = None) -> None:
        dist = torch.distributed
        size, index = dist.get_world_size(group), dist.get_rank(group)
        extreme = torch.nonzero((ops == MIN) | (ops == MAX)).reshape(-1)
        # (non-blocking: a blocking copy from host memory waits for the device's queue,
        # which is the step this all-reduce must not hold up)
        device = values.device
        self._low = (ops[extreme] == MIN).to(device, non_blocking=True)
        self._squares = (ops == ROOT_SUM_SQUARES).to(device, non_blocking=True)
        self._extreme = extreme.to(device, non_blocking=True)
        self._size, self._n = size, values.numel()
        summed = torch.where(self._squares, values * values, values).index_fill(
            0, self._extreme, 0.0
        )
        slots = values.new_zeros(extreme.numel(), size)
        slots[:, index] = values.index_select(0, self._extreme)
        self._buffer = torch.cat([summed, slots.reshape(-1)])
        self._work = dist.all_reduce(self._buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)
        self._out: Tensor | None = None

    def result(self) -> Tensor:
        """The combined values (waits for the all-reduce the first time)."""
        if self._out is None:
            if self._work is not None:
                self._work.wait()
                self._work = None
            summed, slots = self._buffer[: self._n], self._buffer[self._n :]
            slots = slots.reshape(-1, self._size)
            picked = torch.where(self._low, slots.amin(1), slots.amax(1))
            out = torch.where(self._squares, summed.sqrt(), summed)
            self._out = out.index_copy(0, self._extreme, picked)
        return self._out


# -- histograms --------------------------------------------------------------------------------


def _edges() -> Tensor:
    """TensorBoard's bucket edges: ±1e-12 growing by 10 % to ±1e20, and 0."""
    positive = [1e-12]
    while positive[-1] < 1e20:
        positive.append(positive[-1] * 1.1)
    return torch.tensor([-v for v in reversed(positive)] + [0.0] + positive, dtype=torch.float64)


EDGES = _edges()
_EDGES_ON: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _edges_on(device: torch.device, dtype: torch.dtype) -> Tensor:
    """:data:`EDGES` on ``device``, copied there once (a copy from host memory synchronises)."""
    key = (device, dtype)
    if key not in _EDGES_ON:
        _EDGES_ON[key] = EDGES.to(device, dtype)
    return _EDGES_ON[key]


def histogram(tensors: list[Tensor]) -> Tensor:
    """Counts of the finite values of ``tensors`` in the buckets ``(EDGES[i-1], EDGES[i]]``
    (the last one open above), on their device with no synchronisation; NaN and Inf are not
    counted (the statistics count them)."""
    first = tensors[0]
    counts = torch.zeros(len(EDGES) + 1, dtype=torch.float64, device=first.device)
    for t in tensors:
        x, zeros = stored(t.detach())
        x = x.reshape(-1)
        edges = _edges_on(x.device, torch.float64 if x.dtype == torch.float64 else torch.float32)
        finite = torch.isfinite(x).to(torch.float64)
        counts.index_add_(0, torch.bucketize(x.to(edges.dtype), edges), finite)
        if zeros:  # a sparse tensor's implicit zeros, in the bucket that ends at 0
            counts[len(EDGES) // 2] += zeros
    return counts
