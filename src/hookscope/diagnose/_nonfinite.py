"""``hs.nonfinite``: the first NaN/Inf of a training step, named at module and operator level.

Tier 1 runs on every step and costs little. A session follows every module call; the floating
tensors each call takes and returns are checked on the device, many per operator
(``torch._foreach_norm`` with the infinity norm is NaN when a tensor holds a NaN, inf when it
holds an Inf, finite otherwise: it cannot overflow), and read with one host synchronisation at
the end of each forward. In backward, the gradients arriving at each call's outputs and, at the
end, the parameters' gradients are checked the same way and read once. That is on a GPU, where
each operator costs a launch and each read a synchronisation (``few_operators``). On the CPU
an operator costs its arithmetic and a read nothing, and a check is a pass over memory: a
large tensor is checked alone as it arrives, while it is still in the cache, small ones many
per operator, with the cheapest pass (:func:`_kinds_now`), read at once.

A forward is reported when the model's output is non-finite. The call that made it is found by
following the values back from the output (data flow; a NaN is followed to where a NaN first
appeared, an Inf to where a non-finite value first appeared) to the first call that returned
them from inputs without them. Non-finite values that never reach the output (a ``-inf``
attention mask, a ``-inf`` padding a max-pool drops) are intended and not reported. Tier 2
(``_replay``) replays the step at operator level to name the operator the same way.

Sharded (parameters that are ``DTensor``s, as under FSDP2 and tensor parallelism, in an
initialised process group): each rank checks its own values (its pieces of the gradients, and
of the ``DTensor`` activations tensor parallelism passes between layers), and each check's flag
is combined over the world with one small all-reduce, so a NaN on one rank is found on every
rank. Then every rank replays the forward, in lock step (each forward all-gathers the
parameters, or all-reduces a row-parallel layer's output: a rank that replayed alone would
wait forever), and every rank's finding is gathered; the one whose origin ran first in the
forward is raised on all of them, the lowest rank's among equals (``NonFiniteError.rank``):
under tensor parallelism a NaN made on one rank reaches the others through the next
all-reduce, where they would find it later in the forward. The backward is not replayed
there: its layer is named, not its operator.
"""

from __future__ import annotations

import functools
import math
import warnings
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core import (
    HookSet,
    LayerSelector,
    ModuleCall,
    Session,
    _torch,
    queue_after_backward,
    unwrap,
)
from ..errors import NonFiniteError, UsageError
from . import _stats as _device  # few_operators, looked up when called (tests patch it)
from ._replay import (
    FINITE,
    INF,
    INTENDED,
    NAN,
    Autocast,
    Inputs,
    autocast_state,
    floats,
    holds,
    kind,
    plain,
    replay_backward,
    replay_forward,
)
from ._replay import stats as _stats
from ._sharded import local, sharded_model

__all__ = ["NonFiniteReport", "nonfinite"]

INPUT, LOSS = "<input>", "<loss>"
Mode = Literal["raise", "warn"]
#: (phase, module, call, op, stats): what a finding names
Finding = tuple[str, str, int | None, str | None, dict[str, Any]]
_BATCH = 32  # tensors checked per operator
#: on the CPU, a tensor this large is checked at once, while it is in the cache (smaller ones
#: wait for the operator that checks many: one dispatch instead of a dozen)
_AT_ONCE_BYTES = 1 << 20
_NO_REPLAY = (
    "not replayed: the model changed its inputs in place, so a replay would not see the "
    "values this forward saw"
)
_BATCH_BYTES = 1 << 28  # or fewer, when they are large (they are kept alive until checked)


@dataclass
class NonFiniteReport:
    """What a :func:`nonfinite` session found.

    Attributes:
        findings: one :class:`~hookscope.NonFiniteError` per problem (in ``mode="warn"`` the
            run went on).
        overflows: with ``scaler=``, the backward passes whose gradients overflowed, which the
            ``GradScaler`` skips (expected, not raised).
        forwards, backwards: how many forwards and backwards were checked.
    """

    findings: list[NonFiniteError] = field(default_factory=list)
    overflows: list[NonFiniteError] = field(default_factory=list)
    forwards: int = 0
    backwards: int = 0

    @property
    def ok(self) -> bool:
        """No finding (overflows a GradScaler skips are not findings)."""
        return not self.findings


class _Checks:
    """Tensors to check for NaN/Inf, many per operator (:meth:`read` gets every result with
    one host transfer; on the CPU each result is read when computed, and a large tensor is
    checked at once). A tensor seen again at the same version shares its slot."""

    def __init__(self, sharded: bool = False) -> None:
        self._slots: dict[int, tuple[weakref.ref[Tensor], int, int]] = {}
        #: ``sharded``: slots by the memory their values lie in too, so that a ``DTensor`` a
        #: tensor-parallel layer's input hook made of the previous layer's output shares that
        #: output's slot (the data is followed back through it)
        self._places: dict[tuple[Any, ...], int] | None = {} if sharded else None
        self._pending: dict[tuple[torch.device, torch.dtype], list[tuple[int, Tensor]]] = {}
        self._bytes: dict[tuple[torch.device, torch.dtype], int] = {}
        self._norms: list[Tensor | int | None] = []  # a norm to read, or a kind known already

    def __len__(self) -> int:
        return len(self._norms)

    def add(self, t: Tensor) -> int:
        version = _version(t)
        hit = self._slots.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == version:
            return hit[2]
        piece = local(t)  # (a DTensor, as tensor parallelism passes between layers: its piece)
        place = _place(piece, version) if self._places is not None else None
        if place is not None and place in self._places:  # type: ignore[operator]
            slot = self._places[place]  # type: ignore[index]
            self._slots[id(t)] = (weakref.ref(t), version, slot)
            return slot
        slot = len(self._norms)
        self._norms.append(None)
        self._slots[id(t)] = (weakref.ref(t), version, slot)
        if place is not None:
            self._places[place] = slot  # type: ignore[index]
        if t.is_meta:  # no values to check (a meta-device model): finite as far as known
            return slot
        t = piece
        if t.is_nested or t.is_complex() or t.layout != torch.strided:
            t = plain(t)  # the values of nested and sparse tensors
        if not t.numel():
            return slot
        group = (t.device, t.dtype)
        pending = self._pending.setdefault(group, [])
        pending.append((slot, t))
        self._bytes[group] = self._bytes.get(group, 0) + t.nbytes
        at_once = t.nbytes >= _AT_ONCE_BYTES and not _device.few_operators(t.device)
        if at_once or len(pending) >= _BATCH or self._bytes[group] >= _BATCH_BYTES:
            self._flush(group)
        return slot

    def _flush(self, group: tuple[torch.device, torch.dtype]) -> None:
        pending = self._pending.pop(group, [])
        self._bytes.pop(group, None)
        if not pending:
            return
        ts = [t for _, t in pending]
        if not _device.few_operators(group[0]):
            for (slot, _), known in zip(pending, _kinds_now(ts), strict=True):
                self._norms[slot] = known
            return
        with torch.no_grad():
            norms = _torch.foreach_norm(ts, math.inf)
        for (slot, _), norm in zip(pending, norms, strict=True):
            self._norms[slot] = norm

    def read(self) -> list[int]:
        """FINITE, INF or NAN per slot (one host read per device)."""
        for group in list(self._pending):
            self._flush(group)
        kinds = [FINITE] * len(self._norms)
        by_device: dict[torch.device, list[tuple[int, Tensor]]] = {}
        for slot, norm in enumerate(self._norms):
            if isinstance(norm, int):
                kinds[slot] = norm
            elif norm is not None:
                by_device.setdefault(norm.device, []).append((slot, norm))
        for items in by_device.values():
            values = torch.stack([n for _, n in items]).tolist()
            for (slot, _), v in zip(items, values, strict=True):
                kinds[slot] = NAN if math.isnan(v) else INF if math.isinf(v) else FINITE
        return kinds


def _place(t: Tensor, version: int) -> tuple[Any, ...] | None:
    """Where ``t``'s values lie (its storage, offset, shape and strides) and their version;
    None for a tensor without storage of its own (a wrapper subclass)."""
    try:
        address = t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None
    return address, t.storage_offset(), tuple(t.shape), tuple(t.stride()), version


def _kinds_now(ts: list[Tensor]) -> list[int]:
    """FINITE, INF or NAN of each tensor, where an operator costs its arithmetic and a read
    nothing (the CPU): the L2 norms (one multi-tensor operator, a pass as fast as a sum; the
    max-abs norm has no vectorised kernel there), read at once, are finite exactly when the
    values are unless their squares overflow, and only then are the values checked exactly."""
    half = ts[0].dtype in (torch.float16, torch.bfloat16)
    with torch.no_grad():
        norms = _torch.foreach_norm(ts, 2, dtype=torch.float32 if half else None)
    values: list[float] = [n.item() for n in norms]
    return [FINITE if math.isfinite(v) else kind(t) for t, v in zip(ts, values, strict=True)]


def _version(t: Tensor) -> int:
    try:
        return _torch.version(t)
    except RuntimeError:  # inference tensors have no version counter
        return -1


@dataclass
class _Rec:
    """A finished call, as tier 1 saw it."""

    name: str
    call: int  # 1-based
    allowed: bool
    parent: _Rec | None
    inputs: list[int] = field(default_factory=list)  # slots
    outputs: list[int] = field(default_factory=list)


@dataclass
class _Pass:
    """One forward: what tier 1 saw, and what tier 2 needs to replay it."""

    module: nn.Module
    inputs: Inputs
    rng: Any
    autocast: Autocast
    checks: _Checks = field(default_factory=_Checks)
    recs: list[_Rec] = field(default_factory=list)
    open: dict[int, _Rec] = field(default_factory=dict)  # id(ModuleCall) -> running record
    out_grads: dict[int, Tensor] = field(default_factory=dict)  # output leaf -> its gradient
    found: bool = False


_ALLOW_OPS = (
    "allow= names the layers whose non-finite outputs are intended, and the tracer checks "
    "layers' outputs (it names the operator of a finding itself): allow the layer that runs "
    "the operation"
)


class _Tracer(Session):
    _entry = "hs.nonfinite"

    def __init__(
        self,
        model: nn.Module,
        allow: LayerSelector | None,
        mode: Mode,
        replay: bool,
        scaler: Any,
        recompile: bool,
    ) -> None:
        if mode not in ("raise", "warn"):
            raise UsageError(f"mode must be 'raise' or 'warn', got {mode!r}")
        if scaler is not None and not hasattr(scaler, "scale"):
            raise UsageError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        super().__init__(model, recompile=recompile)
        self.root = unwrap(model)
        self.allow_inputs, self.allowed = self._allowed(allow)
        self.mode, self.replay, self.scaler = mode, replay, scaler
        self.report = NonFiniteReport()
        self.pass_: _Pass | None = None
        self.names = {id(m): n for n, m in self.every_module().items()}
        self.ranks = _Ranks.of(self.root)
        # backward: (pass, call or None for the model's output, output leaf index, slot)
        self.arrived: list[tuple[_Pass, _Rec | None, int, int]] = []
        self.grads = _Checks()
        self.queued: set[int] = set()

    def _allowed(self, allow: Any) -> tuple[bool, set[str]]:
        if allow is None:
            return False, set()
        items = list(allow) if isinstance(allow, (list, tuple)) else [allow]
        inputs = INPUT in items
        items = [a for a in items if a != INPUT]
        if not items:
            return inputs, set()
        sites = self.layers.sites(items, refuse_ops=_ALLOW_OPS)
        return inputs, set(sites)

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, self.every_module())

    # -- tier 1: forward ----------------------------------------------------------------------

    def _started(self, call: ModuleCall, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if call.parent is None:  # a forward starts (the model's, or a layer called alone)
            self.report.forwards += 1
            state = _rng_state(), autocast_state()
            self.pass_ = _Pass(call.module, Inputs(args, kwargs), *state)
            self.pass_.checks = _Checks(sharded=self.ranks is not None)
        p = self.pass_
        if p is None:
            return
        parent = p.open.get(id(call.parent)) if call.parent is not None else None
        rec = _Rec(call.name, call.index + 1, call.name in self.allowed, parent)
        rec.inputs = [p.checks.add(t) for t in floats((args, kwargs))]
        p.open[id(call)] = rec

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        p = self.pass_
        rec = p.open.pop(id(call), None) if p is not None else None
        if p is None or rec is None:
            return
        outputs = floats(output)
        rec.outputs = [p.checks.add(t) for t in outputs]
        p.recs.append(rec)
        root = call.parent is None
        for i, t in enumerate(outputs):
            if t.requires_grad:
                self.hooks.tensor(t, functools.partial(self._on_grad, p, None if root else rec, i))
        if root:
            self._end_forward(p)

    def _raised(self, call: ModuleCall) -> None:
        if self.pass_ is not None:
            self.pass_.open.pop(id(call), None)

    def _end_forward(self, p: _Pass) -> None:
        kinds = p.checks.read()
        if self.ranks is not None:
            self._end_forward_sharded(p, kinds)
            return
        finding = self._forward_finding(p, kinds, lambda: self._replay_forward(p, False))
        if finding is not None:
            p.found = True
            self._found(*finding)

    def _replay_forward(self, p: _Pass, lockstep: bool) -> tuple[Any, str | None]:
        return replay_forward(
            p.module, self.names, self.allowed, p.inputs.call, p.rng, p.autocast, lockstep
        )

    def _end_forward_sharded(self, p: _Pass, kinds: list[int]) -> None:
        """Every rank learns whether any rank's output is non-finite (one all-reduce), then,
        if one is, replays in lock step (the forward all-gathers) and raises the finding
        whose origin ran first, the lowest rank's among equals (see the module docstring)."""
        assert self.ranks is not None
        bad = any(kinds[s] != FINITE for s in p.recs[-1].outputs)
        if not self.ranks.any(bad):
            return
        replayed = self._replay_forward(p, True) if self.replay else (None, None)
        mine = self._forward_finding(p, kinds, lambda: replayed) if bad else None
        self._found_somewhere(p, mine, self.report.forwards, _position(p, kinds) if bad else 0)

    def _forward_finding(
        self, p: _Pass, kinds: list[int], replay: Callable[[], tuple[Any, str | None]]
    ) -> Finding | None:
        """What the forward of ``p`` found (tier 1, then ``replay`` to name the operator),
        or None when its output is finite or its non-finite values are intended."""
        root = p.recs[-1]
        bad = [s for s in root.outputs if kinds[s] != FINITE]
        if not bad:
            return None
        want = NAN if any(kinds[s] == NAN for s in bad) else INF
        origin = _origin(p.recs, kinds, next(s for s in bad if kinds[s] == want), want)
        if origin is None:
            if self.allow_inputs:
                return None
            return ("forward", INPUT, None, None, {"inputs": _stats(floats(p.inputs.call))})
        if origin.allowed:
            return None  # an intended non-finite value (allow=)
        op: str | None = None
        module, call, st = origin.name, origin.call, {}
        if self.replay and p.inputs.unchanged:
            found, outside = replay()
            if outside == INTENDED:
                return None
            if found is not None:  # '' is the root's own code: a name, not a miss
                op, module, call, st = found[0], _named(found[1], origin.name), found[2], found[3]
            elif outside == INPUT and not self.allow_inputs:
                return ("forward", INPUT, None, None, {"inputs": _stats(floats(p.inputs.call))})
            elif outside is not None and outside != "<unknown>":
                st = {"source": f"the values come from {outside}, which holds NaN/Inf"}
        elif self.replay:
            st = {"operator": _NO_REPLAY}
        return ("forward", module, call, op, st)

    def _found_somewhere(
        self, p: _Pass, mine: Finding | None, step: int, rank_order: int = 0
    ) -> None:
        """The lowest rank's finding of the lowest ``rank_order``, raised (or warned) on every
        rank (one gather of every rank's finding: on the way to the error only)."""
        assert self.ranks is not None
        first = self.ranks.first(mine, rank_order)
        if first is None:  # every rank's non-finite values were intended
            return
        rank, finding = first
        if finding[0] == "forward":
            p.found = True
            self._found(*finding, rank=rank, step=step)
        else:
            self._backward(*finding, rank=rank, step=step)

    # -- tier 1: backward ---------------------------------------------------------------------

    def _on_grad(self, p: _Pass, rec: _Rec | None, index: int, grad: Tensor) -> None:
        if rec is None:  # the model's own output: what came in from the loss
            p.out_grads[index] = grad
        self.arrived.append((p, rec, index, self.grads.add(grad)))
        task = _torch.backward_id()
        if task not in self.queued:
            self.queued.add(task)
            queue_after_backward(functools.partial(self._end_backward, task))

    def _end_backward(self, task: int) -> None:
        self.queued.discard(task)
        arrived, self.arrived = self.arrived, []
        checks, self.grads = self.grads, _Checks()
        params = [(n, local(p.grad)) for n, p in self.root.named_parameters() if p.grad is not None]
        slots = [checks.add(g) for _, g in params if g.is_floating_point() or g.is_complex()]
        if not arrived:
            return
        self.report.backwards += 1
        kinds = checks.read()
        p = arrived[0][0]
        if p.found:
            return  # a consequence of the forward's finding (on every rank when sharded)
        mine = self._backward_finding(p, arrived, kinds, params, slots)
        if self.ranks is None:
            if mine is not None:
                self._backward(*mine)
        elif self.ranks.any(mine is not None):
            # FSDP reduce-scatters the gradients, tensor parallelism all-reduces them between
            # layers: a NaN one rank made reaches the others later in the backward (a finding
            # in the parameters' gradients alone, last), so the earliest finding is the first
            order = _arrival(arrived, kinds, mine) if mine is not None else 0
            self._found_somewhere(p, mine, self.report.backwards, order)

    def _backward_finding(
        self,
        p: _Pass,
        arrived: list[tuple[_Pass, _Rec | None, int, int]],
        kinds: list[int],
        params: list[tuple[str, Tensor]],
        slots: list[int],
    ) -> Finding | None:
        """What the backward found, or None. Sharded, the backward is not replayed (its
        reduce-scatters would have to run in lock step): the layer is named, not the
        operator."""
        loss = [i for i, (_, rec, _, s) in enumerate(arrived) if rec is None and kinds[s]]
        if loss:
            grads = [g for g in p.out_grads.values()]
            return ("backward", LOSS, None, None, {"gradient": _stats(grads)})
        if any(kinds[s] for *_, s in arrived) or any(kinds[s] for s in slots):
            first = next((a for a in arrived if kinds[a[3]]), None)
            bad = [pn for (pn, _), s in zip(params, slots, strict=False) if kinds[s]]
            receiver = first[1] if first is not None else None
            if receiver is not None:
                name, n = receiver.name, receiver.call
            else:  # only parameters' gradients: the module holding them all
                name, n = _owner_of(bad), None
            op: str | None = None
            st: dict[str, Any] = {}
            replay = self.replay and self.ranks is None
            if replay and self.scaler is None and p.out_grads and p.inputs.unchanged:
                found = replay_backward(
                    p.module, self.names, p.inputs.call, p.rng, p.out_grads, p.autocast
                )
                if found is not None:
                    op, name, n, st = found[0], _named(found[1], name), found[2], found[3]
            if first is None:
                st = {**st, "parameters": bad[:10]}
            return ("backward", name, n, op, st)
        return None

    def _backward(
        self,
        phase: str,
        module: str,
        call: int | None,
        op: str | None,
        st: dict[str, Any],
        rank: int | None = None,
        step: int | None = None,
    ) -> None:
        if self.scaler is not None:  # GradScaler skips steps whose gradients overflow
            self.report.overflows.append(self._error(phase, module, call, op, st, rank, step))
            return
        self._found(phase, module, call, op, st, rank, step)

    # -- findings -------------------------------------------------------------------------------

    def _error(
        self,
        phase: str,
        module: str,
        call: int | None,
        op: str | None,
        st: dict[str, Any],
        rank: int | None = None,
        step: int | None = None,
    ) -> NonFiniteError:
        message = _message(phase, module, call, op, st, self.root)
        if rank is not None:
            message = message.replace(
                f"in the {phase}:", f"in the {phase} on rank {rank} ({phase} {step}):", 1
            )
        return NonFiniteError(
            message, phase=phase, module=module, call=call, op=op, stats=st, rank=rank, step=step
        )

    def _found(
        self,
        phase: str,
        module: str,
        call: int | None,
        op: str | None,
        st: dict[str, Any],
        rank: int | None = None,
        step: int | None = None,
    ) -> None:
        error = self._error(phase, module, call, op, st, rank, step)
        self.report.findings.append(error)
        if self.mode == "raise":
            raise error
        warnings.warn(str(error), RuntimeWarning, stacklevel=3)

    def _closed(self) -> None:
        self.pass_, self.arrived = None, []


class _Ranks:
    """The process group of a sharded model's tracer: every rank's flag combined (one small
    all-reduce per check), and on the way to an error every rank's finding gathered."""

    def __init__(self) -> None:
        dist = torch.distributed
        cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else None

    @staticmethod
    def of(model: nn.Module) -> _Ranks | None:
        """For a model with sharded (DTensor) parameters in an initialised process group."""
        dist = torch.distributed
        if not (dist.is_available() and dist.is_initialized()):
            return None
        if not sharded_model(model):
            return None
        return _Ranks()

    def any(self, flag: bool) -> bool:
        """Whether any rank's ``flag`` is set (every rank calls this together)."""
        t = torch.tensor([int(flag)], dtype=torch.int32, device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return bool(t.item())

    def first(self, mine: Finding | None, order: int = 0) -> tuple[int, Finding] | None:
        """The rank whose finding comes first (lowest ``order``, then lowest rank), and that
        finding (every rank calls this)."""
        every: list[tuple[int, Finding] | None] = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(every, None if mine is None else (order, mine))
        found = [(o, r, f) for r, item in enumerate(every) if item is not None for o, f in [item]]
        return min(found, key=lambda orf: orf[:2])[1:] if found else None


def _arrival(
    arrived: list[tuple[_Pass, _Rec | None, int, int]], kinds: list[int], mine: Finding
) -> int:
    """When in the backward this rank's finding arrived: -1 for the loss's gradient, else
    the position of the first non-finite gradient among those that arrived (every rank's
    backward runs the same nodes in the same order), after them all for a parameter's."""
    if mine[1] == LOSS:
        return -1
    return next((i for i, a in enumerate(arrived) if kinds[a[3]]), len(arrived))


def _position(p: _Pass, kinds: list[int]) -> int:
    """Where in the forward this rank's non-finite output was first made: the position of
    its origin among the calls in completion order (-1: the inputs). Every rank of a model
    runs the same calls; under tensor parallelism a NaN one rank makes reaches the others
    through the layers' all-reduces, later in the forward, so the earliest origin of all
    ranks is the producer and a later one a consequence."""
    root = p.recs[-1]
    bad = [s for s in root.outputs if kinds[s] != FINITE]
    want = NAN if any(kinds[s] == NAN for s in bad) else INF
    origin = _origin(p.recs, kinds, next(s for s in bad if kinds[s] == want), want)
    return -1 if origin is None else p.recs.index(origin)


def _origin(recs: list[_Rec], kinds: list[int], start: int, want: int) -> _Rec | None:
    """The call whose own work made the value at ``start`` hold ``want`` (NAN, or INF for any
    non-finite value), found by following the data back; None if it came from the inputs."""
    maker: dict[int, _Rec] = {}
    for rec in recs:  # in completion order: inner calls first, so the innermost maker wins
        for s in rec.outputs:
            maker.setdefault(s, rec)
    root = recs[-1]
    slot, consumer = start, root
    for _ in range(len(recs) + 1):
        made = maker.get(slot)
        if made is None:  # not returned by any call: the inputs, or the code of a caller
            return None if slot in root.inputs else consumer.parent or consumer
        bad = [s for s in made.inputs if holds(kinds[s], want)]
        if not bad:
            return made
        slot, consumer = bad[0], made
    return consumer


def _named(found: str | None, fallback: str) -> str:
    """The module a replay named (``''``, the root's own code, included), else tier 1's."""
    return fallback if found is None else found


def _owner_of(parameters: list[str]) -> str:
    """The innermost module holding every one of ``parameters`` (dotted names)."""
    common = [p.split(".")[:-1] for p in parameters]
    prefix: list[str] = []
    for parts in zip(*common, strict=False):
        if len(set(parts)) != 1:
            break
        prefix.append(parts[0])
    return ".".join(prefix)


def _rng_state() -> tuple[Tensor, list[Tensor]]:
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []  # type: ignore[no-untyped-call]
    return torch.random.get_rng_state(), cuda


def _fmt(st: dict[str, Any]) -> str:
    if not isinstance(st, dict) or "numel" not in st:
        return str(st)
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
    text = f"NaN/Inf in the {phase}: {head}." + ("\n  " + "\n  ".join(parts) if parts else "")
    if phase == "backward" and module != LOSS:
        text += (
            "\n  (Training with torch.amp.GradScaler? Overflowing gradients are expected there "
            "and the scaler skips those steps: pass scaler= to record them instead.)"
        )
    return text


@contextmanager
def nonfinite(
    model: nn.Module,
    *,
    allow: LayerSelector | None = None,
    mode: Mode = "raise",
    replay: bool = True,
    scaler: Any = None,
    recompile: bool = False,
) -> Iterator[NonFiniteReport]:
    """Watch a training step for NaN/Inf and name where the first one came from.

    Wrap the forward, loss and backward (one step or many)::

        with hs.nonfinite(model) as report:
            loss = criterion(model(x), y)
            loss.backward()

    A forward is reported when the model's output holds a NaN or an Inf; the producer is the
    first operation on the data's path to that output that made such a value from inputs
    without one (intended infinities that do not reach the output, such as attention masks,
    are not reported). A backward is reported when a gradient reaching a layer's output or a
    parameter is non-finite.

    Under FSDP2 or HSDP (``DTensor`` parameters in a process group) open it on every rank:
    each check's flag is combined over the world (one all-reduce per forward and backward),
    the forward is replayed on every rank together, and every rank raises the same error,
    naming the first producer's ``rank`` and ``step``.

    Args:
        model: the model (wrappers are seen through).
        allow: layers whose non-finite outputs are intended even when they reach the output
            (any layer selector); include ``"<input>"`` to accept non-finite inputs.
        mode: ``"raise"`` (default) raises :class:`~hookscope.NonFiniteError` from the forward
            or backward that produced the value; ``"warn"`` warns, records it in the report
            and goes on.
        replay: run tier 2 (replay at operator level) to name the operator.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop: gradients that
            overflow are then expected (the scaler skips those steps) and are recorded in
            ``report.overflows`` instead of raised. Forward problems are still raised.
        recompile: hook a ``torch.compile``d model that already ran (its compiled code then
            runs eagerly while the session is open); otherwise CompiledModelError.

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
    tracer = _Tracer(model, allow, mode, replay, scaler, recompile)
    with tracer:
        yield tracer.report
