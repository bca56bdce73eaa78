"""Walk nested module inputs and outputs as trees whose leaves are tensors.

Containers: tuple, list, namedtuple, dict (any Mapping with a plain constructor and any
hashable keys: strings, ints, tuples, enums; Hugging Face ``ModelOutput`` included) and
dataclasses. Anything else is an opaque leaf kept as is.

hookscope walks trees itself rather than through ``torch.utils._pytree`` because user
dataclasses are not registered there, and registering them would change global state that
belongs to the user.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from torch import Tensor

from ._types import Path, PathKey, PathLike

__all__ = ["as_path", "describe", "get", "leaves", "map_tensors", "path_str", "replace_at"]


def _children(obj: Any) -> list[tuple[PathKey, Any]] | None:
    """The (key, child) pairs of a container, or None for a leaf."""
    if isinstance(obj, Tensor):
        return None
    if isinstance(obj, (tuple, list)):
        return list(enumerate(obj))
    if isinstance(obj, Mapping):
        return list(obj.items())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    return None


def _rebuild(obj: Any, values: dict[PathKey, Any]) -> Any:
    """A container like ``obj`` with the children named in ``values`` replaced."""
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple: _make skips a
        # validating __new__ (PackedSequence's refuses meta tensors and None leaves)
        return type(obj)._make(values.get(i, v) for i, v in enumerate(obj))  # type: ignore[attr-defined]
    if isinstance(obj, (tuple, list)):
        return type(obj)(values.get(i, v) for i, v in enumerate(obj))
    if isinstance(obj, Mapping):
        items = {k: values.get(k, v) for k, v in obj.items()}
        if dataclasses.is_dataclass(obj):  # Hugging Face ModelOutput: keyword constructor
            return type(obj)(**items)
        try:
            return type(obj)(items)  # type: ignore[call-arg]
        except TypeError:  # e.g. defaultdict: keep its extra state, replace the values
            new = obj.copy()  # type: ignore[attr-defined]
            new.update(items)
            return new
    init = {f.name: values[f.name] for f in dataclasses.fields(obj) if f.name in values and f.init}
    return dataclasses.replace(obj, **init)


def leaves(obj: Any, prefix: Path = ()) -> Iterator[tuple[Path, Tensor]]:
    """Yield ``(path, tensor)`` for every tensor leaf, depth first, in container order."""
    if isinstance(obj, Tensor):
        yield prefix, obj
        return
    kids = _children(obj)
    if kids is not None:
        for key, child in kids:
            yield from leaves(child, (*prefix, key))


def map_tensors(
    fn: Callable[[Path, Tensor], Any],
    obj: Any,
    prefix: Path = (),
    other: Callable[[Any], Any] | None = None,
) -> Any:
    """A copy of the tree with every tensor leaf replaced by ``fn(path, tensor)`` (and every
    other leaf by ``other(leaf)`` if given)."""
    if isinstance(obj, Tensor):
        return fn(prefix, obj)
    kids = _children(obj)
    if kids is None:
        return obj if other is None else other(obj)
    if not kids:
        return obj
    return _rebuild(obj, {k: map_tensors(fn, v, (*prefix, k), other) for k, v in kids})


def as_path(at: PathLike) -> Path:
    """Normalise ``0``, ``"logits"`` or ``(0, "x")`` to a path tuple (``None`` -> ``()``)."""
    if at is None:
        return ()
    return at if isinstance(at, tuple) else (at,)


def _child(obj: Any, key: PathKey) -> Any:
    kids = dict(_children(obj) or ())
    if key not in kids:
        raise KeyError(key)
    return kids[key]


def get(obj: Any, path: Path) -> Any:
    """The value at ``path``; raises KeyError naming the first missing key."""
    for key in path:
        obj = _child(obj, key)
    return obj


def replace_at(obj: Any, path: Path, value: Any) -> Any:
    """A copy of the tree with the value at ``path`` replaced; containers are rebuilt."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    return _rebuild(obj, {head: replace_at(_child(obj, head), rest, value)})


def describe(obj: Any, depth: int = 0) -> str:
    """A short description: ``Tensor[4, 768] float32``, ``tuple(Tensor[...], None)``."""
    if isinstance(obj, Tensor):
        return f"Tensor[{', '.join(map(str, obj.shape))}] {str(obj.dtype).removeprefix('torch.')}"
    kids = _children(obj)
    if kids is None:
        return "None" if obj is None else type(obj).__name__
    if depth >= 2:
        return f"{type(obj).__name__}(...)"
    keyed = isinstance(obj, Mapping) or (
        dataclasses.is_dataclass(obj) and not isinstance(obj, tuple)
    )
    parts = [
        f"{k}={describe(v, depth + 1)}" if keyed else describe(v, depth + 1) for k, v in kids[:6]
    ]
    more = ", ..." if len(kids) > 6 else ""
    return f"{type(obj).__name__}({', '.join(parts)}{more})"


def path_str(path: Path) -> str:
    """``(0, "logits", ("a", 1))`` -> ``[0].logits[('a', 1)]``, for messages."""
    return "".join(f".{k}" if isinstance(k, str) and k.isidentifier() else f"[{k!r}]" for k in path)
