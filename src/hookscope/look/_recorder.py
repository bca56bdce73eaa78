"""The summary's session: one record per module call, operators charged to the innermost.

:class:`Recorder` is a :class:`hookscope.core.Session` tracking every module. Its hooks do
the least they can while the forward runs (shape trees of inputs and outputs, the counter's
target); names of arguments, parameter counts and everything else are worked out once the
forward is over (``_rows``), when on a GPU the device is still busy.

With ``ops=True`` it also follows the operations each module's own code calls, through the
session's operation listener (``Session._listen_ops``, the machinery of
``hs.names(ops=True)``): one :class:`OpRecord` per call, its FLOPs being what the counter
charged to its module's call while it ran. Without it no function mode is ever pushed.
"""

from __future__ import annotations

import time as _time
from typing import Any

import torch
from torch import nn

from ..core import Binder, ModuleCall, Session, _torch, leaves, op_qualname
from ._flops import Counter, Tally
from ._profiles import Profile, Profiles
from ._shapes import ShapeTree, Walk, has_shape

__all__ = ["OpRecord", "Record", "Recorder", "bind_names"]

_BINDERS: dict[type, Binder] = {}  # one signature per module class


def bind_names(module: nn.Module, args: list[Any], kwargs: dict[str, Any]) -> dict[str, Any]:
    """``{argument name: value}`` after ``module.forward``'s signature."""
    cls = type(module)
    binder = _BINDERS.get(cls) if "forward" not in module.__dict__ else None
    if binder is None:
        binder = Binder(module)
        if "forward" not in module.__dict__:
            _BINDERS[cls] = binder
    return binder.bind(tuple(args), kwargs)


def _tree(obj: Any) -> ShapeTree:
    return Walk().tree(obj)


class Record:
    """One module call while the forward runs (turned into a ``SummaryRow`` after)."""

    __slots__ = (
        "args",
        "call",
        "child_flops",
        "dtype",
        "index",
        "key",
        "kwargs",
        "live",
        "module",
        "muted",
        "nbytes",
        "output",
        "parent",
        "peak",
        "probe",
        "profile",
        "raised",
        "remute",
        "start",
        "tally",
        "tensors",
        "time_ms",
    )

    def __init__(self, call: ModuleCall, index: int, parent: int | None) -> None:
        self.call, self.module, self.index, self.parent = call, call.module, index, parent
        self.tally = Tally()
        self.args: list[ShapeTree] = []
        self.kwargs: dict[str, ShapeTree] = {}
        self.output: ShapeTree = None
        self.dtype: torch.dtype | None = None
        self.nbytes = self.child_flops = self.live = self.peak = self.tensors = 0
        self.raised = self.muted = self.remute = self.probe = False
        self.key: Any = None  # learn this kind of call when it returns
        self.profile: Profile | None = None
        self.start = 0.0
        self.time_ms: float | None = None

    @property
    def total_flops(self) -> int:
        return self.tally.flops + self.child_flops


class OpRecord:
    """One operation a module's own code called (``ops=True``), in execution order."""

    __slots__ = (
        "after",
        "dtype",
        "flops",
        "how",
        "k",
        "name",
        "nbytes",
        "output",
        "owner",
        "raised",
        "tensor",
        "time_ms",
        "uncounted",
    )

    def __init__(self, owner: Record, after: int, name: str, k: int, how: str) -> None:
        self.owner, self.after, self.name, self.k, self.how = owner, after, name, k, how
        self.output: ShapeTree = None
        self.dtype: torch.dtype | None = None
        self.nbytes = self.flops = 0
        self.uncounted: dict[str, int] = {}
        self.tensor = False  # returned a tensor (calls that return none get no row)
        self.raised = True  # until it returns
        self.time_ms: float | None = None


class Recorder(Session):
    """Rows of every module call; see the module docstring."""

    _entry = "hs.summary"

    def __init__(self, model: nn.Module, *, time: bool, ops: bool = False) -> None:
        super().__init__(model, recompile=True, this_thread=True)
        self.modules = self.every_module()
        self.records: list[Record] = []
        self.outside = Tally()  # operators run outside every module
        self.counter = Counter(self.outside, self._alloc if time else None)
        # time=True needs every allocation, ops=True every operator: no call is skipped then
        self._profiles = None if time or ops else Profiles(self.modules)
        self.ops: list[OpRecord] = []
        if ops:
            self._listen_ops(self.modules, self._listen)
        self._open: list[Record] = []
        self._time = time
        self._live = 0
        self.failed: Record | None = None  # the innermost call of the error unwinding
        self.unwinding = False

    def _install(self, hooks: Any) -> None:
        self._track(hooks, self.modules)

    # -- calls ------------------------------------------------------------------------------------
    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        parent = self._open[-1] if self._open else None
        rec = Record(call, len(self.records), None if parent is None else parent.index)
        rec.args = [_tree(a) for a in args]
        rec.kwargs = {k: _tree(v) for k, v in kwargs.items()}
        self.records.append(rec)
        if parent is not None and parent.muted and not self.counter.active:
            self.counter.unmute()  # a call made from inside a profiled leaf: count it
            rec.remute = True
        elif self._profiles is not None and not _torch.children(call.module):
            worth = self._profiles.worth(type(call.module))
            if worth is None:
                rec.probe = True
            elif worth:
                self._lookup(rec, args, kwargs)
        if self._time:
            rec.start, rec.live, rec.peak = _time.perf_counter(), self._live, self._live
        self._open.append(rec)
        if not rec.muted:
            self.counter.target = rec.tally

    def _lookup(self, rec: Record, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        assert self._profiles is not None
        key = self._profiles.key(rec.module, args, kwargs)
        if key is None:
            return
        known = self._profiles.get(key)
        if known is False:
            rec.key = key
        elif isinstance(known, Profile) and self.counter.mute():
            rec.profile, rec.muted = known, True  # (if another mode is innermost: count it)

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        rec = self._close(call)
        self._returned_record(rec, output)
        self._charge_caller(rec)
        self.unwinding = False

    def _returned_record(self, rec: Record, output: Any) -> None:
        walk = Walk()
        rec.output = walk.tree(output)
        rec.dtype, rec.nbytes, rec.tensors = walk.dtype, walk.nbytes, walk.tensors
        if rec.profile is not None:
            rec.tally.flops += rec.profile.flops
            for name, n in rec.profile.uncounted:
                rec.tally.add_uncounted(name, n)
        elif self._profiles is not None:
            if rec.key is not None:
                self._profiles.learn(rec.key, rec.tally)
            elif rec.probe:
                self._profiles.judge(type(rec.module), rec.tally)
        if self._time:
            self._timed(rec, output)

    def _raised(self, call: ModuleCall) -> None:
        rec = self._close(call)
        rec.raised = True
        if self._time:
            self._timed(rec, None)
        self._charge_caller(rec)
        if not self.unwinding:
            self.failed = rec
        self.unwinding = True

    def _close(self, call: ModuleCall) -> Record:
        """Pop the call's record (and any left open inside it, as raised)."""
        while True:
            rec = self._open.pop()
            if rec.muted:
                self.counter.unmute()
            if rec.remute:
                self.counter.mute()
            parent = self._open[-1] if self._open else None
            self.counter.target = self.outside if parent is None else parent.tally
            if rec.call is call or not self._open:
                return rec
            rec.raised = True
            self._charge_caller(rec)

    def _charge_caller(self, rec: Record) -> None:
        """Add a closed call's FLOPs (and peak memory) to its caller's."""
        if rec.parent is not None:
            parent = self.records[rec.parent]
            parent.child_flops += rec.total_flops
            parent.peak = max(parent.peak, rec.peak)

    def abandon_open(self) -> None:
        """Calls still open when the forward ended with an exception: they raised."""
        while self._open:
            self._raised(self._open[-1].call)

    # -- operations (ops=True) -------------------------------------------------------------------
    def _listen(self, call: ModuleCall, name: str, k: int, func: Any, run: Any) -> Any:
        """An operation of ``call``'s own code (``OpWatch``): run it, noting what it did.
        Its module call's tally is the counter's target meanwhile: what it gains is the
        operation's."""
        rec = next((r for r in reversed(self._open) if r.call is call), None)
        if rec is None:  # pragma: no cover - the watch follows only calls that are open
            return run()
        op = OpRecord(rec, len(self.records), name, k, op_qualname(func))
        self.ops.append(op)
        flops, uncounted = rec.tally.flops, dict(rec.tally.uncounted)
        start = _time.perf_counter() if self._time else 0.0
        out = run()
        if self._time:
            self._timed_op(op, start, out)
        walk = Walk()
        op.output = walk.tree(out)
        op.dtype, op.nbytes, op.tensor = walk.dtype, walk.nbytes, walk.tensors > 0
        op.flops = rec.tally.flops - flops
        for n, count in rec.tally.uncounted.items():
            if count > uncounted.get(n, 0):
                op.uncounted[n] = count - uncounted.get(n, 0)
        op.raised = False
        return out

    # -- time and memory --------------------------------------------------------------------------
    def _alloc(self, nbytes: int) -> None:
        self._live += nbytes
        if self._open and self._live > self._open[-1].peak:
            self._open[-1].peak = self._live

    def _timed(self, rec: Record, output: Any) -> None:
        if any(t.is_cuda for _, t in leaves(output)):
            torch.cuda.synchronize()  # time=True measures the device's work too
        rec.time_ms = (_time.perf_counter() - rec.start) * 1e3

    def _timed_op(self, op: OpRecord, start: float, output: Any) -> None:
        if any(t.is_cuda for _, t in leaves(output)):
            torch.cuda.synchronize()
        op.time_ms = (_time.perf_counter() - start) * 1e3

    # -- after the forward ------------------------------------------------------------------------
    def inputs_of(self, rec: Record) -> dict[str, ShapeTree]:
        named = bind_names(rec.module, rec.args, rec.kwargs)
        return {k: v for k, v in named.items() if has_shape(v)}
