"""Small helpers over nested module outputs (tensors inside tuples, lists and dicts)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

__all__ = ["map_tensors", "storage_bytes", "tensor_leaves", "trees_equal"]


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor replaced by ``fn(tensor)`` (tuples, lists, dicts rebuilt)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensor_leaves(obj: Any) -> list[Tensor]:
    """Every tensor in ``obj``, depth first, in container order."""
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in tensor_leaves(v)]
    if isinstance(obj, Mapping):
        return [t for v in obj.values() for t in tensor_leaves(v)]
    return []


def trees_equal(a: Any, b: Any) -> bool:
    """Same number of tensors, pairwise ``torch.equal``."""
    ta, tb = tensor_leaves(a), tensor_leaves(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def storage_bytes(obj: Any) -> int:
    """Bytes of the distinct storages behind the tensors in ``obj`` (what keeping it costs)."""
    seen: dict[int, int] = {}
    for t in tensor_leaves(obj):
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())
