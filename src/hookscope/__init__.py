"""hookscope: look inside a PyTorch model and change what flows through it."""

from ._capture import Capture, capture
from ._naming import names
from ._records import Call, LayerRecord
from ._version import __version__
from .errors import (
    CaptureBudgetError,
    CaptureError,
    CompiledModelError,
    EditError,
    GradientUnavailableError,
    HookscopeError,
    LayerNotFoundError,
    StaleCaptureError,
)

__all__ = [
    "Call",
    "Capture",
    "CaptureBudgetError",
    "CaptureError",
    "CompiledModelError",
    "EditError",
    "GradientUnavailableError",
    "HookscopeError",
    "LayerNotFoundError",
    "LayerRecord",
    "StaleCaptureError",
    "__version__",
    "capture",
    "names",
]
