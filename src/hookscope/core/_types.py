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
"""The type of every ``reduce=`` argument (``capture``, ``features``, ``FeatureExtractor``,
``extract``): one name with one meaning everywhere, or a function of the tensor.

* ``"spatial_mean"``: ``(N, C, *spatial) -> (N, C)``, the mean over every dim after the second;
* ``"token_mean"``: ``(N, T, *rest) -> (N, *rest)``, each sample's mean over its real tokens,
  those the forward's ``attention_mask`` keeps (or not its ``src_key_padding_mask``) when that
  mask has the shape ``(N, T)``; without one, over every token. A padded batch gives each
  sample the mean it would have alone (sentence-transformers' mean pooling);
* ``"batch_mean"``: the mean over dim 0 (refused by ``extract``, whose stores keep a row per
  sample).

Built-in reductions keep integer tensors (token ids, masks) as they are, and tensors of two
dims or fewer for the first two.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> emb = nn.Embedding(10, 2)
    >>> model = nn.Sequential(emb)
    >>> ids, mask = torch.tensor([[1, 2, 0]]), torch.tensor([[1, 1, 0]])
    >>> class Tokens(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.emb = emb
    ...     def forward(self, input_ids, attention_mask):
    ...         return self.emb(input_ids)
    >>> got = hs.features(Tokens(), {"input_ids": ids, "attention_mask": mask}, "emb",
    ...                   reduce="token_mean")["emb"]
    >>> torch.allclose(got, emb.weight[[1, 2]].mean(0, keepdim=True))
    True
"""

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
