"""A layer's output as one row per sample, as the store keeps it.

The output's first tensor is reduced (a name of core's one reducer table, ``core/_reduce.py``,
with the same meaning as in ``capture`` and ``features``, or a function, which must work per
sample: the store has one row per sample), a nested tensor (``TransformerEncoder``'s fast
path over padded inputs) is reduced sample by sample or padded back to the inputs' length,
and the result is cast to the storage dtype. Anything that would store wrong rows is refused:
a first dimension that is not the batch's samples, a reduce that mixes samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..core import REDUCERS, keep_mask, reduce_tensor
from ..core import check_reduce as check_name
from ..errors import UsageError

__all__ = ["Rows", "check_reduce", "keep_mask"]


def check_reduce(reduce: Any) -> None:
    """Refuse, before anything runs, a reduce that cannot give one row per sample."""
    if reduce == "batch_mean":
        raise UsageError(
            "reduce='batch_mean' averages the samples of a batch together, and a feature store "
            "keeps one row per sample: use reduce='spatial_mean' or 'token_mean', a function "
            "that keeps dim 0 (the samples), or hs.features for a batch mean"
        )
    check_name(reduce)


class Rows:
    """``rows(name, output, n, mask)``: the ``(n, ...)`` tensor to store for a batch of ``n``."""

    def __init__(self, reduce: Any, dtype: torch.dtype | None) -> None:
        self.reduce, self.dtype = reduce, dtype
        self._fn: Callable[[Tensor], Any] | None = (
            _unmasked(reduce) if isinstance(reduce, str) else reduce
        )
        self._checked: set[str] = set()  # layers whose reduce was checked on one sample

    def __call__(self, name: str, t: Tensor, n: int, mask: Tensor | None) -> Tensor:
        if t.is_nested:
            t = self._nested(name, t, mask)
        elif self._fn is not None:
            t = self._reduced(name, t, mask)
        self._check(name, t, n)
        t = t.detach()
        dtype = self.dtype or (torch.float32 if t.dtype == torch.bfloat16 else t.dtype)
        if t.is_floating_point() and not (dtype.is_floating_point or dtype.is_complex):
            kind = str(dtype).replace("torch.", "")
            raise UsageError(
                f"dtype={kind} cannot store the {str(t.dtype).replace('torch.', '')} values of "
                f"layer {name!r}: a cast to an integer or bool type truncates them (int8 "
                "stores zeros for values in -1..1, bool True for any nonzero value). Use a "
                "floating dtype such as torch.float16, or leave dtype=None"
            )
        return t if t.dtype == dtype else t.to(dtype)  # bfloat16 (no NumPy type): float32

    def _reduced(self, name: str, t: Tensor, mask: Tensor | None) -> Tensor:
        value = reduce_tensor(self.reduce, t, mask)  # as capture and features reduce it
        if not isinstance(value, Tensor):
            raise UsageError(
                f"reduce={_spelled(self.reduce)} returned {type(value).__name__} for layer "
                f"{name!r}; it must return a tensor with one row per sample"
            )
        if (
            name not in self._checked
            and not isinstance(self.reduce, str)
            and t.dim()
            and len(t) > 1
        ):
            self._checked.add(name)
            self._per_sample(name, t, value)
        return value

    def _per_sample(self, name: str, t: Tensor, value: Tensor) -> None:
        """A function given one sample must give one row of the batch's shape: this catches
        ``t.mean(0)`` even where the batch size equals another dimension."""
        one = self._fn(t[:1]) if self._fn is not None else t[:1]
        if not isinstance(one, Tensor) or tuple(one.shape) != (1, *value.shape[1:]):
            got = tuple(one.shape) if isinstance(one, Tensor) else type(one).__name__
            raise UsageError(
                f"reduce={_spelled(self.reduce)} does not work per sample on layer {name!r}: "
                f"a batch of {len(t)} gave {tuple(value.shape)} but one sample gave {got}, "
                f"not {(1, *value.shape[1:])}. A reduce must keep dim 0 (the samples), e.g. "
                "lambda t: t.mean(dim=(2, 3)); t.mean(0) averages samples together"
            )

    def _nested(self, name: str, t: Tensor, mask: Tensor | None) -> Tensor:
        """Per sample: each one reduced alone, or (no reduce) padded with zeros to the
        inputs' length, as ``TransformerEncoder`` pads its own output."""
        parts = t.unbind()
        if self._fn is None:
            length = mask.shape[1] if mask is not None and len(mask) == len(parts) else None
            size = None
            if length is not None and parts and all(p.dim() and len(p) <= length for p in parts):
                size = (len(parts), length, *parts[0].shape[1:])
            padded: Tensor = torch.nested.to_padded_tensor(t, 0.0, size)
            return padded
        rows = [self._reduced(name, p.unsqueeze(0), None) for p in parts]
        shapes = {tuple(r.shape) for r in rows}
        if len(shapes) > 1:
            raise UsageError(
                f"layer {name!r} returns a nested tensor (samples of different lengths) and "
                f"reduce={_spelled(self.reduce)} leaves them different ({sorted(shapes)}): use "
                "reduce='token_mean' (each sample's mean over its own tokens) or a function "
                "giving every sample one shape"
            )
        return torch.cat(rows)

    def _check(self, name: str, t: Tensor, n: int) -> None:
        if t.dim() >= 1 and t.shape[0] == n:
            return
        if self._fn is not None:
            raise UsageError(
                f"reduce={_spelled(self.reduce)} returned shape {tuple(t.shape)} for layer "
                f"{name!r} on a batch of {n} samples: a reduce must keep dim 0 (the samples), "
                "since the store keeps one row per sample"
            )
        raise UsageError(
            f"layer {name!r} returned shape {tuple(t.shape)} for a batch of {n} samples: its "
            "first dimension is not the samples (e.g. a sequence-first RNN), so it has no row "
            "per sample. Pass a reduce= function that puts the samples first, e.g. "
            "lambda t: t.transpose(0, 1), or choose another layer"
        )


def _unmasked(name: str) -> Callable[[Tensor], Tensor]:
    """A named reduction of one sample (no token mask: a nested tensor's own tokens)."""
    fn = REDUCERS[name]
    return lambda t: fn(t, None)


def _spelled(reduce: Any) -> str:
    if callable(reduce) and not isinstance(reduce, str):
        return str(getattr(reduce, "__qualname__", type(reduce).__name__))
    return repr(reduce)
