"""Diagnose: the first NaN/Inf in forward and backward, training-health statistics, and
gradient clipping that reports what it did."""

from ._clipping import ClipReport, clip_grad_norm
from ._logsinks import CSVSink, JSONLSink, TensorBoardSink
from ._monitoring import Monitor
from ._nonfinite import NonFiniteReport, nonfinite

__all__ = [
    "CSVSink",
    "ClipReport",
    "JSONLSink",
    "Monitor",
    "NonFiniteReport",
    "TensorBoardSink",
    "clip_grad_norm",
    "nonfinite",
]
