"""The lifecycle shared by every hookscope context manager (capture, edit).

A :class:`Session` resolves its layers when built (so a bad selector fails before any
forward), installs its hooks in :meth:`open` behind the torch.compile check, tracks the
model's top-level forward passes, and removes everything in :meth:`close`.

Passes. A forward pre-hook on the model's root starts a pass; a forward hook (always called)
ends it, so a recursive root call stays one pass. A forward ended by a ``BaseException``
(hookscope's own early stop from another session, ``KeyboardInterrupt``) skips that end hook,
so a root call that finds a pass still open checks the Python stack: if no call of the root
is actually running, the old pass is over and a new one starts.

Nesting. ``with`` on a session that is already open nests: the hooks stay until the
outermost block exits. :meth:`close` closes at once.
"""

from __future__ import annotations

import contextlib
import sys
from types import TracebackType
from typing import Any

from torch import nn

from ..errors import UnsupportedModelError
from ._autograd import backward_id
from ._compile import compile_guard, is_compiled
from ._lifetime import HookSet
from ._naming import Layers

__all__ = ["Session", "replica_error"]

_CALL_CODES = (nn.Module._call_impl.__code__, nn.Module._wrapped_call_impl.__code__)


class Session:
    """Base of :class:`~hookscope.Capture` and :class:`~hookscope.Editor`."""

    def __init__(self, model: nn.Module, *, recompile: bool) -> None:
        self.model = model
        self._layers = Layers(model)
        self._recompile = recompile
        self._hooks: HookSet | None = None
        self._exit = contextlib.ExitStack()
        self._entered = 0  # nesting of `with` blocks
        self._depth = 0  # nesting of root calls: a recursive root is still one pass

    # -- subclass API ---------------------------------------------------------------------------
    def _install(self, hooks: HookSet) -> None:
        """Register the session's hooks on its layers."""
        raise NotImplementedError

    def _new_pass(self) -> None:
        """Called when a top-level forward of the model starts."""

    def _closed(self) -> None:
        """Called once the hooks are gone."""

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> Any:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        if self._hooks is not None:
            return self
        _check_replicas(self.model)
        compiled = is_compiled(self.model)
        with contextlib.ExitStack() as stack:
            if compiled:
                stack.enter_context(compile_guard(self.model, recompile=self._recompile))
            self._hooks = hooks = HookSet(eager=compiled)
            stack.callback(hooks.close)
            hooks.forward_pre(self._layers.root, self._on_root_start)
            hooks.forward(self._layers.root, self._on_root_end, always_call=True)
            self._install(hooks)
            self._exit = stack.pop_all()
        return self

    def close(self) -> None:
        """Remove every hook this session added. Idempotent; results stay readable."""
        try:
            self._exit.close()
        finally:
            self._hooks = None
            self._depth = 0
            self._entered = 0
            self._closed()

    def __enter__(self) -> Any:
        opened = self.open()
        self._entered += 1
        return opened

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self._entered -= 1
        if self._entered <= 0:
            self.close()
        return None

    # -- passes ------------------------------------------------------------------------------------
    def _on_root_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if backward_id() != -1:  # activation checkpointing replays part of a pass in backward
            return
        if module is not self._layers.root:
            raise replica_error(module)
        if self._depth and not _running(module, skip=1):
            self._depth = 0  # that forward was ended by a BaseException: a new pass
        self._depth += 1
        if self._depth == 1:
            self._new_pass()

    def _on_root_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if backward_id() == -1:
            self._depth = max(0, self._depth - 1)


def _running(module: nn.Module, skip: int) -> bool:
    """Whether a call of ``module`` is on the Python stack (beyond the innermost ``skip``)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _CALL_CODES and frame.f_locals.get("self") is module:
            if skip == 0:
                return True
            skip -= 1
            # _wrapped_call_impl calls _call_impl: both frames belong to the same call
            if frame.f_back is not None and frame.f_back.f_code in _CALL_CODES:
                frame = frame.f_back
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _check_replicas(model: nn.Module) -> None:
    module: nn.Module | None = model
    while module is not None:
        if isinstance(module, nn.DataParallel) and len(module.device_ids or []) > 1:
            raise UnsupportedModelError(
                f"nn.DataParallel over {len(module.device_ids)} devices runs a copy of the "
                "model per device, in threads; hookscope cannot attribute their calls "
                "reliably. Hook the model on one device (model.module, or DataParallel with "
                "device_ids=[0]), or use DistributedDataParallel (one process per GPU)."
            )
        inner = getattr(module, "module", None) or getattr(module, "_orig_mod", None)
        module = inner if isinstance(inner, nn.Module) else None


def replica_error(module: nn.Module) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"a hook of hookscope ran on a copy of the hooked {type(module).__name__} (a "
        "DataParallel replica, or a copy made while the hooks existed); hookscope records "
        "only the modules it hooked. Hook the model on one device."
    )
