"""Methods that run the model again on perturbed inputs or activations (Score-CAM,
Ablation-CAM): their cost is known before they run (:meth:`Perturbation.cost`), the extra
forwards are batched (``batch_size``), and a budget (``top_k`` channels per image) bounds them.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._progress import progress, wanted
from ..core import HookSet, call_model, leaves, map_tensors, training_mode
from ..errors import UsageError
from ._base import LayerMethod, normalize
from ._targets import Target, scores

__all__ = ["Perturbation"]


class Perturbation(LayerMethod):
    """Base of Score-CAM and Ablation-CAM: one extra forward per (image, channel) explored.

    Args:
        batch_size: images per extra forward.
        top_k: explore only ``top_k`` channels per image (the others get weight 0); None
            explores every channel.
        rank: how ``top_k`` channels are chosen: ``"gradient"`` (default) by their Grad-CAM
            contribution, mean gradient times mean activation (one extra backward to the
            layer), or ``"activation"`` by mean activation alone.
        progress: a bar with forwards done, rate and time left (rich, tqdm or a plain line);
            None (default) draws one only on a terminal outside CI.
    """

    needs_grad = False

    def __init__(
        self,
        model: nn.Module,
        layer: Any,
        *,
        batch_size: int = 32,
        top_k: int | None = None,
        rank: str = "gradient",
        progress: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, layer, **kwargs)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise UsageError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if top_k is not None and (not isinstance(top_k, int) or top_k < 1):
            raise UsageError(f"top_k must be an int >= 1 or None, got {top_k!r}")
        if rank not in ("gradient", "activation"):
            raise UsageError(f"rank must be 'gradient' or 'activation', got {rank!r}")
        wanted(progress)  # refuses a bad value now, not after the first forward
        self.batch_size, self.top_k, self.rank, self.progress = batch_size, top_k, rank, progress
        self.needs_grad = top_k is not None and rank == "gradient"  # type: ignore[misc]

    def cost(self, x: Any) -> dict[str, int]:
        """``{"forwards": images run again, "calls": model calls}`` for this batch, found from
        the layer's channel count (one forward of the batch without gradients)."""
        with torch.no_grad():
            channels = self._channels(x)
        n = self._batch(x)
        k = min(self.top_k or channels, channels)
        return {"forwards": n * k, "calls": math.ceil(n * k / self.batch_size)}

    def _channels(self, x: Any) -> int:
        seen: list[int] = []
        hooks = HookSet()
        try:
            hooks.forward(self.module, lambda m, a, out: seen.append(_first(out).shape[1]))
            with training_mode(self.model, False):
                call_model(self.model, x)
        finally:
            hooks.close()
        return seen[0]

    @staticmethod
    def _batch(x: Any) -> int:
        return next(t for _, t in leaves(x)).shape[0]

    def _chosen(self, acts: Tensor, grads: Tensor | None) -> Tensor:
        """``(N, K)`` channel indices to explore per image."""
        k = min(self.top_k or acts.shape[1], acts.shape[1])
        weight = acts.mean((2, 3))
        if grads is not None:
            weight = weight * grads.mean((2, 3))
        return weight.topk(k, dim=1).indices

    def _scores(self, targets: Target, index: Tensor | None, run: Any, pairs: Tensor) -> Tensor:
        """Target scores of the perturbed forwards: ``pairs`` (M, 2) of (image, channel);
        ``run(rows)`` runs the model for a chunk of those pairs."""
        out = []
        with progress(len(pairs), type(self).__name__, self.progress) as advance:
            for chunk in torch.split(pairs, self.batch_size):
                output = run(chunk)
                sample = chunk[:, 0]
                if callable(targets) and not isinstance(targets, Tensor):
                    s, _ = scores(output, targets, len(chunk))
                else:
                    assert index is not None
                    s, _ = scores(output, index[sample].tolist(), len(chunk))
                out.append(s.detach())
                advance(len(chunk))
        return torch.cat(out)

    def _run(self, x: Any, image: Tensor, rows: Tensor, images: Tensor) -> Any:
        """The model on ``images`` standing for samples ``rows`` of the batch: other batched
        inputs (masks, ids) are taken at the same rows."""
        n = image.shape[0]

        def pick(_: Any, t: Tensor) -> Tensor:
            if t is image:
                return images
            return t[rows] if t.dim() > 0 and t.shape[0] == n else t

        with torch.no_grad(), training_mode(self.model, False):
            return call_model(self.model, map_tensors(pick, x))


def _first(out: Any) -> Tensor:
    return next(t for _, t in leaves(out))


def _pairs(chosen: Tensor) -> Tensor:
    n, k = chosen.shape
    sample = torch.arange(n, device=chosen.device).repeat_interleave(k)
    return torch.stack([sample, chosen.reshape(-1)], 1)


def upsampled_masks(acts: Tensor, size: tuple[int, int]) -> Tensor:
    """Activations upsampled to the input's size, each channel min-max scaled to 0..1."""
    # align_corners=True, as the Score-CAM authors' code and pytorch-grad-cam upsample
    up = F.interpolate(acts, size=size, mode="bilinear", align_corners=True)
    return normalize(up.flatten(0, 1)).reshape(up.shape)  # one scale per (image, channel)
