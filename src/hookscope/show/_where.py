"""Where a forward failed. When a command fails, the command line runs the model's forward once
more under :class:`Where` (:func:`locate`), so that the one line it prints names the innermost
module call that raised and what it was called with (no ``-v`` needed). Running it again only
after a failure keeps hooks off the model, and their cost off every forward that works.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..core import (
    Binder,
    HookSet,
    ModuleCall,
    Session,
    call_model,
    describe,
    leaves,
    run_eagerly,
    training_mode,
)

__all__ = ["Failure", "Where", "hint", "locate"]


@dataclass(frozen=True)
class Failure:
    """The innermost module call that raised: its name (``""``: the model's own forward),
    type, and arguments as ``name=Tensor[2, 64] float32``."""

    name: str
    type: str
    inputs: str
    embedding_of_floats: bool

    def __str__(self) -> str:
        where = repr(self.name) if self.name else "the model's own forward"
        return f"in {where} ({self.type}) called with {self.inputs or 'no arguments'}"


class Where(Session):
    """Follows every module call of ``model`` and keeps the first call of a forward that ended
    with an exception (the innermost: calls end from the inside out) as :attr:`failed`.

    Example:
        >>> import torch, torch.nn as nn
        >>> net = nn.Sequential(nn.Linear(4, 3), nn.Linear(5, 2))
        >>> with Where(net) as where:
        ...     try:
        ...         _ = net(torch.ones(2, 4))
        ...     except RuntimeError:
        ...         pass
        >>> str(where.failed)
        "in '1' (Linear) called with input=Tensor[2, 3] float32"
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, recompile=True, this_thread=True)  # the command line runs it
        self.failed: Failure | None = None
        self._running: dict[int, tuple[tuple[Any, ...], dict[str, Any]]] = {}

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, self.every_module())

    def _new_pass(self) -> None:
        self.failed = None
        self._running.clear()

    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        self._running[id(call)] = (args, kwargs)  # references only: described if it fails
        return None

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        self._running.pop(id(call), None)
        return None

    def _raised(self, call: ModuleCall) -> None:
        args, kwargs = self._running.pop(id(call), ((), {}))
        if self.failed is not None:
            return
        named = _bind(call.module, args, kwargs)
        floats = [t for _, t in leaves((args, kwargs)) if t.is_floating_point()]
        self.failed = Failure(
            name=call.name,
            type=type(call.module).__name__,
            inputs=", ".join(f"{k}={describe(v)}" for k, v in named),
            embedding_of_floats=isinstance(call.module, (nn.Embedding, nn.EmbeddingBag))
            and bool(floats),
        )


def _bind(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """``(name, value)`` of the tensor-holding arguments, named as ``forward`` names them."""
    bound = Binder(module).bind(args, kwargs)
    return [(k, v) for k, v in bound.items() if any(True for _ in leaves(v))]


def hint(failure: Failure | None) -> str:
    """What to try, for failures with a known cause."""
    if failure is not None and failure.embedding_of_floats:
        return "token ids must be integers: pass --dtype long"
    return ""


def locate(
    model: nn.Module, inputs: Any, error: BaseException, *, train: bool = False
) -> Failure | None:
    """Run ``model`` on ``inputs`` again (no gradients, eval mode unless ``train``: the mode
    it failed in) under :class:`Where`; the failing call if the forward raises ``error`` again
    (same type and message), else None (the failure was elsewhere: in a backward, or in
    hookscope's own code)."""
    where = Where(model)
    try:
        with where, torch.no_grad(), training_mode(model, train), run_eagerly(model):
            call_model(model, inputs)
    except Exception as again:
        if type(again) is type(error) and str(again) == str(error):
            return where.failed
    return None
