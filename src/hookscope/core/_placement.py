"""Where a captured tensor lies across the ranks of a tensor-parallel model, and its whole.

Under tensor parallelism (``torch.distributed.tensor.parallel.parallelize_module``) a layer's
output reaches the hooks registered after the plan as one of:

* a ``DTensor`` (a style with ``use_local_output=False``, ``SequenceParallel``'s default): its
  mesh, placements and global shape are its own (``source="dtensor"``);
* a plain tensor, the local piece the style's own forward hook made of the layer's
  ``DTensor`` output (``to_local()``, the default). For a parallelized ``nn.Linear`` or
  ``nn.Embedding`` (the layers ``ColwiseParallel`` and ``RowwiseParallel`` accept), whose
  input arrives as a ``DTensor`` on the tensor-parallel mesh (the style's input hook made it),
  the global shape is known exactly: the input's global shape with the last dim the layer's
  width (``Linear``: ``input[:-1] + (out_features,)``; ``Embedding``: ``input +
  (embedding_dim,)``). The piece is then ``Shard(d)`` when it differs from that shape along
  ``d`` alone by the size ``torch.chunk`` gives this rank, and ``Replicate()`` when it has the
  whole shape (``source="tp-layer"``). One layout is not told apart: a row-parallel layer
  whose plan sets ``output_layouts=Partial()`` with ``use_local_output=True`` hands on
  partial sums of the whole shape, read here as ``Replicate()``; no stock plan does this, and
  telling it apart would need the style's private hook state;
* any other plain tensor of a model with ``DTensor`` parameters (a ``LayerNorm``, a ``ReLU``
  after a column-parallel layer, an operation inside a layer): nothing on the tensor says
  whether it is a slice or a copy, so its layout is unknown (``source="unknown"``), never
  guessed.

:func:`whole` gives the global tensor of a piece whose layout is known, on every rank of its
mesh: no collective for ``Replicate``, one all-gather for ``Shard`` and one all-reduce for
``Partial`` per mesh dimension (``DTensor.full_tensor``). Every rank of the mesh must ask for
the same tensors in the same order, as the forward's own collectives do.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["Layout", "is_dtensor", "layout_of", "sharded_model", "whole"]


@dataclass(frozen=True)
class Layout:
    """How a captured tensor lies across ranks.

    Attributes:
        placements: per mesh dimension, torch's ``Shard(d)``, ``Replicate()`` or
            ``Partial()``; None when unknown.
        mesh: the ``DeviceMesh`` (None when unknown).
        global_shape: the shape of the whole tensor (None when unknown).
        source: ``"dtensor"`` (read from the ``DTensor`` itself), ``"tp-layer"`` (the local
            piece a parallelized ``Linear``/``Embedding`` handed on, read from its input's
            ``DTensor`` and its width) or ``"unknown"``.
    """

    placements: tuple[Any, ...] | None
    mesh: Any
    global_shape: torch.Size | None
    source: str

    @property
    def known(self) -> bool:
        return self.placements is not None


UNKNOWN = Layout(None, None, None, "unknown")


def _dtensor_class() -> type[Tensor] | None:
    """``DTensor``, or None when ``torch.distributed.tensor`` was never imported (no tensor
    can be one then, and importing it would cost a second for nothing)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def sharded_model(model: nn.Module) -> bool:
    """Whether ``model`` holds a ``DTensor`` parameter (tensor parallelism, FSDP2)."""
    cls = _dtensor_class()
    return cls is not None and any(isinstance(p, cls) for p in model.parameters())


def layout_of(module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Layout:
    """The layout of ``out``, an output of ``module`` called with ``args`` (as the module's
    forward hooks see them: after the style's input hook), in a sharded model."""
    if is_dtensor(out):
        return Layout(tuple(out.placements), out.device_mesh, out.shape, "dtensor")  # type: ignore[attr-defined]
    source = args[0] if args else None
    width = _width(module)
    if width is None or not is_dtensor(source) or not is_dtensor(_weight(module)):
        return UNKNOWN
    mesh = source.device_mesh  # type: ignore[union-attr]
    if mesh.ndim != 1:
        return UNKNOWN
    given: torch.Size = source.shape  # type: ignore[union-attr]
    lead = given if isinstance(module, nn.Embedding) else given[:-1]
    shape = torch.Size((*lead, width))
    placement = _piece_placement(out.shape, shape, int(mesh.size()), int(mesh.get_local_rank()))
    if placement is None:
        return UNKNOWN
    return Layout((placement,), mesh, shape, "tp-layer")


def _width(module: nn.Module) -> int | None:
    if isinstance(module, nn.Linear):
        return module.out_features
    if isinstance(module, nn.Embedding):
        return module.embedding_dim
    return None


def _weight(module: nn.Module) -> Any:
    return getattr(module, "weight", None)


def _piece_placement(local: torch.Size, shape: torch.Size, parts: int, rank: int) -> Any:
    """``Replicate()`` when ``local`` is the whole ``shape``; ``Shard(d)`` when it differs
    along ``d`` alone by this rank's ``torch.chunk`` size; else None."""
    from torch.distributed.tensor import Replicate, Shard

    if len(local) != len(shape):
        return None
    if local == shape:
        return Replicate()
    dims = [d for d, (a, b) in enumerate(zip(local, shape, strict=True)) if a != b]
    if len(dims) != 1:
        return None
    (d,) = dims
    chunk = -(-shape[d] // parts)
    mine = max(0, min(chunk, shape[d] - rank * chunk))
    return Shard(d) if local[d] == mine else None


def whole(t: Tensor, layout: Layout) -> Tensor:
    """The global tensor of ``t`` (a ``DTensor``, or the local piece ``layout`` describes)
    on every rank of its mesh; ``t`` itself when already whole."""
    assert layout.known
    if not is_dtensor(t):
        if all(p.is_replicate() for p in layout.placements or ()):
            return t
        from torch.distributed.tensor import DTensor

        shape = layout.global_shape
        assert shape is not None
        stride = _contiguous_strides(shape)
        t = DTensor.from_local(
            t, layout.mesh, layout.placements, run_check=False, shape=shape, stride=stride
        )
    return t.full_tensor()  # type: ignore[attr-defined, no-any-return]


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides: list[int] = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
