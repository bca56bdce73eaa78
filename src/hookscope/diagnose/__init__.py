"""Diagnose: the first NaN/Inf in forward and backward, training-health statistics, and
gradient clipping that reports what it did."""

from ._clipping import ClipReport, clip_grad_norm
from ._logsinks import CSVSink, JSONLSink, TensorBoardSink
from ._monitoring import Monitor
from ._nonfinite import NonFiniteReport, nonfinite
from ._trackers import MetricsSink, MLflowSink, WandbSink

__all__ = [
    "CSVSink",
    "ClipReport",
    "JSONLSink",
    "MLflowSink",
    "MetricsSink",
    "Monitor",
    "NonFiniteReport",
    "TensorBoardSink",
    "WandbSink",
    "clip_grad_norm",
    "nonfinite",
]
