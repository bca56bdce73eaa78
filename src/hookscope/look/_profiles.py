"""Operator profiles of leaf module calls: FLOPs counted once per kind of call.

A leaf module (no submodules) that runs twice with the same configuration on inputs of the
same shapes runs the same operators, so the second call need not be watched operator by
operator: the summary mutes its dispatch-level counter for that call and charges the
profile learned from the first (``formulas cached by shape``). Three layers of a transformer
then cost one layer's Python calls per operator, and a CNN's repeated blocks none.

What makes two calls *the same kind* (the key): the module's class, training flag and every
plain attribute (numbers, strings, flags; other objects by identity), its parameters' and
buffers' shapes, dtypes and devices, the grad mode, and each input's shape, dtype, device,
contiguity and ``requires_grad`` (other inputs by value). A call is never profiled when that
cannot capture what its code does:

* the module has hooks of its own (they run inside the call), a ``forward`` set on the
  instance, a parametrization (``.weight`` computed by a module), or lazy parameters;
* an input is a tensor subclass or a nested tensor, or an unhashable non-tensor;
* outside ``torch.nn`` (user code may read its inputs' values without an operator, e.g.
  ``.tolist()``): an integer or boolean tensor input (lengths, offsets, masks steer code);
* the learning call read tensor values (``.item()``, ``bool()``) or made data-dependent
  shapes (``nonzero``): the key is then marked and every such call is counted operator by
  operator.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import _torch
from ._flops import Tally

__all__ = ["Profile", "Profiles"]

_INTERNALS = frozenset(
    {
        "training",
        "_parameters",
        "_buffers",
        "_non_persistent_buffers_set",
        "_modules",
        "_backward_pre_hooks",
        "_backward_hooks",
        "_is_full_backward_hook",
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
        "_state_dict_hooks",
        "_state_dict_pre_hooks",
        "_load_state_dict_pre_hooks",
        "_load_state_dict_post_hooks",
        "_compiled_call_impl",
    }
)
_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
_PLAIN = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
    enum.Enum,
)
_PLAIN_TENSORS = (Tensor, nn.Parameter)


class _Uncacheable(Exception):
    """A value that a key cannot capture."""


class Profile:
    """The operators of one kind of leaf call: FLOPs and uncounted operators."""

    __slots__ = ("flops", "uncounted")

    def __init__(self, tally: Tally) -> None:
        self.flops = tally.flops
        self.uncounted = tuple(tally.uncounted.items())


def _tensor_key(t: Tensor) -> Hashable:
    if torch.nn.parameter.is_lazy(t) or t.is_nested:
        raise _Uncacheable
    return (type(t), t.shape, t.dtype, t.device, t.layout, t.requires_grad)


_SIMPLE = frozenset({type(None), bool, int, float, str})


def _value_key(v: Any, depth: int = 0) -> Hashable:
    """A module attribute: plain values by value, tensors by metadata, the rest by identity
    (alive for the whole summary, so identities cannot be reused meanwhile)."""
    kind = type(v)
    # the common case, fast: sizes, strides, flags (1 and True alike)
    if kind in _SIMPLE or (kind is tuple and all(type(x) in _SIMPLE for x in v)):
        return v  # type: ignore[no-any-return]
    if isinstance(v, _PLAIN):
        return (kind, v)
    if isinstance(v, Tensor):
        return _tensor_key(v)
    if isinstance(v, (tuple, list, frozenset)) and depth < 2:
        return (kind, tuple(_value_key(x, depth + 1) for x in v))
    return ("id", id(v))


def _input_key(v: Any, trusted: bool, depth: int = 0) -> Hashable:
    """A call argument: tensors by metadata, plain values by value."""
    if isinstance(v, Tensor):
        if type(v) not in _PLAIN_TENSORS or v.is_nested:
            raise _Uncacheable
        if not trusted and not v.is_floating_point():
            raise _Uncacheable
        return (v.shape, v.dtype, v.device, v.requires_grad, v.is_contiguous())
    if isinstance(v, _PLAIN):
        return (type(v), v)
    if isinstance(v, (tuple, list)) and depth < 2:
        return (type(v), tuple(_input_key(x, trusted, depth + 1) for x in v))
    raise _Uncacheable


class Profiles:
    """Profiles learned during one summary, by key (see the module docstring)."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        # hooks the model had before the summary's own: they run inside the call
        self._hooked = {id(m) for m in modules.values() if any(getattr(m, h) for h in _HOOKS)}
        self._static: dict[int, tuple[int, bool] | None] = {}  # id(module) -> (id, trusted)
        self._interned: dict[Hashable, int] = {}
        self._known: dict[Hashable, Profile | None] = {}
        self._worth: dict[type, bool] = {}

    def worth(self, cls: type) -> bool | None:
        """Whether calls of this class are profiled; None until one call was watched."""
        return self._worth.get(cls)

    def judge(self, cls: type, tally: Tally) -> None:
        """Decide from one watched call: muting and unmuting the counter costs about what
        one operator's Python call does, so a class running one operator is not profiled."""
        self._worth[cls] = tally.ops > 1

    def key(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The call's key, or None if this call cannot be profiled."""
        if id(module) not in self._static:
            self._static[id(module)] = self._module_key(module)
        static = self._static[id(module)]
        if static is None:
            return None
        number, trusted = static
        try:
            inputs = tuple(_input_key(a, trusted) for a in args)
            named = tuple((k, _input_key(v, trusted)) for k, v in kwargs.items())
        except _Uncacheable:
            return None
        return (number, torch.is_grad_enabled(), inputs, named)

    def get(self, key: Hashable) -> Profile | bool | None:
        """The profile; None if calls of this key must be counted operator by operator;
        False if not learned yet."""
        return self._known.get(key, False)

    def learn(self, key: Hashable, tally: Tally) -> None:
        self._known[key] = None if tally.data_dependent else Profile(tally)

    def _module_key(self, module: nn.Module) -> tuple[int, bool] | None:
        if id(module) in self._hooked or "forward" in module.__dict__:
            return None  # (a parametrized module has submodules: it is never a leaf here)
        try:
            attrs = tuple(
                (k, _value_key(v)) for k, v in vars(module).items() if k not in _INTERNALS
            )
            params = tuple(
                (n, p if p is None else _tensor_key(p))
                for n, p in _torch.parameters_of(module).items()
            )
            buffers = tuple(
                (n, b if b is None else _tensor_key(b))
                for n, b in _torch.buffers_of(module).items()
            )
        except (_Uncacheable, ValueError, RuntimeError):  # uninitialised parameters raise
            return None
        whole = (type(module), module.training, attrs, params, buffers)
        number = self._interned.setdefault(whole, len(self._interned))
        return number, type(module).__module__.startswith("torch.nn.")
