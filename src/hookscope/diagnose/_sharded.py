"""Statistics of sharded tensors: computed on each rank's local piece, combined over exactly
the process groups that shard it.

A ``DTensor`` (FSDP2's parameters and gradients, tensor parallelism's weights) lies on a device
mesh; along each mesh dimension its placement is ``Shard(d)`` (the ranks of that dimension's
process group hold disjoint pieces), ``Replicate()`` (they hold the same values) or
``Partial()`` (they hold terms of a reduction still to be done). A statistic that adds up over
pieces (a count, a sum, a sum of ``|x|^p``, a maximum) is computed on the local piece
(``to_local()``) and combined over the process groups of the dimensions where the tensor is
sharded, and over no other: HSDP's replicate dimension holds copies of the same shard, and
adding them would count every value twice. A ``Partial`` tensor's local values are not its
values until summed, so it is summed first (torch's ``redistribute`` to ``Replicate`` on those
dimensions: one collective per such tensor, which gradients under FSDP2 and HSDP never need).

:class:`Plan` decides once which tensor combines over which group; :meth:`Plan.combine` packs
every tensor's row of statistics into one buffer per process group and reduces it with one
all-reduce per group (waited: clipping needs the result now); :meth:`Plan.start` does the
same for the Monitor's sums and extremes together, in one sum all-reduce per group that it
does not wait for. Plain tensors (DDP's gradients among them: already equal on every rank)
are never combined, and no ``DTensor`` at all means no plan (:func:`plan` returns None).

Used by :func:`hookscope.clip_grad_norm` and the Monitor's parameter statistics
(``_flush.py``). The NaN tracer (``_nonfinite.py``) needs no plan: it checks each rank's local
pieces and combines one flag per check over the world.

Activations under tensor parallelism are plain tensors (``parallelize_module``'s styles hand
each layer's output on as a local tensor by default): a column-parallel layer's output is this
rank's slice of the output features, a row-parallel one's the whole output, summed over the
tensor-parallel group, and every other layer's the same on every rank of that group (its input
is). :func:`output_piece` tells which from what a parallelized layer receives (a ``DTensor``
on the tensor-parallel mesh: the style's input hook made it) and the shape it returns.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from . import _stats

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "Combining",
    "Piece",
    "Plan",
    "among",
    "is_sharded",
    "local",
    "output_piece",
    "placed",
    "plan",
    "sharded_model",
]


def _dtensor_class() -> type[Tensor] | None:
    """``DTensor``, or None when ``torch.distributed.tensor`` was never imported (then no
    tensor can be one, and importing it here would cost a second for nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def among(types: Any) -> bool:
    """Whether a ``__torch_dispatch__``'s ``types`` include ``DTensor`` or another tensor
    subclass of ``torch.distributed`` (the ``AsyncCollectiveTensor`` a row-parallel layer
    returns, its all-reduce still in flight): a dispatch mode then returns ``NotImplemented``,
    so that the subclass runs the operator on plain tensors (which come back to the mode:
    ``DTensor`` on its local pieces, without its sharding propagation on fake tensors)."""
    cls = _dtensor_class()
    if cls is None:
        return False
    return any(
        issubclass(t, cls) or getattr(t, "__module__", "").startswith("torch.distributed.")
        for t in types
    )


def is_sharded(t: Tensor) -> bool:
    """Whether ``t`` is a ``DTensor`` (whatever its placements)."""
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def sharded_model(model: nn.Module) -> bool:
    """Whether ``model`` is sharded: a ``DTensor`` parameter (tensor parallelism, FSDP2), or
    a module ``fully_shard`` made (its parameters are plain tensors while gathered: after a
    forward that an exception ended, until the next one)."""
    if any(is_sharded(p) for p in model.parameters()):
        return True
    fsdp = sys.modules.get("torch.distributed.fsdp")
    kind = getattr(fsdp, "FSDPModule", None)
    return kind is not None and any(isinstance(m, kind) for m in model.modules())


def local(t: Tensor) -> Tensor:
    """This rank's piece of ``t`` (``t`` itself for a plain tensor): in-place operations on it
    change ``t``."""
    return t.to_local() if is_sharded(t) else t  # type: ignore[attr-defined]


@dataclass(frozen=True)
class _Group:
    """A process group and the rows (tensor positions) combined over it."""

    group: ProcessGroup
    ranks: tuple[int, ...]
    rows: list[int]


class Plan:
    """Which of ``tensors`` combines over which process group, and the values each rank's
    statistics are computed on.

    Attributes:
        values: per tensor, the local values to compute statistics on: the local piece, after
            summing a ``Partial`` tensor (a new tensor then; otherwise the piece itself).
        groups: per process group, in the order every rank meets them, the tensors sharded
            over it.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.values: list[Tensor] = []
        self._by_ranks: dict[tuple[int, ...], _Group] = {}
        self._combined: set[int] = set()
        self._ranks: dict[int, tuple[int, ...]] = {}
        self._several: dict[int, bool] = {}  # split over several groups: over the world?
        for i, t in enumerate(tensors):
            self.values.append(self._place(i, t))

    def _place(self, i: int, t: Tensor) -> Tensor:
        if not is_sharded(t):
            return t
        mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
        if any(p.is_partial() for p in placements):
            from torch.distributed.tensor import Replicate

            summed = [Replicate() if p.is_partial() else p for p in placements]
            t = t.redistribute(mesh, summed)  # type: ignore[attr-defined]
        # split over a dimension: Shard, and the _StridedShard FSDP2 puts on a
        # tensor-parallel Shard(0) (whose is_shard() is False)
        dims = [d for d, p in enumerate(t.placements) if not (p.is_replicate() or p.is_partial())]  # type: ignore[attr-defined]
        for dim in dims:
            self._join(mesh.get_group(dim), i)
        if len(dims) > 1:  # (start: are they the world's?)
            # the ranks holding its pieces: those of the product of these dimensions' groups
            spanned = math.prod(int(mesh.size(d)) for d in dims)
            self._several[i] = spanned == torch.distributed.get_world_size()
        return t.to_local()  # type: ignore[attr-defined, no-any-return]

    def _join(self, group: ProcessGroup, i: int) -> None:
        # two meshes may each have made a group of the same ranks: one all-reduce serves both
        # (every rank meets the tensors in the same order, so picks the same group object)
        ranks = self._ranks.get(id(group))
        if ranks is None:  # (asked once per group: FSDP2 gives every layer the same one)
            ranks = self._ranks[id(group)] = tuple(torch.distributed.get_process_group_ranks(group))
        entry = self._by_ranks.setdefault(ranks, _Group(group, ranks, []))
        entry.rows.append(i)
        self._combined.add(i)

    @property
    def groups(self) -> list[_Group]:
        return list(self._by_ranks.values())

    def combined(self, i: int) -> bool:
        """Whether tensor ``i`` is combined over any group (it is sharded somewhere)."""
        return i in self._combined

    def combine(self, rows: Tensor, op: Any, only: Sequence[int] | None = None) -> Tensor:
        """``rows[i]`` (tensor ``i``'s statistics on this rank, one row each) combined over the
        groups that shard tensor ``i``, element by element with ``op`` (a
        ``torch.distributed.ReduceOp``): one all-reduce per group, in the order every rank
        meets the groups. Rows of tensors sharded nowhere come back as they were.

        ``only``: combine just these tensors (their rows in ``rows``, in this order); every
        rank of a group must pass the same ones for that group.
        """
        which = list(range(rows.shape[0])) if only is None else list(only)
        at = {tensor: row for row, tensor in enumerate(which)}
        out = list(rows.unbind(0))
        for g in self._by_ranks.values():
            mine = [at[i] for i in g.rows if i in at]
            if not mine:
                continue
            packed = torch.stack([out[r] for r in mine])
            torch.distributed.all_reduce(packed, op=op, group=g.group)
            for r, value in zip(mine, packed.unbind(0), strict=True):
                out[r] = value
        return torch.stack(out) if out else rows

    def over_world(self, i: int) -> bool:
        """Whether tensor ``i`` is combined over the whole world at once (its one group is
        the world, or it is split over mesh dimensions whose groups together span the world)."""
        if i in self._several:
            return self._several[i]
        world = tuple(range(torch.distributed.get_world_size()))
        return i in self._combined and any(
            i in g.rows and g.ranks == world for g in self._by_ranks.values()
        )

    def start(self, sums: Tensor, highs: Tensor, skip: Collection[int] = ()) -> Combining:
        """Start combining each tensor's row of ``sums`` (added) and of ``highs`` (maximised)
        over the ranks that hold its pieces: one sum all-reduce per group (the maxima in
        per-rank slots: :class:`~hookscope.diagnose._stats.Reduction`), started now and
        waited by :meth:`Combining.result`. Rows of tensors sharded nowhere, and of ``skip``,
        stay as they are.

        A tensor split over one mesh dimension is combined over that dimension's group; one
        split over several mesh dimensions whose groups together span the world (FSDP2 and tensor
        parallelism on a 2-D mesh) over the world, at once. One split over some of the
        dimensions of a larger mesh (HSDP with tensor parallelism) has no group of its own:
        its rows are combined group after group first (:meth:`combine`: two waited
        all-reduces per group, the only case that waits)."""
        chained = [i for i, whole in self._several.items() if not whole and i not in skip]
        if chained:
            sums, highs = sums.clone(), highs.clone()
            sums[chained] = self.combine(sums[chained], torch.distributed.ReduceOp.SUM, chained)
            highs[chained] = self.combine(highs[chained], torch.distributed.ReduceOp.MAX, chained)
        by_group: dict[tuple[int, ...], tuple[ProcessGroup | None, list[int]]] = {}
        for g in self._by_ranks.values():
            rows = [i for i in g.rows if i not in self._several and i not in skip]
            by_group[g.ranks] = (g.group, rows)
        world = tuple(range(torch.distributed.get_world_size()))
        wholes = [i for i, whole in self._several.items() if whole and i not in skip]
        if wholes:
            group, rows = by_group.get(world, (None, []))
            by_group[world] = (group, rows + wholes)
        k, h = sums.shape[1], highs.shape[1]
        parts = []
        for group, rows in by_group.values():
            if not rows:
                continue
            mine = torch.tensor(rows).to(sums.device, non_blocking=True)  # (see Reduction)
            flat = torch.cat([sums[mine].reshape(-1), highs[mine].reshape(-1)])
            ops = torch.tensor([_stats.SUM] * (len(rows) * k) + [_stats.MAX] * (len(rows) * h))
            parts.append((mine, _stats.Reduction(flat, ops, group)))
        return Combining(sums, highs, parts)

    def holders(self, flags: Sequence[bool], only: Sequence[int]) -> list[list[int]]:
        """For each tensor of ``only``, the global ranks whose piece has its flag set (each
        rank passes its own flags): one all-reduce per group over a row of the world's ranks.
        A tensor sharded nowhere is held by this rank alone, as far as this rank can tell."""
        dist = torch.distributed
        me = dist.get_rank()
        table = torch.zeros(len(only), dist.get_world_size(), dtype=torch.int32)
        table[:, me] = torch.tensor([int(f) for f in flags], dtype=torch.int32)
        device = self.values[only[0]].device if only else table.device
        found = self.combine(table.to(device), dist.ReduceOp.SUM, only).cpu()
        return [[r for r in range(found.shape[1]) if found[k, r] > 0] for k in range(len(only))]


class Combining:
    """The rows :meth:`Plan.start` is combining; :meth:`result` waits for them."""

    def __init__(
        self, sums: Tensor, highs: Tensor, parts: list[tuple[Tensor, _stats.Reduction]]
    ) -> None:
        self._sums, self._highs, self._parts = sums, highs, parts
        self._out: tuple[Tensor, Tensor] | None = None

    def result(self) -> tuple[Tensor, Tensor]:
        """``(sums, highs)``, every sharded tensor's rows combined over its groups."""
        if self._out is None:
            sums, highs = self._sums.clone(), self._highs.clone()
            n = sums.shape[1]
            for mine, reduction in self._parts:
                flat = reduction.result()
                sums[mine] = flat[: mine.numel() * n].reshape(-1, n)
                highs[mine] = flat[mine.numel() * n :].reshape(mine.numel(), -1)
            self._out = sums, highs
        return self._out


def plan(tensors: Sequence[Tensor]) -> Plan | None:
    """The plan for ``tensors``, or None when none is a ``DTensor`` (nothing to combine: the
    caller keeps its plain path)."""
    if not any(is_sharded(t) for t in tensors):
        return None
    return Plan(tensors)


#: a layer's output under tensor parallelism, when it is a slice along its last dim: where
#: this rank's slice starts and the whole width (slices as ``Shard``'s: ``torch.chunk``'s)
Piece = tuple[int, int]


def _piece(index: int, parts: int, width: int) -> Piece:
    chunk = -(-width // parts)
    return min(index * chunk, width), width


def _full_width(module: nn.Module) -> int | None:
    """The last dim of ``module``'s whole output, for the layers tensor parallelism's styles
    split by columns (``Linear``: out_features, ``Embedding``: embedding_dim); else None."""
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return None


def output_piece(module: nn.Module, source: Tensor, out: Tensor) -> tuple[Piece | None, int]:
    """Where the plain output ``out`` of ``module`` lies, given the ``DTensor`` ``source`` it
    received (a parallelized layer's input, on the tensor-parallel mesh), and the size of
    that mesh: a slice of the output features when ``out`` is narrower than the layer's
    whole output (column-parallel), else the whole output (row-parallel)."""
    mesh = source.device_mesh  # type: ignore[attr-defined]
    size = int(mesh.size())
    width = _full_width(module)
    if mesh.ndim == 1 and width is not None and out.dim() and out.shape[-1] < width:
        return _piece(int(mesh.get_local_rank()), size, width), size
    return None, size


def placed(t: Tensor) -> tuple[Tensor, Piece | None, int]:
    """A layer's ``DTensor`` output (a style with ``use_local_output=False``): the values to
    measure, where they lie (:data:`Piece`) and the size of its mesh. A slice along its last
    dim or a replica on a 1-D mesh is measured on this rank's piece; any other placement on
    the whole tensor (``full_tensor()``: a collective every rank makes in the same forward)."""
    mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
    size = int(mesh.size())
    if mesh.ndim == 1 and t.dim():
        (p,) = placements
        if p.is_replicate():
            return t.to_local(), None, size  # type: ignore[attr-defined]
        if p.is_shard() and p.dim % t.dim() == t.dim() - 1:
            where = _piece(int(mesh.get_local_rank()), size, t.shape[-1])
            return t.to_local(), where, size  # type: ignore[attr-defined]
    return t.full_tensor(), None, size  # type: ignore[attr-defined]
