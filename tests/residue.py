"""Snapshots of everything hookscope promises to leave as found (used by conftest.py).

* every ``nn.Module`` handed to a public hookscope callable, taken *before* the call runs:
  the module tree, each module's training flag, every hook dict, every attribute (by
  identity, or by value for plain values), the full parameter and buffer lists (names,
  identity, requires_grad, parameter hooks, values);
* every tensor handed to one: its hooks, requires_grad and value (except a torch.func
  transform's wrappers, which have no values after it);
* process-global state: torch's global module hooks, ``nn.Module.__getstate__``,
  ``copyreg.dispatch_table``, the torch function mode stack, dynamo's config and compile
  stance.
"""

from __future__ import annotations

import copyreg
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.modules import module as module_globals

HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_hooks_with_kwargs",
    "_global_forward_hooks_always_called",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
    "_global_module_registration_hooks",
    "_global_parameter_registration_hooks",
    "_global_buffer_registration_hooks",
)
_PLAIN = (int, float, bool, str, bytes, type(None))


def _same(a: Any, b: Any) -> bool:
    return a is b or (isinstance(a, _PLAIN) and type(a) is type(b) and a == b)


def _hooks(obj: Any, names: tuple[str, ...]) -> dict[str, tuple[Any, ...]]:
    return {n: tuple((getattr(obj, n, None) or {}).items()) for n in names}


@dataclass
class ModuleState:
    """One model, as hookscope found it."""

    tree: list[tuple[str, int, bool]]
    hooks: list[dict[str, tuple[Any, ...]]]
    attrs: list[dict[str, Any]]
    params: list[tuple[str, int, bool, tuple[Any, ...], Tensor]]
    buffers: list[tuple[str, int, Tensor | None]]

    @staticmethod
    def of(model: nn.Module) -> ModuleState:
        mods = list(model.named_modules(remove_duplicate=False))
        return ModuleState(
            tree=[(n, id(m), m.training) for n, m in mods],
            hooks=[_hooks(m, HOOK_DICTS) for _, m in mods],
            attrs=[dict(vars(m)) for _, m in mods],
            params=[
                (n, id(p), p.requires_grad, tuple((p._backward_hooks or {}).items()), _copy(p))
                for n, p in model.named_parameters(remove_duplicate=False)
            ],
            buffers=[
                (n, id(b), None if b is None else _copy(b))
                for n, b in model.named_buffers(remove_duplicate=False)
            ],
        )

    def diff(self, now: ModuleState, *, values: bool) -> list[str]:
        out: list[str] = []
        if self.tree != now.tree:
            out.append("module tree or training flags changed")
            return out
        for (name, _, _), a, b in zip(self.tree, self.hooks, now.hooks):
            changed = [k for k in HOOK_DICTS if a[k] != b[k]]
            if changed:
                out.append(f"hooks changed on {name!r}: {changed}")
        for (name, _, _), a, b in zip(self.tree, self.attrs, now.attrs):
            if not values:
                break
            moved = sorted(set(a) ^ set(b)) + [k for k in a if k in b and not _same(a[k], b[k])]
            if moved:
                out.append(f"attributes changed on {name!r}: {moved}")
        if [p[:4] for p in self.params] != [p[:4] for p in now.params]:
            out.append("parameter list, identity, requires_grad or parameter hooks changed")
        elif values:
            out += [
                f"parameter {a[0]!r} values changed"
                for a, b in zip(self.params, now.params)
                if not _equal_or_none(a[4], b[4])
            ]
        if [b[:2] for b in self.buffers] != [b[:2] for b in now.buffers]:
            out.append("buffer list or identity changed")
        elif values:
            out += [
                f"buffer {a[0]!r} values changed"
                for a, b in zip(self.buffers, now.buffers)
                if not _equal_or_none(a[2], b[2])
            ]
        return out


def _copy(t: Tensor) -> Tensor:
    if torch.nn.parameter.is_lazy(t):  # no values yet: a lazy marker of its own
        return torch.nn.parameter.UninitializedBuffer()
    return t.detach().clone() if not t.is_meta else t.detach()


def _fake(t: Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor)


def _equal_or_none(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    lazy = torch.nn.parameter.is_lazy
    if lazy(a) or lazy(b):  # a lazy parameter must still be lazy (not initialised)
        return lazy(a) and lazy(b)
    if (a.device, a.dtype, a.shape) != (b.device, b.dtype, b.shape):
        return False  # moved, cast or resized
    if a.is_nested and b.is_nested:  # torch.equal has no nested kernel: compare the values
        a, b = a.values(), b.values()
    if a.is_meta or _fake(a) or torch.equal(a, b):  # meta and fake tensors hold no values
        return True
    if not a.is_floating_point():
        return False
    return bool(torch.isclose(a, b, rtol=0, atol=0, equal_nan=True).all())  # NaN where NaN was


@dataclass
class TensorState:
    hooks: tuple[Any, ...]
    requires_grad: bool
    value: Tensor

    @staticmethod
    def of(t: Tensor) -> TensorState:
        return TensorState(tuple((t._backward_hooks or {}).items()), t.requires_grad, _copy(t))

    def diff(self, now: TensorState, *, values: bool) -> list[str]:
        out = []
        if self.hooks != now.hooks:
            out.append("a tensor's hooks changed")
        if self.requires_grad != now.requires_grad:
            out.append("a tensor's requires_grad changed")
        if values and not _equal_or_none(self.value, now.value):
            out.append("a tensor's values changed")
        return out


def global_state() -> dict[str, Any]:
    import torch._dynamo
    from torch._dynamo import eval_frame

    state: dict[str, Any] = {n: tuple(getattr(module_globals, n).items()) for n in _GLOBAL_HOOKS}
    state["nn.Module.__getstate__"] = nn.Module.__dict__["__getstate__"]
    state["copyreg.dispatch_table"] = {  # the module classes' entries (imports add others)
        cls: fn
        for cls, fn in copyreg.dispatch_table.items()
        if isinstance(cls, type) and issubclass(cls, nn.Module)
    }
    state["torch function modes"] = tuple(torch.overrides._get_current_function_mode_stack())
    state["dynamo config"] = torch._dynamo.config.get_config_copy()
    state["dynamo stance"] = eval_frame._stance
    return state


class Watch:
    """Snapshots taken for one test."""

    def __init__(self) -> None:
        self.modules: dict[int, tuple[nn.Module, ModuleState]] = {}
        self.tensors: dict[int, tuple[Tensor, TensorState]] = {}
        self.globals = global_state()
        # Entry points called from several threads at once: the first snapshot of a model must
        # be taken before any of them runs, not by a second thread that found it unseen too
        # and snapshotted it while the first already had it in another mode.
        self.lock = threading.Lock()

    def see(self, value: Any) -> None:
        """Snapshot ``value`` if it is a module or tensor not seen yet (first sight wins)."""
        if isinstance(value, nn.Module) and id(value) not in self.modules:
            self.modules[id(value)] = (value, ModuleState.of(value))
        elif isinstance(value, Tensor) and id(value) not in self.tensors:
            if torch._C._functorch.is_functorch_wrapped_tensor(value):
                return  # a torch.func transform's wrapper: it has no values outside it
            self.tensors[id(value)] = (value, TensorState.of(value))
        elif isinstance(value, (list, tuple)):
            for v in value:
                self.see(v)
        elif isinstance(value, dict):
            for v in value.values():
                self.see(v)

    def wrap(self, fn: Callable[..., Any], *, method: bool = False) -> Callable[..., Any]:
        """``fn`` with its arguments snapshotted before it runs (``method``: not ``self``)."""

        @functools.wraps(fn)
        def watched(*args: Any, **kwargs: Any) -> Any:
            with self.lock:
                self.see(list(args[1:] if method else args) + list(kwargs.values()))
            return fn(*args, **kwargs)

        return watched

    def problems(self, *, values: bool) -> list[str]:
        out = []
        for model, before in self.modules.values():
            now = ModuleState.of(model)
            out += [f"{type(model).__name__}: {p}" for p in before.diff(now, values=values)]
        for tensor, before in self.tensors.values():
            out += before.diff(TensorState.of(tensor), values=values)
        state = global_state()
        out += [
            f"global state changed: {k}"
            for k in self.globals
            if not _global_equal(self.globals[k], state[k])
        ]
        return out


def _global_equal(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # config values that cannot be compared
        return a is b
