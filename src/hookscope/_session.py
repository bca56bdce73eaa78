"""The lifecycle shared by every hookscope context manager (capture, edit).

A :class:`Session` resolves its layers when built (so a bad selector fails before any
forward), installs its hooks in :meth:`open` behind the torch.compile check, tracks the
model's top-level forward passes, and removes everything in :meth:`close`.
"""

from __future__ import annotations

import contextlib
from types import TracebackType
from typing import Any

from torch import nn

from ._compile import compile_guard
from ._lifetime import HookSet
from ._naming import Layers

__all__ = ["Session"]


class Session:
    """Base of :class:`~hookscope.Capture` and :class:`~hookscope.Editor`."""

    def __init__(self, model: nn.Module, *, recompile: bool) -> None:
        self.model = model
        self._layers = Layers(model)
        self._recompile = recompile
        self._hooks: HookSet | None = None
        self._exit = contextlib.ExitStack()
        self._depth = 0  # nesting of root calls: a recursive root is still one pass

    def _install(self, hooks: HookSet) -> None:
        """Register the session's hooks on its layers."""
        raise NotImplementedError

    def _new_pass(self) -> None:
        """Called when a top-level forward of the model starts."""

    def open(self) -> Any:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        if self._hooks is not None:
            return self
        with contextlib.ExitStack() as stack:
            stack.enter_context(compile_guard(self.model, recompile=self._recompile))
            self._hooks = hooks = HookSet(self._layers.root)
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

    def __enter__(self) -> Any:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        self.close()
        return None

    def _on_root_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        self._depth += 1
        if self._depth == 1:
            self._new_pass()

    def _on_root_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._depth = max(0, self._depth - 1)
