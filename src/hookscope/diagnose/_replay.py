"""Tier 2 of ``hs.nonfinite``: replay a step at operator level to name the producer.

The step is replayed on the copies of its inputs taken when the forward began, with that
forward's RNG state and autocast regions (a float16 overflow happens again), as a private
forward (no other session sees it) on clones of the model's
buffers (the real ones are neither changed nor bumped in version, so a backward of the user's
own graph still works). ``.grad`` is never touched.

Forward: a dispatch mode records, for every operator, which values it read and wrote (a value
is a storage at a version, so in-place operators and views are followed) and whether each held
a NaN or an Inf. The producer is found by following the data back from the non-finite output:
the first operator on that path whose output holds the kind of non-finite value traced (a NaN,
else an Inf) although none of its inputs did. Non-finite values that never reach the output
(a ``-inf`` padding that a max-pool discards, memory filled with NaN by
``torch.use_deterministic_algorithms`` before an operator writes it) are not on that path. A
second replay stops at that operator to measure its inputs and outputs.

Backward: the replayed graph is differentiated into a private gradient with the gradient that
reached the model's outputs, and post-hooks on its nodes find the first node that sent a
non-finite gradient while receiving a finite one; autograd sequence numbers recorded around
each module call name the call that created the node (the innermost call whose range holds
it: the model's own code when no child's does). A node is named by its aten operator, or by
the ``torch.autograd.Function`` it runs.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.multiprocessing.reductions import StorageWeakRef

from ..core import (
    DispatchInterceptor,
    ModuleCall,
    Session,
    _torch,
    leaves,
    map_tensors,
    private_forward,
)
from ..core._torch import node_sequence_nr, sequence_nr
from ._sharded import among
from ._stats import stored

__all__ = [
    "INTENDED",
    "Autocast",
    "Found",
    "Inputs",
    "autocast_state",
    "floats",
    "holds",
    "plain",
    "producer",
    "replay_backward",
    "replay_forward",
    "stats",
]

#: (operator, module name, call (1-based), statistics) of a producer
Found = tuple[str | None, str | None, int, dict[str, Any]]

FINITE, INF, NAN = 0, 1, 2

#: the autocast regions a forward ran in: (device type, dtype) of each enabled one
Autocast = tuple[tuple[str, torch.dtype], ...]
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "mps")


def autocast_state() -> Autocast:
    """The autocast regions the code running now is in."""
    found = []
    for device in _AUTOCAST_DEVICES:
        try:
            if torch.is_autocast_enabled(device):
                found.append((device, torch.get_autocast_dtype(device)))
        except RuntimeError:  # a device type this build does not know
            continue
    return tuple(found)


class _Stop(BaseException):
    """Ends a replay early (a BaseException: model code cannot catch it)."""


def plain(t: Tensor) -> Tensor:
    """The values of ``t`` as an ordinary tensor (a nested tensor's packed values, a sparse
    tensor's stored values: its other values are zeros, finite; complex numbers as pairs of
    reals)."""
    return stored(t.detach())[0]


def stats(tensors: list[Tensor]) -> dict[str, Any]:
    """Counts of NaN / +Inf / -Inf and min, max, mean of the finite values (exact, on host)."""
    flat = (
        torch.cat([plain(t).reshape(-1).double().cpu() for t in tensors])
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


def kind(t: Tensor) -> int:
    """FINITE, INF (non-finite values but no NaN) or NAN, exactly."""
    v = plain(t)
    if v.numel() == 0:
        return FINITE
    if bool(v.isnan().any()):
        return NAN
    return FINITE if bool(torch.isfinite(v).all()) else INF


# -- the replay ---------------------------------------------------------------------------------


class _Tracker(Session):
    """Module calls during a replay: the innermost running call (forward) and, with ``seq``,
    the autograd sequence numbers each call spanned (backward)."""

    def __init__(self, module: nn.Module, names: dict[int, str], *, seq: bool = False) -> None:
        super().__init__(module, recompile=True, this_thread=True)
        self.names, self.seq = names, seq
        self.ranges: list[list[Any]] = []  # [start, end, name, call]
        self.output: Any = None
        self.allowed: set[str] = set()

    def _install(self, hooks: Any) -> None:
        self._track(hooks, self.every_module())

    def _name(self, call: ModuleCall) -> str:
        return self.names.get(id(call.module), call.name)

    def _started(self, call: ModuleCall, args: Any, kwargs: Any) -> None:
        if self.seq:
            self.ranges.append([sequence_nr(), -1, self._name(call), call.index + 1])

    def _returned(self, call: ModuleCall, args: Any, output: Any) -> None:
        self._close_range(call)
        if call.parent is None:
            self.output = output

    def _raised(self, call: ModuleCall) -> None:
        self._close_range(call)

    def _close_range(self, call: ModuleCall) -> None:
        if not self.seq:
            return
        name = self._name(call)
        for r in reversed(self.ranges):
            if r[1] == -1 and (r[2], r[3]) == (name, call.index + 1):
                r[1] = sequence_nr()
                break

    def where(self) -> tuple[str | None, int]:
        stack = self.now.stack
        if not stack:
            return None, 0
        call = stack[-1]
        return self._name(call), call.index + 1

    def in_allowed(self) -> bool:
        """Whether an allowed layer's call is running (its infinities are intended)."""
        return bool(self.allowed) and any(self._name(c) in self.allowed for c in self.now.stack)

    def owner(self, seq: int) -> tuple[str | None, int]:
        """The innermost call whose range of sequence numbers holds ``seq``. Ranges nest; a
        call whose range equals its parent's (the parent made no node outside it) started
        later and is the inner one."""
        best = None
        for r in self.ranges:  # in the order the calls started
            if r[0] <= seq < r[1] and (best is None or r[1] - r[0] <= best[1] - best[0]):
                best = r
        return (None, 0) if best is None else (best[2], best[3])


@contextlib.contextmanager
def _replaying(
    module: nn.Module, rng: Any, autocast: Autocast, tracker: _Tracker
) -> Iterator[None]:
    """The RNG as it was when the forward began (the caller's restored after), its autocast
    regions, clones of every buffer in place of the real ones, and a private forward seen only
    by ``tracker``."""
    swapped = [
        (m, name, b)
        for m in module.modules()
        for name, b in _torch.buffers_of(m).items()
        if b is not None
    ]
    devices = [torch.device("cuda", i) for i in range(len(rng[1]))] if rng[1] else []
    try:
        for m, name, b in swapped:
            _torch.buffers_of(m)[name] = b.detach().clone()
        with torch.random.fork_rng(devices=devices):
            torch.random.set_rng_state(rng[0])
            if rng[1]:
                torch.cuda.set_rng_state_all(rng[1])
            with contextlib.ExitStack() as regions:
                for device, dtype in autocast:
                    regions.enter_context(torch.autocast(device, dtype=dtype))
                with tracker, private_forward(tracker):
                    yield
    finally:
        for m, name, b in swapped:
            _torch.buffers_of(m)[name] = b


def _call(module: nn.Module, inputs: Any) -> Any:
    args, kwargs = inputs
    return module(*args, **kwargs)


#: A value: a storage's address, which storage that was at this address (a storage freed
#: during the forward leaves its address to a later one), and its version.
Value = tuple[int, int, int]


@dataclass
class _Op:
    name: str
    module: str | None
    call: int
    inputs: list[tuple[Value | None, int]]  # (value, kind) read, before the op ran
    index: int
    deliberate: bool  # given an infinity as a constant, or run by an allowed layer


@dataclass
class _Flow:
    """What the dispatch mode saw: the operator that wrote each value, and what it was."""

    writer: dict[Value, tuple[_Op, int]] = field(default_factory=dict)
    external: dict[Value, str] = field(default_factory=dict)
    count: int = 0
    #: address -> (weak reference to the storage last seen there, its generation)
    storages: dict[int, tuple[StorageWeakRef, int]] = field(default_factory=dict)

    def key(self, t: Tensor) -> Value | None:
        """The value ``t`` holds: its storage at its current version (views share both). A
        storage at an address whose previous storage was freed is a new generation, so that
        a temporary's address taken over by a later tensor is not mistaken for it."""
        if t.layout != torch.strided and not t.is_nested:  # sparse: its values' storage
            t = _torch.sparse_values(t)
        try:
            storage = t.untyped_storage()
            address, version = storage.data_ptr(), _torch.version(t)
        except (RuntimeError, NotImplementedError):
            return None
        seen = self.storages.get(address)
        if seen is None or seen[0].expired():  # type: ignore[no-untyped-call]
            ref = StorageWeakRef(storage)  # type: ignore[no-untyped-call]
            seen = self.storages[address] = (ref, seen[1] + 1 if seen else 0)
        return address, seen[1], version


class _Record(DispatchInterceptor):
    def __init__(
        self, tracker: _Tracker, flow: _Flow, stop_at: int | None = None, stop: bool = True
    ) -> None:
        super().__init__()
        self.tracker, self.flow, self.stop_at, self.stop = tracker, flow, stop_at, stop
        self.measured: dict[str, Any] | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if among(types):  # (tensor parallelism's activations: measured on their pieces)
            return NotImplemented
        if func.is_view or func.overloadpacket is _torch.LOCAL_SCALAR_DENSE:
            return func(*args, **kwargs)
        ins = floats((args, kwargs))
        index = self.flow.count
        self.flow.count += 1
        if index == self.stop_at:
            before = stats(ins)
            out = func(*args, **kwargs)
            self.measured = {"inputs": before, "outputs": stats(floats(out))}
            if not self.stop:
                return out
            raise _Stop
        read = [(self.flow.key(t), kind(t)) for t in ins]
        out = func(*args, **kwargs)
        name, call = self.tracker.where()
        deliberate = self.tracker.in_allowed() or _infinite_constant((args, kwargs))
        op = _Op(f"aten.{func.overloadpacket.__name__}", name, call, read, index, deliberate)
        # Written in place: the version counter is bumped only once the operator has
        # returned through the dispatcher, after this mode (ADInplaceOrView), hence + 1.
        mutated = _written(func, args, kwargs) if _torch.is_mutable(func) else []
        fresh = [t for t in floats(out) if not any(t is m for m in mutated)]
        reads = {k for k, _ in read}
        for t, bump in [*((t, 0) for t in fresh), *((t, 1) for t in mutated)]:
            k = self.flow.key(t)
            # an alias of an input (an _unsafe_view) writes nothing
            if k is not None and (bump or k not in reads):
                address, generation, version = k
                self.flow.writer[address, generation, version + bump] = (op, kind(t))
        return out


def _infinite_constant(args: Any) -> bool:
    """Whether an operator's arguments include an infinity as a plain number."""
    stack = [args]
    while stack:
        a = stack.pop()
        if isinstance(a, float) and math.isinf(a):
            return True
        if isinstance(a, (tuple, list)):
            stack.extend(a)
        elif isinstance(a, dict):
            stack.extend(a.values())
    return False


def _written(func: Any, args: Any, kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors an operator writes in place (``Tensor(a!)`` in its schema)."""
    out = []
    for i, arg in enumerate(_torch.schema_arguments(func)):
        info = arg.alias_info
        if info is None or not info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        out += floats(value)
    return out


def _source(flow: _Flow, start: Value, want: int) -> tuple[_Op | None, str | None]:
    """Follow the values back from ``start`` (holding ``want``: NAN, or INF for any non-finite
    value) to the first operator on their path that made them from inputs without; or the
    outside value (``"<input>"``, a parameter's name) they came from."""
    seen: set[Value] = set()
    todo = [start]
    while todo:
        value = todo.pop()
        if value in seen:
            continue
        seen.add(value)
        found = flow.writer.get(value)
        if found is None:
            return None, flow.external.get(value, "<unknown>")
        op, _ = found
        bad = [k for k, kd in op.inputs if k is not None and holds(kd, want)]
        if not bad:
            return op, None
        todo.extend(reversed(bad))
    return None, None


def holds(found: int, want: int) -> bool:
    """Whether a value of kind ``found`` holds what is traced: a NaN, or (INF) any non-finite."""
    return found == NAN if want == NAN else found != FINITE


#: what ``replay_forward`` returns when the non-finite values are intended
INTENDED = "<intended>"


def producer(flow: _Flow, start: Value, want: int) -> tuple[_Op | None, str | None]:
    """The operator to blame for the non-finite value at ``start``, or the outside source, or
    :data:`INTENDED`.

    A NaN is blamed on the operator where it first appeared, unless the infinities it was
    made from were not put there on purpose (then their source is blamed: a division by
    zero, an overflow). Infinities are on purpose when an operator was given them as a
    constant (``masked_fill(mask, -inf)``, ``torch.full(..., -inf)``, a ``-inf`` padding) or an
    allowed layer made them, or when they came in with the inputs (masks); NaN in the inputs
    is the inputs' fault.
    """
    if want == INF:
        op, outside = _source(flow, start, INF)
        if (op is not None and op.deliberate) or outside == "<input>":
            return None, INTENDED
        return op, outside
    op, outside = _source(flow, start, NAN)
    if op is None:
        return None, outside
    for value, kd in op.inputs:
        if value is None or kd != INF:
            continue
        source, where = _source(flow, value, INF)
        if source is not None and not source.deliberate:
            return source, None
        if source is None and where not in (None, "<input>", "<unknown>"):
            return None, where  # a parameter or buffer holding an infinity
    return op, None


def replay_forward(
    module: nn.Module,
    names: dict[int, str],
    allowed: set[str],
    inputs: Any,
    rng: Any,
    autocast: Autocast = (),
    lockstep: bool = False,
) -> tuple[Found | None, str | None]:
    """``(found, outside)``: the operator to blame for the non-finite output (see
    :func:`producer`; ``(None, None)`` if the output is finite in the replay), or, if the
    values came from outside the model's operators, ``(None, "<input>")`` or
    ``(None, "<layer>.<parameter>")``, or ``(None, INTENDED)``.

    ``lockstep``: every rank of a sharded model calls this together, and each forward
    all-gathers parameters (FSDP), so every rank runs the same forwards to their end: both
    replays always, whatever this rank found, the second one measuring without stopping."""
    if lockstep:
        return _replay_lockstep(module, names, allowed, inputs, rng, autocast)
    flow = _Flow()
    tracker = _Tracker(module, names)
    tracker.allowed = allowed
    with _replaying(module, rng, autocast, tracker):
        _register_outside(flow, module, names, inputs)
        with _Record(tracker, flow):
            _call(module, inputs)
    bad = [(kind(t), t) for t in floats(tracker.output)]
    bad = [(k, t) for k, t in bad if k != FINITE]
    if not bad:
        return None, None
    want, tensor = max(bad, key=lambda kt: kt[0])  # a NaN first
    start = flow.key(tensor)
    op, outside = producer(flow, start, want) if start is not None else (None, None)
    if op is None:
        return None, outside
    measure = _Record(_Tracker(module, names), _Flow(), stop_at=op.index)
    with _replaying(module, rng, autocast, measure.tracker), contextlib.suppress(_Stop), measure:
        _call(module, inputs)
    return (op.name, op.module, op.call, measure.measured or {}), None


def _replay_lockstep(
    module: nn.Module,
    names: dict[int, str],
    allowed: set[str],
    inputs: Any,
    rng: Any,
    autocast: Autocast,
) -> tuple[Found | None, str | None]:
    flow = _Flow()
    tracker = _Tracker(module, names)
    tracker.allowed = allowed
    with _replaying(module, rng, autocast, tracker), torch.no_grad():
        _register_outside(flow, module, names, inputs)
        with _Record(tracker, flow):
            _call(module, inputs)
    bad = [(k, t) for k, t in ((kind(t), t) for t in floats(tracker.output)) if k != FINITE]
    op, outside = None, None
    if bad:
        want, tensor = max(bad, key=lambda kt: kt[0])  # a NaN first
        start = flow.key(tensor)
        op, outside = producer(flow, start, want) if start is not None else (None, None)
    measure = _Record(
        _Tracker(module, names), _Flow(), stop_at=op.index if op else None, stop=False
    )
    with _replaying(module, rng, autocast, measure.tracker), torch.no_grad(), measure:
        _call(module, inputs)
    if op is None:
        return None, outside
    return (op.name, op.module, op.call, measure.measured or {}), None


def _register_outside(flow: _Flow, module: nn.Module, names: dict[int, str], inputs: Any) -> None:
    for t in floats(inputs):
        if (k := flow.key(t)) is not None:
            flow.external[k] = "<input>"
    for prefix, m in module.named_modules():
        owner = names.get(id(m), prefix)
        for pname, p in [*_torch.parameters_of(m).items(), *_torch.buffers_of(m).items()]:
            if isinstance(p, Tensor) and (k := flow.key(p)) is not None:
                flow.external.setdefault(k, f"{owner}.{pname}" if owner else pname)


# -- backward -------------------------------------------------------------------------------


def replay_backward(
    module: nn.Module,
    names: dict[int, str],
    inputs: Any,
    rng: Any,
    out_grads: dict[int, Tensor],
    autocast: Autocast = (),
) -> Found | None:
    """The first backward node that sent a non-finite gradient, and the call that made it."""
    tracker = _Tracker(module, names, seq=True)
    found: list[Found] = []
    with _replaying(module, rng, autocast, tracker), torch.enable_grad():
        output = _call(module, inputs)
        pairs = [(t, out_grads[i]) for i, (_, t) in enumerate(leaves(output)) if i in out_grads]
        outs = [t for t, _ in pairs if t.requires_grad]
        if not outs:
            return None
        _watch_nodes(tracker, outs, found)
        wrt = [x for x in (*module.parameters(), *floats(inputs)) if x.requires_grad]
        with contextlib.suppress(_Stop):
            torch.autograd.grad(
                outs, wrt, [g for t, g in pairs if t.requires_grad], allow_unused=True
            )
    return found[0] if found else None


def _watch_nodes(tracker: _Tracker, outs: list[Tensor], found: list[Found]) -> None:
    """Post-hooks on every node of the replayed graph; the first producer lands in ``found``
    and ends the backward."""
    start = min((r[0] for r in tracker.ranges), default=0)
    seen: set[Any] = set()
    todo: list[Any] = [t.grad_fn for t in outs if t.grad_fn is not None]
    while todo:
        node = todo.pop()
        if node in seen or node is None:
            continue
        seen.add(node)
        if node_sequence_nr(node) >= start:
            tracker.hooks.node(node, _node_hook(tracker, node, found))
        todo.extend(n for n, _ in node.next_functions)


def _node_hook(tracker: _Tracker, node: Any, found: list[Found]) -> Any:
    def check(grad_inputs: Any, grad_outputs: Any) -> None:
        ins = [g for g in grad_outputs if isinstance(g, Tensor)]
        outs = [g for g in grad_inputs if isinstance(g, Tensor)]
        if found:
            return
        before = max((kind(g) for g in ins), default=FINITE)
        after = max((kind(g) for g in outs), default=FINITE)
        if after > FINITE and (before == FINITE or (after == NAN and before != NAN)):
            name, call = tracker.owner(node_sequence_nr(node))
            st = {"gradient in": stats(ins), "gradient out": stats(outs)}
            found.append((_op_of(node), name, call, st))
            raise _Stop

    return check


def _op_of(node: Any) -> str:
    """What an autograd node runs the backward of: a ``torch.autograd.Function`` by its
    qualified name, an aten operator (``MmBackward0`` -> ``aten.mm``) where one of that name
    exists, else the node's own name (``CopySlices``)."""
    function = _torch.function_class(node)
    if function is not None:
        return f"{function.__module__}.{function.__qualname__}"
    name: str = node.name()
    base = re.sub(r"Backward\d*$", "", name.rsplit("::", 1)[-1])
    # a word starts at a capital after a small letter, or before a capital and a small
    # letter (MaxPool2DWithIndices -> max_pool2d_with_indices)
    op = re.sub(r"(?<=[a-z])(?=[A-Z])|(?<=[A-Z0-9])(?=[A-Z][a-z])", "_", base).lower()
    for candidate in (op, f"_{op}"):
        if _is_aten(candidate):
            return f"aten.{candidate}"
    return name


def _is_aten(name: str) -> bool:
    try:
        getattr(torch.ops.aten, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class Inputs:
    """A forward's inputs, kept for the replays: the tensors themselves (copying every batch
    would cost every step), with their versions, so that a model that changes its inputs in
    place is noticed and not replayed on changed values. Inference tensors, which have no
    version counter, are copied."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self.versions: list[tuple[Tensor, int]] = []

        def keep(_: Any, t: Tensor) -> Tensor:
            if t.is_inference():
                return t.clone()
            self.versions.append((t, _torch.version(t)))
            return t

        self.args, self.kwargs = map_tensors(keep, args), map_tensors(keep, kwargs)

    @property
    def unchanged(self) -> bool:
        return all(_torch.version(t) == v for t, v in self.versions)

    @property
    def call(self) -> tuple[Any, Any]:
        return self.args, self.kwargs
