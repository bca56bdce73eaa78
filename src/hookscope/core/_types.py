"""Type aliases shared across hookscope."""

from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Sequence
from typing import Any, Literal, TypeAlias

from torch import Tensor, nn

#: One way to pick layers: an exact dotted name or a glob (``"encoder.layer.*.output"``),
#: a compiled regex (full match), a module type, a module object, or a predicate called as
#: ``fn(module)`` or ``fn(name, module)``.
SingleSelector: TypeAlias = (
    "str | re.Pattern[str] | type[nn.Module] | nn.Module | Callable[..., bool]"
)
#: A single selector or a list mixing them; the union of their matches, in first-seen order.
LayerSelector: TypeAlias = "SingleSelector | Sequence[SingleSelector]"

#: A position in a nested output: an index, a key (any hashable dict key) or attribute name,
#: or a tuple of those.
PathKey: TypeAlias = Hashable
Path: TypeAlias = "tuple[PathKey, ...]"
PathLike: TypeAlias = "PathKey | Path | None"

#: Tensor -> tensor function applied to captured tensors at capture time.
ReduceFn: TypeAlias = Callable[[Tensor], Any]
Reduce: TypeAlias = "Literal['spatial_mean', 'token_mean', 'batch_mean'] | ReduceFn"

CopyMode: TypeAlias = Literal["clone", "reference"]
Keep: TypeAlias = "Literal['pass', 'all', 'last'] | int"

#: Where an edit applies: the output, an input, the gradient w.r.t. the output, or the
#: gradient w.r.t. an input flowing through the layer.
EditTarget: TypeAlias = Literal["output", "input", "grad", "input_grad"]

#: A module's inputs bound to its ``forward`` signature, by parameter name.
Inputs: TypeAlias = "dict[str, Any]"

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
