"""Gradient clipping that says what it did: the report both clippers return, and ``clip_grad``,
the edit that clips each of a layer's parameter gradients as it arrives in backward.

``hs.clip_grad_norm`` (``diagnose``) clips after backward, as ``torch.nn.utils.clip_grad_norm_``
does; both describe what they did with a :class:`ClipReport`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from ..errors import UsageError
from ._edit import Edit, EditContext

__all__ = ["ClipGrad", "ClipReport", "clip_grad"]


@dataclass(frozen=True)
class ClipReport:
    """What a clipper found and did.

    ``layers`` maps each layer (the module owning the parameters, or a parameter's name when
    clipping is per parameter or parameters were given without a model) to its gradient norm
    before clipping; ``clipped`` maps the entries that were scaled down to the factor applied
    (norm after ÷ norm before, < 1); ``nonfinite`` lists the parameters whose gradient holds a
    NaN or an Inf.
    """

    total_norm: float
    total_norm_after: float
    max_norm: float
    norm_type: float
    layers: dict[str, float] = field(default_factory=dict)
    clipped: dict[str, float] = field(default_factory=dict)
    nonfinite: list[str] = field(default_factory=list)

    @property
    def was_clipped(self) -> bool:
        """Whether any gradient was scaled down (``clipped`` is not empty)."""
        return bool(self.clipped)


class _Log:
    """Per parameter, ``(norm before, norm after, finite)`` of its latest gradient, kept on the
    gradient's device until a report is asked for."""

    def __init__(self) -> None:
        self.latest: dict[str, Tensor] = {}


@dataclass(frozen=True)
class ClipGrad(Edit):
    """The edit :func:`clip_grad` returns; :meth:`report` says what it did."""

    max_norm: float = math.inf
    log: _Log = field(default_factory=_Log, compare=False, repr=False)

    def report(self) -> ClipReport:
        """What happened to each clipped parameter's most recent gradient (so, after one
        backward, what that backward's clipping did), read with one host transfer.

        Keys are ``"layer.parameter"``; norms are 2-norms; ``total_norm`` is the norm of all
        those gradients together, before and after clipping.
        """
        names = list(self.log.latest)
        if not names:
            return ClipReport(0.0, 0.0, self.max_norm, 2.0)
        device = self.log.latest[names[0]].device
        rows = torch.stack([t.to(device) for t in self.log.latest.values()])
        totals = torch.linalg.vector_norm(rows[:, :2], dim=0)  # before, after
        host = torch.cat([totals, rows.flatten()]).tolist()  # the one host transfer
        table = [host[2 + 3 * i : 5 + 3 * i] for i in range(len(names))]
        return ClipReport(
            total_norm=host[0],
            total_norm_after=host[1],
            max_norm=self.max_norm,
            norm_type=2.0,
            layers={n: b for n, (b, _, _) in zip(names, table, strict=True)},
            clipped={n: a / b for n, (b, a, _) in zip(names, table, strict=True) if a < b},
            nonfinite=[n for n, (_, _, ok) in zip(names, table, strict=True) if not ok],
        )


def clip_grad(*, value: float | None = None, norm: float | None = None) -> ClipGrad:
    """Clip each of the layer's parameter gradients as it arrives in backward: elementwise
    to ``[-value, value]`` and/or rescaled to 2-norm at most ``norm``.

    ``norm`` applies to *each parameter tensor on its own* (what a ``register_hook`` on each
    parameter that rescales its gradient does), unlike ``torch.nn.utils.clip_grad_norm_``,
    which rescales all gradients by their joint norm after backward. The returned edit's
    ``report()`` gives a :class:`ClipReport` of the latest gradients it clipped.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> clip = hs.clip_grad(norm=1e-3)
        >>> with hs.edit(model, {"0": clip}):
        ...     model(torch.ones(2, 3)).sum().backward()
        >>> sorted(clip.report().layers)
        ['0.bias', '0.weight']
    """
    if value is None and norm is None:
        raise UsageError("clip_grad needs value= or norm= (or both)")
    for label, bound in (("value", value), ("norm", norm)):
        if bound is not None and not (_is_number(bound) and bound > 0):
            raise UsageError(f"clip_grad({label}={bound!r}): use a positive number")
    log = _Log()

    def fn(g: Tensor, ctx: EditContext) -> Tensor:
        before = torch.linalg.vector_norm(g.detach()).float()
        finite = torch.isfinite(g).all().float()  # (a norm of finite values may overflow)
        if value is not None:
            g = g.clamp(-value, value)
        if norm is not None:
            g = g * torch.clamp(norm / (torch.linalg.vector_norm(g) + 1e-6), max=1.0)
        after = torch.linalg.vector_norm(g.detach()).float()
        log.latest[".".join(filter(None, (ctx.layer, *map(str, ctx.path))))] = torch.stack(
            [before, after, finite]
        )
        return g

    max_norm = math.inf if norm is None else float(norm)
    return ClipGrad(fn, "param_grad", name="clip_grad", max_norm=max_norm, log=log)


def _is_number(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)
