"""Every private PyTorch internal hookscope relies on, in one place.

PyTorch does not promise these names. Each is looked up once, here, when hookscope is
imported, except ``torch._dynamo``'s: importing it takes most of a second, so they are looked
up when first needed (only for a compiled model, by when torch has imported dynamo). A missing
one does not break the import but makes the feature that needs it raise
:class:`~hookscope.errors.TorchCompatError` naming the internal, the torch version and what
to do, instead of failing somewhere deep or, worse, silently doing nothing.
``tests/test_architecture.py`` checks that every internal resolves on the torch CI tests, and
that no other module of hookscope names a private torch name (``torch.*._name``, a tensor's
``._version``, an operator's ``._schema``, a private ``nn`` base class): they are all here.
Capabilities may import this module (and no other private module of ``core``).

CI tests torch 2.13.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import operator
import sys
import threading
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import TorchCompatError

__all__ = [
    "CALL_CODES",
    "EXPORTING_FLAG",
    "FUSED_ATTENTION",
    "INTERNALS",
    "LOCAL_SCALAR_DENSE",
    "NN_BASES",
    "DispatchMode",
    "backward_id",
    "buffers_of",
    "call_raised",
    "call_shown",
    "checkpoint_codes",
    "children",
    "current_dispatch_mode",
    "dispatch_has_composite",
    "dynamo_cache_entries",
    "export_traced",
    "foreach_mul",
    "foreach_norm",
    "foreach_sub",
    "function_class",
    "function_mode_on",
    "function_stack_length",
    "functorch_level",
    "functorch_transforms",
    "hide_function_modes",
    "inner_code",
    "is_mutable",
    "missing",
    "need",
    "nested_sizes",
    "node_sequence_nr",
    "parameters_of",
    "push_function_mode",
    "queue_callback",
    "remove_function_mode",
    "restore_function_modes",
    "saved_tensor_hooks_active",
    "schema_arguments",
    "sequence_nr",
    "set_stance",
    "sparse_values",
    "transforms_active",
    "version",
    "wrap_inline_codes",
]

#: name -> the object, or None when this torch lacks it
INTERNALS: dict[str, Any] = {}
#: name -> how to find it, for internals looked up when first needed (see the docstring)
_LATER: dict[str, Callable[[], Any]] = {}


def _find(name: str, get: Callable[[], Any]) -> Any:
    try:
        value = get()
    except (AttributeError, ImportError, IndexError, KeyError, StopIteration):
        value = None
    INTERNALS[name] = value
    return value


def _resolve_later() -> None:
    for name, get in list(_LATER.items()):
        if name not in INTERNALS:
            _find(name, get)


def need(name: str) -> Any:
    """The internal ``name``; raises TorchCompatError if this torch does not have it."""
    if name not in INTERNALS and (get := _LATER.get(name)) is not None:
        _find(name, get)
    value = INTERNALS.get(name)
    if value is None:
        raise TorchCompatError(
            f"hookscope needs the PyTorch internal {name!r}, which torch {torch.__version__} "
            "does not have. hookscope is tested on torch 2.13: install it, or report this at "
            "hookscope's issue tracker with your torch version."
        )
    return value


def missing() -> list[str]:
    """The internals this torch lacks (empty on a supported torch)."""
    _resolve_later()
    return sorted(name for name, value in INTERNALS.items() if value is None)


# -- module calls ---------------------------------------------------------------------------------
_call_impl = nn.Module._call_impl
#: the frames of a module call (``__call__`` -> ``_wrapped_call_impl`` -> ``_call_impl``)
CALL_CODES: tuple[types.CodeType, ...] = (
    _call_impl.__code__,
    nn.Module._wrapped_call_impl.__code__,
)
#: the nested function of ``_call_impl`` that runs the hooks when forward returned; hooks
#: with ``always_call=True`` run from ``_call_impl`` itself after forward raised
_INNER = _find(
    "nn.Module._call_impl.<locals>.inner",
    lambda: next(
        c
        for c in _call_impl.__code__.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "inner"
    ),
)


def inner_code() -> types.CodeType:
    """The code of ``_call_impl``'s nested ``inner`` (hooks and ``forward`` run in it)."""
    code: types.CodeType = need("nn.Module._call_impl.<locals>.inner")
    return code


def call_raised() -> bool:
    """Inside a forward hook registered with ``always_call=True``: whether the module's
    forward (or a hook before this one) raised, rather than returned."""
    inner = need("nn.Module._call_impl.<locals>.inner")
    frame = sys._getframe(2)  # our caller is the hook, its caller the module call
    for _ in range(8):  # hooks run outside compiled graphs are wrapped a few frames deep
        if frame is None:
            break
        code = frame.f_code
        if code is inner:
            return False
        if code is CALL_CODES[0]:
            return True
        frame = frame.f_back  # type: ignore[assignment]
    return False


# -- autograd -------------------------------------------------------------------------------------
backward_id: Callable[[], int] = _find(
    "torch._C._current_graph_task_id", lambda: torch._C._current_graph_task_id
)
"""The id of the backward pass running on this thread, -1 outside backward."""

sequence_nr: Callable[[], int] = _find(
    "torch._C._autograd._get_sequence_nr", lambda: torch._C._autograd._get_sequence_nr
)
"""The sequence number the next autograd node created on this thread will get."""


def node_sequence_nr(node: Any) -> int:
    """The sequence number of an autograd node (the order in which nodes were created)."""
    seq: int = node._sequence_nr()
    return seq


def function_class(node: Any) -> type | None:
    """The ``torch.autograd.Function`` whose backward an autograd node runs (a custom
    Function's node is an instance of a class PyTorch makes for it, which names the Function
    in ``_forward_cls``); None for a node of a built-in operator."""
    cls = getattr(node, "_forward_cls", None)
    return cls if isinstance(cls, type) else None


_engine = _find(
    "torch.autograd.Variable._execution_engine.queue_callback",
    lambda: torch.autograd.Variable._execution_engine.queue_callback,
)


def queue_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the current backward pass finishes (only valid inside backward)."""
    need("torch.autograd.Variable._execution_engine.queue_callback")(fn)


_top_hooks = _find(
    "torch._C._autograd._top_saved_tensors_default_hooks",
    lambda: torch._C._autograd._top_saved_tensors_default_hooks,
)


def saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks are set (a non-reentrant checkpoint segment sets them)."""
    return need("torch._C._autograd._top_saved_tensors_default_hooks")(False) is not None


functorch_level: Callable[[], int | None] = _find(
    "torch._C._functorch.maybe_current_level", lambda: torch._C._functorch.maybe_current_level
)
"""The torch.func transform level of the code running now, None outside transforms."""

transforms_active: Callable[[], bool] = _find(
    "torch._C._are_functorch_transforms_active",
    lambda: torch._C._are_functorch_transforms_active,
) or (lambda: functorch_level() is not None)
"""Whether a torch.func transform is running (the test a per-call hot path makes before
:data:`functorch_level`: a bool, no optional int; still a pybind11 binding, about 300
instructions a call, the dearest of the capture hot path's tests)."""

_find(
    "torch._C._functorch.get_interpreter_stack",
    lambda: torch._C._functorch.get_interpreter_stack,
)


def functorch_transforms() -> list[str]:
    """The torch.func transforms the code running now is inside, outermost first: ``"vmap"``,
    ``"grad"`` (``grad``, ``vjp``, ``jacrev``), ``"jvp"`` (``jvp``, ``jacfwd``) or
    ``"functionalize"``; empty outside transforms."""
    stack = need("torch._C._functorch.get_interpreter_stack")() or []
    return [interpreter.key().name.lower() for interpreter in stack]


# -- torch.export ---------------------------------------------------------------------------------
_FAKE_MODE = _find(
    "torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)",
    lambda: (torch._C._get_dispatch_mode, torch._C._TorchDispatchModeKey.FAKE),
)


class _Always:
    flag = True


#: ``(holder, name)``: ``getattr(holder, name)`` is the flag ``torch.compiler.is_exporting()``
#: returns, read by a per-call hot path without a Python call (Dynamo folds the read to a
#: constant while it traces, as it does the call). A torch without the flag gets a holder
#: whose flag is always set, so every call takes the exact test, :func:`export_traced`.
EXPORTING_FLAG: tuple[Any, str] = _find(
    "torch.compiler._is_exporting_flag",
    lambda: (torch.compiler, "_is_exporting_flag", torch.compiler._is_exporting_flag)[:2],
) or (_Always, "flag")


def export_traced() -> bool:
    """Whether ``torch.export`` is tracing the code running now on this thread: Dynamo
    traces it (``strict=True``), or it runs under the fake tensor mode of a non-strict
    export. ``torch.compiler.is_exporting()`` alone says only that an export is running
    somewhere in the process (it is one flag for every thread). Dynamo traces this function
    to a constant: the first lines decide under strict export."""
    if not torch.compiler.is_exporting():
        return False
    if torch.compiler.is_dynamo_compiling():
        return True
    get, fake = need("torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)")
    return get(fake) is not None


# -- activation checkpointing -------------------------------------------------------------------
def _checkpoint_codes() -> dict[str, Any] | None:
    from torch.utils import checkpoint as cp

    unpack = next(
        c
        for c in cp._checkpoint_hook.__init__.__code__.co_consts
        if isinstance(c, types.CodeType) and c.co_name == "unpack_hook"
    )
    return {
        "reentrant_forward": cp.CheckpointFunction.forward.__code__,
        "reentrant_backward": cp.CheckpointFunction.backward.__code__,
        "non_reentrant": inspect.unwrap(cp.checkpoint).__code__,
        "non_reentrant_unpack": unpack,
    }


_CHECKPOINT = _find("torch.utils.checkpoint internals", _checkpoint_codes)


def checkpoint_codes() -> dict[str, Any]:
    """Code objects of torch.utils.checkpoint's forward and recomputation frames."""
    found: dict[str, Any] = need("torch.utils.checkpoint internals")
    return found


# -- dispatch -------------------------------------------------------------------------------------
_has_kernel = _find(
    "torch._C._dispatch_has_kernel_for_dispatch_key",
    lambda: torch._C._dispatch_has_kernel_for_dispatch_key,
)


def dispatch_has_composite(func: Any) -> bool:
    """Whether an aten operator has a CompositeImplicitAutograd kernel (a decomposition)."""
    has: Callable[[str, str], bool] = need("torch._C._dispatch_has_kernel_for_dispatch_key")
    try:
        return has(func.name(), "CompositeImplicitAutograd")
    except RuntimeError:  # not a dispatcher operator (``prim::layout``, a jagged .layout)
        return False


# -- tensors and operators ------------------------------------------------------------------------
_find("torch.Tensor._version", lambda: torch.Tensor._version)
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")
"""A tensor's version counter (bumped by every in-place change; an inference tensor has none
and raises RuntimeError)."""


def nested_sizes(t: torch.Tensor) -> tuple[tuple[int, ...], ...]:
    """The sizes of a nested tensor's components, read from its metadata without running an
    operator (a dispatch mode counting the model's operators, or a user's, would see one:
    even ``.layout`` and ``.unbind()`` of a jagged tensor dispatch). Strided layout: its
    CPU size tensor; jagged layout (``torch.nested._internal``'s ``NestedTensor``): its
    values' shape with the ragged dim cut at its offsets (or lengths, where it has holes).
    On a GPU the jagged offsets are read on the host."""
    jagged = INTERNALS["torch.nested._internal.nested_tensor.NestedTensor"]
    if jagged is None or not isinstance(t, jagged):
        sizes: list[list[int]] = need("torch.Tensor._nested_tensor_size")(t).tolist()
        return tuple(tuple(s) for s in sizes)
    shape = list(t._values.shape)
    dim = t._ragged_idx - 1  # in the values, which have no batch dim
    if t._lengths is not None:
        lengths: list[int] = t._lengths.tolist()
    else:
        offsets: list[int] = t._offsets.tolist()
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
    return tuple((*shape[:dim], n, *shape[dim + 1 :]) for n in lengths)


_find("torch.Tensor._nested_tensor_size", lambda: torch.Tensor._nested_tensor_size)
_find("torch.Tensor._values", lambda: torch.Tensor._values)


def sparse_values(t: torch.Tensor) -> torch.Tensor:
    """The tensor holding a sparse tensor's stored values, as they are (a COO tensor's
    uncoalesced too: ``.values()`` would refuse it)."""
    if t.layout == torch.sparse_coo:
        values: torch.Tensor = need("torch.Tensor._values")(t)
        return values
    return t.values()


_find(
    "torch.nested._internal.nested_tensor.NestedTensor",
    lambda: importlib.import_module("torch.nested._internal.nested_tensor").NestedTensor,
)


def is_mutable(func: Any) -> bool:
    """Whether an aten operator (an ``OpOverload``) writes one of its arguments."""
    return bool(func._schema.is_mutable)


def schema_arguments(func: Any) -> list[Any]:
    """The schema's arguments of an aten operator (``name``, ``alias_info``, ...)."""
    return list(func._schema.arguments)


_find("torch._ops.OpOverload._schema", lambda: torch.ops.aten.add.Tensor._schema)
LOCAL_SCALAR_DENSE: Any = _find(
    "torch.ops.aten._local_scalar_dense", lambda: torch.ops.aten._local_scalar_dense
)
"""The operator behind ``.item()`` (and every other read of a value into Python)."""

foreach_norm: Callable[..., Any] = _find("torch._foreach_norm", lambda: torch._foreach_norm)
foreach_mul: Callable[..., Any] = _find("torch._foreach_mul", lambda: torch._foreach_mul)
foreach_sub: Callable[..., Any] = _find("torch._foreach_sub", lambda: torch._foreach_sub)

#: ``torch.nn``'s private base classes of module families (convolutions, norms, pooling)
NN_BASES: dict[str, type[nn.Module]] = (
    _find(
        "torch.nn private base classes",
        lambda: {
            "_ConvNd": nn.modules.conv._ConvNd,
            "_NormBase": nn.modules.batchnorm._NormBase,
            "_MaxPoolNd": nn.modules.pooling._MaxPoolNd,
            "_AvgPoolNd": nn.modules.pooling._AvgPoolNd,
            "_AdaptiveAvgPoolNd": nn.modules.pooling._AdaptiveAvgPoolNd,
            "_AdaptiveMaxPoolNd": nn.modules.pooling._AdaptiveMaxPoolNd,
        },
    )
    or {}
)


# -- modules -------------------------------------------------------------------------------------
_find("nn.Module._modules / _parameters / _buffers", lambda: nn.Module().__dict__["_modules"])


def children(module: nn.Module) -> dict[str, nn.Module | None]:
    """A module's own dict of child modules (``named_children()`` without the generator:
    walking a model's tree reads it for every module)."""
    found: dict[str, nn.Module | None] = module._modules
    return found


def parameters_of(module: nn.Module) -> dict[str, Any]:
    """A module's own dict of parameters (entries may be None)."""
    found: dict[str, Any] = module._parameters
    return found


def buffers_of(module: nn.Module) -> dict[str, Any]:
    """A module's own dict of buffers (entries may be None); the NaN tracer's replay swaps
    entries for clones while it runs."""
    found: dict[str, Any] = module._buffers
    return found


#: the fused attention kernels' operators (``torch.ops.aten``), for FLOP formulas
FUSED_ATTENTION: tuple[Any, ...] = (
    _find(
        "torch.ops.aten fused attention operators",
        lambda: (
            torch.ops.aten._flash_attention_forward,
            torch.ops.aten._efficient_attention_forward,
        ),
    )
    or ()
)


# -- dispatch modes -------------------------------------------------------------------------------
def _dispatch_module() -> Any:
    from torch.utils import _python_dispatch

    _python_dispatch.TorchDispatchMode  # noqa: B018 - resolve it now
    return _python_dispatch


_DISPATCH = _find("torch.utils._python_dispatch.TorchDispatchMode", _dispatch_module)
#: the base class of dispatch modes (``object`` if this torch lacks it: instantiating a
#: subclass then raises TorchCompatError, see ``_lifetime.DispatchInterceptor``)
DispatchMode: type = _DISPATCH.TorchDispatchMode if _DISPATCH is not None else object


_CURRENT_DISPATCH_MODE = getattr(_DISPATCH, "_get_current_dispatch_mode", None)


def current_dispatch_mode() -> Any:
    """The innermost dispatch mode on this thread's stack, or None."""
    get = _CURRENT_DISPATCH_MODE
    return get() if get is not None else None


# -- torch function modes (operation selectors, ``ops/``) ---------------------------------------
_MODES = _find(
    "torch._C torch function mode stack",
    lambda: (
        torch._C._len_torch_function_stack,
        torch._C._get_function_stack_at,
        torch._C._push_on_torch_function_stack,
        torch._C._pop_torch_function_stack,
    ),
)


class _Hidden(threading.local):
    """Per thread: the function modes each region of hookscope's own code took off the stack
    (:func:`hide_function_modes`), innermost last, each bottom first."""

    def __init__(self) -> None:
        self.regions: list[list[Any]] = []


_HIDDEN = _Hidden()


def _no_stack_length() -> int:
    need("torch._C torch function mode stack")  # raises TorchCompatError
    return 0


#: How many torch function modes are on this thread's stack (0 almost always: the check that
#: keeps hookscope's hooks cheap, so it is torch's own C function, not a Python call).
function_stack_length: Callable[[], int] = (
    INTERNALS["torch._C torch function mode stack"][0]
    if INTERNALS.get("torch._C torch function mode stack") is not None
    else _no_stack_length
)


def hide_function_modes() -> None:
    """Take every torch function mode off this thread's stack until
    :func:`restore_function_modes`: hookscope's own work (copies, statistics, bookkeeping) is
    then invisible to the user's modes and to other sessions' interceptors. A mode pushed or
    removed meanwhile (a session's interceptor, by its hooks) is pushed or left out as if the
    stack had been there."""
    length, _, _, pop = need("torch._C torch function mode stack")
    taken = [pop() for _ in range(length())]
    taken.reverse()
    _HIDDEN.regions.append(taken)


def restore_function_modes() -> None:
    """Put back the modes the innermost :func:`hide_function_modes` took, under those pushed
    since."""
    length, _, push, pop = need("torch._C torch function mode stack")
    taken = _HIDDEN.regions.pop()
    since = [pop() for _ in range(length())]
    for mode in taken:
        push(mode)
    for mode in reversed(since):
        push(mode)


def call_shown(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``func(*args, **kwargs)`` with the modes the innermost hidden region took back on the
    stack: an operation a handler forwards is the model's, and modes below must see it."""
    regions = _HIDDEN.regions
    if not regions or not regions[-1]:
        return func(*args, **kwargs)
    length, _, push, pop = need("torch._C torch function mode stack")
    base, taken = length(), regions[-1]
    regions[-1] = []  # shown now: a nested pass-through must not push them again
    for mode in taken:
        push(mode)
    try:
        return func(*args, **kwargs)
    finally:
        back = [pop() for _ in range(length() - base)]
        back.reverse()
        regions[-1] = back


def function_mode_on(mode: object) -> bool:
    """Whether ``mode`` is on this thread's torch function mode stack (at any depth), or
    taken off it for a while by :func:`hide_function_modes`."""
    length, at, _, _ = need("torch._C torch function mode stack")
    if any(at(i) is mode for i in range(length())):
        return True
    return any(m is mode for region in _HIDDEN.regions for m in region)


def push_function_mode(mode: object) -> None:
    """Push ``mode`` on this thread's torch function mode stack (``TorchFunctionMode``'s
    ``__enter__`` without the ``with``: hookscope pushes and removes it from module hooks)."""
    need("torch._C torch function mode stack")[2](mode)


def remove_function_mode(mode: object) -> None:
    """Take ``mode`` off the stack wherever it is (``__exit__`` pops the top, whatever it
    is); the modes above it stay, in order. Nothing happens if it is not there. A mode taken
    off for a while by :func:`hide_function_modes` is left out when they are put back."""
    length, at, push, pop = need("torch._C torch function mode stack")
    if not any(at(i) is mode for i in range(length())):
        for region in _HIDDEN.regions:
            region[:] = [m for m in region if m is not mode]
        return
    above = []
    while (top := pop()) is not mode:
        above.append(top)
    for other in reversed(above):
        push(other)


# -- torch.compile ------------------------------------------------------------------------------
def _cache_lister() -> Any:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return _debug_get_cache_entry_list


_LATER["torch._dynamo.eval_frame._debug_get_cache_entry_list"] = _cache_lister


def dynamo_cache_entries(code: types.CodeType) -> list[Any]:
    """The compiled-code cache entries dynamo holds for ``code``."""
    entries: list[Any] = need("torch._dynamo.eval_frame._debug_get_cache_entry_list")(code)
    return entries


def _wrap_inline() -> Any:
    from torch._dynamo import external_utils

    consts = external_utils.wrap_inline.__code__.co_consts
    return [c for c in consts if isinstance(c, types.CodeType)]


_LATER["torch._dynamo.external_utils.wrap_inline"] = _wrap_inline


def wrap_inline_codes() -> list[types.CodeType]:
    """Code objects of the frame through which dynamo compiles a ``torch.nn`` module's call."""
    codes: list[types.CodeType] = need("torch._dynamo.external_utils.wrap_inline")
    return codes


def _stance_api() -> Any:
    from torch._dynamo import eval_frame

    eval_frame.DynamoStance  # noqa: B018 - resolve it now
    return eval_frame


_LATER["torch._dynamo.eval_frame._set_stance"] = _stance_api


def set_stance(stance: Any) -> Any:
    """Set dynamo's stance (``"force_eager"`` or a saved one); returns the one before."""
    eval_frame = need("torch._dynamo.eval_frame._set_stance")
    if isinstance(stance, str):
        stance = eval_frame.DynamoStance(stance)
    return eval_frame._set_stance(stance)
