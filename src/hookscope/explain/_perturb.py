"""Methods that run the model again on perturbed inputs or activations (Score-CAM,
Ablation-CAM): their cost is known before they run (:meth:`Perturbation.cost`), the extra
forwards are batched (``batch_size``), and a budget (``top_k`` channels per image) bounds them.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .._progress import progress, wanted
from ..core import LayerSelector, call_model, map_tensors, run_eagerly
from ..errors import UsageError
from ._base import Context, LayerMethod, evaluating, image_of, normalize
from ._layout import spatial_size
from ._targets import Resolved

__all__ = ["Perturbation", "pairs_of", "upsampled_masks"]


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
        layers: LayerSelector,
        *,
        batch_size: int = 32,
        top_k: int | None = None,
        rank: Literal["gradient", "activation"] = "gradient",
        progress: bool | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(model, layers, **kwargs)
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
        image = image_of(x)
        n, channels = image.shape[0], self._channels(x, image)
        k = min(self.top_k or channels, channels)
        return {"forwards": n * k, "calls": math.ceil(n * k / self.batch_size)}

    def _channels(self, x: Any, image: Tensor) -> int:
        tap = self._tap
        tap.state.values = False  # the shape is enough
        with run_eagerly(self.model), evaluating(tap), torch.no_grad(), tap:
            call_model(self.model, x)
        shape = tap.take()[2]
        grid = self._grid(shape, image)
        if grid.channel_dim is not None:
            return shape[grid.channel_dim]
        return int(grid.place(torch.zeros((1, *shape[1:]))).shape[1])

    def _chosen(self, ctx: Context) -> Tensor:
        """``(N, K)`` channel indices to explore per image."""
        acts = ctx.acts
        k = min(self.top_k or acts.shape[1], acts.shape[1])
        weight = acts.mean((2, 3))
        if ctx.grads is not None:
            weight = weight * ctx.grads.mean((2, 3))
        return weight.topk(k, dim=1).indices

    def _scores(self, ctx: Context, pairs: Tensor, run: Callable[[Tensor], Any]) -> Tensor:
        """Target scores of the perturbed forwards: ``pairs`` (M, 2) of (image, channel);
        ``run(chunk)`` runs the model for a chunk of those pairs."""
        out = []
        with progress(len(pairs), type(self).__name__, self.progress) as advance:
            for chunk in torch.split(pairs, self.batch_size):
                rows = chunk[:, 0]
                s, _ = _chunk_target(ctx, rows).score(run(chunk))
                out.append(s.detach())
                advance(len(chunk))
        return torch.cat(out)

    def _run(self, ctx: Context, rows: Tensor, images: Tensor) -> Any:
        """The model on ``images`` standing for samples ``rows`` of the batch: other batched
        inputs (masks, ids) are taken at the same rows."""
        n = ctx.image.shape[0]

        def pick(_: Any, t: Tensor) -> Tensor:
            if t is ctx.image:
                return images
            return t[rows.to(t.device)] if t.dim() > 0 and t.shape[0] == n else t

        with torch.no_grad():
            return call_model(self.model, map_tensors(pick, ctx.inputs))


def _chunk_target(ctx: Context, rows: Tensor) -> Resolved:
    """The targets of samples ``rows``: the classes the first pass explained, or the callable."""
    if ctx.targets is not None:
        return Resolved.fixed(ctx.targets[rows.to(ctx.targets.device)])
    return Resolved(len(rows), fn=ctx.target.fn)


def pairs_of(chosen: Tensor) -> Tensor:
    """``(N * K, 2)`` (image, channel) pairs of the ``(N, K)`` chosen channels."""
    n, k = chosen.shape
    sample = torch.arange(n, device=chosen.device).repeat_interleave(k)
    return torch.stack([sample, chosen.reshape(-1)], 1)


def upsampled_masks(acts: Tensor, image: Tensor) -> Tensor:
    """Maps ``(M, h, w)`` upsampled to the input's positions ``(M, *spatial)``, each min-max
    scaled to 0..1."""
    size = spatial_size(image)
    grid = size if len(size) == 2 else (1, size[0])
    # align_corners=True, as the Score-CAM authors' code and pytorch-grad-cam upsample
    up = F.interpolate(acts[:, None], size=grid, mode="bilinear", align_corners=True)[:, 0]
    return normalize(up).reshape(len(acts), *size)
