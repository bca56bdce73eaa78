"""What ``hookscope nan``'s backward starts from: ``--loss`` (the sum of the outputs, or a real
loss against ``--target`` classes or ``--labels``), so that the gradients it watches are those
of a training step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..core import leaves
from ..errors import UsageError

__all__ = ["LOSSES", "labels_for", "loss_of"]

#: ``--loss`` choices and what each is, for messages
LOSSES = {
    "sum": "the sum of every floating output",
    "cross_entropy": "cross-entropy of the logits against the classes",
    "mse": "mean squared error of the first output against the labels",
}


def labels_for(
    loss: str, targets: tuple[int, ...], labels: str | None, n: int, device: torch.device
) -> Tensor | None:
    """The labels ``loss`` needs for a batch of ``n``, on ``device``: ``--target`` classes
    (one, or one per input) or a ``--labels`` ``.npy`` file; None for ``sum``."""
    if loss == "sum":
        if targets or labels:
            raise UsageError("--target and --labels go with --loss cross_entropy or mse")
        return None
    if targets and labels:
        raise UsageError("give the labels once: --target or --labels, not both")
    if targets and loss == "cross_entropy":
        if len(targets) not in (1, n):
            raise UsageError(f"got {len(targets)} --target classes for {n} inputs: give 1 or {n}")
        return torch.tensor(targets * (n if len(targets) == 1 else 1), device=device)
    if not labels:
        need = (
            "--target K (repeatable) or --labels FILE.npy"
            if loss == "cross_entropy"
            else ("--labels FILE.npy (values shaped like the output)")
        )
        raise UsageError(f"--loss {loss} needs labels: {need}")
    return _npy_labels(labels, n, device)


def _npy_labels(path: str, n: int, device: torch.device) -> Tensor:
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"--labels {path!r}: cannot read a NumPy array ({e})") from None
    if array.ndim == 0 or len(array) != n:
        raise UsageError(f"--labels {Path(path).name} holds {array.shape} for {n} inputs")
    return torch.from_numpy(array).to(device)


def loss_of(loss: str, output: Any, labels: Tensor | None) -> Tensor | None:
    """The scalar the backward starts from (None: the output has no floating tensor)."""
    floats = [t for _, t in leaves(output) if t.is_floating_point()]
    if not floats:
        return None
    if loss == "sum":
        return sum((t.float().sum() for t in floats), torch.zeros((), device=floats[0].device))
    assert labels is not None  # labels_for() gave them
    first = getattr(output, "logits", None)
    first = first if isinstance(first, Tensor) else floats[0]
    if loss == "cross_entropy":
        if labels.is_floating_point() or first.dim() != 2 or len(first) != len(labels):
            raise UsageError(
                f"--loss cross_entropy takes (N, classes) logits and N class indices: the "
                f"output is {tuple(first.shape)}, the labels {tuple(labels.shape)} "
                f"{str(labels.dtype).replace('torch.', '')}"
            )
        return F.cross_entropy(first.float(), labels.long())
    if tuple(labels.shape) != tuple(first.shape):
        raise UsageError(
            f"--loss mse compares the output {tuple(first.shape)} with labels of its shape, "
            f"got {tuple(labels.shape)}"
        )
    return F.mse_loss(first.float(), labels.float())
