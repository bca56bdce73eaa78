"""Shapes as data: what a module call received and returned, without the tensors.

A *shape tree* mirrors a value's nesting: a tensor becomes the tuple of its sizes, a nested
tensor a :class:`NestedShape`, a tuple or list a ``list`` of trees, a mapping, dataclass or
namedtuple a ``dict`` of trees (keys as strings), ``None`` stays ``None`` and anything else
becomes its type name (a ``str``). Rows keep these trees; only rendering turns them into
text (:func:`format_shape`), so callers read shapes as data (``row.output == (8, 512)``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch
from torch import Tensor

from ..core import _torch

__all__ = [
    "NestedShape",
    "ShapeTree",
    "Walk",
    "format_shape",
    "has_shape",
    "shape_leaves",
    "tree_from_json",
    "tree_to_json",
]


@dataclass(frozen=True)
class NestedShape:
    """The sizes of a nested tensor: one tuple per component (a ragged batch).

    ``nested[2, (5|3), 8]`` is two components of 5 x 8 and 3 x 8 (``sizes ((5, 8), (3, 8))``).
    """

    sizes: tuple[tuple[int, ...], ...]

    @property
    def dims(self) -> tuple[int | tuple[int, ...], ...]:
        """The batch, then per dimension its size, or the per-component sizes where ragged."""
        columns = list(zip(*self.sizes, strict=True)) if self.sizes else []
        return (len(self.sizes), *(c[0] if len(set(c)) == 1 else c for c in columns))

    def numel(self) -> int:
        total = 0
        for size in self.sizes:
            n = 1
            for d in size:
                n *= d
            total += n
        return total


ShapeTree: TypeAlias = (
    "tuple[int, ...] | NestedShape | list[ShapeTree] | dict[str, ShapeTree] | str | None"
)


def _children(obj: Any) -> list[tuple[str | None, Any]] | None:
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: keep the names
        return [(str(k), v) for k, v in zip(obj._fields, obj, strict=True)]
    if isinstance(obj, (tuple, list)):
        return [(None, v) for v in obj]
    if isinstance(obj, Mapping):
        return [(str(k), v) for k, v in obj.items()]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


class Walk:
    """One pass over a value: its shape tree, the first tensor's dtype, and the bytes of
    every tensor in it (what a call's output row needs, read in one walk)."""

    __slots__ = ("dtype", "nbytes", "tensors")

    def __init__(self) -> None:
        self.dtype: torch.dtype | None = None
        self.nbytes = 0
        self.tensors = 0

    def tree(self, obj: Any) -> ShapeTree:
        if isinstance(obj, Tensor):
            self.tensors += 1
            if self.dtype is None:
                self.dtype = obj.dtype
            if obj.is_nested:
                nested = NestedShape(_torch.nested_sizes(obj))
                self.nbytes += nested.numel() * obj.element_size()
                return nested
            self.nbytes += obj.numel() * obj.element_size()
            return tuple(obj.shape)
        if obj is None:
            return None
        kids = _children(obj)
        if kids is None:
            return type(obj).__name__
        if kids and kids[0][0] is not None:
            return {str(k): self.tree(v) for k, v in kids}
        if not kids and isinstance(obj, Mapping):
            return {}
        return [self.tree(v) for _, v in kids]


def has_shape(tree: ShapeTree) -> bool:
    """Whether the tree holds at least one tensor's shape."""
    return next(shape_leaves(tree), None) is not None


def shape_leaves(tree: ShapeTree) -> Iterator[tuple[int, ...] | NestedShape]:
    """Every tensor's shape in the tree, depth first."""
    if isinstance(tree, (tuple, NestedShape)):
        yield tree
    elif isinstance(tree, list):
        for item in tree:
            yield from shape_leaves(item)
    elif isinstance(tree, dict):
        for item in tree.values():
            yield from shape_leaves(item)


# -- text ------------------------------------------------------------------------------------

_SHOWN = 4  # container elements shown before "..."


def _ragged(sizes: tuple[int, ...]) -> str:
    if len(sizes) <= _SHOWN:
        return "(" + "|".join(map(str, sizes)) + ")"
    return f"({min(sizes)}..{max(sizes)})"


def format_shape(tree: ShapeTree, depth: int = 0) -> str:
    """A shape tree in compact notation (containers past ``depth`` 3 are elided).

    Args:
        tree: a row's ``output``, or one of its ``inputs``.
        depth: how deep ``tree`` already is (1 for a call argument).

    Returns:
        ``[8, 3, 224, 224]``, ``([2, 4], None)``, ``{logits: [2, 9]}``,
        ``nested[2, (5|3), 8]``.

    Example:
        >>> from hookscope.look import NestedShape, format_shape
        >>> format_shape({"logits": (2, 9), "past": [(2, 4), None]})
        '{logits: [2, 9], past: ([2, 4], None)}'
        >>> format_shape(NestedShape(((5, 8), (3, 8))))
        'nested[2, (5|3), 8]'
    """
    if isinstance(tree, tuple):
        return f"[{', '.join(map(str, tree))}]"
    if isinstance(tree, NestedShape):
        dims = [str(d) if isinstance(d, int) else _ragged(d) for d in tree.dims]
        return f"nested[{', '.join(dims)}]"
    if tree is None:
        return "None"
    if isinstance(tree, str):
        return tree
    if depth >= 3:
        return "(...)" if isinstance(tree, list) else "{...}"
    if isinstance(tree, list):
        parts = [format_shape(v, depth + 1) for v in tree[:_SHOWN]]
        more = [f"... {len(tree)} in all"] if len(tree) > _SHOWN else []
        body = ", ".join(parts + more)
        return f"({body},)" if len(tree) == 1 else f"({body})"
    items = list(tree.items())
    parts = [f"{k}: {format_shape(v, depth + 1)}" for k, v in items[:_SHOWN]]
    more = [f"... {len(items)} in all"] if len(items) > _SHOWN else []
    return "{" + ", ".join(parts + more) + "}"


# -- JSON ------------------------------------------------------------------------------------

_NESTED = "__nested__"


def tree_to_json(tree: ShapeTree) -> Any:
    """JSON-able form: a shape is a list of ints, a container a list / object of trees, a
    nested tensor ``{"__nested__": [[5, 8], [3, 8]]}``."""
    if isinstance(tree, tuple):
        return list(tree)
    if isinstance(tree, NestedShape):
        return {_NESTED: [list(s) for s in tree.sizes]}
    if isinstance(tree, list):
        return [tree_to_json(v) for v in tree]
    if isinstance(tree, dict):
        return {k: tree_to_json(v) for k, v in tree.items()}
    return tree


def tree_from_json(data: Any) -> ShapeTree:
    """The inverse of :func:`tree_to_json` (an empty container reads back as ``()``)."""
    if isinstance(data, list):
        if all(isinstance(n, int) and not isinstance(n, bool) for n in data):
            return tuple(data)
        return [tree_from_json(v) for v in data]
    if isinstance(data, dict) and set(data) == {_NESTED}:
        return NestedShape(tuple(tuple(s) for s in data[_NESTED]))
    if isinstance(data, dict):
        return {k: tree_from_json(v) for k, v in data.items()}
    if data is None or isinstance(data, str):
        return data
    raise ValueError(f"not a shape tree: {data!r}")
