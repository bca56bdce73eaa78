"""hookscope: look inside a PyTorch model and change what flows through it.

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
    >>> with hs.capture(model, ["0", "2"]) as cap:
    ...     _ = model(torch.ones(2, 3))
    >>> cap["0"].output.shape
    torch.Size([2, 4])
"""

from ._version import __version__
from .core import (
    Call,
    Capture,
    Edit,
    EditContext,
    Editor,
    FeatureExtractor,
    GradHook,
    LayerRecord,
    LayerSelector,
    Reduce,
    ablate,
    add,
    capture,
    clip_grad,
    edit,
    features,
    grad_of,
    mean_ablate,
    names,
    on_grad,
    patch,
    replace,
    scale,
    transform,
)
from .diagnose import ClipReport, Monitor, NonFiniteReport, clip_grad_norm, nonfinite
from .errors import (
    CaptureBudgetError,
    CaptureError,
    CompiledModelError,
    EditError,
    GradientUnavailableError,
    HookscopeError,
    LayerNotFoundError,
    NonFiniteError,
    StaleCaptureError,
    TorchCompatError,
    UnsupportedModelError,
    UsageError,
)
from .explain import (
    CAM,
    AblationCAM,
    EigenCAM,
    Explanation,
    FeatureAblation,
    GradCAM,
    GradCAMPlusPlus,
    GuidedBackprop,
    GuidedGradCAM,
    HiResCAM,
    InputXGradient,
    IntegratedGradients,
    LayerCAM,
    LayerConductance,
    LayerIntegratedGradients,
    Occlusion,
    Saliency,
    ScoreCAM,
    SmoothGrad,
    XGradCAM,
    overlay,
)
from .extract import FeatureStore, extract, open_features
from .look import Summary, SummaryRow, feature_grid, feature_grids, summary
from .show import report

__all__ = [
    "CAM",
    "AblationCAM",
    "Call",
    "Capture",
    "CaptureBudgetError",
    "CaptureError",
    "ClipReport",
    "CompiledModelError",
    "Edit",
    "EditContext",
    "EditError",
    "Editor",
    "EigenCAM",
    "Explanation",
    "FeatureAblation",
    "FeatureExtractor",
    "FeatureStore",
    "GradCAM",
    "GradCAMPlusPlus",
    "GradHook",
    "GradientUnavailableError",
    "GuidedBackprop",
    "GuidedGradCAM",
    "HiResCAM",
    "HookscopeError",
    "InputXGradient",
    "IntegratedGradients",
    "LayerCAM",
    "LayerConductance",
    "LayerIntegratedGradients",
    "LayerNotFoundError",
    "LayerRecord",
    "LayerSelector",
    "Monitor",
    "NonFiniteError",
    "NonFiniteReport",
    "Occlusion",
    "Reduce",
    "Saliency",
    "ScoreCAM",
    "SmoothGrad",
    "StaleCaptureError",
    "Summary",
    "SummaryRow",
    "TorchCompatError",
    "UnsupportedModelError",
    "UsageError",
    "XGradCAM",
    "__version__",
    "ablate",
    "add",
    "capture",
    "clip_grad",
    "clip_grad_norm",
    "edit",
    "extract",
    "feature_grid",
    "feature_grids",
    "features",
    "grad_of",
    "mean_ablate",
    "names",
    "nonfinite",
    "on_grad",
    "open_features",
    "overlay",
    "patch",
    "replace",
    "report",
    "scale",
    "summary",
    "transform",
]

# Public objects say they live where users import them from (help(), repr, docs).
for _name in __all__:
    _obj = globals()[_name]
    if getattr(_obj, "__module__", "").startswith("hookscope."):
        _obj.__module__ = __name__
del _name, _obj
