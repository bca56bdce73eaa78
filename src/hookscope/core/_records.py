"""Plain-data records of what a capture saw: one :class:`Call` per module call.

A call fills itself in (``set_output``, ``set_inputs``, ``set_grad``) through its capture's
:class:`~hookscope.core._store.Store`, which decides how values are stored and counts their
bytes. Every read goes through one accessor that first waits for pending device copies and
checks by-reference values for later in-place changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..errors import CaptureError, GradientUnavailableError, StaleCaptureError
from . import _torch, _tree
from ._placement import Layout
from ._store import Store, describe
from ._types import Inputs, Path

__all__ = ["Call", "LayerRecord"]

_OUTPUT: Path = ("output",)
_version = _torch.version
#: the structure of an output computed on read (a single tensor), for its gradient
_ONE_TENSOR = torch.empty(0, device="meta")


class _Extra:
    """The less common parts of a call, kept out of the per-call fast path."""

    __slots__ = ("events", "grads", "inputs", "layout", "lazy", "refs", "skeleton", "why")

    def __init__(self) -> None:
        self.inputs: Inputs | None = None
        self.skeleton: Inputs | None = None  # input structure (meta tensors) for grads
        self.grads: dict[Path, Tensor] | None = None  # set when gradients are captured
        self.why: dict[Path, str] = {}  # why a leaf has no gradient
        self.refs: list[tuple[Tensor, int, Path]] = []  # by-reference values and versions
        self.events: list[Any] = []  # CUDA events of non-blocking copies not yet waited for
        #: computes the output from the call's record on every read (attention weights)
        self.lazy: Callable[[Call], Any] | None = None
        #: how the output lies across ranks, in a model with DTensor parameters
        self.layout: Layout | None = None


class Call:
    """What one call of one layer saw: inputs, output and (on request) their gradients.

    Read-only for users: a capture fills it in (through the underscore methods) and every
    public attribute and property only reads.

    Attributes:
        layer: the layer's dotted name.
        index: position of this call among the layer's calls since the capture opened.
        pass_index: which top-level forward of the model this call belonged to (see
            :attr:`step`).
    """

    __slots__ = (
        "_evicted",
        "_extra",
        "_output",
        "_ref",
        "_store",
        "index",
        "layer",
        "pass_index",
    )

    def __init__(self, layer: str, pass_index: int, store: Store) -> None:
        self.layer = layer
        self.index = -1  # set when the call finishes
        self.pass_index = pass_index
        self._output: Any = None
        self._ref: tuple[Tensor, int] | None = None  # a single by-reference output
        self._extra: _Extra | None = None
        self._store = store
        self._evicted = False

    @classmethod
    def _made(
        cls, layer: str, store: Store, index: int, value: Tensor, tag: Any, pass_: int
    ) -> Call:
        """The call of a single-tensor output recorded as ``Store.keep`` returned it."""
        call = cls(layer, pass_, store)
        call.index, call._output = index, value
        if type(tag) is int:
            call._ref = (value, tag)
        elif tag is not None:
            call._more().events.append(tag)
        return call

    @property
    def step(self) -> int:
        """The generation step: which forward of the model this call belonged to, counted
        from 0 since the capture was built (under ``generate()``: 0 is the prefill, then one
        forward per new token). The same number as :attr:`pass_index`, named for
        ``steps=``."""
        return self.pass_index

    @property
    def positions(self) -> range | None:
        """The token positions the call's forward covered: columns of the forward's
        ``attention_mask`` (absolute positions in the padded sequence, as in ``generate()``'s
        output), the forward's last columns for its input tokens (the prompt at step 0, then
        the new token); without a mask, counted after what its KV cache holds. None when the
        forward got no ``input_ids`` / ``inputs_embeds``. (A layer called by itself, outside a
        forward of the model, counts as part of the forward before it, as for ``keep=``.)
        With ``positions=`` the record keeps some of these (``positions=[-1]``: the last).
        Under left padding a sample's own token index at a column is
        ``attention_mask.cumsum(-1)[:, column] - 1``."""
        spans = self._store.spans
        return None if spans is None else spans.get(self.pass_index)

    # -- filling in (by the capture) --------------------------------------------------------
    def _more(self) -> _Extra:
        if self._extra is None:
            self._extra = _Extra()
        return self._extra

    def _keep(self, t: Tensor, path: Path, grad: bool = False) -> Tensor:
        store = self._store
        value, tag = (store.keep_grad if grad else store.keep)(t, (self.layer, path))
        if tag is None:
            return value
        if type(tag) is not int:  # a CUDA event: the copy is still running
            self._more().events.append(tag)
        else:
            self._more().refs.append((value, tag, path))
        return value

    def _set_output(self, output: Any) -> None:
        if type(output) is Tensor:  # the common case, inlined: this runs for every call
            value, tag = self._store.keep(output, (self.layer, _OUTPUT))
            self._output = value
            if tag is not None:
                if type(tag) is int:
                    self._ref = (value, tag)
                else:
                    self._more().events.append(tag)
        else:
            self._output = _tree.map_tensors(lambda p, t: self._keep(t, ("output", *p)), output)

    def _set_layout(self, layout: Layout) -> None:
        self._more().layout = layout

    def _set_lazy(self, compute: Callable[[Call], Any]) -> None:
        """The output is ``compute(self)``, computed on every read and never kept (so that
        the bytes held and ``max_bytes`` count only what was captured)."""
        self._more().lazy = compute

    def _set_inputs(self, bound: Inputs) -> None:
        self._more().inputs = _tree.map_tensors(lambda p, t: self._keep(t, ("input", *p)), bound)

    def _expect_grads(self, inputs: Inputs | None) -> None:
        """Gradients will be recorded; ``inputs`` gives their structure if not captured."""
        extra = self._more()
        extra.grads = {}
        if extra.inputs is None and inputs is not None:
            extra.skeleton = _tree.map_tensors(_placeholder, inputs)

    def _no_grad(self, key: Path, why: str) -> None:
        self._more().why[key] = why

    def _set_grad(self, key: Path, grad: Tensor) -> None:
        """Store the gradient at ``key`` (``("output", ...)`` / ``("input", ...)``); a later
        backward replaces it. Dropped once the call is evicted or the capture closed."""
        extra = self._extra
        if self._evicted or self._store.closed or extra is None or extra.grads is None:
            return
        old = extra.grads.pop(key, None)
        if old is not None:
            self._store.refund(old.nbytes)
            extra.refs = [r for r in extra.refs if r[2] != ("grad", *key)]
        extra.grads[key] = self._keep(grad, ("grad", *key), True)

    def _evict(self) -> None:
        """The capture no longer keeps this call: refund its bytes, take no more gradients."""
        if not self._evicted:
            self._evicted = True
            self._store.refund(self.nbytes)

    @property
    def nbytes(self) -> int:
        """Bytes of the tensors this call holds (output, inputs, gradients)."""
        extra = self._extra
        trees = [self._output]
        if extra is not None:
            trees += [extra.inputs, extra.grads]
        return sum(t.nbytes for tree in trees for _, t in _tree.leaves(tree))

    # -- reading ------------------------------------------------------------------------------
    def _ready(self) -> _Extra | None:
        """Wait for pending device copies, then check by-reference values (every read)."""
        extra = self._extra
        if self._ref is not None and _version(self._ref[0]) != self._ref[1]:
            self._stale(("output",))
        if extra is not None:
            while extra.events:
                extra.events.pop().synchronize()
            for tensor, version, path in extra.refs:
                if _version(tensor) != version:
                    self._stale(path)
        return extra

    def _stale(self, path: Path) -> None:
        raise StaleCaptureError(
            f"{describe((self.layer, path))} (call {self.index}) was modified in place after "
            "it was captured by reference (e.g. by a later ReLU(inplace=True) or "
            "`x += residual`), so it no longer holds the captured value. Capture with "
            "copy='clone' (the default) instead."
        )

    @property
    def output(self) -> Any:
        """The layer's output, same structure as the module returned (tuple, dict, ...); for
        attention weights, computed from the captured inputs when read."""
        extra = self._ready()
        if extra is not None and extra.lazy is not None:
            return extra.lazy(self)
        return self._output

    @property
    def layout(self) -> Layout | None:
        """How the output lies across ranks, in a model with ``DTensor`` parameters (tensor
        parallelism): a ``Layout`` with its ``placements``, ``mesh``,
        ``global_shape`` and ``source`` (all None but the source, ``"unknown"``, where
        nothing says whether this rank holds a slice or a copy); None in any other model.
        The output kept is this piece unless the capture gathered it (``gather=True``, or
        ``reduce=`` of a known layout: then the global tensor)."""
        return None if self._extra is None else self._extra.layout

    @property
    def placements(self) -> tuple[Any, ...] | None:
        """The output's placements per mesh dimension (``Shard(d)``, ``Replicate()``,
        ``Partial()``), as :attr:`layout` reads them; None when not known."""
        layout = self.layout
        return None if layout is None else layout.placements

    @property
    def mesh(self) -> Any:
        """The ``DeviceMesh`` the output lies on (see :attr:`layout`); None when not known."""
        layout = self.layout
        return None if layout is None else layout.mesh

    @property
    def global_shape(self) -> torch.Size | None:
        """The shape of the whole output over every rank (see :attr:`layout`); None when
        not known."""
        layout = self.layout
        return None if layout is None else layout.global_shape

    @property
    def inputs(self) -> Inputs:
        """The inputs bound to ``forward``'s signature, by parameter name."""
        extra = self._ready()
        if extra is None or extra.inputs is None:
            raise CaptureError(
                f"inputs of {self.layer!r} were not captured: open the capture with inputs=True"
            )
        return extra.inputs

    @property
    def input(self) -> Any:
        """The first argument of ``forward`` (the usual single input)."""
        inputs = self.inputs
        if not inputs:
            raise CaptureError(f"{self.layer!r} was called without arguments")
        return next(iter(inputs.values()))

    @property
    def grad(self) -> Any:
        """Gradient of the loss w.r.t. the output, same structure as the output: what came
        back from downstream (the layer's own uses of a returned tensor excluded), as a full
        backward hook's ``grad_output``.

        Leaves of a nested output that got no gradient are ``None``; if none got one, this
        raises GradientUnavailableError saying why.
        """
        lazy = self._extra is not None and self._extra.lazy is not None
        return self._grad_tree("output", _ONE_TENSOR if lazy else self._output)

    @property
    def grad_inputs(self) -> Inputs:
        """Gradients w.r.t. the tensor inputs flowing *through this layer*, by parameter name
        (``None`` for inputs without one, e.g. an attention mask)."""
        named: Inputs = self._grad_tree("input", self._input_tree())
        return named

    @property
    def grad_input(self) -> Any:
        """Gradient w.r.t. the first argument of ``forward``; raises saying why if none."""
        tree = self._input_tree()
        if not tree:
            raise GradientUnavailableError(f"{self.layer!r} was called without arguments")
        first = next(iter(tree))
        return self._grad_tree("input", tree[first], (first,))

    def _input_tree(self) -> Inputs:
        extra = self._need_grads("input")
        return extra.inputs if extra.inputs is not None else (extra.skeleton or {})

    def _need_grads(self, side: str) -> _Extra:
        extra = self._ready()
        if extra is None or extra.grads is None:
            raise GradientUnavailableError(
                f"gradients of {self.layer!r} {side} were not captured: open the capture with "
                "grads=True"
            )
        return extra

    def _grad_tree(self, side: str, tree: Any, prefix: Path = ()) -> Any:
        grads = self._need_grads(side).grads
        assert grads is not None
        missing: list[Path] = []

        def leaf(path: Path, t: Tensor) -> Tensor | None:
            key = (side, *prefix, *path)
            if key in grads:
                return grads[key]
            missing.append(key)
            return None

        result = _tree.map_tensors(leaf, tree, other=lambda value: None)
        if missing and len(missing) == sum(1 for _ in _tree.leaves(tree)):
            raise GradientUnavailableError(self._why_missing(missing[0]))
        return result

    def _why_missing(self, key: Path) -> str:
        where = f"no gradient for {describe((self.layer, key))} (call {self.index})"
        why = self._extra.why.get(key) if self._extra is not None else None
        if why is not None:
            return f"{where}: {why}"
        if self._evicted:
            return f"{where}: the call was no longer kept (keep=) when backward reached it"
        if self._store.closed:
            return (
                f"{where}: backward had not reached it when the capture closed, and gradients "
                "are recorded only while it is open. Call .backward() inside the `with` block."
            )
        return (
            f"{where} yet: backward has not reached it. Call .backward() on a loss that "
            "depends on this value while the capture is open."
        )

    def _shown_output(self) -> str:
        """The output as a repr shows it; attention weights, computed when read, too."""
        extra = self._extra
        if extra is None or extra.lazy is None:
            return _tree.describe(self._output)
        try:
            with torch.no_grad():
                return _tree.describe(extra.lazy(self))
        except Exception:  # a repr must not raise (inputs gone with an evicted call)
            return "computed when read"

    def __repr__(self) -> str:
        parts = [f"{self.layer!r}", f"call={self.index}", f"output={self._shown_output()}"]
        if self._extra is not None and self._extra.inputs is not None:
            parts.append(f"inputs={_tree.describe(self._extra.inputs)}")
        if self._extra is not None and self._extra.grads is not None:
            parts.append(f"grads={len(self._extra.grads)}")
        return f"Call({', '.join(parts)})"


def _pass_of(call: Call) -> int:
    return call.pass_index


class LayerRecord:
    """Every kept call of one layer, oldest first; ``.output`` etc. read the latest call.

    Attributes:
        name: the layer's dotted name.
        module_type: the module's class name.
        calls: the kept :class:`Call` records, in call order.
        count: how many times the layer ran while the capture was open (including calls
            no longer kept because of ``keep=``).
    """

    __slots__ = ("_calls", "_dropped", "_pending", "_store", "_unordered", "module_type", "name")

    def __init__(self, name: str, module_type: str, store: Store) -> None:
        self.name = name
        self.module_type = module_type
        self._dropped = 0  # calls no longer kept
        self._calls: list[Call] = []
        #: a call of an earlier pass was kept after one of a later pass (forwards from several
        #: threads): the calls are put in pass order when read
        self._unordered = False
        # Output-only calls as recorded: (value, tag, pass), made into Call objects when
        # first read. Recording stores nothing else per call.
        self._pending: list[tuple[Tensor, Any, int]] = []
        self._store = store

    def _appender(self) -> Callable[[tuple[Tensor, Any, int]], None]:
        """How a capture's hot path records a finished call with a single-tensor output:
        ``append((value, tag, pass_index))``, with ``value, tag`` as ``Store.keep`` returns
        them. The :class:`Call` is made when the record is read."""
        return self._pending.append

    @property
    def count(self) -> int:
        """How many times the layer ran while the capture was open (kept or not)."""
        return self._dropped + len(self._calls) + len(self._pending)

    @property
    def calls(self) -> list[Call]:
        """The kept :class:`Call` records, oldest first: one per call of the layer (a module
        used three times in a forward has three), as many as ``keep=`` keeps."""
        if self._pending:
            first, name, store = self._dropped + len(self._calls), self.name, self._store
            # (the list is kept: the capture's hot path holds its append; a call another
            # thread appends meanwhile stays for the next read)
            taken = self._pending[: len(self._pending)]
            del self._pending[: len(taken)]
            self._calls += [
                Call._made(name, store, first + i, *entry) for i, entry in enumerate(taken)
            ]
        if self._unordered:
            self._unordered = False
            self._calls.sort(key=_pass_of)  # stable: a pass's own calls keep their order
            for i, call in enumerate(self._calls):
                call.index = self._dropped + i
        return self._calls

    def _evict_passes_before(self, latest: int, *, grads: bool) -> None:
        """Stop keeping the calls of passes before ``latest`` (``keep="pass"`` when several
        threads' forwards overlap: only the latest pass to start is kept)."""
        calls = self.calls
        old = sum(1 for call in calls if call.pass_index < latest)
        if old:
            self._unordered = True  # sorted by pass: the old calls come first
            self._evict(old, grads=grads)

    def _add(self, call: Call) -> None:
        """Keep a finished call as the newest (of its pass)."""
        if self._pending:
            self.calls  # noqa: B018 - keeps the order
        call.index = self.count
        if self._calls and self._calls[-1].pass_index > call.pass_index:
            self._unordered = True
        self._calls.append(call)

    def _evict(self, n: int, *, grads: bool) -> None:
        """Stop keeping the ``n`` oldest calls (``grads``: they may still get gradients)."""
        if self._unordered:
            self.calls  # noqa: B018 - the oldest are those of the earliest passes
        self._dropped += min(n, len(self))
        gone = self._calls[:n]
        del self._calls[:n]
        counting = self._store.counting
        if grads:  # mark each, so that its late gradients are dropped
            for call in gone:
                call._evict()
        elif gone and counting:  # nothing can arrive later: just refund
            self._store.refund(sum(call.nbytes for call in gone))
        rest = n - len(gone)
        if rest > 0 and self._pending:
            if counting:
                self._store.refund(sum(entry[0].nbytes for entry in self._pending[:rest]))
            del self._pending[:rest]

    def _evict_all(self, *, grads: bool) -> None:
        """Stop keeping any call (the fast path of :meth:`_evict`, once per layer and pass)."""
        pending = self._pending
        if len(pending) == 1 and not self._calls and not self._store.counting:
            self._dropped += 1
            pending.clear()
        elif self._calls or pending:
            self._evict(len(self._calls) + len(pending), grads=grads)

    def _held(self) -> int:
        """Bytes of every tensor the kept calls hold."""
        pending = sum(entry[0].nbytes for entry in self._pending)
        return pending + sum(call.nbytes for call in self._calls)

    def __len__(self) -> int:
        return len(self._calls) + len(self._pending)

    @property
    def last(self) -> Call:
        """The most recent kept call."""
        if not self.calls:
            raise CaptureError(
                f"{self.name!r} ({self.module_type}) has not run while the capture was open: "
                "was the model called inside the `with` block, and does its forward reach "
                "this layer?"
            )
        return self.calls[-1]

    def only(self) -> Call:
        """The single call; raises if the layer ran more or less than once."""
        if len(self.calls) != 1:
            raise CaptureError(f"{self.name!r} has {len(self.calls)} kept calls, not 1")
        return self.calls[0]

    @property
    def output(self) -> Any:
        """The latest call's output, in the structure the module returned (a tensor, tuple,
        dict, dataclass...): a detached copy by default (``copy="clone"``).

        Raises:
            CaptureError: the layer has not run while the capture was open.
            StaleCaptureError: with ``copy="reference"``, the tensor was changed in place.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(inplace=True))
            >>> with hs.capture(model, "0") as cap:
            ...     _ = model(-torch.ones(1, 2))
            >>> bool((cap["0"].output == model[0](-torch.ones(1, 2))).all())
            True
        """
        return self.last.output

    @property
    def inputs(self) -> Inputs:
        """The latest call's inputs bound to ``forward``'s parameter names
        (``{"input": tensor}`` for a Linear; ``*args`` entries as ``arg0``, ``arg1``...;
        parameters left to their defaults are absent).

        Raises:
            CaptureError: the capture was opened without ``inputs=True``.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.MultiheadAttention(4, 1, batch_first=True))
            >>> x = torch.randn(1, 3, 4)
            >>> with hs.capture(model, "0", inputs=True) as cap:
            ...     _ = model[0](x, x, x, need_weights=False)
            >>> list(cap["0"].inputs)  # the arguments given, by name
            ['query', 'key', 'value', 'need_weights']
        """
        return self.last.inputs

    @property
    def input(self) -> Any:
        """The latest call's first argument (the usual single input); see :attr:`inputs`."""
        return self.last.input

    @property
    def grad(self) -> Any:
        """Gradient of the loss w.r.t. the latest call's output, in the output's structure:
        what came back from downstream, as a full backward hook's ``grad_output`` defines it.

        Needs ``grads=True`` and a backward run while the capture is open.

        Raises:
            GradientUnavailableError: saying why (``no_grad``, nothing upstream requires
                grad, backward has not reached the layer, the capture closed first).

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 3), nn.ReLU())
            >>> with hs.capture(model, "1", grads=True) as cap:
            ...     model(torch.ones(1, 2)).sum().backward()
            >>> cap["1"].grad
            tensor([[1., 1., 1.]])
        """
        return self.last.grad

    @property
    def grad_inputs(self) -> Inputs:
        """Gradients w.r.t. the latest call's tensor inputs, by parameter name: what flows
        back *through this layer* (not through a skip connection around it); ``None`` for an
        input that gets none (an attention mask). Needs ``grads=True``.

        Raises:
            GradientUnavailableError: saying why, when no input got a gradient.
        """
        return self.last.grad_inputs

    @property
    def grad_input(self) -> Any:
        """Gradient w.r.t. the latest call's first argument, through this layer; see
        :attr:`grad_inputs`.

        Raises:
            GradientUnavailableError: saying why, when it got none.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 1, bias=False))
            >>> nn.init.constant_(model[0].weight, 3.0)
            Parameter containing:
            tensor([[3., 3.]], requires_grad=True)
            >>> with hs.capture(model, "0", grads=True) as cap:
            ...     model(torch.ones(1, 2, requires_grad=True)).sum().backward()
            >>> cap["0"].grad_input
            tensor([[3., 3.]])
        """
        return self.last.grad_input

    @property
    def outputs(self) -> list[Any]:
        """Outputs of every kept call, in order."""
        return [c.output for c in self.calls]

    @property
    def steps(self) -> dict[int, list[Call]]:
        """The kept calls by generation step (:attr:`Call.step`), in step order: under
        ``generate()``, ``record.steps[0]`` holds the prefill's calls, ``record.steps[3]``
        those of the forward that made the third new token.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> model = nn.Sequential(nn.Linear(2, 2))
            >>> with hs.capture(model, "0", keep="all") as cap:
            ...     for _ in range(3):
            ...         _ = model(torch.ones(1, 2))
            >>> {step: len(calls) for step, calls in cap["0"].steps.items()}
            {0: 1, 1: 1, 2: 1}
        """
        found: dict[int, list[Call]] = {}
        for call in self.calls:
            found.setdefault(call.pass_index, []).append(call)
        return dict(sorted(found.items()))

    def __iter__(self) -> Iterator[Call]:
        return iter(self.calls)

    def __getitem__(self, i: int) -> Call:
        return self.calls[i]

    def __repr__(self) -> str:
        if not self.calls:
            return f"LayerRecord({self.name!r}, {self.module_type}, no calls)"
        shown = self.calls[-1]._shown_output()
        return (
            f"LayerRecord({self.name!r}, {self.module_type}, calls={len(self.calls)}/"
            f"{self.count}, output={shown})"
        )


def _placeholder(path: Any, t: Tensor) -> Tensor:
    """An empty meta tensor standing for ``t`` in a skeleton (``new_empty`` of a jagged
    nested tensor raises)."""
    return torch.empty(0, dtype=t.dtype, device="meta")
