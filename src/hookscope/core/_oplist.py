"""``hookscope.names``: the selectable layers, and with ``ops=True`` the operations one forward
makes inside each of them (``ops/``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from . import _naming, _tree
from ._calls import ModuleCall, private_forward
from ._features import call_model
from ._lifetime import HookSet
from ._naming import Layers, is_called
from ._session import Session
from ._types import LayerSelector
from .ops._select import SDPA, WEIGHTS, op_qualname

__all__ = ["names"]

_WEIGHTS_NOTE = "attention probabilities of that call, computed by hookscope"


class _Lister(Session):
    """One private forward that notes every operation each module's own code runs."""

    def __init__(self, model: nn.Module, modules: dict[str, nn.Module]) -> None:
        # the forward is ours: compiled code runs eagerly, and only this thread's is seen
        super().__init__(model, recompile=True, this_thread=True)
        #: per module: {(operation, k): how it was called}, in the order they first ran
        self.found: dict[str, dict[tuple[str, int], str]] = {}
        #: per module and operation: most calls in one call of the module; whether any
        #: returned a tensor
        self.most: dict[tuple[str, str], list[Any]] = {}
        self._listen_ops(modules, self._listen)

    def _install(self, hooks: HookSet) -> None:
        return None  # the modules' calls are followed for the listener (_listen_ops)

    def _listen(self, call: ModuleCall, name: str, k: int, func: Any, run: Any) -> Any:
        out = run()
        self.found.setdefault(call.name, {}).setdefault((name, k), op_qualname(func))
        most = self.most.setdefault((call.name, name), [0, False])
        most[0] = max(most[0], k)
        most[1] = most[1] or any(True for _ in _tree.leaves(out))
        return out

    def entries(self, name: str) -> dict[str, str]:
        """``{selector: how it was called}`` of ``name``'s operations that returned tensors."""
        out: dict[str, str] = {}
        for (op, k), how in self.found.get(name, {}).items():
            most, tensor = self.most[name, op]
            if tensor:
                numbered = f"{op}#{k}" if most > 1 else op
                out[f"{name}::{numbered}"] = how
                if op == SDPA:
                    out[f"{name}::{numbered.replace(SDPA, WEIGHTS)}"] = _WEIGHTS_NOTE
        return out


def names(
    model: nn.Module,
    layers: LayerSelector | None = None,
    *,
    ops: bool = False,
    inputs: Any = None,
) -> dict[str, str]:
    """The selectable layers of ``model``: dotted name -> module type name; with ``ops=True``
    also the operations one forward runs inside each (``"layer::op"``: how it was called).

    Names are those of ``named_modules()`` on the unwrapped model, so they are the same for
    ``model``, ``nn.DataParallel(model)`` and ``torch.compile(model)``. Containers that are
    never called (``nn.ModuleList``, ``nn.ModuleDict``) are listed, since their names prefix
    their children's, but cannot be captured themselves: their type name says so,
    ``"ModuleList (container)"``.

    With ``ops=True`` the model runs once on ``inputs`` (under ``torch.no_grad()``, in its
    current training mode, invisible to other open sessions) and each layer is followed by
    the operations its own code ran, in the order they first ran: ``layer::op`` where a call
    of the layer ran ``op`` once, ``layer::op#1``, ``layer::op#2``... where it ran it several
    times, and ``layer::attention_weights`` after each SDPA call. Operations of the model's
    own ``forward`` come first (``::op``). Calls that returned no tensor (``size()``) are
    left out. These are exactly the selectors ``capture`` and ``edit`` accept.

    Args:
        model: any ``nn.Module``, wrapped or not.
        layers: optionally, a selector to preview what it matches (with ``ops=True``: only
            those layers' operations).
        ops: also list the operations inside each layer's call.
        inputs: with ``ops=True``, the forward's inputs: a tensor, a tuple of positional
            arguments or a mapping of keyword arguments.

    Returns:
        An ordered dict of name to type name (``" (container)"`` added for containers), in
        ``named_modules()`` order.

    Raises:
        LayerNotFoundError: ``layers`` matches nothing.
        UsageError: ``ops=True`` without ``inputs``, or ``inputs`` without ``ops=True``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> hs.names(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
        {'0': 'Linear', '1': 'ReLU'}
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> hs.names(net, ops=True, inputs=torch.ones(1, 2))  # doctest: +NORMALIZE_WHITESPACE
        {'0': 'Linear', '0::linear': 'torch.nn.functional.linear',
         '1': 'ReLU', '1::relu': 'torch.nn.functional.relu'}
    """
    if not ops:
        if inputs is not None:
            raise UsageError("inputs= is used only with ops=True (to run the forward once)")
        return _naming.names(model, layers)
    if inputs is None:
        raise UsageError(
            "names(model, ops=True) runs one forward to see which operations each layer "
            "runs: pass its inputs, e.g. names(model, ops=True, inputs=x)"
        )
    listed = _naming.names(model, layers)
    known = Layers(model)
    modules = {"": known.root} if layers is None else {}
    for name in listed:
        if is_called(known.modules[name]) and not known.in_script(name):
            modules[name] = known.modules[name]
    lister = _Lister(model, modules)
    with torch.no_grad(), private_forward(lister), lister:
        call_model(model, inputs)
    out = lister.entries("")
    for name, kind in listed.items():
        out[name] = kind
        out.update(lister.entries(name))
    return out
