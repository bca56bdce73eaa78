"""Make hooks take effect on ``torch.compile``d models, or say why they cannot.

Hooks registered before a compiled model first runs are traced into its graph. Hooks added
after that are silently ignored: dynamo does not guard on module hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``; pytorch/pytorch#117758). hookscope
detects a compiled model that already ran by the dynamo cache entries on its ``forward``
code and then either raises :class:`CompiledModelError` (default) or, with
``recompile=True``, makes compiled code run eagerly while the session is open
(``torch.compiler.set_stance("force_eager")``, process-wide and reference-counted), so the
hooks see every call. No compiled code is dropped: after the last such session closes, the
model (and every other compiled model) runs its cached compiled code again.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from torch import nn

from ..errors import CompiledModelError, UnsupportedModelError
from . import _torch
from ._lifetime import EAGER

__all__ = ["compile_guard", "is_compiled", "refuse_inside_traces", "run_eagerly", "transforms_now"]


def is_compiled(model: nn.Module) -> bool:
    return any(
        type(m).__name__ == "OptimizedModule" or m.__dict__.get("_compiled_call_impl") is not None
        for m in model.modules()
    )


def _candidate_codes(model: nn.Module) -> list[types.CodeType]:
    """Code objects dynamo may have compiled for this model's forward."""
    codes = {
        fwd.__code__
        for m in model.modules()
        if isinstance(fwd := getattr(type(m), "forward", None), types.FunctionType)
    }
    codes.update(_torch.wrap_inline_codes())  # torch.nn.* roots compile through this frame
    return list(codes)


def _compiled_codes(model: nn.Module) -> list[types.CodeType]:
    return [c for c in _candidate_codes(model) if _torch.dynamo_cache_entries(c)]


@contextlib.contextmanager
def run_eagerly(model: nn.Module) -> Iterator[None]:
    """Context in which a compiled model runs its Python code, compiling and reading nothing.

    For tools that must see every operator (a dispatch mode under a compiled graph would see
    one opaque call, and compiling under it would cache code traced with the tool's hooks).
    The entry points that run the model themselves run it in this context: it refuses to
    start inside a torch.func transform or a torch.export trace (:func:`refuse_inside_traces`).
    """
    refuse_inside_traces()
    if not is_compiled(model):
        yield
        return
    EAGER.acquire()
    try:
        yield
    finally:
        EAGER.release()


@contextlib.contextmanager
def compile_guard(model: nn.Module, *, recompile: bool, python: bool = False) -> Iterator[None]:
    """Context in which hooks added to ``model`` take effect even if it is compiled;
    ``python``: in which its Python code runs (operation selectors see what that code calls,
    which a compiled graph hides), compiled or not yet."""
    if not is_compiled(model):
        yield
        return
    if python and not recompile:
        raise CompiledModelError(
            f"{type(model).__name__} is compiled with torch.compile, and operation selectors "
            "('layer::op') see the calls its Python code makes, which compiled graphs replace. "
            "Fix: pass recompile=True (hookscope then runs compiled code eagerly while it is "
            "open), or hook the model it compiled (model._orig_mod)."
        )
    if not python and not _compiled_codes(model):
        yield
        return
    if not recompile:
        raise CompiledModelError(
            f"{type(model).__name__} is compiled with torch.compile and its compiled code has "
            "already run (for this model, or for another instance of the same class: dynamo "
            "shares compiled code between instances), so hooks added now would be silently "
            "ignored (pytorch/pytorch#117758). Fix: pass recompile=True (hookscope then runs "
            "compiled code eagerly while it is open), or add hooks before the first compiled "
            "call, or call torch.compiler.reset()."
        )
    EAGER.acquire()
    try:
        yield
    finally:
        EAGER.release()


def transforms_now() -> tuple[list[str], str]:
    """The torch.func transforms the code running now is inside, outermost first, and how a
    message says where that is (``"torch.func.grad inside torch.func.vmap"``)."""
    kinds = list(dict.fromkeys(_torch.functorch_transforms())) or ["vmap"]
    return kinds, " inside ".join(f"torch.func.{k}" for k in reversed(kinds))


def refuse_inside_traces() -> None:
    """Refuse an entry point that runs the model itself (``summary``, ``features``,
    ``extract``, the attribution methods, ``report``) called inside a torch.func transform or
    a torch.export trace: its forwards would be the transform's or the trace's, on tensors
    that mean nothing outside them."""
    if _torch.functorch_level() is not None:
        _, where = transforms_now()
        raise UnsupportedModelError(
            f"a hookscope function that runs the model itself was called inside {where} (a "
            "torch.func transform), where tensors are the transform's wrappers: its results "
            "would hold them. Fix: call it outside the transform, on the whole batch."
        )
    if _torch.export_traced():
        raise UnsupportedModelError(
            "a hookscope function that runs the model itself was called inside code that "
            "torch.export is tracing (on fake tensors, with no values). Fix: call it outside "
            "the exported code (hookscope is never part of an exported program)."
        )
