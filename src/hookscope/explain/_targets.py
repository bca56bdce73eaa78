"""Targets: what each sample's explanation is of, as one score per sample.

A class index (broadcast to every sample), one index per sample (a list, a NumPy array or an
integer tensor), a callable on the model's output returning ``(N,)`` scores, or None for each
sample's top class. HF ``ModelOutput`` and dict outputs are read through their ``logits`` (or
the first tensor they hold).

Targets are checked on the host, before the forward, without reading anything back from a
device: ints, lists and CPU tensors are plain data, and their indices reach the device with a
non-blocking copy. The one exception is a tensor of targets that already lives on a GPU: its
range is read back once (one synchronisation), before the forward is queued. Floats and bools
are refused rather than truncated to a class.
"""

from __future__ import annotations

import numbers
from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor

from ..core import leaves
from ..errors import UsageError

__all__ = ["Resolved", "Target", "logits_of", "resolve", "scores"]

Target: TypeAlias = int | Sequence[int] | Tensor | Callable[[Any], Tensor] | None


def logits_of(output: Any) -> Tensor:
    """The class scores in a model's output: the tensor itself, ``.logits``, or the first
    tensor of a tuple / dict."""
    if isinstance(output, Tensor):
        return output
    logits = getattr(output, "logits", None)
    if isinstance(logits, Tensor):
        return logits
    for _, t in leaves(output):
        return t
    raise UsageError(
        f"the model returned {type(output).__name__} with no tensor in it: pass targets= as a "
        "callable that turns the output into one score per sample"
    )


class Resolved:
    """Targets checked against a batch of ``n``: a callable, class indices, or the top class.

    ``bounds`` are the smallest and largest class asked for (checked against the logits'
    width once it is known); None for indices hookscope chose itself (top classes, or the
    classes an earlier pass used), which need no check.
    """

    __slots__ = ("bounds", "fn", "index", "n", "shown")

    def __init__(
        self,
        n: int,
        *,
        fn: Callable[[Any], Tensor] | None = None,
        index: Tensor | None = None,
        bounds: tuple[int, int] | None = None,
        shown: str = "",
    ) -> None:
        self.n, self.fn, self.index, self.bounds, self.shown = n, fn, index, bounds, shown

    @classmethod
    def fixed(cls, index: Tensor) -> Resolved:
        """Class indices hookscope already checked or chose (e.g. an earlier pass's)."""
        return cls(len(index), index=index)

    def to(self, device: torch.device) -> Resolved:
        """The same targets with their indices on ``device`` (a non-blocking copy)."""
        if self.index is None or self.index.device == device:
            return self
        index = _move(self.index, device)
        return Resolved(self.n, fn=self.fn, index=index, bounds=self.bounds, shown=self.shown)

    def score(self, output: Any) -> tuple[Tensor, Tensor | None]:
        """``(scores (N,), class indices (N,) or None)`` for the model's ``output``."""
        if self.fn is not None:
            s = self.fn(output)
            if not isinstance(s, Tensor) or s.shape != (self.n,):
                got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
                raise UsageError(
                    f"a target callable must return one score per sample, shape ({self.n},); "
                    f"got {got}"
                )
            return s, None
        logits = logits_of(output)
        if logits.dim() != 2 or logits.shape[0] != self.n:
            raise UsageError(
                f"class targets need (N, classes) logits for N={self.n} samples, got shape "
                f"{tuple(logits.shape)}: pass targets= as a callable returning one score per "
                "sample"
            )
        index = self.index
        if index is None:
            index = logits.detach().argmax(1)
        else:
            index = self.indices(logits.shape[1], logits.device)
        return logits.gather(1, index[:, None]).squeeze(1), index

    def indices(self, classes: int, device: torch.device) -> Tensor:
        """The ``n`` class indices on ``device``, checked against ``classes`` classes.

        Raises:
            UsageError: a class outside ``0..classes - 1``; targets that are not classes.
        """
        if self.index is None:
            raise UsageError("these targets are not class indices: pass targets= as classes")
        if self.bounds is not None and (self.bounds[0] < 0 or self.bounds[1] >= classes):
            raise UsageError(f"target classes must be in 0..{classes - 1}, got {self.shown}")
        return _move(self.index, device)


def resolve(targets: Any, n: int) -> Resolved:
    """Check ``targets`` for a batch of ``n`` samples (see the module docstring).

    Raises:
        UsageError: a float or bool target, a count that is neither 1 nor ``n``.
    """
    if isinstance(targets, Resolved):
        if targets.n != n:
            raise UsageError(f"got {targets.n} targets for a batch of {n}")
        return targets
    if targets is None:
        return Resolved(n)
    if callable(targets) and not isinstance(targets, Tensor):
        return Resolved(n, fn=targets)
    if isinstance(targets, Tensor) and targets.device.type != "cpu":
        return _on_device(targets, n)
    values = _host_values(targets)
    if len(values) == 1:
        index = torch.full((n,), values[0], dtype=torch.long)  # one class for every sample
    elif len(values) == n:
        index = torch.tensor(values, dtype=torch.long)
    else:
        raise _count_error(len(values), n)
    shown = str(values[0] if len(values) == 1 else values)
    return Resolved(n, index=index, bounds=(min(values), max(values)), shown=shown)


def scores(output: Any, targets: Target, n: int) -> tuple[Tensor, Tensor | None]:
    """``(scores (N,), class indices (N,) or None)`` of ``output`` for a batch of ``n``."""
    return resolve(targets, n).score(output)


def _host_values(targets: Any) -> list[int]:
    """Class indices given as host data (an int, a sequence, a NumPy array, a CPU tensor)."""
    if isinstance(targets, Tensor):
        _check_dtype(targets.dtype, targets)
        got: list[int] = targets.reshape(-1).tolist()  # a CPU tensor: no device to wait for
        return got
    if hasattr(targets, "dtype") and hasattr(targets, "tolist"):  # NumPy arrays and scalars
        kind = getattr(targets.dtype, "kind", "")
        if kind not in ("i", "u"):
            raise _type_error(targets, f"an array of dtype {targets.dtype}")
        listed = targets.tolist()
        values = listed if isinstance(listed, list) else [listed]
        return [int(v) for v in _flat(values)]
    if isinstance(targets, (str, bytes)) or not isinstance(targets, Sequence):
        return [_one(targets, targets)]
    return [_one(v, targets) for v in targets]


def _flat(values: list[Any]) -> list[Any]:
    out: list[Any] = []
    for v in values:
        out.extend(_flat(v) if isinstance(v, list) else [v])
    return out


def _one(value: Any, targets: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise _type_error(targets, f"{value!r} ({type(value).__name__})")
    return int(value)


def _check_dtype(dtype: torch.dtype, targets: Any) -> None:
    if dtype == torch.bool or dtype.is_floating_point or dtype.is_complex:
        raise _type_error(targets, f"a tensor of dtype {dtype}")


def _on_device(targets: Tensor, n: int) -> Resolved:
    """Targets already on a GPU: their range is read back once, before the forward."""
    _check_dtype(targets.dtype, targets)
    index = targets.reshape(-1).long()
    count = index.numel()
    if count not in (1, n):
        raise _count_error(count, n)
    lo, hi = torch.stack(torch.aminmax(index)).tolist()  # the one synchronisation
    index = index.expand(n) if count == 1 else index
    return Resolved(n, index=index, bounds=(lo, hi), shown=f"classes {lo}..{hi}")


def _move(index: Tensor, device: torch.device) -> Tensor:
    # Host -> device copies need not wait: the source is staged at once (pinned or not). A
    # copy to the host must finish before it is read, so that one blocks.
    return index.to(device, non_blocking=device.type != "cpu")


def _count_error(count: int, n: int) -> UsageError:
    return UsageError(
        f"got {count} targets for a batch of {n}: give one per sample, or a single class to "
        "use for every sample"
    )


def _type_error(targets: Any, what: str) -> UsageError:
    return UsageError(
        f"targets must be class indices (ints), got {what} in targets={targets!r}: floats "
        "and bools are refused rather than truncated to a class. Convert them yourself "
        "(e.g. t.long()), or pass targets= as a callable returning one score per sample"
    )
