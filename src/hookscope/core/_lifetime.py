"""Every way hookscope touches a model, or the process, goes through this module.

Hooks. No other module calls ``register_*_hook``. A :class:`HookSet` keeps the
``RemovableHandle`` of every hook it adds and removes them all, newest first, in
:meth:`HookSet.close`, which is idempotent and runs from ``finally`` / ``__exit__`` on every
exit path (never ``__del__``). hookscope registers only:

* forward pre-hooks and forward hooks on the selected modules and on the model's root;
* tensor hooks (``Tensor.register_hook``) on tensors crossing those modules' boundaries, and
  on the selected modules' parameters for gradient clipping;
* post-hooks on autograd nodes created inside a selected module's call (the nodes that send
  gradient to its inputs, see ``_autograd``);
* optimizer step hooks (``Monitor`` follows optimizer steps), through :meth:`HookSet.handle`.

Operation selectors (``"layer::op"``, ``_ops``) also push a ``TorchFunctionMode`` on the
thread's torch function mode stack while a selected module's call runs: its pre-hook pushes
it, its post-hook takes it off; a call ended by a ``BaseException`` (which skips the
post-hook) leaves it there, passing every call through untouched, until the session's next
forward or its close takes it off.

Tensor and node hooks are removed on close like module hooks, so a backward that runs after
the session ended sees none of them. It never uses module backward hooks: the legacy
``register_backward_hook`` reports the last op's gradients, and ``register_full_backward_hook``
fails when a later in-place op touches the module's output and skips dict outputs
(pytorch/pytorch#61519, #87540).

Process-global effects, each reference-counted (made by the first session that needs it,
undone exactly by the last one to close, whatever the order):

* ``copyreg.dispatch_table`` has an entry for each class of module hookscope has hooked, so
  that ``copy.deepcopy``, ``pickle`` and ``torch.save`` of a hooked model work and the copy
  carries none of hookscope's hooks (the user's own hooks are copied as PyTorch always does);
* the compiler stance is ``force_eager`` while a session with ``recompile=True`` is open on a
  compiled model that already ran (see ``_compile``).

Module hooks live in the module's hook dicts, which PyTorch shares between every thread that
calls the module: a capture also records calls other threads make while it is open.
"""

from __future__ import annotations

import contextlib
import copyreg
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any

from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

__all__ = ["HookSet", "Shared", "training_mode"]

#: Handle ids of module hooks hookscope holds right now (dropped from pickled state).
_MODULE_HOOK_IDS: set[int] = set()
_HOOK_DICTS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
)


class Shared:
    """A process-global change, made by the first :meth:`acquire` and undone by the last
    :meth:`release`, so overlapping sessions closing in any order restore it exactly."""

    def __init__(self, apply: Callable[[], Any], undo: Callable[[Any], None]) -> None:
        self._apply, self._undo = apply, undo
        self._count = 0
        self._saved: Any = None

    def acquire(self) -> None:
        if self._count == 0:
            self._saved = self._apply()
        self._count += 1

    def release(self) -> None:
        self._count -= 1
        if self._count == 0:
            self._undo(self._saved)
            self._saved = None


class _CleanCopies:
    """Copies and pickles of hooked modules leave hookscope's hooks out.

    ``copy.deepcopy``, ``pickle`` and ``torch.save`` look a class up in
    ``copyreg.dispatch_table`` before anything else; while a module of that exact class holds
    hookscope hooks, an entry there reduces it as usual and then drops those hooks from its
    state. Entries are counted per class and removed by the last release (a dict entry, so
    installing it does not touch the class itself).
    """

    _MISSING = object()

    def __init__(self) -> None:
        self._count: dict[type, int] = {}
        self._before: dict[type, Any] = {}  # what dispatch_table held for the class

    def acquire(self, cls: type) -> None:
        count = self._count.get(cls, 0)
        if count == 0:
            self._before[cls] = copyreg.dispatch_table.get(cls, self._MISSING)
            copyreg.dispatch_table[cls] = self.reduce
        self._count[cls] = count + 1

    def release(self, cls: type) -> None:
        count = self._count.pop(cls) - 1
        if count:
            self._count[cls] = count
            return
        before = self._before.pop(cls)
        if copyreg.dispatch_table.get(cls) == self.reduce:  # leave a later owner's entry
            if before is self._MISSING:
                del copyreg.dispatch_table[cls]
            else:
                copyreg.dispatch_table[cls] = before

    def reduce(self, module: nn.Module) -> Any:
        before = self._before.get(type(module), self._MISSING)
        rv = module.__reduce_ex__(4) if before is self._MISSING else before(module)
        if isinstance(rv, tuple) and len(rv) > 2 and isinstance(rv[2], dict):
            rv = (rv[0], rv[1], _without_our_hooks(rv[2]), *rv[3:])
        return rv


def _without_our_hooks(state: dict[str, Any]) -> dict[str, Any]:
    out = dict(state)
    for key in _HOOK_DICTS:
        hooks = out.get(key)
        if hooks and not _MODULE_HOOK_IDS.isdisjoint(hooks):
            out[key] = OrderedDict((k, v) for k, v in hooks.items() if k not in _MODULE_HOOK_IDS)
    return out


#: Copies of a hooked model carry none of hookscope's hooks (see the module docstring).
CLEAN_COPIES = _CleanCopies()


class HookSet:
    """The hooks one hookscope session added, removed together on :meth:`close`."""

    __slots__ = ("_classes", "_eager", "_handles", "_module_ids", "_prune_at")

    def __init__(self, *, eager: bool = False) -> None:
        #: run module hooks outside torch.compile graphs (a graph break around each hook):
        #: hookscope's hooks read the real autograd graph, which tracing does not have
        self._eager = eager
        self._handles: list[RemovableHandle] = []
        self._module_ids: list[int] = []
        self._classes: list[type] = []  # of hooked modules, for CLEAN_COPIES
        self._prune_at = 256

    def __len__(self) -> int:
        return len(self._handles)

    def forward_pre(
        self, module: nn.Module, fn: Callable[..., Any], *, with_kwargs: bool = False
    ) -> None:
        """Register ``fn`` as a forward pre-hook of ``module`` until :meth:`close`."""
        fn = self._outside_graphs(fn)
        self._module(module, module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        always_call: bool = False,
    ) -> None:
        """Register ``fn`` as a forward hook of ``module`` until :meth:`close`
        (``always_call=True``: it runs even when the forward raises)."""
        fn = self._outside_graphs(fn)
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call)
        self._module(module, handle)

    def tensor(self, tensor: Tensor, fn: Callable[[Tensor], Tensor | None]) -> None:
        """Hook ``tensor``'s gradient until :meth:`close`. ``fn`` never sees ``None``, which
        autograd passes for an output nothing used when its node runs for another output
        (an LSTM's ``output`` when the loss reads only ``h_n``)."""

        def hook(grad: Tensor | None) -> Tensor | None:
            return None if grad is None else fn(grad)

        self._keep(tensor.register_hook(hook))  # type: ignore[no-untyped-call]

    def node(self, node: Any, fn: Callable[[Any, Any], Any]) -> None:
        """Hook an autograd node: ``fn(grad_inputs, grad_outputs)`` after it runs."""
        self._keep(node.register_hook(fn))

    def handle(self, handle: RemovableHandle) -> None:
        """Keep a handle of a hook registered elsewhere (an optimizer's step hooks) to
        remove it with the rest."""
        self._handles.append(handle)

    def close(self) -> None:
        """Remove every hook, newest first. Safe to call more than once."""
        try:
            while self._handles:
                self._handles.pop().remove()
        finally:
            _MODULE_HOOK_IDS.difference_update(self._module_ids)
            self._module_ids.clear()
            while self._classes:
                CLEAN_COPIES.release(self._classes.pop())

    def _outside_graphs(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not self._eager:
            return fn
        import torch._dynamo

        disabled: Callable[..., Any] = torch._dynamo.disable(fn)  # type: ignore[no-untyped-call]
        return disabled

    def _module(self, module: nn.Module, handle: RemovableHandle) -> None:
        self._handles.append(handle)
        self._module_ids.append(handle.id)
        _MODULE_HOOK_IDS.add(handle.id)
        self._classes.append(type(module))
        CLEAN_COPIES.acquire(type(module))

    def _keep(self, handle: RemovableHandle) -> None:
        # A hook on a graph node lives as long as the graph; once the graph is freed its
        # handle refers to nothing. Drop those now and then so a session open over many
        # training steps keeps a bounded list.
        self._handles.append(handle)
        if len(self._handles) >= self._prune_at:
            self._handles = [h for h in self._handles if h.hooks_dict_ref() is not None]
            self._prune_at = 2 * len(self._handles) + 256


@contextlib.contextmanager
def training_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Set every module's ``training`` flag to ``train``; restore each one's own flag after.
    Flags already right are left alone (``nn.Module.__setattr__`` is slow, and this runs
    once per call of an explainer)."""
    flags = [(m, m.training) for m in model.modules()]
    try:
        if any(flag != train for _, flag in flags):
            # a torch.export module refuses train(): its mode was fixed when it was exported
            with contextlib.suppress(NotImplementedError):
                model.train(train)
        yield
    finally:
        for module, flag in flags:
            if module.training != flag:
                module.training = flag
