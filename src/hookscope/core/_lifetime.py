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
* optimizer step pre- and post-hooks (``Monitor`` follows optimizer steps),
  :meth:`HookSet.optimizer_step`.

Interceptors. Every torch function mode and dispatch mode hookscope uses is a subclass of
:class:`FunctionInterceptor` or :class:`DispatchInterceptor`, defined here; both kinds live on
per-thread stacks in PyTorch. Dispatch interceptors (the FLOP counter of ``summary``, the NaN
tracer's operator replay) are entered with ``with`` around a forward hookscope runs itself.
Function interceptors are pushed and taken off by hooks: operation selectors (``"layer::op"``,
``ops/``) push one while a selected module's call runs (its pre-hook pushes it, its post-hook
takes it off; a call ended by a ``BaseException``, which skips the post-hook, leaves it there,
passing every call through untouched, until the session's next forward or its close takes it
off); guided backpropagation enters one with ``with`` around its forward.

``torch.export`` traces are not the model's forwards: while an export traces the model on a
thread (Dynamo's strict tracing, or the fake tensors of a non-strict export), every module hook
hookscope registers does nothing and returns None, so the program holds none of hookscope's
records, counts or edits (:func:`_module_hook`).

hookscope's own work is invisible to torch function modes, the user's and its own: every hook
it registers runs with the function mode stack taken off (when there is one: an empty stack is
the fast path), and so do the handlers of operation sites, except for the operation they
forward (:func:`unseen`, :func:`run_unseen`, ``_torch.hide_function_modes``).

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
  compiled model that already ran (see ``_compile``); module hooks of a session on a compiled
  model run outside compiled graphs (``torch.compiler.disable``);
* the ``training`` flags of a model's modules while an entry point runs it in a mode of its
  own (:func:`training_mode`): set by the first, restored by the last, per model.

Module hooks live in the module's hook dicts, which PyTorch shares between every thread that
calls the module: a session sees the calls of every thread, each thread's forward its own pass
(``_calls``), except sessions opened by entry points that run the model themselves, which see
only their own thread's forwards.
"""

from __future__ import annotations

import contextlib
import copyreg
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from ..errors import UsageError
from . import _torch

__all__ = [
    "EAGER",
    "DispatchInterceptor",
    "FunctionInterceptor",
    "HookSet",
    "Shared",
    "run_unseen",
    "training_mode",
    "unseen",
]

_T = TypeVar("_T")

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
        self._lock = threading.Lock()  # sessions open and close from several threads

    def acquire(self) -> None:
        with self._lock:
            if self._count == 0:
                self._saved = self._apply()
            self._count += 1

    def release(self) -> None:
        with self._lock:
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
        self._lock = threading.Lock()

    def acquire(self, cls: type) -> None:
        with self._lock:
            count = self._count.get(cls, 0)
            if count == 0:
                self._before[cls] = copyreg.dispatch_table.get(cls, self._MISSING)
                copyreg.dispatch_table[cls] = self.reduce
            self._count[cls] = count + 1

    def release(self, cls: type) -> None:
        with self._lock:
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

#: Compiled code runs eagerly while a ``recompile=True`` session is open on a compiled model
#: that already ran (``_compile``): ``torch.compiler.set_stance("force_eager")``.
EAGER = Shared(lambda: _torch.set_stance("force_eager"), _torch.set_stance)


class HookSet:
    """The hooks one hookscope session added, removed together on :meth:`close`."""

    __slots__ = ("_classes", "_eager", "_handles", "_module_ids", "_prune_at")

    def __init__(self, *, eager: bool = False) -> None:
        #: run module hooks outside torch.compile graphs (a graph break around each hook):
        #: hookscope's hooks read the real autograd graph, which tracing does not have
        self._eager = eager
        self._handles: list[RemovableHandle] = []
        self._module_ids: list[int] = []
        self._classes: set[type] = set()  # of hooked modules, each acquired once: CLEAN_COPIES
        self._prune_at = 256

    def __len__(self) -> int:
        return len(self._handles)

    def forward_pre(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        hides_modes: bool = False,
    ) -> None:
        """Register ``fn`` as a forward pre-hook of ``module`` until :meth:`close`
        (``hides_modes``: as for :meth:`forward`). With ``with_kwargs``, ``fn`` must take
        ``kwargs=None`` and then do nothing: torch reads a module's pre-hooks and which of them
        take keyword arguments at two moments (``Module._call_impl``), so a forward in another
        thread that took the hooks just before :meth:`close` removed one calls it as a plain
        pre-hook, without ``kwargs``; that forward is not the session's any more."""
        fn = _module_hook(fn, eager=self._eager, hides_modes=hides_modes)
        self._module(module, module.register_forward_pre_hook(fn, with_kwargs=with_kwargs))

    def forward(
        self,
        module: nn.Module,
        fn: Callable[..., Any],
        *,
        with_kwargs: bool = False,
        always_call: bool = False,
        hides_modes: bool = False,
    ) -> None:
        """Register ``fn`` as a forward hook of ``module`` until :meth:`close`
        (``always_call=True``: it runs even when the forward raises; ``hides_modes=True``: the
        hook takes the function modes off itself when there are any, see :func:`unseen`, and
        skips torch.export traces itself, see :func:`_module_hook`, which saves a wrapper's
        call on a per-call hot path)."""
        fn = _module_hook(fn, eager=self._eager, hides_modes=hides_modes)
        handle = module.register_forward_hook(fn, with_kwargs=with_kwargs, always_call=always_call)
        self._module(module, handle)

    def tensor(self, tensor: Tensor, fn: Callable[[Tensor], Tensor | None]) -> None:
        """Hook ``tensor``'s gradient until :meth:`close`. ``fn`` never sees ``None``, which
        autograd passes for an output nothing used when its node runs for another output
        (an LSTM's ``output`` when the loss reads only ``h_n``)."""

        def hook(grad: Tensor | None) -> Tensor | None:
            return None if grad is None else run(grad)

        run = unseen(fn)
        self._keep(tensor.register_hook(hook))  # type: ignore[no-untyped-call]

    def node(self, node: Any, fn: Callable[[Any, Any], Any]) -> None:
        """Hook an autograd node: ``fn(grad_inputs, grad_outputs)`` after it runs."""
        self._keep(node.register_hook(unseen(fn)))

    def optimizer_step(
        self,
        optimizer: torch.optim.Optimizer,
        before: Callable[[torch.optim.Optimizer], None],
        after: Callable[[torch.optim.Optimizer], None],
    ) -> None:
        """Call ``before(optimizer)`` / ``after(optimizer)`` around each of its steps."""
        before, after = unseen(before), unseen(after)
        self._handles.append(optimizer.register_step_pre_hook(lambda o, *_: before(o)))
        self._handles.append(optimizer.register_step_post_hook(lambda o, *_: after(o)))

    def close(self) -> None:
        """Remove every hook, newest first. Safe to call more than once. A hook whose removal
        raises does not keep the others: every one is removed, then the first error raised."""
        error: BaseException | None = None
        while self._handles:
            try:
                self._handles.pop().remove()
            except BaseException as e:
                error = error or e
        _MODULE_HOOK_IDS.difference_update(self._module_ids)
        self._module_ids.clear()
        while self._classes:
            CLEAN_COPIES.release(self._classes.pop())  # (one release per acquire)
        if error is not None:
            raise error

    def _module(self, module: nn.Module, handle: RemovableHandle) -> None:
        self._handles.append(handle)
        self._module_ids.append(handle.id)
        _MODULE_HOOK_IDS.add(handle.id)
        if type(module) not in self._classes:  # (a lock each: once per class, not per hook)
            self._classes.add(type(module))
            CLEAN_COPIES.acquire(type(module))

    def _keep(self, handle: RemovableHandle) -> None:
        # A hook on a graph node lives as long as the graph; once the graph is freed its
        # handle refers to nothing. Drop those now and then so a session open over many
        # training steps keeps a bounded list.
        self._handles.append(handle)
        if len(self._handles) >= self._prune_at:
            self._handles = [h for h in self._handles if h.hooks_dict_ref() is not None]
            self._prune_at = 2 * len(self._handles) + 256


def _module_hook(
    fn: Callable[..., Any], *, eager: bool, hides_modes: bool = False
) -> Callable[..., Any]:
    """``fn`` as a module hook of hookscope's: run :func:`unseen`, outside compiled graphs
    when ``eager`` (a graph break around it), and not at all while ``torch.export`` traces
    the model on this thread (it then returns None, as a hook that changes nothing): an
    export's trace runs on fake tensors with no values, and the program it makes must be the
    model's own, with none of a session's records, counts or edits in it. The export check
    comes first, so that Dynamo (``strict=True``) traces the hook to nothing; outside an
    export it costs one call of ``torch.compiler.is_exporting()``.

    ``hides_modes``: ``fn`` does both itself (a per-call hot path: its first line reads
    torch.compiler's exporting flag, ``_torch.EXPORTING_FLAG``, and then asks
    ``export_traced()``, before any read of the function mode stack, which Dynamo cannot
    trace), so it is registered as it is."""
    if hides_modes and not eager:
        return fn
    exporting, traced = torch.compiler.is_exporting, _torch.export_traced
    if eager:
        inner = fn if hides_modes else unseen(fn)
        disabled: Callable[..., Any] = torch.compiler.disable(inner)  # type: ignore[no-untyped-call]

        def outside_graphs(*args: Any, **kwargs: Any) -> Any:
            if exporting() and traced():
                return None
            return disabled(*args, **kwargs)

        return outside_graphs
    length = _torch.function_stack_length

    def hook(*args: Any, **kwargs: Any) -> Any:  # unseen's, inlined: one frame per hook call
        if exporting() and traced():
            return None
        if not length():
            return fn(*args, **kwargs)
        _torch.hide_function_modes()
        try:
            return fn(*args, **kwargs)
        finally:
            _torch.restore_function_modes()

    return hook


def unseen(fn: Callable[..., _T]) -> Callable[..., _T]:
    """``fn`` (a hook) run with the torch function mode stack taken off, when there is one:
    a user's ``TorchFunctionMode`` sees the model's operations, not hookscope's copies and
    statistics. The stack's length is checked first: an empty stack costs one call."""
    length = _torch.function_stack_length

    def run(*args: Any, **kwargs: Any) -> _T:
        if not length():
            return fn(*args, **kwargs)
        _torch.hide_function_modes()
        try:
            return fn(*args, **kwargs)
        finally:
            _torch.restore_function_modes()

    return run


def run_unseen(fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` with the torch function mode stack taken off (always, even when empty,
    so that the operation it forwards finds the modes it took: the handler of an operation
    site, whose forwarded call ``ops._select.forward_op`` runs where the modes see it)."""
    _torch.hide_function_modes()
    try:
        return fn(*args)
    finally:
        _torch.restore_function_modes()


class FunctionInterceptor(TorchFunctionMode):
    """Base of hookscope's torch function modes (see the module docstring): entered with
    ``with``, or pushed by hooks with :meth:`attach` and taken off with :meth:`detach`."""

    def attach(self) -> bool:
        """Push the mode on this thread's stack unless it is there; whether it pushed."""
        if _torch.function_mode_on(self):
            return False
        _torch.push_function_mode(self)
        return True

    def detach(self) -> None:
        """Take the mode off this thread's stack wherever it is (modes above stay)."""
        _torch.remove_function_mode(self)


class DispatchInterceptor(_torch.DispatchMode):  # type: ignore[misc]
    """Base of hookscope's torch dispatch modes (see the module docstring), entered with
    ``with`` around a forward hookscope runs itself."""

    def __init__(self) -> None:
        _torch.need("torch.utils._python_dispatch.TorchDispatchMode")
        super().__init__()


class _Held:
    """One module's ``training`` flag while entry points run it in a mode of their own."""

    __slots__ = ("flag", "module", "threads", "train")

    def __init__(self, module: nn.Module, train: bool) -> None:
        self.module, self.flag, self.train = module, module.training, train
        self.threads: list[int] = []  # one entry per call inside, by thread


#: id(module) -> its hold, for every module some entry point runs in a mode of its own now
_HELD: dict[int, _Held] = {}
_HELD_CHANGED = threading.Condition()


@contextlib.contextmanager
def training_mode(model: nn.Module, train: bool) -> Iterator[None]:
    """Set every module's ``training`` flag to ``train``; restore each one's own flag after.

    Entry points that run the model themselves (``features``, the attribution methods,
    ``summary``, ``extract``, the report) may do so from several threads at once, on one model
    or on models sharing modules: a module's flag is saved by the first call that needs it in
    a mode, shared by later calls in the same mode, and restored by the last one to leave. A
    call that needs the other mode waits until the modules are free; in a thread already
    holding them in the other mode (a nested call) it is refused, since waiting would never
    end. Flags already right are left alone (``nn.Module.__setattr__`` is slow, and this runs
    once per call of an explainer)."""
    modules = list(model.modules())
    me = threading.get_ident()
    with _HELD_CHANGED:
        while _HELD and (
            clash := [h for m in modules if (h := _HELD.get(id(m))) and h.train != train]
        ):
            if any(me in h.threads for h in clash):
                raise UsageError(
                    f"this thread already runs {type(clash[0].module).__name__} in "
                    f"{_mode_name(clash[0].train)} mode inside a hookscope call; it cannot run "
                    f"it in {_mode_name(train)} mode at the same time. Make the two calls one "
                    "after the other."
                )
            _HELD_CHANGED.wait()
        held = [_HELD.get(id(m)) or _Held(m, train) for m in modules]  # every flag is read
        for h in held:  # before any is set: a compile wrapper's flag is its module's
            if not h.threads:  # new: nobody else holds its module
                _HELD[id(h.module)] = h
                if h.module.training != train:
                    h.module.training = train
            h.threads.append(me)
    try:
        yield
    finally:
        with _HELD_CHANGED:
            for h in reversed(held):  # children first, wrappers last (as they were read)
                h.threads.remove(me)
                if not h.threads:
                    del _HELD[id(h.module)]
                    if h.module.training != h.flag:
                        h.module.training = h.flag
            _HELD_CHANGED.notify_all()


def _mode_name(train: bool) -> str:
    return "training" if train else "eval"
