"""Tier 2 of ``hs.nonfinite``: replay a step at operator level to name the producer.

The step is replayed on the copies of its inputs taken when the forward began, with that
forward's RNG state (the caller's RNG and the model's buffers are restored after). Forward: a
dispatch mode checks every operator, and the producer is the first whose output is
non-finite although its inputs were not (or that made a NaN from inputs without one), judged
on the inputs as they were before it ran (in-place operators). Backward: the replayed graph
is differentiated into a private gradient (``.grad`` is not touched) with the gradient that
reached the model's outputs, and post-hooks on its nodes find the first node that sent a
non-finite gradient while receiving a finite one; autograd sequence numbers recorded around
each module call name the call that created the node.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch._C._autograd import _get_sequence_nr
from torch.utils._python_dispatch import TorchDispatchMode

from ..core import HookSet, leaves

__all__ = ["Found", "floats", "replay_backward", "replay_forward", "stats"]

#: (operator, module name, call, statistics) of a producer
Found = tuple[str | None, str | None, int, dict[str, Any]]


class _Stop(BaseException):
    """Ends a replay at the producer (a BaseException: model code cannot catch it)."""


def stats(tensors: list[Tensor]) -> dict[str, Any]:
    """Counts of NaN / +Inf / -Inf and min, max, mean of the finite values (exact, on host)."""
    flat = (
        torch.cat([t.detach().reshape(-1).double().cpu() for t in tensors])
        if tensors
        else torch.zeros(0, dtype=torch.float64)
    )
    finite = flat[torch.isfinite(flat)]
    out: dict[str, Any] = {
        "numel": flat.numel(),
        "nan": int(flat.isnan().sum()),
        "posinf": int((flat == float("inf")).sum()),
        "neginf": int((flat == float("-inf")).sum()),
    }
    for name, fn in (("min", torch.min), ("max", torch.max), ("mean", torch.mean)):
        out[name] = float(fn(finite)) if finite.numel() else None
    return out


def floats(obj: Any) -> list[Tensor]:
    return [t for _, t in leaves(obj) if t.is_floating_point() or t.is_complex()]


def _nonfinite_kind(tensors: list[Tensor]) -> tuple[bool, bool]:
    """(has NaN, has any non-finite), exactly."""
    nan = any(bool(t.isnan().any()) for t in tensors)
    return nan, nan or any(not bool(torch.isfinite(t).all()) for t in tensors)


def _produces(before: tuple[bool, bool], after: tuple[bool, bool]) -> bool:
    """Non-finite out of finite in, or a NaN out of inputs without one (``_nonfinite_kind``
    of the inputs before the operation and of its outputs after)."""
    (in_nan, in_bad), (out_nan, out_bad) = before, after
    return out_bad and (not in_bad or (out_nan and not in_nan))


def _op_of(node_name: str) -> str:
    base = re.sub(r"Backward\d*$", "", node_name)
    return "aten." + re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower()


def replay_forward(
    root: nn.Module, names: dict[int, str], allowed: set[int], inputs: Any, rng: Any
) -> Found | None:
    """The first operator of the forward that produced a non-finite value, and its call."""
    args, kwargs = inputs
    tracker = _Tracker(root, names, allowed)
    mode = _OpCheck(tracker)
    with _replaying(root, rng), tracker, contextlib.suppress(_Stop), mode:
        root(*args, **kwargs)
    return mode.found


def replay_backward(
    root: nn.Module,
    names: dict[int, str],
    allowed: set[int],
    inputs: Any,
    rng: Any,
    out_grads: dict[int, Tensor],
) -> Found | None:
    """The first backward node that sent a non-finite gradient, and the call that made it."""
    args, kwargs = inputs
    tracker = _Tracker(root, names, allowed, seq=True)
    with _replaying(root, rng), tracker, torch.enable_grad():
        output = root(*args, **kwargs)
        pairs = [(t, out_grads[i]) for i, (_, t) in enumerate(leaves(output)) if i in out_grads]
        outs = [t for t, _ in pairs]
        found = tracker.watch_nodes(outs)
        wrt = [x for x in (*root.parameters(), *floats(inputs)) if x.requires_grad]
        with contextlib.suppress(_Stop):
            torch.autograd.grad(outs, wrt, [g for _, g in pairs], allow_unused=True)
    return found[0] if found else None


@contextlib.contextmanager
def _replaying(root: nn.Module, rng: Any) -> Iterator[None]:
    buffers = [(b, b.detach().clone()) for b in root.buffers()]
    devices = [torch.device("cuda", i) for i in range(len(rng[1]))] if rng[1] else []
    try:
        with torch.random.fork_rng(devices=devices):
            torch.random.set_rng_state(rng[0])
            if rng[1]:
                torch.cuda.set_rng_state_all(rng[1])
            yield
    finally:
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)


class _Tracker:
    """Module calls during a replay: the stack (forward) or sequence-number ranges (backward)."""

    def __init__(
        self, root: nn.Module, names: dict[int, str], allowed: set[int], *, seq: bool = False
    ) -> None:
        self.root, self.names, self.allowed, self.seq = root, names, allowed, seq
        self.stack: list[tuple[str, int, bool]] = []
        self.counts: dict[int, int] = {}
        self.ranges: list[tuple[int, int, str, int]] = []  # start, end, name, call
        self.hooks = HookSet()

    def __enter__(self) -> _Tracker:
        for module in self.root.modules():
            if id(module) in self.names:
                self.hooks.forward_pre(module, self._pre)
                self.hooks.forward(module, self._post, always_call=True)
        return self

    def __exit__(self, *exc: object) -> None:
        self.hooks.close()

    def _pre(self, module: nn.Module, args: Any) -> None:
        n = self.counts[id(module)] = self.counts.get(id(module), 0) + 1
        self.stack.append((self.names[id(module)], n, id(module) in self.allowed))
        if self.seq:
            self.ranges.append((_get_sequence_nr(), -1, *self.stack[-1][:2]))

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name, n, _ = self.stack.pop()
        if self.seq:
            for i in range(len(self.ranges) - 1, -1, -1):
                start, end, rname, rn = self.ranges[i]
                if end == -1 and (rname, rn) == (name, n):
                    self.ranges[i] = (start, _get_sequence_nr(), rname, rn)
                    break

    def where(self) -> tuple[str | None, int, bool]:
        return self.stack[-1] if self.stack else (None, 0, False)

    def owner(self, seq: int) -> tuple[str | None, int]:
        inside = [r for r in self.ranges if r[0] <= seq < r[1]]
        if not inside:
            return None, 0
        best = min(inside, key=lambda r: r[1] - r[0])
        return best[2], best[3]

    def watch_nodes(self, outs: list[Tensor]) -> list[Any]:
        """Post-hooks on every node of the replayed graph; the first producer lands in the
        returned list and ends the backward."""
        found: list[Any] = []
        start = min((r[0] for r in self.ranges), default=0)
        seen: set[Any] = set()
        todo: list[Any] = [t.grad_fn for t in outs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in seen or node is None:
                continue
            seen.add(node)
            if node._sequence_nr() >= start:
                self.hooks.node(node, self._node_hook(node, found))
            todo.extend(n for n, _ in node.next_functions)
        return found

    def _node_hook(self, node: Any, found: list[Any]) -> Any:
        def check(grad_inputs: Any, grad_outputs: Any) -> None:
            ins = [g for g in grad_outputs if isinstance(g, Tensor)]
            outs = [g for g in grad_inputs if isinstance(g, Tensor)]
            if not found and _produces(_nonfinite_kind(ins), _nonfinite_kind(outs)):
                module, call = self.owner(node._sequence_nr())
                op = _op_of(node.name())
                found.append(
                    (op, module, call, {"gradient in": stats(ins), "gradient out": stats(outs)})
                )
                raise _Stop

        return check


class _OpCheck(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, tracker: _Tracker) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.tracker = tracker
        self.found: Found | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name, call, allowed = self.tracker.where()
        if allowed or func.overloadpacket is torch.ops.aten._local_scalar_dense:
            return func(*args, **kwargs)
        ins = floats((args, kwargs))
        before = _nonfinite_kind(ins)  # before the op: an in-place op changes its input
        in_stats = stats(ins) if func._schema.is_mutable else None
        out = func(*args, **kwargs)
        outs = floats(out)
        if outs and _produces(before, _nonfinite_kind(outs)):
            op = f"aten.{func.overloadpacket.__name__}"
            st = {"inputs": in_stats or stats(ins), "outputs": stats(outs)}
            self.found = (op, name, call, st)
            raise _Stop
        return out


# -- helpers ----------------------------------------------------------------------------------
