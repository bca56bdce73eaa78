"""The engine every capability builds on: naming, hook lifetime, sessions, capture, edit,
gradients.

Capabilities (``look``, ``diagnose``, ``explain``, ``extract``) import from here (never from
``core``'s private modules, nor from each other's) and hook a model only as a
:class:`Session` subclass, so every entry point shares one set of policies. The public API
is re-exported flat from ``hookscope``.
"""

from ._autograd import backward_id, can_have_grad, queue_after_backward, recomputing, why_no_grad
from ._bind import Binder
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
from ._lifetime import HookSet, training_mode
from ._naming import Layers, is_called, resolve, unwrap
from ._oplist import names
from ._ops import op_qualname
from ._opwatch import OpWatch
from ._records import Call, LayerRecord
from ._session import ModuleCall, Session, private_forward
from ._torch import dispatch_has_composite, node_sequence_nr, sequence_nr
from ._tree import describe, leaves, map_tensors
from ._types import LayerSelector, Reduce

__all__ = [
    "Binder",
    "Call",
    "Capture",
    "ClipGrad",
    "ClipReport",
    "Edit",
    "EditContext",
    "Editor",
    "FeatureExtractor",
    "GradHook",
    "HookSet",
    "LayerRecord",
    "LayerSelector",
    "Layers",
    "ModuleCall",
    "OpWatch",
    "Reduce",
    "Session",
    "StopForward",
    "ablate",
    "add",
    "backward_id",
    "call_model",
    "can_have_grad",
    "capture",
    "clip_grad",
    "describe",
    "dispatch_has_composite",
    "edit",
    "features",
    "grad_of",
    "is_called",
    "leaves",
    "map_tensors",
    "mean_ablate",
    "names",
    "node_sequence_nr",
    "on_grad",
    "op_qualname",
    "patch",
    "private_forward",
    "queue_after_backward",
    "recomputing",
    "replace",
    "resolve",
    "run_eagerly",
    "scale",
    "sequence_nr",
    "training_mode",
    "transform",
    "unwrap",
    "why_no_grad",
]
