"""``capture``: record the inputs, outputs and gradients of selected layers, per call.

A layer and an operation site (``"layer::op"``, ``ops/``) are recorded by the same code: the
hooks :meth:`Capture._on_input` / :meth:`Capture._on_output` of a layer's module are called,
for an operation, by :meth:`Capture._run_op` around the intercepted call, with the
operation's function in the role of the module's ``forward`` (its arguments bound to the
function's parameters, ``ops/_select.op_binder``). An ``attention_weights`` site is
:meth:`Capture._capture_weights` (``ops/_attention``).

Threads: each thread's forward is a pass of its own (``_calls``). With ``keep="pass"`` a
layer keeps the calls of the latest pass to start; other ``keep=`` modes keep calls in the
order of their passes, as if the forwards had run one after another.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import LayerNotFoundError, UsageError
from . import _torch, _tree
from ._autograd import Boundary, backward_id, why_no_grad
from ._bind import Binder
from ._calls import ModuleCall, Now
from ._lifetime import HookSet, run_unseen
from ._placement import UNKNOWN, is_dtensor, layout_of, sharded_model, whole
from ._records import _OUTPUT, Call, LayerRecord
from ._refusals import replica_error, transformed_error
from ._session import Run, Session
from ._steps import Spans, Steps, span_of, steps_of
from ._store import Store, check_options
from ._types import CopyMode, Keep, LayerSelector, Reduce
from ._units import Indices, MaskNote, Positions, Units, kv_heads, narrows
from ._watch import PENDING, GradWatch
from .ops._attention import (
    WAITING,
    attention_args,
    packed_groups,
    probabilities,
    unpack,
    weights_grad,
)
from .ops._select import SDPA, OpSelector, forward_op, op_binder

__all__ = ["Capture", "StopForward", "capture"]

_NO_INPUT_GRADS = (
    "attention weights are computed from the call's inputs, not part of its graph: select "
    "'...::scaled_dot_product_attention' (grads=True) for the gradients of its inputs"
)


class StopForward(BaseException):
    """Raised by the last needed hook to end the forward early; caught by its own capture.

    A BaseException, like KeyboardInterrupt, so ``except Exception`` in model code cannot
    swallow it.
    """

    def __init__(self, owner: object) -> None:
        super().__init__("hookscope stopped the forward early (stop=True)")
        self.owner = owner


class _Site:
    """Per-layer state of one capture (a layer's, or an operation's: ``op``, see ``ops/``)."""

    __slots__ = ("binder", "module", "name", "op", "record", "used_in")

    def __init__(
        self, name: str, module: nn.Module, store: Store, op: OpSelector | None = None
    ) -> None:
        self.name = name
        self.module = module  # an operation's: the module whose own code runs it
        self.op = op
        kind = type(module).__name__
        self.record = LayerRecord(name, f"{kind}::{op.op}" if op else kind, store)
        self.binder: Binder | None = None  # a layer's, set in _install when inputs are needed
        self.used_in = -2  # the latest pass in which this layer started a call


#: an open call: the call, and its gradient boundary (or why it has none)
_Open = tuple[Call, Boundary | str | None]


class Capture(Session):
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
        capture_device: move captured values there (CUDA -> CPU goes to pinned memory,
            non-blocking; reading a value waits for its copy).
        reduce: applied to each captured floating-point tensor at capture time (see
            :data:`hookscope.Reduce`): ``"spatial_mean"`` (N, C, ...) -> (N, C),
            ``"token_mean"`` (N, T, ...) -> (N, ...) over the tokens the forward's
            ``attention_mask`` keeps, ``"batch_mean"``, or any function (a Python number it
            returns becomes a 0-d tensor). Built-in reductions keep integer tensors (token
            ids, masks) as they are.
        keep: which calls to keep: ``"pass"`` (every call of the latest forward: the
            default), ``"all"`` (the default with ``steps=``), ``"last"``, or an int N (ring
            of the last N calls).
        max_bytes: raise CaptureBudgetError before the stored bytes would exceed this.
        stop: end the forward as soon as every selected layer has run (in execution order);
            the ``with`` block then exits quietly.
        detach: ``False`` keeps captured values attached to the autograd graph: a
            differentiable clone (gradients of a loss on it flow into the model), e.g. for
            feature losses in training. A clone is a new tensor, so
            ``torch.autograd.grad(loss, captured)`` of a loss the model computed finds it
            unused; with ``copy="reference"`` too the capture is the model's tensor itself.
        recompile: allow hooking a ``torch.compile``d model that already ran, by running
            compiled code eagerly while open (otherwise CompiledModelError).
        positions: keep only these token positions of each output: an index or a list of
            them (negative from the end), or ``"last"``, each sample's last real token (the
            last the forward's ``attention_mask`` keeps). Axis 1 of a layer's output, axis 2
            of an SDPA call's and of attention weights (query positions).
        heads: keep only these attention heads: of an SDPA call's output ``(N, H, T, d)``
            (each head's output before the output projection; its query, key and value
            inputs too, key and value at the key/value head each query head reads), of
            attention weights ``(N, H, Tq, Tk)``, and of a Hugging Face model's query, key and
            value projections (``q_proj``...: heads side by side, sizes from the config).
        neurons: keep only these indices of the output's last dimension.
        layout: where units lie in sites hookscope has no layout for (attention written by
            hand): ``{selector: axis names}``, e.g. ``{"blocks.*.attn::softmax": "batch
            heads positions keys"}`` (the batch first; ``positions``, ``heads`` and
            ``neurons`` are narrowed, other words name axes left whole).
        this_thread: see only the forwards of the threads inside the ``with`` block (or
            between :meth:`open` and :meth:`close`); forwards other threads run on the model
            meanwhile are not recorded. Off: every thread's forwards are.
        gather: in a model with ``DTensor`` parameters (tensor parallelism), keep each
            output's global tensor, the same on every rank, instead of this rank's piece:
            one collective per call of a sharded output (an all-gather; an all-reduce for a
            ``Partial`` one), none for a replicated one. Every rank of the mesh must open the
            capture alike, as the forward's own collectives need. An output whose layout is
            unknown (see :attr:`Call.layout`) is refused. Gradients and inputs stay local.
        steps: record only these forwards of the model (an int, a list of them or a range),
            counted from 0 since the capture was built: under ``generate()``, step 0 is the
            prefill and step ``t`` the forward that makes new token ``t``. Each call says its
            step and the token positions its forward covered (:attr:`Call.step`,
            :attr:`Call.positions`, :attr:`LayerRecord.steps`), with or without ``steps=``.

    In a model with ``DTensor`` parameters every call records how its output lies across
    ranks (:attr:`Call.layout`: placements, mesh, global shape, or unknown), and ``reduce=``
    is computed over the global tensor of an output whose layout is known (the same
    collective as ``gather=``); one whose layout is unknown is reduced as this rank sees it.
    See the guide "Sharded training".

    Narrowing keeps every axis (``positions=[-1]``: a position axis of size 1) and
    applies to each floating-point tensor of the output and the gradient w.r.t. it,
    before ``reduce=``; see the guide "Heads, positions and neurons".

    ``cap["layer"]`` is then a :class:`LayerRecord`; ``cap.nbytes`` is the bytes held.

    Forwards from several threads are each a pass of their own: the records are those of the
    same forwards run one after another, in the order they started.

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
        capture_device: torch.device | str | None = None,
        reduce: Reduce | None = None,
        keep: Keep | None = None,
        max_bytes: int | None = None,
        stop: bool = False,
        detach: bool = True,
        recompile: bool = False,
        positions: Positions | None = None,
        heads: Indices | None = None,
        neurons: Indices | None = None,
        layout: Mapping[str, str] | None = None,
        this_thread: bool = False,
        gather: bool = False,
        steps: Steps | None = None,
    ) -> None:
        self._steps = steps_of(steps)
        keep = keep if keep is not None else "pass" if self._steps is None else "all"
        check_options(copy, keep, max_bytes, reduce, stop, grads)
        if not isinstance(gather, bool):
            raise UsageError(f"gather={gather!r}: use True (global tensors) or False")
        units = Units.of(positions, heads, neurons)
        if units is not None and units.positions is not None and reduce == "token_mean":
            raise UsageError(
                "positions= keeps some positions and reduce='token_mean' averages over every "
                "real one: give one of them (positions='last' is the last real token)"
            )
        super().__init__(model, recompile=recompile, this_thread=this_thread)
        if not this_thread:  # (hs.features runs one of its own)
            self._entry = "hs.capture"
        chosen = self._layers.sites(layers)
        masks = MaskNote() if units is not None and units.needs_mask else None
        self._units = units
        self._store = Store(
            copy=copy,
            device=torch.device(capture_device) if capture_device is not None else None,
            reduce=reduce,
            detach=detach,
            max_bytes=max_bytes,
            narrow=narrows(
                units,
                {n: (s.module, s.op) for n, s in chosen.items()},
                layout,
                lambda selector: self._layers.sites(selector),
                masks,
                self._layers.root,
            ),
            masks=masks,
        )
        self._sites = {n: _Site(n, s.module, self._store, s.op) for n, s in chosen.items()}
        self._site_objects = self._sites
        self._records = {n: s.record for n, s in self._sites.items()}
        self._inputs, self._grads = inputs, grads
        self._gather, self._reduces = gather, reduce is not None
        self._placed = False  # a model with DTensor parameters: outputs' layouts (_install)
        self._ring = 1 if keep == "last" else keep if isinstance(keep, int) else None
        # the positions of the forwards whose calls the records may still hold
        self._store.spans = Spans(None if keep == "all" else (self._ring or 1) + 8)
        self._per_pass = keep == "pass"
        self._stop = stop
        self._used: list[_Site] = []  # layers that ran in the latest pass
        self._stale: list[_Site] = []  # layers that ran in the pass before, maybe not since
        self._open_calls: dict[int, Call] = {}  # calls started and not finished, any thread
        self._watch = GradWatch()
        # replays: a reentrant checkpoint's gradients come with its replay in backward
        self._watch_ops(self._sites, replays=grads)

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
        if self._steps is not None and self.latest_pass >= 0:
            raise UsageError(
                f"steps= counts the model's forwards since the capture was built, and this one "
                f"already saw {self.latest_pass + 1}: build a new hs.capture(...) for each "
                "generate() call"
            )
        self._store.closed = False
        # (a model parallelized after the capture was made counts: read at each open)
        self._placed = sharded_model(self._layers.root)
        # the forward's positions (Call.positions: a model that takes tokens, or steps=);
        # its mask for token_mean, "last"
        self._root_binder = Binder(self._layers.root)
        tokens = self._root_binder.may_take({"input_ids", "inputs_embeds"})
        masked = self._store.reduces_tokens or self._store.masks is not None
        if tokens or masked or self._steps is not None:
            hooks.forward_pre(self._layers.root, self._on_model_inputs, with_kwargs=True)
        if masked:
            hooks.forward(self._layers.root, self._on_model_end, always_call=True)
        for site in self._sites.values():
            if site.op is not None:
                continue  # an operation: its module's calls are followed by the session
            if (self._placed or self._steps is not None) and not (self._inputs or self._grads):
                post = functools.partial(self._on_output, site)  # (the general path)
                hooks.forward(site.module, post, hides_modes=True)
            elif self._inputs or self._grads:
                site.binder = Binder(site.module)
                pre = functools.partial(self._on_input, site)
                hooks.forward_pre(site.module, pre, with_kwargs=True, hides_modes=True)
                post = functools.partial(self._on_output, site)
                hooks.forward(site.module, post, hides_modes=True)
            else:
                hooks.forward(site.module, self._output_only(site), hides_modes=True)

    def _closed(self) -> None:
        self._store.closed = True
        self._sweep()
        self._drop_open(list(self._open_calls.values()))

    def _drop_open(self, calls: list[Call]) -> None:
        """Calls that started and never finished (a forward ended by an exception): their
        bytes are refunded, late gradients dropped."""
        for call in calls:
            self._open_calls.pop(id(call), None)
            call._evict()

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
        done = self._now.last_done
        if isinstance(ev, StopForward) and ev.owner is self:
            self._abandon()  # the calls the stop left open end now (operation modes too)
        super().__exit__(et, ev, tb)
        if isinstance(ev, StopForward) and ev.owner is self:
            return True
        if isinstance(ev, Exception) and _raised_in_a_module(tb):
            note = (
                "hookscope: raised inside the model's forward; the last layer this capture "
                f"saw finish was {repr(done) if done else 'none'}"
            )
            if note not in getattr(ev, "__notes__", ()):  # (another capture open said so)
                ev.add_note(note)
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

    def values(self) -> list[LayerRecord]:
        """The captured layers' records, in the order of :meth:`keys`.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
            >>> with hs.capture(model, ["0", "1"]) as cap:
            ...     _ = model(torch.ones(1, 2))
            >>> [record.output.shape for record in cap.values()]
            [torch.Size([1, 3]), torch.Size([1, 3])]
        """
        return list(self.records.values())

    def items(self) -> list[tuple[str, LayerRecord]]:
        """``(name, record)`` of each captured layer, in the order of :meth:`keys` (as a
        mapping's ``items``).

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
            >>> with hs.capture(model, ["0", "1"]) as cap:
            ...     _ = model(torch.ones(1, 2))
            >>> {name: record.count for name, record in cap.items()}
            {'0': 1, '1': 1}
        """
        return list(self.records.items())

    def get(self, name: str, default: Any = None) -> LayerRecord | Any:
        """The record of layer ``name`` (any of its names), or ``default`` if this capture
        has no such layer (as a mapping's ``get``).

        Example:
            >>> import torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
            >>> with hs.capture(model, "0") as cap:
            ...     pass
            >>> cap.get("1") is None, cap.get("0").name
            (True, '0')
        """
        found = self.records.get(self._layers.canonical(name)) if isinstance(name, str) else None
        return default if found is None else found

    def __repr__(self) -> str:
        calls = sum(len(r) for r in self.records.values())
        state = "open" if self._hooks is not None else "closed"
        return (
            f"Capture({len(self.records)} layers, {calls} calls kept, "
            f"{self.nbytes / 2**20:.1f} MiB, {state})"
        )

    def _rebound(self, site: _Site) -> None:
        kind = type(site.module).__name__
        site.record.module_type = f"{kind}::{site.op.op}" if site.op else kind

    # -- passes and calls -----------------------------------------------------------------
    # With keep="pass", a layer's calls of the previous pass are dropped when the layer first
    # runs in the new pass, or, for layers that do not run again, when the capture is read or
    # the next pass starts: each forward touches only the layers it uses.
    def _new_pass(self) -> None:
        now = self._local.now
        if now.open:  # calls an interrupted forward of this thread left
            for opens in now.open.values():
                self._drop_open([entry[0] for entry in opens if entry is not None])
            now.open.clear()
        with self._lock:
            self._sweep(now.pass_index - 1)  # the pass before this one is the latest ended
            self._stale, self._used = self._used, self._stale  # (the swept list, empty)

    def _sweep(self, latest: int | None = None) -> None:
        """Drop what layers that did not run in the latest pass still hold from before."""
        latest = self.latest_pass if latest is None else latest
        with self._lock:
            if self._per_pass:
                for site in self._stale:
                    if site.used_in < latest:
                        site.record._evict_all(grads=self._grads)
            self._stale.clear()

    def _enter_pass(self, site: _Site, pass_index: int) -> None:
        """The layer's first call in this pass (once per layer and forward); ``_output_only``
        does the common case of the solo thread itself."""
        if _transforms_active():  # a torch.func transform around it (_session)
            raise transformed_error(site.name, self._entry)
        lock = self._lock  # acquire/release: half the cost of `with` (the per-site hot path)
        lock.acquire()
        try:
            if pass_index < site.used_in:  # another thread's later forward already ran it
                site.record._unordered = True
                return
            site.used_in = pass_index
            self._used.append(site)
            if self._per_pass:
                site.record._evict_all(grads=self._grads)
        finally:
            lock.release()

    def _stored(self, site: _Site, pass_index: int) -> None:
        """After the fast path stored a call: another thread's forward started meanwhile
        (:meth:`_late`), a ring other threads filled past its size, ``stop=True``."""
        if site.used_in != pass_index:
            self._late(site, pass_index)
        if self._ring is not None and len(site.record) > self._ring:
            self._trim(site.record)
        if self._stop:
            self._finished(site)

    def _late(self, site: _Site, pass_index: int) -> None:
        """A call of ``pass_index`` was kept while a later pass had started on another thread:
        with ``keep="pass"`` the latest pass alone is kept."""
        if self._per_pass:
            with self._lock:
                site.record._evict_passes_before(site.used_in, grads=self._grads)
        else:
            site.record._unordered = True

    def _trim(self, record: LayerRecord) -> None:
        """A ring the forwards of several threads filled past its size at once."""
        assert self._ring is not None
        with self._lock:
            if len(record) > self._ring:
                record._evict(len(record) - self._ring, grads=self._grads)

    def _make_room(self, record: LayerRecord) -> None:
        """A ring of N calls: drop the oldest before storing (the budget sees the room)."""
        assert self._ring is not None
        if len(record) >= self._ring:
            with self._lock:
                if len(record) >= self._ring:
                    record._evict(len(record) - self._ring + 1, grads=self._grads)

    def _new_call(self, site: _Site) -> Call:
        pass_index = self._now.pass_index
        if site.used_in != pass_index:
            self._enter_pass(site, pass_index)
        if self._ring is not None:
            self._make_room(site.record)
        return Call(site.name, pass_index, self._store)

    def _keep(self, site: _Site, call: Call) -> None:
        """Keep a finished call in its layer's record."""
        record = site.record
        with self._lock:
            if call.pass_index < site.used_in and self._per_pass:
                call._evict()  # another thread's later forward is the latest pass
                return
            record._add(call)
            if self._ring is not None and len(record) > self._ring:  # nested calls
                record._evict(len(record) - self._ring, grads=self._grads)
        self._finished(site)

    def _finished(self, site: _Site) -> None:
        """After a layer's call: note it, and with stop=True end the forward once every
        layer has finished a call in this pass."""
        now = self._now
        now.last_done = site.name
        if self._stop:
            done: set[str] = now.extra.setdefault("done", set())
            done.add(site.name)
            if len(done) == len(self._sites):
                raise StopForward(self)

    def _output_only(self, site: _Site) -> Callable[[nn.Module, Any, Any], None]:
        """The forward hook of a capture of outputs only: the per-call hot path, with what it
        needs bound once. It stores the value (and its version, by reference), nothing else.
        With the default storage policy (see ``Store``) the copy is made right here; so is
        :meth:`_enter_pass`'s work in its common case on the session's solo thread (no lock,
        no frame: the layer's previous pass held one call); every other case calls it."""
        module, name, record, store = site.module, site.name, site.record, self._store
        append, ring, stop, where = record._appender(), self._ring, self._stop, (name, _OUTPUT)
        keep = None if store.keep in (store._keep_clone, store._keep_reference) else store.keep
        clone = store.keep == store._keep_clone
        threads, local = self._threads, self._local  # (a new `_local` comes with new hooks)
        per_pass = self._per_pass
        pending, counting = record._pending, store.counting  # (both fixed while open)
        after = ring is not None or stop  # _stored's work beyond a late call's

        def on_output(mod: nn.Module, args: Any, output: Any) -> None:
            if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
                return
            if _stack_length():  # a user's function modes must not see the copy (_lifetime)
                return _run_unseen(on_output, mod, args, output)
            if mod is not module:
                raise replica_error(mod)
            if _backward_id() != -1:
                return  # a checkpoint's replay: the call is already recorded
            now = local.now
            if (now.private or threads is not None) and self._ignores(now):
                return  # a private forward, or another thread's (see Session._ignores)
            pass_index = now.pass_index
            if site.used_in != pass_index:  # the layer's first call in this pass
                if _transforms_active():
                    raise transformed_error(name, self._entry)
                quick = False
                now.busy = True  # before reading _solo: Session._join
                try:  # the solo thread's common case takes no lock (_join), else _enter_pass
                    if self._solo is now and site.used_in < pass_index:
                        if not per_pass:
                            quick = True
                        elif len(pending) == 1 and not counting and not record._calls:
                            quick = True
                            record._dropped += 1  # LayerRecord._evict_all's fast path, inlined
                            pending.clear()
                        if quick:
                            site.used_in = pass_index
                            self._used.append(site)
                finally:
                    now.busy = False
                if not quick:
                    self._enter_pass(site, pass_index)
            if ring is not None:
                self._make_room(record)
            if type(output) is not Tensor:
                call = Call(name, pass_index, store)
                call._set_output(output)
                self._keep(site, call)
                return
            if keep is not None:
                append((*keep(output, where), pass_index))
            elif clone:  # Store._keep_clone, inlined
                value = (output.detach() if output.requires_grad else output).clone()
                append((value, None, pass_index))
            else:  # Store._keep_reference, inlined
                value = output.detach() if output.requires_grad else output
                try:
                    append((value, _version(value), pass_index))
                except RuntimeError:  # an inference tensor has no version counter: copy it
                    append((value.clone(), None, pass_index))
            now.last_done = name
            if after or site.used_in != pass_index:
                self._stored(site, pass_index)

        return on_output

    # -- hooks ----------------------------------------------------------------------------
    def _on_model_inputs(
        self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None
    ) -> None:
        """Note the token positions of the forward starting (``Call.positions``) and, for
        ``reduce="token_mean"`` and ``positions="last"``, its token mask (this thread's).

        No ``kwargs``: torch called this with-kwargs hook as a plain one, which happens when
        another thread's forward took the module's hooks just before this session removed
        it (``Module._call_impl`` reads the hooks and the with-kwargs set at two times): that
        forward is not this session's."""
        if kwargs is None:
            return
        now = self._now
        if now.depth == 1 and not (self._in_backward() or self._ignores()):
            bound = self._root_binder.bind(args, kwargs)
            if self._steps is None or now.pass_index in self._steps:
                assert self._store.spans is not None
                self._store.spans.note(now.pass_index, span_of(bound))
            if self._store.reduces_tokens:
                self._store.note_inputs(bound)
            if self._store.masks is not None:
                self._store.masks.note(bound)

    def _on_model_end(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self._now.depth and not (self._in_backward() or self._ignores()):
            self._store.note_inputs({})  # a layer called outside a forward has no mask
            if self._store.masks is not None:
                self._store.masks.note({})

    def _on_input(
        self,
        site: _Site,
        module: nn.Module,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        binder: Binder | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return None
        if kwargs is None:  # a forward that took the hooks as this session removed it (_lifetime)
            return None
        if _stack_length():  # a user's function modes must not see the copies (_lifetime)
            return _run_unseen(self._on_input, site, module, args, kwargs, binder)
        if module is not site.module:
            raise replica_error(module)
        now = self._local.now
        if (now.private or self._threads is not None) and self._ignores(now):
            return None
        binder = binder or site.binder
        assert binder is not None
        if _backward_id() != -1:
            self._replayed_input(site, binder.bind(args, kwargs))
            return None
        if self._steps is not None and self._skips(site.name, module, now):
            return None
        call = self._new_call(site)
        bound = binder.bind(args, kwargs)
        opens = now.open.setdefault(site, [])
        opens.append((call, None))  # first: if storing raises, closing refunds it
        self._open_calls[id(call)] = call
        if self._inputs:
            call._set_inputs(self._narrow_inputs(site, bound))
        if not self._grads:
            return None
        call._expect_grads(None if self._inputs else bound)
        opens[-1] = (call, self._watch.start(site.name, call, bound))
        return None

    def _on_output(self, site: _Site, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if _getattr(_flags, _EXPORTING) and _export_traced():  # an export's trace (_lifetime)
            return None
        if _stack_length():  # a user's function modes must not see the copies (_lifetime)
            return _run_unseen(self._on_output, site, module, args, output)
        if module is not site.module:
            raise replica_error(module)
        now = self._local.now
        if (now.private or self._threads is not None) and self._ignores(now):
            return None
        if _backward_id() != -1:  # activation checkpointing replays the call in backward
            return self._replayed_output(site, output)
        if self._steps is not None and self._skips(site.name, module, now):
            return None
        opens = now.open.get(site)
        if opens:
            call, boundary = opens.pop()
            self._open_calls.pop(id(call), None)
        else:
            call, boundary = self._new_call(site), None
        if self._placed:
            call._set_output(self._placed_output(site, call, args, output))
        else:
            call._set_output(output)
        new_output = None
        if self._grads:
            new_output = self._watch.finish(self.hooks, call, boundary, output)
        self._keep(site, call)
        return new_output

    def _placed_output(self, site: _Site, call: Call, args: tuple[Any, ...], output: Any) -> Any:
        """In a sharded model: note how ``output`` lies across ranks on ``call`` and return
        what to store: its global tensor where ``gather=`` or ``reduce=`` asks for it and the
        layout is known (``_placement``), else ``output`` itself."""
        whole_wanted = self._gather or self._reduces
        if isinstance(output, Tensor):
            layout = layout_of(site.module, args, output)
            call._set_layout(layout)
            if whole_wanted and layout.known:
                return whole(output, layout)
            if self._gather:
                raise _unknown_layout(site.name, ())
            return output

        def leaf(path: Any, t: Tensor) -> Tensor:
            if is_dtensor(t):
                return whole(t, layout_of(site.module, args, t)) if whole_wanted else t
            if self._gather:
                raise _unknown_layout(site.name, path)
            return t

        call._set_layout(UNKNOWN)  # (a structure: its DTensor leaves carry their own)
        return _tree.map_tensors(leaf, output)

    def _skips(self, name: str, module: nn.Module, now: Now) -> bool:
        """``steps=``: whether this call's forward is not one of the steps; a layer called
        by itself, outside a forward of the model, has no step and is refused."""
        if not now.depth and module is not self._layers.root:
            raise UsageError(
                f"steps= records some forwards of the model, and {name!r} ran outside "
                "any (called by itself), so it has no step: call the model, or capture "
                "without steps="
            )
        assert self._steps is not None
        return now.pass_index not in self._steps

    def _narrow_inputs(self, site: _Site, bound: dict[str, Any]) -> dict[str, Any]:
        """``heads=`` on an SDPA call's inputs: the query at the selected heads, key and
        value at the key/value heads those read (grouped-query attention); a packed call's
        query (``ops/_attention``) unpacked first, so that its heads are the query heads."""
        units = self._units
        if units is None or units.heads is None or site.op is None or site.op.op != SDPA:
            return bound
        query, key = bound.get("query"), bound.get("key")
        if not isinstance(query, Tensor) or not isinstance(key, Tensor) or query.dim() < 3:
            return bound
        query = unpack(query, packed_groups(site.module, query, key))
        hq, hk = query.size(-3), key.size(-3)
        chosen = [h % hq for h in units.heads]
        narrowed = dict(bound)
        narrowed["query"] = query.index_select(-3, torch.tensor(chosen, device=query.device))
        kv = torch.tensor(kv_heads(chosen, hq, hk), device=key.device)
        for name in ("key", "value"):
            value = bound.get(name)
            if isinstance(value, Tensor) and value.dim() >= 3 and value.size(-3) == hk:
                narrowed[name] = value.index_select(-3, kv)
        return narrowed

    # -- checkpoint replays (only captures with grads=True hook them) ----------------------
    def _replayed_input(self, site: _Site, bound: dict[str, Any]) -> None:
        found = self._watch.replayed(site.name) if self._grads else None
        replaying = self._now.open.setdefault((site, "replay"), [])
        replaying.append(None if found is None else (found, Boundary(bound)))

    def _replayed_output(self, site: _Site, output: Any) -> Any:
        replaying = self._now.open.get((site, "replay"))
        entry = replaying.pop() if replaying else None
        if entry is None:
            return None
        call, boundary = entry
        return self._watch.finish(self.hooks, call, boundary, output)

    # -- operation sites (see ``ops/``) ------------------------------------------------------
    def _run_op(
        self,
        owner: ModuleCall,
        sites: list[Any],
        weights: list[Any],
        func: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        """Record an operation call for each of ``sites`` and, for an SDPA call, its attention
        weights for each of ``weights`` (the first selector outermost)."""
        named = (sites or weights)[0].name
        if self._steps is not None and self._skips(named, owner.module, self._now):
            return forward_op(func, args, kwargs)
        run: Run = functools.partial(forward_op, func)
        for site in reversed(sites):
            run = functools.partial(self._capture_value, site, func, run)
        for wsite in reversed(weights):
            run = functools.partial(self._capture_weights, wsite, func, run)
        return run(args, kwargs)

    def _capture_value(
        self, site: _Site, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        if self._inputs or self._grads:
            self._on_input(site, site.module, args, kwargs, op_binder(func))
        out = run(args, kwargs)
        new = self._on_output(site, site.module, args, out)
        return out if new is None else new

    def _capture_weights(
        self, wsite: _Site, func: Any, run: Run, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        bound = op_binder(func).bind(args, kwargs)
        groups = packed_groups(wsite.module, bound["query"], bound["key"])
        if backward_id() != -1:  # a checkpoint's replay: only gradients may still be wanted
            found = self._watch.replayed(wsite.name) if self._grads else None
            out = run(args, kwargs)
            if found is not None:
                self._hook_weights_grad(found, bound, groups, out)
            return out
        call = self._new_call(wsite)
        eager = self._store.transforms  # reduce= and units apply to the weights, not Q, K, V
        if self._inputs or not eager:
            call._set_inputs(bound)
        slot: list[Tensor] = []
        at = len(WAITING)
        WAITING.append(slot)  # an edit below fills it with the probabilities it produces
        try:
            out = run(args, kwargs)
        finally:
            del WAITING[at:]
        if slot:
            call._set_output(slot[0])
        elif eager:
            with torch.no_grad():
                call._set_output(unpack(probabilities(**attention_args(bound)), groups))
        else:
            call._set_lazy(functools.partial(_lazy_weights, groups))
        if self._grads:
            self._weights_grads(wsite, call, bound, groups, out)
        self._keep(wsite, call)
        return out

    def _weights_grads(
        self, wsite: _Site, call: Call, bound: dict[str, Any], groups: int, out: Any
    ) -> None:
        call._expect_grads(None)
        for path, _ in _tree.leaves(bound):
            call._no_grad(("input", *path), _NO_INPUT_GRADS)
        if float(bound.get("dropout_p", 0.0)) > 0:
            why = "the call applied dropout (dropout_p > 0), whose mask the fused kernel hides"
            call._no_grad(_OUTPUT, why)
            return
        boundary = self._watch.start(wsite.name, call, {})  # notes a reentrant checkpoint's call
        if isinstance(boundary, str):
            if boundary != PENDING:
                call._no_grad(_OUTPUT, boundary)
            return
        self._hook_weights_grad(call, bound, groups, out)

    def _hook_weights_grad(self, call: Call, bound: dict[str, Any], groups: int, out: Any) -> None:
        if not isinstance(out, Tensor) or not out.requires_grad:
            call._no_grad(_OUTPUT, why_no_grad())
            return
        value: Tensor = bound["value"].detach()
        heads = bound["query"].size(-3) if bound.get("enable_gqa") else None

        def on_grad(grad: Tensor) -> None:
            call._set_grad(_OUTPUT, unpack(weights_grad(value, heads, grad), groups))

        self.hooks.tensor(out, on_grad)


def _lazy_weights(groups: int, call: Call) -> Tensor:
    return unpack(probabilities(**attention_args(call.inputs)), groups)


_backward_id = backward_id  # module globals: the per-call path looks them up fastest
_stack_length = _torch.function_stack_length
_run_unseen = run_unseen
_export_traced = _torch.export_traced
_getattr, (_flags, _EXPORTING) = getattr, _torch.EXPORTING_FLAG
_transforms_active = _torch.transforms_active
_version = _torch.version


def _unknown_layout(name: str, path: Any) -> UsageError:
    where = f"output{_tree.path_str(tuple(path))}" if path else "output"
    return UsageError(
        f"gather=True: {name!r} {where} is a plain tensor of a tensor-parallel model, and "
        "nothing says whether this rank holds a slice or a copy of it (only a DTensor, or "
        "the output of a parallelized nn.Linear / nn.Embedding, says how it lies). Select "
        "the parallelized layers, hand on DTensors (use_local_output=False in the plan), or "
        "capture without gather=True (this rank's values)"
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
