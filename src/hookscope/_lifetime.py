"""Every way hookscope touches a model goes through :class:`HookSet`.

No other module calls ``register_*_hook``. A ``HookSet`` keeps the ``RemovableHandle`` of
each hook it adds and removes them all, newest first, in :meth:`HookSet.close`, which is
idempotent and runs from ``finally`` / ``__exit__`` on every exit path (never ``__del__``).

hookscope registers only:

* forward pre-hooks and forward hooks on the selected modules and on the model's root;
* tensor hooks (``Tensor.register_hook``) on tensors flowing through those modules, and on
  the selected modules' parameters for gradient clipping.

It never uses module backward hooks: the legacy ``register_backward_hook`` reports the last
op's gradients, and ``register_full_backward_hook`` fails when a later in-place op touches the
module's output and skips dict outputs (pytorch/pytorch#61519, #87540). Gradients come from
tensor hooks registered inside the forward hooks instead.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookSet", "live_hooksets", "session_listeners", "training_mode"]

#: Callables run with the model whenever a HookSet is created for it. Empty in normal use;
#: hookscope's test suite adds one to snapshot each model before hookscope first touches it.
session_listeners: list[Callable[[nn.Module], None]] = []

_live: weakref.WeakSet[HookSet] = weakref.WeakSet()


def _notify(model: nn.Module) -> None:
    for listener in session_listeners:
        listener(model)


def live_hooksets() -> list[HookSet]:
    """HookSets that still hold hooks (for leak checks)."""
    return [h for h in _live if len(h)]


class HookSet:
    """The hooks one hookscope session added, removed together on :meth:`close`."""

    def __init__(self, model: nn.Module | None) -> None:
        self._handles: list[RemovableHandle] = []
        if model is not None:
            _notify(model)
        _live.add(self)

    def __len__(self) -> int:
        return len(self._handles)

    def forward_pre(
        self, module: nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False
    ) -> None:
        self._handles.append(module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> None:
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call)
        self._handles.append(handle)

    def tensor(
        self, tensor: Tensor, fn: Callable[[Tensor], Tensor | None], *, always_keep: bool = False
    ) -> None:
        """Hook ``tensor``'s gradient.

        A hook on a non-leaf tensor lives on its graph node and goes away with the graph, so
        only hooks on leaves (parameters, user inputs) are kept for removal, unless
        ``always_keep`` (the caller wants to remove it before backward).
        """
        handle = tensor.register_hook(fn)  # type: ignore[no-untyped-call]
        if always_keep or tensor.grad_fn is None:
            self._handles.append(handle)

    def close(self) -> None:
        """Remove every hook, newest first. Safe to call more than once."""
        while self._handles:
            self._handles.pop().remove()


@contextlib.contextmanager
def training_mode(model: nn.Module, train: bool, root: nn.Module) -> Iterator[None]:
    """Set every module's ``training`` flag to ``train``; restore each one's own flag after.

    ``root`` is the unwrapped model the session's hooks go on (``model`` itself when there
    is no DataParallel / compile wrapper).
    """
    _notify(model)
    _notify(root)
    flags = [(m, m.training) for m in model.modules()]
    try:
        model.train(train)
        yield
    finally:
        for module, flag in flags:
            module.training = flag
