"""Following the operations of selected modules' calls (see ``_select`` for what they are).

A ``TorchFunctionMode`` is pushed when a selected module's call starts (its session's
pre-hook) and removed when it ends (the always-called post-hook, or, for a call ended by a
``BaseException``, which skips every end hook, when the session sees the call abandoned: the
next forward, or its close). Nothing is intercepted outside the selected modules' calls. Each
intercepted call finds its owner on the Python stack: the nearest ``Module._call_impl`` frame
above it, which must be a running selected call, reached through that module's ``forward``
(not a hook). A call that finds no owner (a child's, a hook's, or one made after its module's
call was abandoned) passes through untouched.

Each session has its own mode; the one opened later is pushed later and sees a call first,
so, as for layers, a capture opened after an edit records the edited value. Sessions run the
intercepted call through :func:`~hookscope.core.ops._select.forward_op`, which the others'
owner search sees through; anything else hookscope computes in a handler (copies, explicit
attention) is its own and invisible to them.

The watch talks to its session through two functions it is given, nothing else: the
``handler`` that runs a call some sites select, or a ``listener`` that sees every operation
(listings, summaries). The session tells it when a watched module's call starts and ends
(:meth:`OpWatch.enter`, :meth:`OpWatch.leave`) and when a pass ends (:meth:`OpWatch.check`).
Function modes are per thread in PyTorch, and so is everything the watch keeps per call.
"""

from __future__ import annotations

import difflib
import sys
import threading
import types
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import LayerNotFoundError, UnsupportedModelError
from .. import _torch
from .._calls import ModuleCall
from .._lifetime import FunctionInterceptor, run_unseen
from .._naming import Layers
from ._select import METADATA, SDPA, WEIGHTS, OpSelector, forward_op, op_name

__all__ = ["OpWatch"]


# -- watching -------------------------------------------------------------------------------------
class _Running:
    """One running call of a module whose operations are watched."""

    __slots__ = ("call", "code", "counts", "frame", "names", "pushed", "sites")

    def __init__(
        self,
        call: ModuleCall,
        frame: types.FrameType,
        sites: Mapping[Any, Any],
        names: frozenset[str],
    ) -> None:
        self.call, self.frame, self.sites, self.names = call, frame, sites, names
        forward = call.module.forward  # the code hooks are told apart from (a decorator's too)
        self.code = getattr(getattr(forward, "__func__", forward), "__code__", None)
        self.counts: dict[str, int] = {}  # calls of each operation so far, by name
        self.pushed = False


#: ``handler(call, sites, weights_sites, func, args, kwargs) -> result``: the sites that
#: select this call (``op``, then ``op#k``), and for an SDPA call those that select its
#: ``attention_weights``; one list at least is not empty
Handler = Callable[[ModuleCall, list[Any], list[Any], Any, tuple[Any, ...], dict[str, Any]], Any]
#: ``listener(call, name, k, func, run) -> result``, ``run()`` running the call (listings)
Listener = Callable[[ModuleCall, str, int, Any, Callable[[], Any]], Any]


class OpWatch:
    """The operation side of one session (see the module docstring).

    Args:
        layers: the session's model, for messages.
        sites: ``{module name: {(op, k): site}}``, the session's own site objects.
        handler: runs a call that sites select (through :func:`forward_op`).
        listener: instead of sites, sees every operation of every watched call.
    """

    def __init__(
        self,
        layers: Layers,
        sites: Mapping[str, Mapping[tuple[str, int | None], Any]],
        handler: Handler | None = None,
        listener: Listener | None = None,
    ) -> None:
        self._layers, self._sites = layers, sites
        self._handler, self._listener = handler, listener
        self._mode = _Mode(self)
        self._stops = (_CALL_IMPL, _torch.inner_code())  # where a module call's machinery starts
        self._running: dict[types.FrameType, _Running] = {}  # frames are per thread
        self._by_call: dict[ModuleCall, _Running] = {}
        #: selectors whose operation part no call has matched yet, and (per thread) what ran
        #: in the pass
        self._pending = {(m, op, k) for m, ops in sites.items() for op, k in ops}
        self._local = threading.local()
        #: per module, the operations its sites select (an SDPA call for attention weights)
        self._names = {
            m: frozenset(SDPA if op == WEIGHTS else op for op, _ in ops) for m, ops in sites.items()
        }
        #: count every operation, not only the selected ones: for listings, and for the
        #: messages of selectors not resolved yet
        self._count_all = listener is not None or bool(self._pending)

    def rebind(self, layers: Layers) -> None:
        """The session's model changed (a layer replaced): read modules from ``layers``."""
        self._layers = layers

    def modules(self) -> dict[str, Any]:
        """``{name: module}`` of the modules whose calls must be reported to :meth:`enter`."""
        layers = self._layers
        return {n: layers.root if n == "" else layers.modules[n] for n in self._sites}

    def enter(self, call: ModuleCall) -> None:
        """A watched module's call starts (the session's call tracking reports it)."""
        name = call.name
        running = _Running(call, _call_frame(call), self._sites[name], self._names[name])
        running.pushed = self._mode.attach()  # once per thread: the mode is per thread
        self._running[running.frame] = running
        self._by_call[call] = running

    def leave(self, call: ModuleCall) -> None:
        """A watched module's call ended, returned or raised."""
        running = self._by_call.pop(call, None)
        if running is None:
            return
        self._running.pop(running.frame, None)
        if running.pushed:
            self._mode.detach()
        if self._pending and not call.replay:
            self._note(running)
            self._count_all = self._listener is not None or bool(self._pending)

    def close(self) -> None:
        """The session closes: no call is watched any more, the mode is gone (from the
        closing thread's stack; another thread's is taken off by its own calls' ends)."""
        self._running.clear()
        self._by_call.clear()
        self._mode.detach()

    # -- per operation ---------------------------------------------------------------------------
    def owner(self, frame: types.FrameType | None) -> _Running | None:
        """The watched call whose own code made the intercepted call, found on the stack."""
        stops, forwarded, below = self._stops, False, None
        while frame is not None:
            code = frame.f_code
            if code in stops:
                break
            if code is _FORWARD:
                forwarded = True
            elif code is _HANDLER:  # another session's handler: see through only what
                if not forwarded:  # it forwards, not what it computes itself
                    return None
                forwarded = False
            below, frame = frame, frame.f_back
        if frame is None or below is None:
            return None
        if frame.f_code is not stops[0]:  # `inner`: the call's frame is its caller
            frame = frame.f_back
        running = self._running.get(frame)  # type: ignore[arg-type]
        if running is None or (running.code is not None and below.f_code is not running.code):
            return None  # a child's call, a hook, or a call abandoned by a BaseException
        return running

    def dispatch(
        self, running: _Running, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        name = op_name(func)
        selected = name in running.names
        if not (selected or self._count_all):  # the common case: nothing to do
            return forward_op(func, args, kwargs)
        counts = running.counts
        k = counts[name] = counts.get(name, 0) + 1
        if self._listener is not None:
            run = lambda: forward_op(func, args, kwargs)  # noqa: E731
            return run_unseen(self._listener, running.call, name, k, func, run)
        if not selected:
            return forward_op(func, args, kwargs)
        assert self._handler is not None
        sites = running.sites
        found = [x for x in (sites.get((name, None)), sites.get((name, k))) if x is not None]
        weights = []
        if name == SDPA:
            pair = (sites.get((WEIGHTS, None)), sites.get((WEIGHTS, k)))
            weights = [x for x in pair if x is not None]
        if not found and not weights:
            return forward_op(func, args, kwargs)
        # the handler's own work (copies, explicit attention) is hidden from every function
        # mode; the call it forwards is not (forward_op)
        return run_unseen(self._handler, running.call, found, weights, func, args, kwargs)

    # -- resolution ------------------------------------------------------------------------------
    def _seen(self) -> dict[str, dict[str, int]]:
        seen: dict[str, dict[str, int]] | None = getattr(self._local, "seen", None)
        if seen is None:
            seen = self._local.seen = {}
        return seen

    def _note(self, running: _Running) -> None:
        name, counts = running.call.name, running.counts
        seen = self._seen().setdefault(name, {})
        for op, n in counts.items():
            seen[op] = max(seen.get(op, 0), n)
        for key in [key for key in self._pending if key[0] == name]:
            _, op, k = key
            if counts.get(SDPA if op == WEIGHTS else op, 0) >= (k or 1):
                self._pending.discard(key)

    def check(self) -> None:
        """A pass of this thread ended: a selector whose module ran but whose operation part
        matched none of its calls raises (see ``_select``, "Resolution")."""
        if not self._pending:
            return
        seen, self._local.seen = self._seen(), {}
        for module_name, op, k in sorted(self._pending, key=str):
            if module_name in seen:
                raise LayerNotFoundError(self._miss(module_name, op, k, seen[module_name]))

    def _miss(self, name: str, op: str, k: int | None, ran: dict[str, int]) -> str:
        layers = self._layers
        module = layers.root if name == "" else layers.modules[name]
        where = (
            f"the model's own forward ({type(module).__name__})"
            if name == ""
            else f"{name!r} ({type(module).__name__})"
        )
        text = OpSelector(name, op, k).name
        target = SDPA if op == WEIGHTS else op
        if k and ran.get(target, 0):
            msg = f"{text!r} selects nothing: {target} ran {ran[target]} time(s) in a call"
            msg += f" of {where}"
        else:
            msg = f"{text!r} selects nothing: no {target} ran in {where} during the forward"
            if op == WEIGHTS and "multi_head_attention_forward" in ran:
                msg += (
                    " (nn.MultiheadAttention runs its attention inside "
                    "F.multi_head_attention_forward, which hookscope sees as one operation: its "
                    "weights are the module's own second output, returned with "
                    "need_weights=True, per head with average_attn_weights=False; capture the "
                    "module itself)"
                )
            elif op == WEIGHTS:
                msg += " (attention weights come from F.scaled_dot_product_attention; with eager "
                msg += "attention, select its softmax)"
            close = difflib.get_close_matches(target, list(ran), n=3, cutoff=0.6)
            msg += f". Closest: {', '.join(map(repr, close))}" if close else ""
        ran = {o: n for o, n in ran.items() if o not in METADATA}
        own = ", ".join(f"{o} x{n}" if n > 1 else o for o, n in list(ran.items())[:24])
        msg += f". Its own operations were: {own or 'none'}{', ...' if len(ran) > 24 else ''}"
        kids = [f"{name}.{k}" if name else k for k, _ in module.named_children()][:3]
        if kids:
            msg += f"; its child modules' are theirs ({', '.join(map(repr, kids))}, ...)"
        return f"{msg}. List them all with hookscope.names(model, ops=True, inputs=...)."


def _call_frame(call: ModuleCall) -> types.FrameType:
    """The ``_call_impl`` frame of ``call``, from its pre-hook (a few frames up)."""
    frame: types.FrameType | None = sys._getframe(2)
    for _ in range(16):  # session frames, graph-break wrappers, then inner, then _call_impl
        if frame is None:
            break
        if frame.f_code is _CALL_IMPL:
            return frame
        frame = frame.f_back
    raise UnsupportedModelError(
        f"the call of {call.name or 'the model'!r} ({type(call.module).__name__}) does not run "
        "through torch.nn.Module.__call__ as hookscope expects, so the operations it runs "
        "cannot be attributed to it. Select a layer instead of an operation."
    )


_CALL_IMPL = _torch.CALL_CODES[0]


class _Mode(FunctionInterceptor):
    """Intercepts calls while a watched call runs; see :class:`OpWatch`."""

    def __init__(self, watch: OpWatch) -> None:
        super().__init__()
        self._watch = watch

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        running = self._watch.owner(sys._getframe(1))
        if running is None:  # forward_op: sessions below must see the call as it was made
            return forward_op(func, args, kwargs or {})
        return self._watch.dispatch(running, func, args, kwargs or {})


_FORWARD = forward_op.__code__
_HANDLER = _Mode.__torch_function__.__code__
