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

On torch releases without ``set_stance`` (before 2.6), ``recompile=True`` drops the cache
entries of the model's forward code and turns dynamo's hook guards on while open, so the
next call recompiles with the hooks.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..errors import CompiledModelError
from ._lifetime import Shared

__all__ = ["compile_guard", "is_compiled", "run_eagerly"]


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
    try:  # torch.nn.* roots are compiled through an extra frame, wrap_inline's `inner`
        from torch._dynamo import external_utils

        codes.update(
            c
            for c in external_utils.wrap_inline.__code__.co_consts
            if isinstance(c, types.CodeType)
        )
    except (ImportError, AttributeError):  # pragma: no cover - older torch
        pass
    return list(codes)


def _compiled_codes(model: nn.Module) -> list[types.CodeType]:
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    return [c for c in _candidate_codes(model) if _debug_get_cache_entry_list(c)]


def _force_eager() -> Any:
    from torch._dynamo import eval_frame

    return eval_frame._set_stance(eval_frame.DynamoStance("force_eager"))  # the prior stance


def _restore_stance(prior: Any) -> None:
    from torch._dynamo import eval_frame

    eval_frame._set_stance(prior)


def _hook_guards_on() -> Any:
    import torch._dynamo

    saved = torch._dynamo.config.skip_nnmodule_hook_guards
    torch._dynamo.config.skip_nnmodule_hook_guards = False
    return saved


def _hook_guards_restore(saved: Any) -> None:
    torch._dynamo.config.skip_nnmodule_hook_guards = saved


_HAS_STANCE = hasattr(torch.compiler, "set_stance")
#: Compiled code runs eagerly while a recompile=True session is open (see the docstring).
EAGER = Shared(_force_eager, _restore_stance)
_GUARDS = Shared(_hook_guards_on, _hook_guards_restore)  # torch < 2.6 only


@contextlib.contextmanager
def run_eagerly(model: nn.Module) -> Iterator[None]:
    """Context in which a compiled model runs its Python code, compiling and reading nothing.

    For tools that must see every operator (a dispatch mode under a compiled graph would see
    one opaque call, and compiling under it would cache code traced with the tool's hooks).
    """
    if not is_compiled(model):
        yield
    elif _HAS_STANCE:
        EAGER.acquire()
        try:
            yield
        finally:
            EAGER.release()
    else:  # pragma: no cover - torch < 2.6
        with compile_guard(model, recompile=True):
            yield


@contextlib.contextmanager
def compile_guard(model: nn.Module, *, recompile: bool) -> Iterator[None]:
    """Context in which hooks added to ``model`` take effect even if it is compiled."""
    if not is_compiled(model):
        yield
        return
    ran = _compiled_codes(model)
    if not ran:
        yield
        return
    if not recompile:
        raise CompiledModelError(
            f"{type(model).__name__} is compiled with torch.compile and its compiled code has "
            "already run (for this model, or for another instance of the same class: dynamo "
            "shares compiled code between instances), so hooks added now would be silently "
            "ignored (pytorch/pytorch#117758). Fix: pass recompile=True (hookscope then runs "
            "compiled code eagerly while it is open), or add hooks before the first compiled "
            "call, or call torch._dynamo.reset()."
        )
    shared = EAGER if _HAS_STANCE else _GUARDS
    shared.acquire()
    try:
        if shared is _GUARDS:  # pragma: no cover - torch < 2.6
            for code in ran:
                torch._dynamo.reset_code(code)  # type: ignore[attr-defined]
        yield
    finally:
        shared.release()
