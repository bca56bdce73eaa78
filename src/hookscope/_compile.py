"""Make hooks take effect on ``torch.compile``d models, or say why they cannot.

Hooks registered before a compiled model first runs are traced into its graph. Hooks added
after that are silently ignored: dynamo does not guard on module hooks by default
(``torch._dynamo.config.skip_nnmodule_hook_guards``; pytorch/pytorch#117758). hookscope
detects a compiled model that already ran by the dynamo cache entries on its ``forward``
code and then either raises :class:`CompiledModelError` (default) or, with
``recompile=True``, drops those cache entries and turns hook guards on for the session, so
the next call recompiles with the hooks (and once more after they are removed).
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator

from torch import nn

from .errors import CompiledModelError

__all__ = ["compile_guard"]


def _is_compiled(model: nn.Module) -> bool:
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


@contextlib.contextmanager
def compile_guard(model: nn.Module, *, recompile: bool) -> Iterator[None]:
    """Context in which hooks added to ``model`` take effect even if it is compiled."""
    if not _is_compiled(model):
        yield
        return
    import torch._dynamo

    ran = _compiled_codes(model)
    if ran and not recompile:
        raise CompiledModelError(
            f"{type(model).__name__} is compiled with torch.compile and its compiled code has "
            "already run (for this model, or for another instance of the same class: dynamo "
            "shares compiled code between instances), so hooks added now would be silently "
            "ignored (pytorch/pytorch#117758). Fix: pass "
            "recompile=True (hookscope then recompiles it with the hooks, and again after), "
            "or add hooks before the first compiled call, or call torch._dynamo.reset()."
        )
    with torch._dynamo.config.patch(skip_nnmodule_hook_guards=False):
        for code in ran:
            torch._dynamo.reset_code(code)  # type: ignore[attr-defined]
        yield
