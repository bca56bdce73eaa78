"""``hs.Monitor``: training-health statistics per layer, per logging step.

Steps are optimizer steps: ``mon.step()`` after each ``optimizer.step()`` (or give the
optimizer(s) and the monitor follows their steps through optimizer step hooks), so gradient
accumulation over micro-batches counts once. Step ``k`` is logged when ``k % every == 0``; on
other steps the hooks return at once and nothing runs on the device.

Step ``k`` runs from its first forward to step ``k + 1``'s first forward: the optimizer step
(where the statistics are taken) is inside it, not at its end, so the scalars a training loop
logs after ``optimizer.step()`` belong to the step they describe, as those logged before it
do. Its values are therefore read when that span ends: at the next forward, the next
``step()``, when ``records`` is read, or at ``close()``; a scalar named again before then
starts the next step (a loop that runs no forward between steps).

On a logging step, every forward (micro-batch) of the selected layers adds the moments of the
layer's output (``_stats``) and, through a tensor hook, of the gradient w.r.t. it. Checkpoint
recomputations and hookscope's own replays are not forwards of the model and are not counted
(the session policy). At ``step()`` parameter norms, gradient norms and, with optimizers,
update norms are added (``torch._foreach_norm`` over every watched parameter at once),
everything is read with one host transfer, and the records go to the sinks on a writer thread.

Statistics of a tensor: ``norm`` (L2), ``mean``, ``std``, ``min``, ``max`` over its finite
values, ``zeros`` (fraction of exact zeros), ``nonfinite`` (count of NaN/Inf, never dropped);
``dead`` for the outputs of activations that can have dead units (``torch.nn``'s ReLU, ReLU6,
Hardtanh, Tanh, Sigmoid, ...: ``_dead.py``): the fraction of channels through which no
gradient passed in the step's forwards (every output at 0 for a ReLU, at a bound of the
range for ReLU6, Hardtanh, and saturated Tanh and Sigmoid). Channels are dim 1 of
outputs of channels-first layers (convolutions, batch and
instance norms, pooling) and the last dim of outputs of channels-last ones (linear, embedding,
layer norm); a layer of neither kind (an activation, dropout) takes the layout of the layer
that made its input, and otherwise dim 1 of a 4-D or larger output and the last dim of others.
"""

from __future__ import annotations

import contextlib
import numbers
import threading
import weakref
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, TypedDict

import torch
from torch import Tensor, nn

from ..core import HookSet, LayerSelector, ModuleCall, Session, Site, _torch, is_called, unwrap
from ..errors import UsageError
from . import _sharded, _stats
from ._dead import no_gradient_at
from ._flush import Ended, StepEnd, end_step, zero64
from ._logsinks import Sink, make_sink
from ._stats import Moments

__all__ = ["Monitor", "MonitorRecord"]

Ranks = Literal["reduce", "each"]


class MonitorRecord(TypedDict, total=False):
    """One record: ``step``, ``layer``, ``kind`` (``"activation"``, ``"gradient"``,
    ``"parameter"``, or ``"scalar"`` for values given to :meth:`Monitor.log`) and the
    statistics of that kind."""

    step: int
    layer: str
    kind: str
    rank: int
    norm: float
    mean: float
    std: float
    min: float
    max: float
    zeros: float
    nonfinite: int
    dead: float
    grad_norm: float
    grad_nonfinite: float
    update_norm: float
    update_ratio: float


_CHANNELS_FIRST: tuple[type[nn.Module], ...] = (
    *(
        _torch.NN_BASES[name]
        for name in (
            "_ConvNd",
            "_NormBase",  # batch and instance norms
            "_MaxPoolNd",
            "_AvgPoolNd",
            "_AdaptiveAvgPoolNd",
            "_AdaptiveMaxPoolNd",
        )
        if name in _torch.NN_BASES
    ),
    nn.GroupNorm,
    nn.LocalResponseNorm,
    nn.Dropout1d,
    nn.Dropout2d,
    nn.Dropout3d,
    nn.PixelShuffle,
    nn.Upsample,
)
_CHANNELS_LAST: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Embedding,
    nn.LayerNorm,
    nn.RMSNorm,
    nn.MultiheadAttention,
)
_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish)


class Monitor(Session):
    """Per-layer activation, gradient and parameter statistics every ``every`` steps.

    Args:
        model: the model (hooks only while open; nothing else is changed).
        layers: what to watch (any selector); default every layer with parameters of its own
            (a parametrized layer, e.g. with ``weight_norm``, counts its parametrization's
            parameters) that has no sub-modules, and activation modules.
        every: log every ``every`` optimizer steps (step 0 included).
        sinks: where records go: paths ending in ``.jsonl`` / ``.csv``, a TensorBoard log
            directory given as ``("tensorboard", dir)`` (``("tensorboard", dir, "all")`` adds
            activation histograms), a ``SummaryWriter``, or sink objects. They are written on a
            background thread; ``close()`` (the end of the ``with`` block) waits for them.
        optimizer: an optimizer or a list of them to follow (no ``step()`` calls needed): a
            step ends when each has stepped once. Update norms (``||w_after - w_before||``) and
            the update / weight ratio are recorded for the parameters they update (NaN for the
            others).
        ranks: under ``torch.distributed``: ``"reduce"`` (default) combines every rank's
            statistics (counts and sums added, extremes taken, a channel dead only if it is
            dead on every rank, parameter statistics averaged) with one all-reduce per
            logging step, and only rank 0 writes to the sinks; ``"each"``: every rank logs its
            own, with a ``rank`` key (give each rank its own files). Training does not wait
            for these all-reduces: they are started (``async_op``) and waited at the next
            logged step's end, when :attr:`records` is read, or at ``close()``; the sinks
            get a step's records then. Sharded parameters
            (FSDP2, HSDP, tensor parallelism: ``DTensor``) are measured on each rank's piece
            and combined over the groups that shard them under both: their statistics are
            the whole tensors'. Under tensor parallelism (``parallelize_module``) activation
            and output-gradient records are the whole tensors' under ``"reduce"``: a
            column-parallel layer's output (and that of an elementwise layer after it) is
            each rank's slice of the features, its channels put side by side for dead
            units, every other output the same on every rank of the tensor-parallel group,
            counted once; under ``"each"``, what the rank holds.
        recompile: watch a ``torch.compile``d model that already ran (its compiled code then
            runs eagerly while the monitor is open); otherwise CompiledModelError.
        scaler: the ``torch.amp.GradScaler`` of a mixed-precision loop: the gradients reaching
            the layers' outputs are those of the scaled loss, and their statistics are
            divided by the scale (read on the device, no synchronisation) so that they are
            the gradients of the loss. Parameter gradients are read at the optimizer step,
            after the scaler unscaled them. A step the scaler skips (its gradients overflowed)
            is no optimizer step: its forwards count in the next step, whose ``nonfinite``
            counts show the overflow.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> with hs.Monitor(net, every=2) as mon:
        ...     for _ in range(3):
        ...         loss = net(torch.randn(8, 3)).pow(2).mean()
        ...         loss.backward()
        ...         mon.log(loss=loss)  # scalars of yours, beside the statistics
        ...         mon.step()  # after optimizer.step() (or pass optimizer=)
        >>> sorted({(r["step"], r["kind"]) for r in mon.records})[:4]
        [(0, 'activation'), (0, 'gradient'), (0, 'parameter'), (0, 'scalar')]
    """

    _entry = "hs.Monitor"

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector | None = None,
        *,
        every: int = 10,
        sinks: Iterable[Any] = (),
        optimizer: torch.optim.Optimizer | Sequence[torch.optim.Optimizer] | None = None,
        ranks: Ranks = "reduce",
        recompile: bool = False,
        scaler: Any = None,
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be an int >= 1, got {every!r}")
        if ranks not in ("reduce", "each"):
            raise UsageError(f'ranks must be "reduce" or "each", got {ranks!r}')
        if scaler is not None and not callable(getattr(scaler, "scale", None)):
            raise UsageError(f"scaler must be a torch.amp.GradScaler, got {type(scaler).__name__}")
        super().__init__(model, recompile=recompile)
        self.every, self.ranks, self.scaler = every, ranks, scaler
        self._paused = 0
        self.optimizers = _optimizers(optimizer)
        chosen = (
            self.layers.sites(layers)
            if layers is not None
            else {n: Site(n, m) for n, m in self._default().items()}
        )
        #: the watched layers and operation sites (an operation's: the module running it)
        self.layers_watched = {n: s.module for n, s in chosen.items()}
        self._layer_sites = {n: s.module for n, s in chosen.items() if s.op is None}
        self._watch_ops(chosen)  # operation sites come to _returned
        made = [make_sink(s) for s in sinks]
        #: histograms are computed only when a sink draws them (TensorBoard): of parameters
        #: and their gradients, and with ``"all"`` of activations and output gradients too
        #: (on every rank where rank 0 writes: the values reduced must be the same on all)
        wants = [getattr(sink, "histograms", False) for sink in made]
        self.histograms: bool | str = "all" if "all" in wants else any(wants)
        if self.ranks == "reduce" and _rank() > 0:
            for sink in made:  # rank 0 writes the reduced records
                sink.close()
            made = []
        self.sinks: list[Sink] = made
        self.count = 0  # optimizer steps so far
        self._records: list[dict[str, Any]] = []
        self._moments: dict[tuple[str, str], list[Moments]] = {}
        self._hist: dict[tuple[str, str], list[Tensor]] = {}
        self._scalars: dict[str, float | Tensor] = {}
        self._names: set[str] = set()  # the names logged in this step, logged or not
        self._gap: _Gap | None = None  # from a step's end to the next step's first forward
        self._layout: dict[int, tuple[weakref.ref[Tensor], int]] = {}
        #: tensor parallelism: outputs that are this rank's slice of their features, the
        #: layers whose outputs are (see ``_sharded.output_piece``), and the size of the
        #: tensor-parallel group, over which every other output is the same
        self._pieces: dict[int, tuple[weakref.ref[Tensor], _sharded.Piece]] = {}
        self._shards: dict[str, _sharded.Piece] = {}
        self._replicas = 1
        self._before: dict[int, Tensor] = {}
        self._stepped: dict[int, int] = {}
        self._writer: _Writer | None = None
        #: logged steps whose collectives were started and not yet waited for (see _flush)
        self._pending: list[Ended] = []

    @property
    def logging(self) -> bool:
        """Whether the current step is logged."""
        return self.count % self.every == 0

    @property
    def records(self) -> list[dict[str, Any]]:
        """Everything logged so far (a new list): flat :class:`MonitorRecord` dicts with
        ``step``, ``layer``, ``kind`` and one key per statistic (what the JSONL sink writes).

        Reading it reads the step that just ended (see :meth:`log`), except under
        ``ranks="reduce"`` across processes, where that read is a collective every rank makes
        at its next forward: there the step appears then."""
        if not self._collective():
            self._end_gap()
        self._flush()  # (waits for the collectives already started: no rank waits alone)
        return list(self._records)

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Forwards and backwards inside the block are not part of any step: a validation or
        evaluation pass inside a training step's span adds nothing to its statistics (the
        trainer integrations pause the monitor there).

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs
            >>> net = nn.Sequential(nn.Linear(3, 2))
            >>> with hs.Monitor(net, every=1) as mon:
            ...     net(torch.ones(1, 3)).sum().backward()
            ...     with mon.paused(), torch.no_grad():
            ...         _ = net(torch.ones(5, 3))  # not counted
            ...     mon.step()
            >>> [row] = [r for r in mon.records if r["kind"] == "activation"]
            >>> abs(row["norm"] - float(net(torch.ones(1, 3)).norm())) < 1e-6
            True
        """
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def log(self, **scalars: float | Tensor) -> None:
        """Record scalars beside the statistics (the loss, the learning rate), as
        ``kind="scalar"`` records of logged steps; tensors are read in the step's single
        transfer (no synchronisation of their own).

        A scalar belongs to the step whose forwards and backward it follows, logged before
        the optimizer step or after it: from a step's first forward to the next step's first
        forward (or the next ``step()``, reading :attr:`records`, ``close()``; a name the step
        already has starts the next one). So ``opt.step(); mon.log(loss=loss)`` and
        ``mon.log(loss=loss); opt.step()`` both write iteration ``k``'s loss at step ``k``.

        Raises:
            UsageError: a value that is not a real number or a one-element real tensor.
        """
        for name, value in scalars.items():
            _check_scalar(name, value)
        gap = self._gap
        if gap is not None and gap.names.isdisjoint(scalars):  # late, for the step that ended
            gap.names.update(scalars)
            if gap.ended is not None:
                gap.ended.log(scalars)
            return
        self._end_gap()
        self._names.update(scalars)
        if self.logging:
            self._scalars.update(scalars)

    @property
    def _params(self) -> dict[str, list[Tensor]]:
        """Each watched layer's parameters as they are now (an operation has none of its own;
        those on the meta device have no values and are left out): ``fully_shard`` puts new
        parameters in place of a module's, so a Monitor made before it follows those."""
        return {
            n: [p for p in _layer_params(m) if _stats.has_values(p)]
            if n in self._layer_sites
            else []
            for n, m in self.layers_watched.items()
        }

    # -- session ----------------------------------------------------------------------------------
    def __enter__(self) -> Monitor:
        super().__enter__()
        return self

    def _install(self, hooks: HookSet) -> None:
        self._track_outputs(hooks, self._layer_sites)
        for opt in self.optimizers:  # optimizer step hooks, removed with the rest
            hooks.optimizer_step(opt, self._before_step, self._after_step)
        self._writer = _Writer(self.sinks)
        params = [p for ps in self._params.values() for p in ps]
        if params:
            zero64(params[0].device)  # made now, not in the first logging step

    def _closed(self) -> None:
        writer, self._writer = self._writer, None
        try:
            self._end_gap(writer)
            self._flush(writer)
        finally:
            self._pending = []  # (a collective that failed: its step is dropped, not waited again)
            if writer is not None:
                writer.close()

    def _new_pass(self) -> None:
        if self._paused:
            return
        self._layout.clear()
        self._pieces.clear()
        self._end_gap()

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> None:
        """An operation site's call returned (layers' outputs come to :meth:`_output`)."""
        self._output(call.name, call.module, args, output)

    def _output(self, name: str, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.logging or self._paused:
            return
        out = _first_float(output)
        if out is None or not _stats.has_values(out):  # a meta tensor: left out
            return
        t = self._placed(name, module, args, out)
        dim = self._channel_dim(module, args, t)  # always: later layers take its layout
        moments = Moments.of(t, dim, no_gradient_at(module))
        if moments is not None:
            self._moments.setdefault((name, "activation"), []).append(moments)
        if self.histograms == "all":
            self._hist.setdefault((name, "activation"), []).append(_stats.histogram([t]))
        if out.requires_grad:
            self.hooks.tensor(out, lambda g: self._on_grad(name, g))

    def _placed(self, name: str, module: nn.Module, args: tuple[Any, ...], out: Tensor) -> Tensor:
        """The values of ``out`` to measure, and under tensor parallelism where they lie:
        this rank's slice of the layer's output features (a column-parallel layer's, and
        those of the layers after it that keep its shape), or the whole output, the same on
        every rank of the tensor-parallel group (see ``_sharded.py``)."""
        piece: _sharded.Piece | None = None
        if _sharded.is_sharded(out):
            out, piece, size = _sharded.placed(out)
            self._replicas = max(self._replicas, size)
        else:
            source = _first_tensor(args)
            if source is not None and _sharded.is_sharded(source):  # a parallelized layer
                piece, size = _sharded.output_piece(module, source, out)
                self._replicas = max(self._replicas, size)
            elif source is not None:  # an elementwise layer after a column-parallel one
                known = self._pieces.get(id(source))
                if known is not None and known[0]() is source and source.shape == out.shape:
                    piece = known[1]
        if piece is not None:
            self._pieces[id(out)] = (weakref.ref(out), piece)
            self._shards[name] = piece
        return out

    def _on_grad(self, name: str, grad: Tensor) -> None:
        if not _stats.has_values(grad):
            return
        if _sharded.is_sharded(grad):  # (a DTensor output's: placed as the output)
            grad = _sharded.placed(grad)[0]
        moments = Moments.of(grad)
        unscale = self._unscale(grad) if self.scaler is not None else None
        if moments is not None:
            if unscale is not None:
                moments = moments.scaled(unscale)
            self._moments.setdefault((name, "gradient"), []).append(moments)
        if self.histograms == "all":
            counted = grad if unscale is None else grad.detach() * unscale
            self._hist.setdefault((name, "gradient"), []).append(_stats.histogram([counted]))

    def _unscale(self, grad: Tensor) -> Tensor:
        """1 / the scaler's current scale, on ``grad``'s device (``scaler.scale`` of a one:
        the scale stays on the device; a disabled scaler returns the one)."""
        with torch.no_grad():
            one = torch.ones((), dtype=torch.float32, device=grad.device)
            return torch.reciprocal(self.scaler.scale(one))

    def _channel_dim(self, module: nn.Module, args: tuple[Any, ...], t: Tensor) -> int | None:
        """The dim of ``t`` whose entries are channels (see the module docstring)."""
        if t.dim() < 2:
            return None
        if isinstance(module, _CHANNELS_FIRST):
            dim = 1
        elif isinstance(module, _CHANNELS_LAST):
            dim = -1
        else:
            source = _first_float(args)
            known = self._layout.get(id(source)) if source is not None else None
            if (
                source is not None
                and known is not None
                and known[0]() is source
                and source.dim() == t.dim()
            ):
                dim = known[1]
            else:
                dim = 1 if t.dim() >= 4 else -1
        self._layout[id(t)] = (weakref.ref(t), dim)
        return dim

    def _default(self) -> dict[str, nn.Module]:
        """Leaf layers with parameters of their own, and activation modules."""
        chosen = {
            n: m
            for n, m in self.layers.modules.items()
            if is_called(m)
            and ".parametrizations." not in f".{n}."
            and _is_leaf(m)
            and (bool(_layer_params(m)) or isinstance(m, _ACTIVATIONS))
        }
        root = unwrap(self.model)
        if not chosen and any(True for _ in root.parameters(recurse=False)):
            return {"": root}  # a single layer: watch the model itself
        if not chosen:
            raise UsageError(
                f"{type(self.model).__name__} has no leaf layer with parameters and no "
                "activation module to watch: pass layers="
            )
        return chosen

    # -- steps ----------------------------------------------------------------------------------
    def _before_step(self, opt: torch.optim.Optimizer) -> None:
        if self.logging and not any(self._stepped.values()):  # the round's first optimizer
            followed = self._followed()
            params: list[Tensor] = [
                p for ps in self._params.values() for p in ps if id(p) in followed
            ]
            if params:
                with torch.no_grad():  # (a sharded parameter's: this rank's piece)
                    copies = _torch.foreach_mul([_sharded.local(p) for p in params], 1.0)
                self._before = {id(p): c for p, c in zip(params, copies, strict=True)}

    def _after_step(self, opt: torch.optim.Optimizer) -> None:
        self._stepped[id(opt)] = self._stepped.get(id(opt), 0) + 1
        if all(self._stepped.get(id(o), 0) for o in self.optimizers):
            self._stepped.clear()
            self.step()

    def _followed(self) -> set[int]:
        return {id(p) for o in self.optimizers for g in o.param_groups for p in g["params"]}

    def step(self) -> None:
        """Mark an optimizer step (called for you when optimizers were given): on a logging
        step, take the statistics on the device; they are read (one host transfer) and written
        to the sinks when the step's span ends (see :meth:`log`), or, where all-reduces across
        processes combine them, when the next logging step ends (they run meanwhile)."""
        if self._writer is not None:
            self._writer.check()
        if self.logging:  # the last logged step's collectives, finished while this one ran
            self._flush()
        self._end_gap()  # no forward since the last step
        ended = self._end_step() if self.logging else None
        self._gap = _Gap(self._names, ended)
        self._names = set()
        self.count += 1

    def _end_step(self) -> Ended:
        world = _world()
        ended = end_step(
            StepEnd(
                step=self.count,
                layers=list(self.layers_watched),
                moments=self._moments,
                hist=self._hist,
                params=self._params,
                before=self._before,
                histograms=self.histograms,
                world=world if self.ranks == "reduce" else 1,
                rank=_rank() if self.ranks == "each" and world > 1 else None,
                shards=self._shards,
                replicas=self._replicas,
            )
        )
        ended.log(self._scalars)
        self._moments, self._hist, self._before, self._scalars = {}, {}, {}, {}
        return ended

    def _end_gap(self, writer: _Writer | None = None) -> None:
        """The step that ended, if it was logged, has all its scalars: start combining its
        values across ranks and, when no collective is in flight, read it now."""
        gap, self._gap = self._gap, None
        if gap is None or gap.ended is None:
            return
        gap.ended.send()
        self._pending.append(gap.ended)
        if not gap.ended.pending:
            self._flush(writer)

    def _flush(self, writer: _Writer | None = None) -> None:
        """Read the logged steps whose collectives were started, waiting for them (they ran
        while training went on), and hand their records to the sinks."""
        pending, self._pending = self._pending, []
        writer = writer or self._writer
        for ended in pending:
            records, histograms = ended.read()
            self._records.extend(records)
            if writer is not None:
                writer.submit(records, histograms)

    def _collective(self) -> bool:
        return self.ranks == "reduce" and _world() > 1


class _Gap:
    """From a step's end to the next step's first forward: the names logged for the step
    that ended, and its values to read (None when it was not logged)."""

    def __init__(self, names: set[str], ended: Ended | None) -> None:
        self.names, self.ended = names, ended


class _Writer:
    """Writes records to the sinks on a background thread; errors surface at the next step
    or at close."""

    def __init__(self, sinks: list[Sink]) -> None:
        self._sinks = sinks
        self._jobs: list[Any] = []
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if sinks:
            self._thread = threading.Thread(target=self._run, name="hookscope-monitor", daemon=True)
            self._thread.start()

    def submit(self, records: list[dict[str, Any]], histograms: list[Any]) -> None:
        if self._thread is None:
            return
        with self._cond:
            self._jobs.append((records, histograms))
            self._cond.notify()

    def check(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        try:
            if self._thread is not None:
                with self._cond:
                    self._jobs.append(None)
                    self._cond.notify()
                self._thread.join()
        finally:
            for sink in self._sinks:
                sink.close()
        self.check()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs:
                    self._cond.wait()
                job = self._jobs.pop(0)
            if job is None:
                return
            try:
                _write(self._sinks, *job)
            except BaseException as e:  # surfaced on the training thread
                self._error = e


def _write(sinks: list[Sink], records: list[dict[str, Any]], histograms: list[Any]) -> None:
    for sink in sinks:
        for record in records:
            sink.write(record)
        if getattr(sink, "histograms", False):
            for tag, step, stats, counts in histograms:
                sink.histogram(tag, step, stats, counts, _stats.EDGES)  # type: ignore[attr-defined]
        sink.flush()


# -- helpers ---------------------------------------------------------------------------------------


def _check_scalar(name: str, value: object) -> None:
    if isinstance(value, Tensor):
        if value.numel() == 1 and not value.is_complex():
            return
        shown = f"a {value.dtype} tensor of shape {tuple(value.shape)}"
    elif isinstance(value, numbers.Real):
        return
    else:
        shown = repr(value)
    raise UsageError(
        f"Monitor.log({name}=...) takes a real number or a one-element real tensor, got "
        f"{shown}: pass e.g. {name}=loss.detach() or {name}=float(value)"
    )


def _optimizers(optimizer: Any) -> list[torch.optim.Optimizer]:
    if optimizer is None:
        return []
    items = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for o in items:
        if not isinstance(o, torch.optim.Optimizer):
            raise UsageError(
                f"optimizer must be a torch.optim.Optimizer or a list of them, got "
                f"{type(o).__name__}"
            )
    return items


def _is_leaf(m: nn.Module) -> bool:
    """No sub-modules but its parametrizations (``weight_norm``'s ``parametrizations``)."""
    return all(name == "parametrizations" for name, _ in m.named_children())


def _layer_params(m: nn.Module) -> list[nn.Parameter]:
    """A layer's own parameters, and those its parametrizations hold (``original0``, ...)."""
    own = list(m.parameters(recurse=False))
    extra = getattr(m, "parametrizations", None)
    return own + (list(extra.parameters()) if isinstance(extra, nn.Module) else [])


def _first_float(obj: Any) -> Tensor | None:
    from ..core import leaves

    return next((t for _, t in leaves(obj) if t.is_floating_point() or t.is_complex()), None)


def _first_tensor(obj: Any) -> Tensor | None:
    from ..core import leaves

    return next((t for _, t in leaves(obj)), None)


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
