"""Type aliases shared across hookscope."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeAlias

from torch import Tensor, nn

SingleSelector: TypeAlias = (
    str | re.Pattern[str] | type[nn.Module] | nn.Module | Callable[..., bool]
)
"""One way to pick layers: an exact dotted name or a glob (``"encoder.layer.*.output"``),
a compiled regex (full match), a module type, a module object, or a predicate called as
``fn(module)`` or ``fn(name, module)``."""

LayerSelector: TypeAlias = SingleSelector | Sequence[SingleSelector]
"""The type of every ``layers`` argument: one selector or a list mixing them.

A selector is an exact dotted name (``"encoder.layer.3.output"``), a glob (``*``, ``?`` and
``[..]`` stay within one dotted segment, ``**`` crosses dots), a compiled regex (full match), a
module type (every instance), a module object, or a predicate ``fn(module)`` /
``fn(name, module)``. A list selects the union of its matches, in first-seen order. Names
are those of ``hs.names(model)``: the ``named_modules()`` paths of the unwrapped model.

Example:
    >>> import re, torch.nn as nn, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    >>> selector: hs.LayerSelector = [re.compile(r"[02]"), nn.ReLU]
    >>> with hs.capture(model, selector) as cap:
    ...     pass
    >>> list(cap.records)
    ['0', '2', '1']
"""

#: A position in a nested output: an index, a key (any hashable dict key) or attribute name,
#: or a tuple of those.
PathKey: TypeAlias = Hashable
Path: TypeAlias = tuple[PathKey, ...]
PathLike: TypeAlias = PathKey | Path | None

#: Tensor -> tensor function applied to captured tensors at capture time.
ReduceFn: TypeAlias = Callable[[Tensor], Any]
Reduce: TypeAlias = Literal["spatial_mean", "token_mean", "batch_mean"] | ReduceFn

CopyMode: TypeAlias = Literal["clone", "reference"]
Keep: TypeAlias = Literal["pass", "all", "last"] | int

#: Where an edit applies: the output, an input, the gradient w.r.t. the output, or the
#: gradient w.r.t. an input flowing through the layer.
EditTarget: TypeAlias = Literal["output", "input", "grad", "input_grad"]

#: A module's inputs bound to its ``forward`` signature, by parameter name.
Inputs: TypeAlias = dict[str, Any]

__all__ = [
    "CopyMode",
    "EditTarget",
    "Inputs",
    "Keep",
    "LayerSelector",
    "Path",
    "PathKey",
    "PathLike",
    "Reduce",
    "ReduceFn",
    "SingleSelector",
]
