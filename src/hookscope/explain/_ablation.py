"""The template of the input perturbation methods (occlusion, feature ablation), as Captum's
``FeatureAblation`` computes them.

A method splits one sample of the explained tensor into K features (each a boolean mask over
one sample's values: a window, a group of a feature mask). Every (feature, sample) pair is one
extra image: the sample with that feature set to the baseline. Its attribution is the drop of
the target score, ``S(x) - S(x with the feature ablated)``, given to every value of the
feature; where features overlap (occlusion's windows with a stride smaller than the window),
each value gets the mean over the features that cover it. ``N * K`` images run in forwards of
``batch_size`` (``cost(x)`` says how many before they run), feature by feature, every sample
of the batch for one feature before the next, as Captum orders them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from .._progress import progress, wanted
from ..core import map_tensors, run_eagerly
from ..errors import UsageError
from ._base import Explanation, evaluating
from ._path import _number, baseline_for, fixed, scores_at
from ._session import Plain
from ._targets import Resolved, Target, resolve
from ._tokens import explained

__all__ = ["Ablation", "Features", "on"]


class Features(Protocol):
    """The features of one sample: how many, and the masks of some of them."""

    count: int

    def masks(self, features: list[int], rows: Tensor) -> Tensor:
        """``(M, ...)`` boolean masks of feature ``features[i]`` for sample ``rows[i]``."""
        ...


class Ablation:
    """Base of occlusion and feature ablation: ``Method(model, ...)(x, targets=...)`` with
    ``raw``, ``maps`` and ``attributions`` of the explained tensor's shape.

    Args:
        model: the model (left as found: eval mode during the call).
        baselines: what an ablated value becomes: a number, or a tensor of the explained
            tensor's shape or of one sample's ``(1, ...)``; None is 0 (for token ids: id 0).
        batch_size: images per extra forward.
        progress: a bar with forwards done, rate and time left; None (default) draws one only
            on a terminal outside CI.
    """

    name: ClassVar[str] = ""
    weighted: ClassVar[bool] = False  # overlapping features: the mean over those covering

    def __init__(
        self,
        model: nn.Module,
        *,
        baselines: float | Tensor | None = None,
        batch_size: int = 32,
        progress: bool | None = None,
    ) -> None:
        self._session = Plain(model)
        self.model = model
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if not (baselines is None or isinstance(baselines, Tensor) or _number(baselines)):
            raise UsageError(f"baselines must be a number, a tensor or None, got {baselines!r}")
        wanted(progress)  # refuses a bad value now, not after the first forward
        self.baselines, self.batch_size, self.progress = baselines, batch_size, progress

    def cost(self, x: Any) -> dict[str, int]:
        """``{"forwards": images run again, "calls": model calls}`` for this batch (no
        forward: the features are known from the shapes, or from the feature mask)."""
        t = explained(x)
        forwards = t.shape[0] * self._features(t).count
        return {"forwards": forwards, "calls": math.ceil(forwards / self.batch_size)}

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs: its
        first floating-point tensor, else its token ids ``(N, T)``) for ``targets``."""
        t = explained(x)
        target = resolve(targets, t.shape[0]).to(t.device)
        base = _fill(self.baselines, t)
        features = self._features(t)
        with run_eagerly(self.model), evaluating(self._session), self._session:
            s, index = scores_at(self.model, x, target)
            attr = self._sweep(x, t, base, s, fixed(target, index), features)
        return Explanation(attr, attr, index, s, self.name, "<input>", attr)

    def _features(self, t: Tensor) -> Features:
        raise NotImplementedError

    def _sweep(
        self,
        x: Any,
        t: Tensor,
        base: float | Tensor,
        s: Tensor,
        target: Resolved,
        features: Features,
    ) -> Tensor:
        """Every (feature, sample) pair ablated, ``batch_size`` images per forward."""
        n, total = t.shape[0], features.count * t.shape[0]
        attr = torch.zeros(t.shape, dtype=s.dtype, device=t.device)
        counts = torch.zeros(t.shape[1:], dtype=s.dtype, device=t.device)
        with progress(total, type(self).__name__, self.progress) as advance:
            for start in range(0, total, self.batch_size):
                pairs = range(start, min(start + self.batch_size, total))
                rows = on(torch.tensor([p % n for p in pairs]), t.device)
                mask = features.masks([p // n for p in pairs], rows)
                images = torch.where(
                    mask, base[rows] if isinstance(base, Tensor) else base, t[rows]
                )
                drop = s[rows] - self._scores(x, t, rows, images, target)
                _add_rows(attr, start, n, drop.view(-1, *[1] * (t.dim() - 1)) * mask)
                if self.weighted:  # each feature once: it covers the same values in every sample
                    counts += mask[(-start) % n :: n].sum(0)
                advance(len(pairs))
        return attr / counts if self.weighted else attr

    def _scores(self, x: Any, t: Tensor, rows: Tensor, images: Tensor, target: Resolved) -> Tensor:
        """Target scores of ``images``, which stand for samples ``rows`` of the batch: the
        other batched inputs (masks, ids) are taken at the same rows."""
        n = t.shape[0]

        def pick(_: Any, u: Tensor) -> Tensor:
            if u is t:
                return images
            return u[rows.to(u.device)] if u.dim() > 0 and u.shape[0] == n else u

        chunk = _rows_of(target, rows)
        return scores_at(self.model, map_tensors(pick, x), chunk)[0]


def _add_rows(attr: Tensor, start: int, n: int, values: Tensor) -> None:
    """``attr[(start + i) % n] += values[i]``: each sample's rows, every n-th, summed first
    (slices, not ``index_add_``, which is orders of magnitude slower on a busy CPU, its
    threads contending on small tensors); whole features at once when the chunk holds them."""
    if start % n == 0 and len(values) % n == 0:
        attr += values.view(-1, n, *values.shape[1:]).sum(0)
        return
    for i in range(min(n, len(values))):
        attr[(start + i) % n] += values[i::n].sum(0)


def _fill(baselines: Any, t: Tensor) -> float | Tensor:
    """The baseline as a number (``torch.where`` takes it as it is) or a tensor of ``t``'s
    shape."""
    if baselines is None or _number(baselines):
        return baselines or 0
    return baseline_for(baselines, t)


def on(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor on ``device`` without waiting (host -> device copies are staged at once)."""
    return t.to(device, non_blocking=device.type != "cpu")


def _rows_of(target: Resolved, rows: Tensor) -> Resolved:
    if target.index is not None:
        return Resolved.fixed(target.index[rows.to(target.index.device)])
    fn: Callable[[Any], Tensor] | None = target.fn
    return Resolved(len(rows), fn=fn)
