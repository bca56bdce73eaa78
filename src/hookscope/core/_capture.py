"""``capture``: record the inputs, outputs and gradients of selected layers, per call."""

from __future__ import annotations

import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import LayerNotFoundError, UnsupportedModelError
from . import _torch
from ._autograd import Boundary, backward_id
from ._bind import Binder
from ._lifetime import HookSet
from ._ops import OpSelector, has_ops
from ._ops import select as select_ops
from ._opsites import OpSession, capture_op, op_plan
from ._opwatch import OpWatch
from ._records import _OUTPUT, Call, LayerRecord
from ._session import _PRIVATE, replica_error
from ._store import Store, check_options
from ._types import CopyMode, Keep, LayerSelector, Reduce
from ._watch import GradWatch

__all__ = ["Capture", "StopForward", "capture"]


class StopForward(BaseException):
    """Raised by the last needed hook to end the forward early; caught by its own capture.

    A BaseException, like KeyboardInterrupt, so ``except Exception`` in model code cannot
    swallow it.
    """

    def __init__(self, owner: object) -> None:
        super().__init__("hookscope stopped the forward early (stop=True)")
        self.owner = owner


class _Site:
    """Per-layer state of one capture (a layer's, or an operation's: ``op``, see ``_ops``)."""

    __slots__ = (
        "binder", "done_in", "module", "name", "op", "open", "record", "replays", "used_in"
    )  # fmt: skip

    def __init__(
        self, name: str, module: nn.Module, store: Store, op: OpSelector | None = None
    ) -> None:
        self.name = name
        self.module = module  # an operation's: the module whose own code runs it
        self.op = op
        kind = type(module).__name__
        self.record = LayerRecord(name, f"{kind}::{op.op}" if op else kind, store)
        self.binder: Binder | None = None  # set in open() when inputs are needed
        self.open: list[tuple[Call, Boundary | str | None]] = []  # calls running (recursion)
        self.replays: list[tuple[Call, Boundary] | None] = []  # replayed calls running
        self.used_in = -2  # the last pass in which this layer started a call
        self.done_in = -2  # the last pass in which it finished one (for stop=True)


class Capture(OpSession):
    """Record selected layers' outputs (and inputs, gradients) for every call.

    Use as a context manager; hooks exist only inside the ``with`` block and are removed on
    every exit path (tensor and graph hooks included: a backward after the block records
    nothing). Records stay readable afterwards. Re-entering an open capture nests.

    Args:
        model: the model; DataParallel / DDP / torch.compile wrappers are seen through.
        layers: names, globs (``"encoder.layer.*.output"``; ``*`` stays within a dotted
            segment, ``**`` crosses dots), compiled regexes (full match), module types,
            module objects, predicates, or a list mixing them. Operations inside a layer's
            call are selected as ``"layer::op"`` / ``"layer::op#k"`` (README, "Inside the
            forward"): ``"h.3.attn::softmax"``, ``"h.3.attn::attention_weights"``.
        inputs: also record each call's inputs, bound to ``forward``'s parameter names.
        grads: also record gradients w.r.t. outputs and inputs, read from the autograd graph
            (see the guide "Capture and gradients"): nothing the model computes changes.
        copy: ``"clone"`` (default) stores detached copies; ``"reference"`` stores the live
            tensors (no copy) and raises StaleCaptureError on read if they were changed
            in place later. Inference tensors, which carry no version counter, are copied.
        device: move captured tensors there (CUDA -> CPU goes to pinned memory, non-blocking;
            reading a value waits for its copy).
        reduce: applied to each captured floating-point tensor at capture time:
            ``"spatial_mean"`` (N, C, ...) -> (N, C), ``"token_mean"`` (N, T, D) -> (N, D),
            ``"batch_mean"``, or any function (a Python number it returns becomes a 0-d
            tensor). Built-in reductions keep integer tensors (token ids, masks) as they are.
        keep: which calls to keep: ``"pass"`` (default: every call of the latest forward),
            ``"all"``, ``"last"``, or an int N (ring of the last N calls).
        max_bytes: raise CaptureBudgetError before the stored bytes would exceed this.
        stop: end the forward as soon as every selected layer has run (in execution order);
            the ``with`` block then exits quietly.
        detach: ``False`` keeps captured values attached to the autograd graph (a
            differentiable clone), e.g. for feature losses in training.
        recompile: allow hooking a ``torch.compile``d model that already ran, by running
            compiled code eagerly while open (otherwise CompiledModelError).

    ``cap["layer"]`` is then a :class:`LayerRecord`; ``cap.nbytes`` is the bytes held.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> with hs.capture(model, "0") as cap:
        ...     _ = model(torch.ones(2, 3))
        >>> cap["0"].output.shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        inputs: bool = False,
        grads: bool = False,
        copy: CopyMode = "clone",
        device: torch.device | str | None = None,
        reduce: Reduce | None = None,
        keep: Keep = "pass",
        max_bytes: int | None = None,
        stop: bool = False,
        detach: bool = True,
        recompile: bool = False,
    ) -> None:
        check_options(copy, keep, max_bytes, reduce, stop, grads)
        super().__init__(model, recompile=recompile)
        self._store = Store(
            copy=copy,
            device=torch.device(device) if device is not None else None,
            reduce=reduce,
            detach=detach,
            max_bytes=max_bytes,
        )
        if has_ops(layers):  # operation selectors ("layer::op"): see _ops
            chosen = select_ops(self._layers, layers)
            self._sites = {n: _Site(n, m, self._store, op) for n, (m, op) in chosen.items()}
            self._ops = self._op_watch()
        else:
            selected = self._layers.select(layers)
            self._sites = {n: _Site(n, m, self._store) for n, m in selected.items()}
        self._records = {n: s.record for n, s in self._sites.items()}
        self._inputs, self._grads = inputs, grads
        self._ring = 1 if keep == "last" else keep if isinstance(keep, int) else None
        self._per_pass = keep == "pass"
        self._stop = stop
        self._remaining = len(self._sites)  # layers still to run in this pass (stop=True)
        self._used: list[_Site] = []  # layers that ran in this pass
        self._stale: list[_Site] = []  # layers that ran in the pass before, maybe not since
        self._last_done: str | None = None
        self._watch = GradWatch()

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this capture holds (outputs, inputs, gradients)."""
        self._sweep()
        if self._store.counting:
            return self._store.nbytes
        return sum(record._held() for record in self._records.values())

    @property
    def records(self) -> dict[str, LayerRecord]:
        """``{layer name: LayerRecord}``, in selection order."""
        self._sweep()
        return self._records

    # -- lifetime -----------------------------------------------------------------------
    def _install(self, hooks: HookSet) -> None:
        self._check_hookable(self._sites)
        self._store.closed = False
        for site in self._sites.values():
            if site.op is not None:
                continue  # an operation: its module's calls are followed by self._ops
            if self._inputs or self._grads:
                site.binder = Binder(site.module)
                pre = functools.partial(self._on_input, site)
                hooks.forward_pre(site.module, pre, with_kwargs=True)
                hooks.forward(site.module, functools.partial(self._on_output, site))
            else:
                hooks.forward(site.module, self._output_only(site))
        if self._ops is not None:  # replays: a reentrant checkpoint's gradients come there
            self._ops.install(hooks, replays=self._grads)

    def _closed(self) -> None:
        self._store.closed = True
        self._sweep()
        for site in self._sites.values():
            self._drop_open(site)
        self._close_ops()

    def _op_watch(self) -> OpWatch:
        plan = op_plan((site.op, site) for site in self._sites.values())
        return OpWatch(self, plan, functools.partial(capture_op, self))

    def open(self) -> Capture:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        opened: Capture = super().open()
        return opened

    def __enter__(self) -> Capture:
        opened: Capture = super().__enter__()
        return opened

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        super().__exit__(et, ev, tb)
        if isinstance(ev, StopForward) and ev.owner is self:
            self._abandon()  # the calls the stop left open end now (operation modes too)
            return True
        if isinstance(ev, Exception) and _raised_in_a_module(tb):
            done = f"'{self._last_done}'" if self._last_done else "none"
            ev.add_note(
                f"hookscope: raised inside the model's forward; the last layer this capture "
                f"saw finish was {done}"
            )
        return False

    # -- reading ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> LayerRecord:
        record = self.records.get(self._layers.canonical(name))
        if record is None:
            raise LayerNotFoundError(
                self._layers.miss_message(name, f"this capture's layers {list(self.records)}")
            )
        return record

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._layers.canonical(name) in self.records

    def __iter__(self) -> Any:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[str]:
        """The captured layers' canonical names, in the order they were selected.

        Example:
            >>> import torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
            >>> with hs.capture(model, [nn.ReLU, "0"]) as cap:
            ...     pass
            >>> cap.keys()
            ['1', '0']
        """
        return list(self.records)

    def __repr__(self) -> str:
        calls = sum(len(r) for r in self.records.values())
        state = "open" if self._hooks is not None else "closed"
        return (
            f"Capture({len(self.records)} layers, {calls} calls kept, "
            f"{self.nbytes / 2**20:.1f} MiB, {state})"
        )

    # -- passes and calls -----------------------------------------------------------------
    # With keep="pass", a layer's calls of the previous pass are dropped when the layer first
    # runs in the new pass, or, for layers that do not run again, when the capture is read or
    # the next pass starts: each forward touches only the layers it uses.
    def _new_pass(self) -> None:
        if _functorch_level() is not None:  # once per forward; see also _enter_pass
            raise _transformed(type(self._layers.root).__name__)
        self._sweep(self._pass - 1)  # the pass that just ended is the latest one
        self._remaining = len(self._sites)
        self._stale, self._used = self._used, []

    def _sweep(self, latest: int | None = None) -> None:
        """Drop what layers that did not run in the latest pass still hold from before."""
        latest = self._pass if latest is None else latest
        for site in self._stale:
            if site.used_in != latest:
                self._reset(site)
        self._stale.clear()

    def _enter_pass(self, site: _Site) -> None:
        """The layer's first call in this pass (it runs once per layer and forward: the body
        of _reset is repeated here rather than called)."""
        if not self._depth and _functorch_level() is not None:  # a call outside a forward
            raise _transformed(site.name)  # of the model (the model's is checked above)
        site.used_in = self._pass
        self._used.append(site)
        if site.open or site.replays:  # left over only if a forward was interrupted
            self._drop_open(site)
        if self._per_pass:
            site.record._evict_all(grads=self._grads)

    def _reset(self, site: _Site) -> None:
        """Drop a layer's calls left from earlier passes (keep="pass")."""
        if site.open or site.replays:
            self._drop_open(site)
        if self._per_pass:
            site.record._evict_all(grads=self._grads)

    def _drop_open(self, site: _Site) -> None:
        for call, _ in site.open:
            call._evict()
        site.open.clear()
        site.replays.clear()

    def _make_room(self, record: LayerRecord) -> None:
        """A ring of N calls: drop the oldest before storing (the budget sees the room)."""
        assert self._ring is not None
        if len(record) >= self._ring:
            record._evict(len(record) - self._ring + 1, grads=self._grads)

    def _new_call(self, site: _Site) -> Call:
        if site.used_in != self._pass:
            self._enter_pass(site)
        if self._ring is not None:
            self._make_room(site.record)
        return Call(site.name, self._pass, self._store)

    def _finished(self, site: _Site) -> None:
        """stop=True: end the forward once every layer has finished a call in this pass."""
        if site.done_in != self._pass:
            site.done_in = self._pass
            self._remaining -= 1
            if not self._remaining:
                raise StopForward(self)

    def _output_only(self, site: _Site) -> Callable[[nn.Module, Any, Any], None]:
        """The forward hook of a capture of outputs only: the per-call hot path, with what it
        needs bound once. It stores the value (and its version, by reference), nothing else.
        With the default storage policy (see ``Store``) the copy is made right here."""
        module, name, record, store = site.module, site.name, site.record, self._store
        append, ring, stop, where = record._appender(), self._ring, self._stop, (name, _OUTPUT)
        keep = None if store.keep == store._keep_clone else store.keep

        def on_output(mod: nn.Module, args: Any, output: Any) -> None:
            if mod is not module:
                raise replica_error(mod)
            if _backward_id() != -1 or (_PRIVATE and self not in _PRIVATE):
                return  # a checkpoint's replay (the call is already recorded), or a private forward
            if site.used_in != self._pass:
                self._enter_pass(site)
            if ring is not None:
                self._make_room(record)
            if type(output) is not Tensor:
                call = Call(name, self._pass, store)
                call._set_output(output)
                record._add(call)
            elif keep is None:  # Store._keep_clone, inlined
                value = (output.detach() if output.requires_grad else output).clone()
                append((value, None, self._pass))
            else:
                append((*keep(output, where), self._pass))
            self._last_done = name
            if stop:
                self._finished(site)

        return on_output

    # -- hooks ----------------------------------------------------------------------------
    def _on_input(
        self, site: _Site, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if module is not site.module:
            raise replica_error(module)
        if _PRIVATE and self not in _PRIVATE:
            return None
        if _backward_id() != -1:
            return self._replayed_input(site, args, kwargs)
        call = self._new_call(site)
        assert site.binder is not None
        bound = site.binder.bind(args, kwargs)
        site.open.append((call, None))  # first: if storing raises, closing refunds it
        if self._inputs:
            call._set_inputs(bound)
        if not self._grads:
            return None
        call._expect_grads(None if self._inputs else bound)
        site.open[-1] = (call, self._watch.start(site.name, call, bound))
        return None

    def _on_output(self, site: _Site, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if module is not site.module:
            raise replica_error(module)
        if _PRIVATE and self not in _PRIVATE:
            return None
        if _backward_id() != -1:  # activation checkpointing replays the call in backward
            return self._replayed_output(site, output)
        if site.open:
            call, boundary = site.open.pop()
        else:
            call, boundary = self._new_call(site), None
        call._set_output(output)
        new_output = None
        if self._grads:
            assert self._hooks is not None
            new_output = self._watch.finish(self._hooks, call, boundary, output)
        record = site.record
        record._add(call)
        if self._ring is not None and len(record) > self._ring:  # nested calls
            record._evict(len(record) - self._ring, grads=self._grads)
        self._last_done = site.name
        if self._stop:
            self._finished(site)
        return new_output

    # -- checkpoint replays (only captures with grads=True hook them) ----------------------
    def _replayed_input(
        self, site: _Site, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        found = self._watch.replayed(site.name) if self._grads else None
        if found is None:
            site.replays.append(None)
            return None
        assert site.binder is not None
        site.replays.append((found, Boundary(site.binder.bind(args, kwargs))))
        return None

    def _replayed_output(self, site: _Site, output: Any) -> Any:
        entry = site.replays.pop() if site.replays else None
        if entry is None:
            return None
        assert self._hooks is not None
        call, boundary = entry
        return self._watch.finish(self._hooks, call, boundary, output)


_backward_id = backward_id  # module globals: the per-call path looks them up fastest
_functorch_level = _torch.functorch_level


def _transformed(layer: str) -> UnsupportedModelError:
    return UnsupportedModelError(
        f"{layer!r} ran inside a torch.func transform (vmap, grad, jacrev, ...), where "
        "tensors are per-sample wrappers that are meaningless outside it. Capture outside "
        "the transform (e.g. run the batched model directly)."
    )


def _raised_in_a_module(tb: TracebackType | None) -> bool:
    """Whether the exception passed through a module call on its way out."""
    while tb is not None:
        if tb.tb_frame.f_code in _torch.CALL_CODES:
            return True
        tb = tb.tb_next
    return False


capture = Capture
"""Record selected layers' outputs (and inputs, gradients) for every call: ``hs.capture(model,
layers, ...)`` is :class:`Capture` (the same class, named for ``with hs.capture(...) as cap``).

Example:
    >>> import torch, torch.nn as nn, hookscope as hs
    >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    >>> with hs.capture(model, "0") as cap:
    ...     _ = model(torch.ones(2, 3))
    >>> cap["0"].output.shape
    torch.Size([2, 4])
"""
