"""Targets: what each sample's explanation is of, as one score per sample.

A class index (broadcast to every sample), one index per sample, a callable on the model's
output returning ``(N,)`` scores, or None for each sample's top class. HF ``ModelOutput`` and
dict outputs are read through their ``logits`` (or the first tensor they hold).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import torch
from torch import Tensor

from ..core import leaves
from ..errors import UsageError

__all__ = ["Target", "class_index", "logits_of", "scores"]

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


def scores(output: Any, targets: Target, n: int) -> tuple[Tensor, Tensor | None]:
    """``(scores (N,), class indices (N,) or None)`` for a batch of ``n`` samples."""
    if callable(targets) and not isinstance(targets, Tensor):
        s = targets(output)
        if not isinstance(s, Tensor) or s.shape != (n,):
            got = tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__
            raise UsageError(
                f"a target callable must return one score per sample, shape ({n},); got {got}"
            )
        return s, None
    logits = logits_of(output)
    if logits.dim() != 2 or logits.shape[0] != n:
        raise UsageError(
            f"class targets need (N, classes) logits for N={n} samples, got shape "
            f"{tuple(logits.shape)}: pass targets= as a callable returning one score per sample"
        )
    if targets is None:
        index = logits.detach().argmax(1)
    else:
        index = class_index(targets, n, logits.shape[1], logits.device)
    return logits.gather(1, index[:, None]).squeeze(1), index


def class_index(targets: Any, n: int, classes: int, device: torch.device) -> Tensor:
    """Class targets (one class, or one per sample) as ``n`` validated indices."""
    if isinstance(targets, int) and not isinstance(targets, bool):
        index = torch.full((n,), targets, dtype=torch.long, device=device)  # broadcast
    else:
        index = torch.as_tensor(targets, dtype=torch.long).reshape(-1).to(device)
        if index.numel() == 1:
            index = index.expand(n)  # one target for the batch, broadcast explicitly
        elif index.numel() != n:
            raise UsageError(
                f"got {index.numel()} targets for a batch of {n}: give one per sample, or a "
                "single class to use for every sample"
            )
    if bool(((index < 0) | (index >= classes)).any()):
        raise UsageError(f"target classes must be in 0..{classes - 1}, got {index.tolist()}")
    return index
