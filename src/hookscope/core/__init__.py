"""The engine every capability builds on: naming and sites, hook lifetime, sessions, capture,
edit, gradients, reductions.

Capabilities (``look``, ``diagnose``, ``explain``, ``extract``, ``show``) import from here
(never from ``core``'s private modules, except ``core._torch``, the list of PyTorch internals,
nor from each other's) and hook a model only as a :class:`Session` subclass, so every entry
point shares one set of policies. ``__all__`` is what a contributor building a session
needs; the public API is re-exported flat from ``hookscope``.
"""

from ._autograd import can_have_grad, queue_after_backward, recomputing, why_no_grad
from ._bind import Binder
from ._calls import ModuleCall, own_forward, private_forward
from ._capture import Capture, StopForward, capture
from ._clip import ClipGrad, ClipReport, clip_grad
from ._compile import run_eagerly
from ._edit import (
    Edit,
    EditContext,
    ablate,
    add,
    mean_ablate,
    patch,
    replace,
    scale,
    transform,
)
from ._editor import Editor, edit
from ._features import FeatureExtractor, call_model, features
from ._grad import GradHook, grad_of, on_grad
from ._lifetime import DispatchInterceptor, FunctionInterceptor, HookSet, training_mode
from ._naming import Layers, Site, is_called, unwrap
from ._oplist import names
from ._records import Call, LayerRecord
from ._reduce import REDUCERS, check_reduce, keep_mask, reduce_tensor
from ._session import Session
from ._tree import describe, leaves, map_tensors
from ._types import LayerSelector, Reduce
from ._units import last_positions
from .ops._select import op_qualname

__all__ = [
    "REDUCERS",
    "Binder",
    "Call",
    "Capture",
    "ClipGrad",
    "ClipReport",
    "DispatchInterceptor",
    "Edit",
    "EditContext",
    "Editor",
    "FeatureExtractor",
    "FunctionInterceptor",
    "GradHook",
    "HookSet",
    "LayerRecord",
    "LayerSelector",
    "Layers",
    "ModuleCall",
    "Reduce",
    "Session",
    "Site",
    "StopForward",
    "ablate",
    "add",
    "call_model",
    "can_have_grad",
    "capture",
    "check_reduce",
    "clip_grad",
    "describe",
    "edit",
    "features",
    "grad_of",
    "is_called",
    "keep_mask",
    "last_positions",
    "leaves",
    "map_tensors",
    "mean_ablate",
    "names",
    "on_grad",
    "op_qualname",
    "own_forward",
    "patch",
    "private_forward",
    "queue_after_backward",
    "recomputing",
    "reduce_tensor",
    "replace",
    "run_eagerly",
    "scale",
    "training_mode",
    "transform",
    "unwrap",
    "why_no_grad",
]
