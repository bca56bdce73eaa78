"""``hs.nonfinite``: the first NaN/Inf of a training step, named at module and operator level.

Tier 1 runs on every step and costs little: each module call's inputs and outputs (and, in
backward, the gradient arriving at each output) are reduced on the device to one number that
is non-finite exactly when the tensor holds a NaN or an Inf (a float32 sum; a sum that merely
overflows is a false alarm that tier 2 clears). The numbers are read with one host
synchronisation at the end of each forward and one at the end of each backward.

Tier 2 (``_replay``) runs only when tier 1 found something: it replays the step at operator
level, on copies of the inputs taken when the forward began and with that forward's RNG state,
to name the operator (forward) or the autograd node (backward) and the module call that ran it.
"""

from __future__ import annotations

import contextlib
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core import HookSet, Layers, leaves, map_tensors, recomputing, unwrap
from ..core._autograd import backward_id, queue_after_backward
from ..core._naming import is_called
from ..errors import NonFiniteError, UsageError
from ._replay import Found, floats, replay_backward, replay_forward, stats

__all__ = ["NonFiniteReport", "nonfinite"]

INPUT, LOSS = "<input>", "<loss>"
Mode = Literal["raise", "warn"]


@dataclass
class NonFiniteReport:
    """What a :func:`nonfinite` session found: one :class:`NonFiniteError` per problem (in
    ``mode="warn"`` the run went on), and how many forwards and backwards it checked."""

    findings: list[NonFiniteError] = field(default_factory=list)
    forwards: int = 0
    backwards: int = 0

    @property
    def ok(self) -> bool:
        return not self.findings


def _summed(t: Tensor) -> Tensor:
    t = t.detach()
    if t.is_complex():
        t = torch.view_as_real(t)
    return t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32).float()


@dataclass
class _Call:
    name: str
    call: int
    allowed: bool
    inp: Tensor | None = None  # device scalars, non-finite iff the tensors are
    out: Tensor | None = None


@dataclass
class _Pass:
    """One forward: what tier 1 saw, and what tier 2 needs to replay it."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: Any
    inp: Tensor | None = None
    calls: list[_Call] = field(default_factory=list)
    out_grads: dict[int, Tensor] = field(default_factory=dict)  # output leaf index -> grad
    loss: list[Tensor] = field(default_factory=list)  # device scalars of those grads


class _Tracer:
    def __init__(self, model: nn.Module, allow: Any, mode: Mode, replay: bool) -> None:
        if mode not in ("raise", "warn"):
            raise UsageError(f"mode must be 'raise' or 'warn', got {mode!r}")
        self.model, self.root = model, unwrap(model)
        self.names = {id(m): n for n, m in self.root.named_modules() if is_called(m)}
        self.allow_inputs, self.allowed = _allowed(model, allow)
        self.mode, self.replay = mode, replay
        self.report = NonFiniteReport()
        self.hooks = HookSet()
        self.stack: list[_Call] = []
        self.counts: dict[int, int] = {}
        self.pass_: _Pass | None = None
        self.pending: list[tuple[_Pass, _Call | None, Tensor]] = []  # backward flags
        self.queued: set[int] = set()
        self.quiet = False  # replaying: tier 1 looks away
        self.sums = _Sums()

    # -- tier 1: forward ----------------------------------------------------------------------

    def open(self) -> NonFiniteReport:
        try:
            for module in self.root.modules():
                if id(module) in self.names:
                    self.hooks.forward_pre(module, self.pre, with_kwargs=True)
                    self.hooks.forward(module, self.post)
        except BaseException:
            self.hooks.close()
            raise
        return self.report

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if self.quiet or recomputing():
            return
        if not self.stack:  # a forward starts (the model's, or a layer called on its own)
            self._start(args, kwargs)
        n = self.counts[id(module)] = self.counts.get(id(module), 0) + 1
        call = _Call(self.names[id(module)], n, id(module) in self.allowed)
        call.inp = self.sums((args, kwargs))
        self.stack.append(call)

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if self.quiet or recomputing() or not self.stack or self.pass_ is None:
            return
        call = self.stack.pop()
        call.out = self.sums(output)
        self.pass_.calls.append(call)
        self._watch_grads(output, call, root=module is self.root and not self.stack)
        if not self.stack:
            self._end_forward()

    def _start(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.counts.clear()
        self.stack.clear()
        self.sums.clear()

        def keep(_: Any, t: Tensor) -> Tensor:
            return t.detach().clone().requires_grad_(t.requires_grad and t.is_leaf)

        self.pass_ = _Pass(map_tensors(keep, args), map_tensors(keep, kwargs), _rng_state())
        self.pass_.inp = self.sums((args, kwargs))
        self.report.forwards += 1

    def _end_forward(self) -> None:
        p = self.pass_
        assert p is not None
        values = _read([p.inp, *(f for c in p.calls for f in (c.inp, c.out))])
        bad_input, rest = values[0], values[1:]
        if bad_input and not self.allow_inputs:
            self._found("forward", INPUT, None, None, {"inputs": stats(floats((p.args, p.kwargs)))})
            return
        culprit = _producer(p.calls, rest)
        if culprit is not None:
            found = self._replay_forward(p) if self.replay else None
            op, module, call, st = found if found is not None else (None, None, 0, {})
            self._found(
                "forward",
                module if module is not None else culprit.name,
                call or culprit.call,
                op,
                st,
            )

    # -- tier 1: backward ---------------------------------------------------------------------

    def _watch_grads(self, output: Any, call: _Call, *, root: bool) -> None:
        p = self.pass_
        assert p is not None
        for i, (_, t) in enumerate(leaves(output)):
            if t.requires_grad and (t.is_floating_point() or t.is_complex()):
                self.hooks.tensor(t, self._grad_hook(p, None if root else call, i))

    def _grad_hook(self, p: _Pass, call: _Call | None, index: int) -> Any:
        def on_grad(grad: Tensor) -> None:
            if self.quiet:
                return
            if call is None:  # the model's own output: what came in from the loss
                p.out_grads[index] = grad
            self.pending.append((p, call, _summed(grad)))
            task = backward_id()
            if task not in self.queued:
                self.queued.add(task)
                queue_after_backward(lambda: self._end_backward(task))

        return on_grad

    def _end_backward(self, task: int) -> None:
        self.queued.discard(task)
        pending, self.pending = self.pending, []
        if not pending:
            return
        self.report.backwards += 1
        bad = _read([flag for _, _, flag in pending])
        from_loss = [i for i, (_, call, _) in enumerate(pending) if call is None and bad[i]]
        if from_loss:
            p = pending[from_loss[0]][0]
            grads = [g for g in p.out_grads.values()]
            self._found("backward", LOSS, None, None, {"gradient": stats(grads)})
        elif any(bad):
            first = next(i for i, b in enumerate(bad) if b)
            p, call, _ = pending[first]
            found = self._replay_backward(p) if self.replay else None
            op, module, n, st = found if found is not None else (None, None, 0, {})
            receiver = call.name if call is not None else ""
            self._found(
                "backward",
                module if module is not None else receiver,
                n or (call.call if call else None),
                op,
                st,
            )

    # -- tier 2 -------------------------------------------------------------------------------

    def _replay_forward(self, p: _Pass) -> Found | None:
        self.quiet = True
        try:
            return replay_forward(self.root, self.names, self.allowed, (p.args, p.kwargs), p.rng)
        finally:
            self.quiet = False

    def _replay_backward(self, p: _Pass) -> Found | None:
        if not p.out_grads:
            return None
        self.quiet = True
        try:
            inputs = (p.args, p.kwargs)
            return replay_backward(self.root, self.names, self.allowed, inputs, p.rng, p.out_grads)
        finally:
            self.quiet = False

    # -- findings -----------------------------------------------------------------------------

    def _found(
        self, phase: str, module: str, call: int | None, op: str | None, st: dict[str, Any]
    ) -> None:
        error = NonFiniteError(
            _message(phase, module, call, op, st, self.root),
            phase=phase,
            module=module,
            call=call,
            op=op,
            stats=st,
        )
        self.report.findings.append(error)
        if self.mode == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)

    def close(self) -> None:
        self.hooks.close()
        self.pass_, self.pending = None, []


class _Sums:
    """Each tensor's sum, computed once per forward: a layer's input is mostly the output of
    the layer before. Keyed by identity and version, so an in-place change is summed again."""

    def __init__(self) -> None:
        self._done: dict[tuple[int, int], tuple[weakref.ref[Tensor], Tensor]] = {}

    def clear(self) -> None:
        self._done.clear()

    def __call__(self, obj: Any) -> Tensor | None:
        sums = [self._one(t) for t in floats(obj)]
        if not sums:
            return None
        device = sums[0].device
        return torch.stack([s.to(device) for s in sums]).sum() if len(sums) > 1 else sums[0]

    def _one(self, t: Tensor) -> Tensor:
        if t.is_inference():  # no version counter to tell an in-place change by
            return _summed(t)
        key = (id(t), t._version)
        hit = self._done.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        s = _summed(t)
        self._done[key] = (weakref.ref(t), s)
        return s


def _read(flags: list[Tensor | None]) -> list[bool]:
    """Whether each flag is non-finite: one host transfer for all of them."""
    present = [f for f in flags if f is not None]
    if not present:
        return [False] * len(flags)
    device = present[0].device
    values = iter((~torch.isfinite(torch.stack([f.to(device) for f in present]))).tolist())
    return [bool(next(values)) if f is not None else False for f in flags]


def _producer(calls: list[_Call], bad: list[bool]) -> _Call | None:
    """The first call (in completion order) whose output went non-finite from finite inputs;
    else the first non-allowed call with a non-finite output."""
    first = None
    for i, call in enumerate(calls):
        bad_in, bad_out = bad[2 * i], bad[2 * i + 1]
        if bad_out and not call.allowed:
            if not bad_in:
                return call
            first = first or call
    return first


def _allowed(model: nn.Module, allow: Any) -> tuple[bool, set[int]]:
    if allow is None:
        return False, set()
    items = list(allow) if isinstance(allow, (list, tuple)) else [allow]
    inputs = INPUT in items
    items = [a for a in items if a != INPUT]
    if not items:
        return inputs, set()
    return inputs, {id(m) for m in Layers(model).select(items).values()}


def _rng_state() -> tuple[Tensor, list[Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    return torch.random.get_rng_state(), cuda


def _fmt(st: dict[str, Any]) -> str:
    counts = f"{st['nan']} NaN, {st['posinf']} +Inf, {st['neginf']} -Inf of {st['numel']}"
    if st["min"] is None:
        return counts + " values, none finite"
    return (
        f"{counts} values; finite min {st['min']:.4g}, max {st['max']:.4g}, mean {st['mean']:.4g}"
    )


def _message(
    phase: str, module: str, call: int | None, op: str | None, st: dict[str, Any], root: nn.Module
) -> str:
    if module == INPUT:
        head = "the model's inputs already hold non-finite values (nothing in the model made them)"
    elif module == LOSS:
        head = (
            "the gradient entering the model's outputs is non-finite: it comes from the loss "
            "(or whatever was differentiated), not from the model"
        )
    else:
        kind = type(root.get_submodule(module)).__name__ if module else type(root).__name__
        head = f"first produced by {module!r} ({kind})" if module else f"first produced by {kind}"
        head += f", call {call}" if call else ""
        if op:
            head += f", in the backward of {op}" if phase == "backward" else f", operator {op}"
    parts = [f"{k}: {_fmt(v)}" for k, v in st.items()]
    return f"NaN/Inf in the {phase}: {head}." + ("\n  " + "\n  ".join(parts) if parts else "")


@contextlib.contextmanager
def nonfinite(
    model: nn.Module, *, allow: Any = None, mode: Mode = "raise", replay: bool = True
) -> Iterator[NonFiniteReport]:
    """Watch a training step for NaN/Inf and name where the first one came from.

    Wrap the forward, loss and backward (one step or many)::

        with hs.nonfinite(model) as report:
            loss = criterion(model(x), y)
            loss.backward()

    Args:
        model: the model (wrappers are seen through).
        allow: layers whose non-finite outputs are intended (any layer selector, e.g. a module
            that builds a ``-inf`` attention mask); include ``"<input>"`` to accept non-finite
            values in the model's inputs.
        mode: ``"raise"`` (default) raises :class:`~hookscope.NonFiniteError` from the forward
            or backward that produced the value; ``"warn"`` warns, records it in the report
            and goes on.
        replay: run tier 2 (replay at operator level) to name the operator.

    Yields:
        The :class:`NonFiniteReport`, filled as the session runs.

    Raises:
        NonFiniteError: with ``phase``, ``module`` (``"<input>"`` / ``"<loss>"`` for values
            that came from outside the model), ``call``, ``op`` and ``stats``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.LogSigmoid())
        >>> with hs.nonfinite(model) as report:
        ...     model(torch.ones(1, 2)).sum().backward()
        >>> report.ok, report.forwards, report.backwards
        (True, 1, 1)
    """
    tracer = _Tracer(model, allow, mode, replay)
    report = tracer.open()
    try:
        yield report
    finally:
        tracer.close()
