"""Attention rollout (Abnar & Zuidema, 2020): the attention of every layer, mixed with the
residual connection, multiplied through the layers."""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from ...core import LayerSelector
from ...errors import UsageError
from .._registry import MethodInfo, register
from .._transformer import AttentionMethod


class AttentionRollout(AttentionMethod):
    """``R = Â_L ... Â_2 Â_1`` with ``Â = normalize((1 - residual) * fuse(A) + residual * I)``.

    ``fuse`` merges the heads of a layer's attention weights ``A`` (``(N, heads, T, T)``):
    ``"mean"`` (the paper's), ``"max"`` or ``"min"``. ``residual`` is the weight of the
    identity that stands for the residual connection (the paper's 0.5); ``normalize`` divides
    each row by its sum (rows of ``A`` sum to 1, so it matters for ``"max"``, ``"min"`` and
    rows SDPA masked entirely, which are zeros). No gradient is taken; the targets only give
    ``scores``.

    From Abnar & Zuidema, *Quantifying Attention Flow in Transformers*, ACL 2020.

    Args:
        model, layers, token: see :class:`~hookscope.explain.AttentionMethod`.
        head_fusion: how the heads are merged.
        residual: the identity's weight in ``[0, 1]``.

    Example:
        >>> import torch, hookscope as hs
        >>> from transformers import ViTConfig, ViTForImageClassification
        >>> vit = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, image_size=32, patch_size=8))
        >>> exp = hs.AttentionRollout(vit)(torch.randn(2, 3, 32, 32), targets=0)
        >>> exp.raw.shape, exp.maps.shape       # the 4x4 patch grid, upsampled
        (torch.Size([2, 4, 4]), torch.Size([2, 32, 32]))
    """

    name = "attention_rollout"

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector | None = None,
        *,
        head_fusion: Literal["mean", "max", "min"] = "mean",
        residual: float = 0.5,
        token: int | None = None,
    ) -> None:
        super().__init__(model, layers, token=token)
        if head_fusion not in ("mean", "max", "min"):
            raise UsageError(f"head_fusion must be 'mean', 'max' or 'min', got {head_fusion!r}")
        number = isinstance(residual, (int, float)) and not isinstance(residual, bool)
        if not number or not 0 <= residual <= 1:
            raise UsageError(f"residual must be a number in [0, 1], got {residual!r}")
        self.head_fusion, self.residual = head_fusion, float(residual)

    def combine(self, weights: list[Tensor], grads: list[Tensor] | None) -> Tensor:
        """Each layer's heads fused, mixed with the identity, rows normalized, multiplied
        from the first layer up."""
        rollout: Tensor | None = None
        for a in weights:
            fused = a.mean(1) if self.head_fusion == "mean" else _extreme(a, self.head_fusion)
            eye = torch.eye(fused.shape[-1], dtype=fused.dtype, device=fused.device)
            mixed = (1 - self.residual) * fused + self.residual * eye
            sums = mixed.sum(-1, keepdim=True)
            mixed = mixed / torch.where(sums > 0, sums, 1)
            rollout = mixed if rollout is None else mixed @ rollout
        assert rollout is not None  # at least one attention layer
        return rollout


def _extreme(a: Tensor, which: str) -> Tensor:
    return a.amax(1) if which == "max" else a.amin(1)


register(
    MethodInfo(
        "attention_rollout",
        AttentionRollout,
        "attention",
        gradients=False,
        reference="Abnar & Zuidema, Quantifying Attention Flow in Transformers, ACL 2020",
    )
)
