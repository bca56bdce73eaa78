"""hookscope: look inside a PyTorch model and change what flows through it.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> with hs.capture(model, ["0", "2"]) as cap:
    ...     _ = model(torch.ones(2, 3))
    >>> cap["0"].output.shape
    torch.Size([2, 4])
"""

from ._capture import Capture, capture
from ._edit import (
    Edit,
    EditContext,
    Editor,
    ablate,
    add,
    clip_grad,
    edit,
    mean_ablate,
    patch,
    replace,
    scale,
    transform,
)
from ._features import FeatureExtractor, features
from ._grad import GradHook, grad_of, on_grad
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
    "Edit",
    "EditContext",
    "EditError",
    "Editor",
    "FeatureExtractor",
    "GradHook",
    "GradientUnavailableError",
    "HookscopeError",
    "LayerNotFoundError",
    "LayerRecord",
    "StaleCaptureError",
    "__version__",
    "ablate",
    "add",
    "capture",
    "clip_grad",
    "edit",
    "features",
    "grad_of",
    "mean_ablate",
    "names",
    "on_grad",
    "patch",
    "replace",
    "scale",
    "transform",
]
