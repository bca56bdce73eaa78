"""The one way hookscope hooks a model: a :class:`Session`.

Every entry point that hooks a model (``capture``, ``edit``, ``summary``, ``nonfinite``,
``Monitor``, the CAM methods, ``features`` and ``extract``) is a session, and so shares one
set of policies, decided here:

* **Sites** are resolved when the session is built, by one resolver (``Layers.sites``), so a
  bad selector fails before any forward, and a selector means the same to every entry point:
  a layer, or an operation inside a layer's own code (``"layer::op"``, ``ops/``). An
  operation's calls reach a session like a module's (:meth:`Session._watch_ops`).
* **Refusals** when it opens: ``nn.DataParallel`` over several devices (its replicas run in
  threads); TorchScript modules, whose calls run in C++ where PyTorch calls no Python hook; a
  ``torch.compile``d model that already ran, whose cached code would ignore new hooks, unless
  ``recompile=True`` (compiled code then runs eagerly while the session is open, ``_compile``).
  Entry points that run the model themselves (``summary``, ``features``, ``extract``, the CAM
  methods, ``report``) pass ``recompile=True``: the forward is theirs.
* **Passes.** A forward pre-hook on the model's root starts a pass; a forward hook (always
  called) ends it, so a recursive root call stays one pass. A forward ended by a
  ``BaseException`` (an early stop, ``KeyboardInterrupt``) skips every end hook, so a root call
  that finds a pass still open checks the Python stack: if no call of the root is running, the
  old pass is over, the calls it left open are abandoned, and a new pass starts.
* **Threads.** What a forward is doing is the state of the thread running it (``_calls``):
  forwards from several threads under one session are each their own pass, numbered in the
  order they start, as if they had run one after another. Sessions opened by entry points
  that run the model themselves (``this_thread=True``) see only the forwards of the threads
  inside their ``with`` block (or that called :meth:`open`): one such session may serve
  several threads at once, each seeing its own forwards.
* **Calls** (:meth:`Session._track`): a pre-hook and an always-called post-hook per module
  keep the stack of running calls, each a :class:`ModuleCall` with its canonical name, its
  index among the module's calls in this pass, its depth and parent. A call that raised ends
  with :meth:`Session._raised`; one that returned with :meth:`Session._returned`.
* **Replays.** Activation checkpointing runs a segment's forward again inside backward. Those
  calls are replays of calls already seen: sessions that do not ask for them
  (``replays=True``) never see them; those that do get ``call.replay`` set and, where the
  checkpoint is recognised, ``call.original`` (``_checkpoint``).
* **Private forwards.** A forward hookscope runs on the user's model for its own purposes (the
  NaN tracer's replay) is seen only by the sessions it names (:func:`private_forward`).
* ``torch.func`` transforms (``vmap``, ``grad``, ``jacrev``, ``jacfwd``, ...): a call inside
  one is refused (``UnsupportedModelError`` naming the transform and the fix), checked when a
  forward starts, at each module's first call in a pass and at each operation call: tensors
  there are the transform's wrappers, with no values of their own outside it. Sessions whose
  hooks are part of the function transformed (edits: ``_transformable``) work there. Entry
  points that run the model themselves refuse to open inside a transform.
  ``torch.func.functional_call`` is not a transform: its calls are ordinary calls.
* ``torch.export`` traces are not the model's forwards: while it traces the model on this
  thread (strict or not), every module hook of hookscope's does nothing
  (``_lifetime._module_hook``), so no session records, counts or edits anything in the trace
  and the program is the model's own. Entry points that run the model themselves refuse to
  open inside a trace.
* **Function modes.** hookscope's own work (hooks, opening, closing, an operation site's
  handler) runs with the torch function mode stack taken off (``_lifetime.unseen``): a user's
  ``TorchFunctionMode`` sees the model's operations only.

Nesting. ``with`` on a session that is already open nests: the hooks stay until the
outermost block exits. :meth:`close` closes at once.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import threading
import time
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any, ClassVar

import torch
from torch import nn

from ..errors import LayerNotFoundError
from . import _torch
from ._calls import UNJUDGED as _UNJUDGED
from ._calls import ModuleCall, Now, PerThread, hidden, in_own_forward, private_to
from ._checkpoint import Replay, find_segments, maybe_in_segment
from ._compile import compile_guard, is_compiled, refuse_inside_traces
from ._lifetime import HookSet, run_unseen, unseen
from ._naming import Layers, Site, is_called, unwrap
from ._refusals import check_model, replica_error, scripted_error, transformed_error
from .ops._attention import attention_args, probabilities
from .ops._select import forward_op, op_binder
from .ops._watch import Listener, OpWatch

__all__ = ["Run", "Session"]

#: ``run(args, kwargs) -> result``: the rest of an intercepted operation's handling
Run = Callable[[tuple[Any, ...], dict[str, Any]], Any]


class Session:
    """Base of every hookscope entry point that hooks a model (see the module docstring).

    A client subclasses it, registers its hooks in :meth:`_install` (usually
    ``self._track(hooks, modules)``, with ``modules`` from ``self.layers.select(...)`` or
    :meth:`every_module`) and reacts to calls in :meth:`_started`, :meth:`_returned` and
    :meth:`_raised`; :meth:`_new_pass` marks each top-level forward. Operation sites
    (``self.layers.sites(...)``) are followed with :meth:`_watch_ops`: their calls reach the
    same three methods, with ``call.op`` set. Gradient hooks taken during a call go through
    ``self.hooks.tensor(t, fn)`` / ``self.hooks.node(node, fn)``, so that closing removes them
    too. Entry points that run the model themselves pass ``recompile=True`` and
    ``this_thread=True`` and call it inside :func:`run_eagerly`.

    Example:
        >>> import torch, torch.nn as nn
        >>> from hookscope.core import Session
        >>> class Names(Session):
        ...     def _install(self, hooks):
        ...         self.seen = []
        ...         self._track(hooks, self.every_module())
        ...     def _returned(self, call, args, output):
        ...         self.seen.append((call.name, call.depth))
        >>> net = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
        >>> with Names(net) as s:
        ...     _ = net(torch.ones(1, 2))
        >>> s.seen
        [('0', 1), ('1', 1), ('', 0)]
    """

    #: whether the session works inside torch.func transforms: its hooks are then part of the
    #: function transformed, and see its wrapped tensors (edits); others refuse
    _transformable: ClassVar[bool] = False
    #: the entry point, as refusals name it
    _entry = "hookscope"

    def __init__(
        self, model: nn.Module, *, recompile: bool = False, this_thread: bool = False
    ) -> None:
        self.model = model
        self._layers = Layers(model)
        self._recompile = recompile
        #: this_thread sessions: the threads inside (thread id -> open ``with`` blocks)
        self._threads: dict[int, int] | None = {} if this_thread else None
        #: opened inside a forward hookscope runs for itself (``own_forward``): hookscope's
        #: own session, which sees such forwards as its runners do
        self._own = False
        self._hooks: HookSet | None = None
        self._exit = contextlib.ExitStack()
        self._entered = 0  # nesting of `with` blocks
        self._mutex = threading.RLock()  # for what threads share: records, pass bookkeeping
        #: the session's only thread so far (its capture hot path takes no lock), or _SHARED
        self._solo: object = None
        self._local = PerThread(self._join)  # what each thread's forward is doing (`_now`)
        self._passes = itertools.count()
        #: the highest pass index started so far, by any thread
        self.latest_pass = -1
        # call tracking (_track)
        self._tracked: dict[str, nn.Module] = {}
        self._reported: set[str] = set()  # tracked modules whose calls the client sees
        self._replays = False
        self._replay_log = Replay()
        # operations (_watch_ops)
        self._ops: OpWatch | None = None
        self._op_owners: frozenset[str] = frozenset()
        self._op_replays = False

    @property
    def layers(self) -> Layers:
        """The model's selectable layers (names, aliases, the unwrapped root)."""
        return self._layers

    @property
    def is_open(self) -> bool:
        """Whether the session's hooks are installed (inside its ``with`` block, or between
        :meth:`open` and :meth:`close`)."""
        return self._hooks is not None

    @property
    def hooks(self) -> HookSet:
        """The hooks of the open session (tensor and node hooks are added here)."""
        if self._hooks is None:
            raise RuntimeError("the session is not open")
        return self._hooks

    @property
    def now(self) -> Now:
        """What the forward running on this thread is doing (its pass, its running calls);
        ``now.extra`` holds a client's own per-pass state."""
        return self._local.now

    @property
    def _lock(self) -> threading.RLock:
        """The lock for what threads share (records, pass bookkeeping). A thread that takes it
        has joined the session first (its state exists: :meth:`_join`)."""
        _ = self._local.now  # (a thread's first read of its state joins it)
        return self._mutex

    def _join(self, now: Now) -> None:
        """A thread's first read of its state. The first thread is the session's solo thread:
        the capture hot path skips the lock there (a lock's acquire and release cost more than
        the rest of a layer's first call in a pass). The next thread makes the session shared
        until it closes, and waits until the solo thread is out of any section it entered
        without the lock; from then on every thread takes the lock. This is Peterson's
        handshake: the solo thread sets ``now.busy`` before it reads ``_solo``, a joining
        thread sets ``_solo`` before it reads ``busy``, so one of them sees the other."""
        with self._mutex:
            solo = self._solo
            self._solo = now if solo is None else _SHARED
        while isinstance(solo, Now) and solo.busy:
            time.sleep(0)  # (hands the interpreter to the solo thread, which ends its section)

    @property
    def _now(self) -> Now:
        # one thread-local read: hot paths read ``self._local.now`` once and keep it
        return self._local.now

    # -- subclass API ---------------------------------------------------------------------------
    def _install(self, hooks: HookSet) -> None:
        """Register the session's hooks on its layers."""
        raise NotImplementedError

    def _new_pass(self) -> None:
        """Called when a top-level forward of the model starts (on the thread running it)."""

    def _closed(self) -> None:
        """Called once the hooks are gone."""

    def _needs_python(self) -> bool:
        """Whether the model's own Python code must run (operation sites): a compiled model
        then runs eagerly while open (``recompile=True``), or is refused."""
        return self._ops is not None

    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A tracked call starts; may return ``(args, kwargs)`` to replace its inputs."""
        return None

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        """A tracked call returned; may return a replacement output."""
        return None

    def _raised(self, call: ModuleCall) -> None:
        """A tracked call ended with an exception (or was abandoned by one)."""

    # -- lifecycle --------------------------------------------------------------------------------
    def open(self) -> Any:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        with self._lock:
            if self._threads is not None:
                refuse_inside_traces()
                me = threading.get_ident()
                self._threads.setdefault(me, 0)
                self._rejudge()
            if self._hooks is None:
                self._own = in_own_forward()
                unseen(self._install_hooks)()  # hookscope's own work: no function mode sees it
        return self

    def _install_hooks(self) -> None:
        check_model(self.model, self._layers.root)
        self._follow_replaced()
        compiled = is_compiled(self.model)
        with contextlib.ExitStack() as stack:
            if compiled:
                python = self._needs_python()
                stack.enter_context(
                    compile_guard(self.model, recompile=self._recompile, python=python)
                )
            self._hooks = hooks = HookSet(eager=compiled)
            stack.callback(hooks.close)
            hooks.forward_pre(self._layers.root, self._on_root_start, hides_modes=True)
            hooks.forward(self._layers.root, self._on_root_end, always_call=True, hides_modes=True)
            self._install(hooks)
            self._register_tracking(hooks)
            self._exit = stack.pop_all()

    def close(self) -> None:
        """Remove every hook this session added. Idempotent; results stay readable."""
        unseen(self._shut)()

    def _shut(self) -> None:
        with self._lock:
            try:
                self._exit.close()
            finally:
                self._hooks = None
                self._entered = 0
                if self._threads is not None:
                    self._threads.clear()
                if self._ops is not None:
                    self._ops.close()
                self._solo = None  # every thread's state starts afresh
                self._local = PerThread(self._join)
                self._tracked, self._reported = {}, set()
                self._closed()

    def __enter__(self) -> Any:
        with self._lock:
            opened = self.open()
            self._entered += 1
            if self._threads is not None:
                self._threads[threading.get_ident()] += 1
                self._rejudge()
        return opened

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        with self._lock:
            self._entered -= 1
            if self._threads is not None:
                me = threading.get_ident()
                left = self._threads.get(me, 1) - 1
                if left > 0:
                    self._threads[me] = left
                else:
                    self._threads.pop(me, None)
                self._rejudge()
            if self._entered <= 0:
                self.close()
        return None

    #: a client's own site objects (with ``name``, ``module`` and ``op``), checked when the
    #: session opens (:meth:`_follow_replaced`)
    _site_objects: Mapping[str, Any] = {}

    def _rebound(self, site: Any) -> None:
        """``site.module`` was just pointed at the module now under its name."""

    def _follow_replaced(self) -> None:
        """A session opened again after one of its layers was replaced (``model[0] = ...``)
        hooks the module now under that name; one whose layer is gone is refused."""
        root = unwrap(self.model)
        stale = []
        for site in self._site_objects.values():
            name = site.op.module if site.op else site.name
            now = _module_at(root, name)
            if now is None:
                raise LayerNotFoundError(
                    f"layer {name!r} is no longer in the model (it was removed after the "
                    "session was built): build a new session for the model as it is now"
                )
            if now is not site.module:
                stale.append(site)
        if stale or root is not self._layers.root:
            self._layers = Layers(self.model)
            if self._ops is not None:
                self._ops.rebind(self._layers)
            for site in stale:
                site.module = _module_at(root, site.op.module if site.op else site.name)
                self._rebound(site)

    # -- which forwards ---------------------------------------------------------------------------
    def _ignores(self, now: Now | None = None) -> bool:
        """Whether the forward running on this thread is not this session's to see: another
        thread's (for a ``this_thread`` session), or a private forward it is not named in.
        Hot paths test ``now.private or self._threads is not None`` first: both false, the
        usual case, means no; they pass their ``now`` (no second thread-local read).

        The verdict is kept in ``now`` while this thread's innermost private forward is the
        same block (a block's sessions never change) and the thread has not entered or left
        the session (:meth:`_rejudge`): the runners' hooks ask on every call."""
        if now is None:
            now = self._now
        blocks = now.private
        top = blocks[-1] if blocks else None
        if top is not now.judged:
            threads = self._threads
            now.member = threads is None or _get_ident() in threads
            now.hidden = hidden(self, not now.member or threads is not None or self._own, blocks)
            now.judged = top
        if now.member:
            return now.hidden
        # (a checkpoint's replay may run on an autograd device thread: that one is ours)
        return _backward_id() == -1 or now.hidden

    def _rejudge(self) -> None:
        """This thread entered or left a ``this_thread`` session: :meth:`_ignores` asks again."""
        self._now.judged = _UNJUDGED

    def _in_backward(self) -> bool:
        """A forward running inside backward: a checkpoint's replay (a private forward run
        from a backward callback is a forward of its own for the sessions it is for)."""
        return _backward_id() != -1 and not private_to(self)

    # -- passes ------------------------------------------------------------------------------------
    def _on_root_start(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return
        if _stack_length():  # a user's function modes must not see hookscope's work
            return run_unseen(self._on_root_start, module, args)
        now = self._local.now
        if _backward_id() != -1 and self._in_backward():  # a checkpoint's replay
            return
        if (now.private or self._threads is not None) and self._ignores(now):
            return  # not this session's forward
        if module is not self._layers.root:
            raise replica_error(module)
        if now.depth and not _running(module, skip=1):
            now.depth = 0  # that forward was ended by a BaseException: a new pass
        if not now.depth and not self._transformable and _functorch_level() is not None:
            raise transformed_error(type(module).__name__, self._entry)  # once per forward
        now.depth += 1
        if now.depth == 1:
            if now.stack:
                self._abandon()
            with self._lock:
                now.pass_index = next(self._passes)
                self.latest_pass = max(self.latest_pass, now.pass_index)
            now.counts.clear()
            now.extra.clear()
            self._new_pass()

    def _on_root_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return
        now = self._local.now  # (no function mode sees this: it runs no torch function)
        if _backward_id() != -1 and self._in_backward():
            return
        if (now.private or self._threads is not None) and self._ignores(now):
            return
        if now.depth:
            now.depth -= 1

    def _ops_pass_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """After a forward returned (registered after every call hook of the root): operation
        selectors whose operation part matched nothing in it raise."""
        ours = not (self._now.depth or self._in_backward() or self._ignores())
        if self._ops is not None and ours:
            self._ops.check()

    # -- calls -------------------------------------------------------------------------------------
    def _check_hookable(self, names: Mapping[str, Any]) -> None:
        """Refuse layers inside TorchScript, where Python hooks never run."""
        for name in names:
            if "::" not in name and self._layers.in_script(name):
                raise scripted_error(repr(name), self._layers.modules[name])

    def every_module(self) -> dict[str, nn.Module]:
        """``{name: module}`` of every module that can be called, the root as ``""`` first;
        TorchScript modules are opaque (their insides run in C++, unhooked)."""
        found = {"": self._layers.root}
        for name, module in self._layers.modules.items():
            if is_called(module) and not self._layers.in_script(name):
                found[name] = module
        return found

    def _track(
        self,
        hooks: HookSet,
        modules: Mapping[str, nn.Module],
        *,
        replays: bool = False,
    ) -> None:
        """Follow every call of ``modules`` (see the module docstring); ``replays``: also the
        recomputations activation checkpointing runs in backward."""
        self._replays = self._replays or replays
        self._check_hookable({n: m for n, m in modules.items() if n})
        self._tracked.update(modules)
        self._reported.update(modules)

    def _register_tracking(self, hooks: HookSet) -> None:
        """Hook the tracked modules, and the modules whose own code runs watched operations:
        one pre-hook and one post-hook per module, whoever needs its calls."""
        if self._ops is not None:
            owners = self._ops.modules()
            self._check_hookable({n: m for n, m in owners.items() if n})
            self._replays = self._replays or self._op_replays
            for name, module in owners.items():
                self._tracked.setdefault(name, module)
        partial, pre, post = functools.partial, self._call_pre, self._call_post
        for name, module in self._tracked.items():
            hooks.forward_pre(module, partial(pre, name), with_kwargs=True, hides_modes=True)
            hooks.forward(module, partial(post, name), always_call=True, hides_modes=True)
        if self._ops is not None:
            hooks.forward(self._layers.root, self._ops_pass_end)

    def _track_outputs(self, hooks: HookSet, modules: Mapping[str, nn.Module]) -> None:
        """Follow only the outputs of ``modules`` (one forward hook each, no call stack):
        :meth:`_output` gets each returned output, replays and others' forwards excluded."""
        self._check_hookable({n: m for n, m in modules.items() if n})
        for name, module in modules.items():
            hooks.forward(module, functools.partial(self._output_hook, name))

    def _output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        """A module followed by :meth:`_track_outputs` returned; may return a new output."""
        return None

    def _output_hook(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self._ignores() or self._in_backward():
            return None
        if name and module is not self._layers.modules.get(name):
            raise replica_error(module)
        if not self._transformable and _functorch_level() is not None:
            raise transformed_error(name, self._entry)
        return self._output(name, module, args, output)

    def _call_pre(
        self,
        name: str,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return None
        if kwargs is None:  # a forward that took the hooks as this session removed it (_lifetime)
            return None
        if _stack_length():  # a user's function modes must not see hookscope's work
            return run_unseen(self._call_pre, name, module, args, kwargs)
        now = self._local.now
        if (now.private or self._threads is not None) and self._ignores(now):
            return None
        replay = _backward_id() != -1 and self._in_backward()
        if replay and not self._replays:
            return None
        if name and module is not self._layers.modules.get(name):
            raise replica_error(module)
        index = now.counts.get(name, 0)
        # a transform inside the forward (or around a call outside one): checked once per
        # module and pass, the root's start having checked the forward itself
        transformed = (not index or not now.depth) and not self._transformable
        if transformed and _functorch_level() is not None:
            raise transformed_error(name, self._entry)
        call = ModuleCall(name, module, index, now.stack[-1] if now.stack else None, now.pass_index)
        if replay:
            self._replayed(call)
        else:
            now.counts[name] = index + 1
            if self._replays and maybe_in_segment():
                _, _, first_runs = find_segments()
                self._replay_log.note([k for k, _ in first_runs], name, call)
        now.stack.append(call)
        if self._ops is not None and name in self._op_owners:
            self._ops.enter(call)
        return self._started(call, args, kwargs) if name in self._reported else None

    def _replayed(self, call: ModuleCall) -> None:
        call.replay = True
        call.index = -1
        segment, _, first_runs = find_segments()
        call.original = self._replay_log.find(segment, call.name, _backward_id())
        if call.original is not None:
            call.index = call.original.index
            self._replay_log.note([k for k, _ in first_runs], call.name, call.original)

    def _call_post(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return None
        if _stack_length():  # a user's function modes must not see hookscope's work
            return run_unseen(self._call_post, name, module, args, output)
        now = self._local.now
        if (now.private or self._threads is not None) and self._ignores(now):
            return None
        if not self._replays and _backward_id() != -1 and self._in_backward():
            return None
        stack = now.stack
        while stack and stack[-1].module is not module:  # left open by a BaseException
            self._end(stack.pop(), raised=True)
        if not stack:
            return None  # its start was not seen (the session opened during the call)
        call = stack.pop()
        if _torch.call_raised():
            self._end(call, raised=True)
            return None
        new = self._returned(call, args, output) if name in self._reported else None
        if self._ops is not None:  # (else a call that returned has nothing to end)
            self._end(call, raised=False)
        return new

    def _end(self, call: ModuleCall, *, raised: bool) -> None:
        if raised and call.name in self._reported:
            self._raised(call)
        if self._ops is not None and call.name in self._op_owners:
            self._ops.leave(call)

    def _abandon(self) -> None:
        """Calls a BaseException left open on this thread: they ended without returning."""
        stack = self._now.stack
        while stack:
            self._end(stack.pop(), raised=True)

    # -- operations ----------------------------------------------------------------------------
    def _watch_ops(self, sites: Mapping[str, Any], *, replays: bool = False) -> None:
        r"""Follow the operation sites among ``sites`` (call in ``__init__``): each call of a
        selected operation goes through :meth:`_run_op` (by default: reported to
        :meth:`_started` / :meth:`_returned` / :meth:`_raised` with ``call.op`` set; an
        ``attention_weights`` site's output is the probabilities of its SDPA call).
        ``replays``: also inside checkpoint recomputations. ``sites`` are :class:`Site`\ s, or a
        client's own objects with the site's ``op`` (given back to :meth:`_run_op`)."""
        plan: dict[str, dict[tuple[str, int | None], Any]] = {}
        for site in sites.values():
            if site.op is not None:
                plan.setdefault(site.op.module, {})[site.op.op, site.op.k] = site
        if plan:
            self._ops = OpWatch(self._layers, plan, handler=self._run_op)
            self._op_owners = frozenset(plan)
            self._op_replays = replays

    def _listen_ops(self, modules: Mapping[str, nn.Module], listener: Listener) -> None:
        """See every operation the own code of ``modules``' calls runs (call in
        ``__init__``): ``listener(call, name, k, func, run)`` runs it (listings, summaries)."""
        self._ops = OpWatch(self._layers, {n: {} for n in modules}, listener=listener)
        self._op_owners = frozenset(modules)

    def _run_op(
        self,
        owner: ModuleCall,
        sites: list[Any],
        weights: list[Any],
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Run an operation call that ``sites`` select (and, for an SDPA call, whose attention
        weights ``weights`` select), the first selector outermost."""
        run: Run = functools.partial(forward_op, func)
        for site in reversed(sites):
            run = functools.partial(self._op_value, owner, site, run)
        for site in reversed(weights):
            run = functools.partial(self._op_weights, owner, site, func, run)
        return run(args, kwargs)

    def _op_call(self, owner: ModuleCall, site: Site) -> ModuleCall:
        """The call record of one call of an operation site (its index counts this pass)."""
        if not self._transformable and _functorch_level() is not None:
            raise transformed_error(site.name, self._entry)
        counts = self._now.counts
        index = counts.get(site.name, 0)
        counts[site.name] = index + 1
        call = ModuleCall(site.name, owner.module, index, owner, owner.pass_index)
        call.op, call.replay = site.op, owner.replay
        return call

    def _op_value(
        self, owner: ModuleCall, site: Site, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        call = self._op_call(owner, site)
        new = self._started(call, args, kwargs)
        if new is not None:
            args, kwargs = new
        try:
            out = run(args, kwargs)
        except BaseException:
            self._raised(call)
            raise
        replaced = self._returned(call, args, out)
        return out if replaced is None else replaced

    def _op_weights(
        self,
        owner: ModuleCall,
        site: Site,
        func: Any,
        run: Run,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        call = self._op_call(owner, site)
        self._started(call, (), {})
        out = run(args, kwargs)
        with torch.no_grad():
            probs = probabilities(**attention_args(op_binder(func).bind(args, kwargs)))
        self._returned(call, (), probs)
        return out


_SHARED = object()  # Session._solo once a second thread has joined
_backward_id = _torch.backward_id
_get_ident = threading.get_ident
_stack_length = _torch.function_stack_length
_export_traced = _torch.export_traced
_getattr, (_flags, _EXPORTING) = getattr, _torch.EXPORTING_FLAG  # (see _capture's hot path)
_functorch_level = _torch.functorch_level


#: what to do instead, per torch.func transform (``_torch.functorch_transforms``)
def _running(module: nn.Module, skip: int) -> bool:
    """Whether a call of ``module`` is on the Python stack (beyond the innermost ``skip``)."""
    frame = sys._getframe(1)
    codes = _torch.CALL_CODES
    while frame is not None:
        if frame.f_code in codes and frame.f_locals.get("self") is module:
            if skip == 0:
                return True
            skip -= 1
            # _wrapped_call_impl calls _call_impl: both frames belong to the same call
            if frame.f_back is not None and frame.f_back.f_code in codes:
                frame = frame.f_back
        frame = frame.f_back  # type: ignore[assignment]
    return False


def _module_at(root: nn.Module, name: str) -> nn.Module | None:
    """The module under the dotted ``name`` now (wrappers seen through), or None."""
    module: nn.Module | None = root
    for part in name.split(".") if name else ():
        kids = _torch.children(unwrap(module)) if module is not None else {}
        module = kids[part] if part in kids else None  # noqa: SIM401 - TorchScript's has no get
    return unwrap(module) if module is not None else None
