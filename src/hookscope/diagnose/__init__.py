"""Diagnose: the first NaN/Inf in forward and backward, and gradient clipping that reports
what it did."""

from ._clipping import ClipReport, clip_grad_norm
from ._nonfinite import NonFiniteReport, nonfinite

__all__ = ["ClipReport", "NonFiniteReport", "clip_grad_norm", "nonfinite"]
