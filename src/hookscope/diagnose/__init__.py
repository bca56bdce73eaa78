"""Diagnose: the first NaN/Inf in forward and backward."""

from ._nonfinite import NonFiniteReport, nonfinite

__all__ = ["NonFiniteReport", "nonfinite"]
