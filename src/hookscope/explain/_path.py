"""Path integrals of integrated gradients (input and layer) and layer conductance: Captum's
integration rules, baselines, and the steps cut into forwards of a bounded size.

The rules are Captum's (``captum.attr._utils.approximation_methods``), named as it names
them: ``"riemann_left"``, ``"riemann_right"``, ``"riemann_middle"``, ``"riemann_trapezoid"``
and ``"gausslegendre"`` (the default). Each gives ``n`` points ``alpha`` in [0, 1] and their
weights (step sizes) as float32 values, the Riemann points from ``torch.linspace`` as Captum
makes them, the Gauss-Legendre nodes computed here in plain Python (Newton's method on the
Legendre polynomial; NumPy is not needed).

Memory. The ``n_steps`` points are run ``internal_batch_size // N`` at a time (at least one:
one forward-backward of the batch), so the peak is that of one forward-backward of
``internal_batch_size`` samples whatever ``n_steps`` is. The default is one step per forward,
the least memory; a larger ``internal_batch_size`` runs fewer, larger forwards.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal, get_args

import torch
from torch import Tensor, nn

from ..core import call_model, map_tensors
from ..errors import UsageError
from ._targets import Resolved
from ._tokens import explained, is_tokens

__all__ = [
    "Path",
    "Rule",
    "gauss_legendre",
    "need_grad",
    "repeated",
    "rule",
    "scalable",
    "scores_at",
    "steps_of",
]

Rule = Literal[
    "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid", "gausslegendre"
]
RULES: tuple[str, ...] = get_args(Rule)


@functools.lru_cache(maxsize=16)
def gauss_legendre(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """``(nodes, weights)`` of the ``n``-point Gauss-Legendre rule on [-1, 1], nodes ascending
    (``numpy.polynomial.legendre.leggauss(n)``, to the last bits of a float64)."""
    nodes, weights = [], []
    for i in range(n):
        x = math.cos(math.pi * (i + 0.75) / (n + 0.5))
        for _ in range(100):
            p, dp = _legendre(n, x)
            step = p / dp
            x -= step
            if abs(step) < 1e-16:
                break
        nodes.append(x)
        weights.append(2 / ((1 - x * x) * _legendre(n, x)[1] ** 2))
    order = sorted(range(n), key=nodes.__getitem__)
    return tuple(nodes[i] for i in order), tuple(weights[i] for i in order)


def _legendre(n: int, x: float) -> tuple[float, float]:
    """``(P_n(x), P_n'(x))`` by the three-term recurrence."""
    p0, p1 = 1.0, x
    for k in range(2, n + 1):
        p0, p1 = p1, ((2 * k - 1) * x * p1 - (k - 1) * p0) / k
    if n == 0:
        return 1.0, 0.0
    return p1, n * (x * p1 - p0) / (x * x - 1)


def rule(method: str, n: int) -> tuple[Tensor, Tensor]:
    """``(step sizes (n,), alphas (n,))``, float32 on the CPU, of Captum's rule ``method``."""
    if method == "gausslegendre":
        nodes, weights = gauss_legendre(n)
        return torch.tensor([0.5 * w for w in weights]), torch.tensor(
            [0.5 * (1 + x) for x in nodes]
        )
    sizes = [1 / n] * n
    if method == "riemann_trapezoid":
        sizes[0] /= 2
        sizes[-1] /= 2
        return torch.tensor(sizes), torch.linspace(0, 1, n)
    start, end = {
        "riemann_left": (0, 1 - 1 / n),
        "riemann_middle": (1 / (2 * n), 1 - 1 / (2 * n)),
        "riemann_right": (1 / n, 1),
    }[method]
    return torch.tensor(sizes), torch.linspace(start, end, n)


@dataclass(frozen=True)
class Path:
    """The options of a path method, checked (see the module docstring).

    Attributes:
        baselines: the path's start: a number (a constant input), a tensor of the explained
            tensor's shape or of one sample's ``(1, ...)``; None is 0.
        n_steps: the points of the integral.
        method: the integration rule, named as Captum names it.
        internal_batch_size: samples per forward, rounded down to whole steps of the batch
            (at least one step); None runs one step per forward.
        return_convergence_delta: also compute ``Explanation.delta``.
    """

    baselines: float | Tensor | None = None
    n_steps: int = 50
    method: str = "gausslegendre"
    internal_batch_size: int | None = None
    return_convergence_delta: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.n_steps, int) or isinstance(self.n_steps, bool):
            raise UsageError(f"n_steps must be an int, got {self.n_steps!r}")
        if self.method not in RULES:
            raise UsageError(f"method must be one of {', '.join(RULES)}; got {self.method!r}")
        least = 1 if self.method == "gausslegendre" else 2  # Captum's own limits
        if self.n_steps < least:
            raise UsageError(f"n_steps must be >= {least} for {self.method}, got {self.n_steps}")
        size = self.internal_batch_size
        if size is not None and (not isinstance(size, int) or size < 1):
            raise UsageError(f"internal_batch_size must be an int >= 1 or None, got {size!r}")
        b = self.baselines
        if not (b is None or isinstance(b, Tensor) or _number(b)):
            raise UsageError(
                f"baselines must be a number, a tensor or None (zeros), got {type(b).__name__}"
            )

    def baseline(self, t: Tensor) -> Tensor:
        """The baseline for the explained tensor ``t``, shaped as ``t``."""
        return baseline_for(self.baselines, t)


def need_grad(method: str) -> None:
    """Refuse a gradient method under ``torch.inference_mode()``, where no gradient exists.

    Raises:
        UsageError: inference mode is on.
    """
    if torch.is_inference_mode_enabled():
        raise UsageError(
            f"{method} takes gradients, which do not exist under torch.inference_mode(): call "
            "it outside (it enables gradients itself, so torch.no_grad() is fine)"
        )


def scalable(x: Any, method: str) -> Tensor:
    """The floating-point input a path scales (or a gradient method differentiates).

    Raises:
        UsageError: the inputs are token ids, which cannot be scaled.
    """
    t = explained(x)
    if is_tokens(x, t) and not t.is_floating_point():
        raise UsageError(
            f"{method} scales or differentiates its input, and token ids cannot be scaled "
            "and have no gradient: explain them through the embeddings with "
            "hs.LayerIntegratedGradients(model, <embeddings layer>, baselines=<reference "
            "ids>), or pass the embeddings as inputs_embeds="
        )
    return t


def _number(b: Any) -> bool:
    return isinstance(b, (int, float)) and not isinstance(b, bool)


def baseline_for(baselines: Any, t: Tensor) -> Tensor:
    """``baselines`` (None: 0, a number, or a tensor of ``t``'s shape or ``(1, *t.shape[1:])``)
    as a tensor of ``t``'s shape, dtype and device.

    Raises:
        UsageError: a tensor of another shape.
    """
    if baselines is None or _number(baselines):
        return torch.full_like(t, baselines or 0)
    shape, one = tuple(baselines.shape), (1, *t.shape[1:])
    if shape not in (tuple(t.shape), one):
        raise UsageError(
            f"baselines has shape {shape}; the explained tensor has shape {tuple(t.shape)}: "
            f"give a number, a tensor of that shape, or of one sample's {one}"
        )
    moved: Tensor = baselines.to(t.device, t.dtype)
    return moved.expand_as(t)


def steps_of(n_steps: int, n: int, internal_batch_size: int | None) -> Iterator[slice]:
    """The steps of each forward: ``internal_batch_size // n`` at a time, at least one."""
    per = max(1, (internal_batch_size or n) // n)
    for start in range(0, n_steps, per):
        yield slice(start, min(start + per, n_steps))


def repeated(x: Any, image: Tensor, k: int, scaled: Tensor) -> Any:
    """The model's inputs for ``k`` steps of the batch: the explained tensor replaced by
    ``scaled`` (``k * N`` samples, step by step) and every other tensor whose first dimension
    is the batch repeated ``k`` times, as Captum expands its additional arguments."""
    n = image.shape[0]

    def pick(_: Any, t: Tensor) -> Tensor:
        if t is image:
            return scaled
        return t.repeat(k, *[1] * (t.dim() - 1)) if t.dim() > 0 and t.shape[0] == n else t

    return map_tensors(pick, x)


def for_steps(target: Resolved, k: int) -> Resolved:
    """The targets of ``k`` steps of the batch (step-major)."""
    if target.index is not None:
        return Resolved.fixed(target.index.repeat(k))
    return Resolved(k * target.n, fn=target.fn)


def scores_at(model: nn.Module, inputs: Any, target: Resolved) -> tuple[Tensor, Tensor | None]:
    """``(scores, class indices)`` of one forward without gradients."""
    with torch.no_grad():
        s, index = target.score(call_model(model, inputs))
    return s.detach(), index


def fixed(target: Resolved, index: Tensor | None) -> Resolved:
    """The targets every later forward explains: the classes the first one chose, or the
    callable."""
    return Resolved.fixed(index) if index is not None else target


def delta_of(attributions: Tensor, end: Tensor, start: Tensor) -> Tensor:
    """Captum's convergence delta: ``sum(attributions) - (S(end) - S(start))`` per sample."""
    rows = attributions.reshape(attributions.shape[0], -1).sum(1)
    return rows - (end - start)
