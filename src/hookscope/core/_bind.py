"""Name a module call's arguments after its ``forward`` signature, and rebuild the call.

``forward(self, x, mask=None)`` called as ``m(t, mask=k)`` binds to ``{"x": t, "mask": k}``.
Arguments caught by ``*args`` are named by their position (``arg1``, ``arg2``, ...) and those
caught by ``**kwargs`` by their keyword, so ``forward(self, *args, **kwargs)`` called as
``m(t, mask=k)`` binds to ``{"arg0": t, "mask": k}``, not to a tuple and a dict.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from torch import nn

from ._types import Inputs

__all__ = ["Binder"]

_VAR_POS, _VAR_KW = inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD


class Binder:
    """Binds calls of one module (or of a function: operations, see ``_ops``); the signature
    is inspected once."""

    __slots__ = ("_fast", "_kinds", "_sig")

    def __init__(self, module: nn.Module | Callable[..., Any]) -> None:
        target = module.forward if isinstance(module, nn.Module) else module
        try:
            self._sig: inspect.Signature | None = inspect.signature(target)
        except (TypeError, ValueError):
            self._sig = None
        params = list(self._sig.parameters.values()) if self._sig is not None else []
        self._kinds = {p.name: p.kind for p in params}
        # Positional parameters before any *args / keyword-only one: a call with only
        # positional arguments binds by zip, without Signature.bind (the hot path).
        fast: list[str] = []
        for p in params:
            if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
                break
            fast.append(p.name)
        self._fast = tuple(fast)

    def parameters(self) -> frozenset[str] | None:
        """The names ``forward`` takes by keyword (not ``*args`` / ``**kwargs``), or None if
        its signature cannot be read."""
        if self._sig is None:
            return None
        keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return frozenset(n for n, k in self._kinds.items() if k in keyword)

    def may_take(self, names: set[str]) -> bool:
        """Whether a call may pass one of ``names``: ``forward`` names one, takes
        ``**kwargs``, or its signature cannot be read."""
        var = inspect.Parameter.VAR_KEYWORD
        return self._sig is None or var in self._kinds.values() or bool(names & self._kinds.keys())

    def bind(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Inputs:
        """``{parameter name: value}`` for one call (``arg{i}`` where no name exists)."""
        if not kwargs and len(args) <= len(self._fast):
            return dict(zip(self._fast, args, strict=False))  # args may be fewer
        arguments = self._arguments(args, kwargs)
        if arguments is None:
            return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
        out: Inputs = {}
        for name, value in arguments.items():
            kind = self._kinds[name]
            if kind is _VAR_POS:
                start = len(self._fast)
                out.update({f"arg{start + i}": v for i, v in enumerate(value)})
            elif kind is _VAR_KW:
                out.update(value)
            else:
                out[name] = value
        return out

    def unbind(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], new: Inputs
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """``(args, kwargs)`` for the same call with the named arguments replaced by ``new``."""
        if not kwargs and len(args) <= len(self._fast):
            return tuple(new.get(n, a) for n, a in zip(self._fast, args, strict=False)), {}
        bound = self._bound(args, kwargs)
        if bound is None:
            new_args = tuple(new.get(f"arg{i}", a) for i, a in enumerate(args))
            return new_args, {k: new.get(k, v) for k, v in kwargs.items()}
        for name, value in list(bound.arguments.items()):
            kind = self._kinds[name]
            if kind is _VAR_POS:
                start = len(self._fast)
                bound.arguments[name] = tuple(
                    new.get(f"arg{start + i}", v) for i, v in enumerate(value)
                )
            elif kind is _VAR_KW:
                bound.arguments[name] = {k: new.get(k, v) for k, v in value.items()}
            else:
                bound.arguments[name] = new.get(name, value)
        return bound.args, bound.kwargs

    def _bound(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._sig is None:
            return None
        try:
            return self._sig.bind(*args, **kwargs)
        except TypeError:
            return None

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        bound = self._bound(args, kwargs)
        return None if bound is None else dict(bound.arguments)
