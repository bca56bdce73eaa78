"""``hs.Monitor``: training-health statistics per layer, per logging step.

Steps are optimizer steps: ``mon.step()`` after each ``optimizer.step()`` (or give the
optimizer and the monitor follows its steps through optimizer step hooks), so gradient
accumulation over micro-batches counts once. Step ``k`` is logged when ``k % every == 0``;
on other steps the hooks return at once.

On a logging step, every forward (micro-batch) of the selected layers adds to on-device
accumulators: activation statistics, the gradient w.r.t. the layer's output (from a tensor
hook), and which channels were ever positive (dead units). At ``step()`` parameter norms,
gradient norms and, with an optimizer, update norms are added, everything is read with one
host transfer, and the records go to the sinks.

Statistics of a tensor: ``norm`` (L2), ``mean``, ``std``, ``min``, ``max`` over its finite
values, ``zeros`` (fraction of exact zeros), ``nonfinite`` (count of NaN/Inf, never dropped);
``dead`` for activations: the fraction of channels (dim 1 of ``(N, C, ...)`` maps, the last
dim of ``(N, C)`` and ``(N, T, C)``) that were never positive in the step's forwards.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import HookSet, Layers, leaves, unwrap
from ..errors import UsageError
from ._logsinks import Sink, make_sink

__all__ = ["Monitor"]

_FIELDS = ("count", "sum", "sumsq", "min", "max", "zeros", "nonfinite")


def _moments(t: Tensor) -> Tensor:
    """(count, sum, sumsq, min, max, zeros, nonfinite) of ``t`` as one float64 vector.

    ``x - x`` is 0 where ``x`` is finite and NaN where it is not, so ``x + (x - x)`` is ``x``
    with every non-finite value turned into NaN, which the NaN-skipping reductions leave out;
    the non-finite ones are counted apart. A few passes in the tensor's own dtype (float32
    accumulation), no float64 copy.
    """
    x = t.detach()
    if x.is_complex():
        x = torch.view_as_real(x)
    if x.numel() == 0:
        return torch.tensor([0, 0, 0, math.inf, -math.inf, 0, 0], dtype=torch.float64)
    d = x - x
    xf = x + d
    nonfinite = torch.count_nonzero(d)
    values = [
        x.numel() - nonfinite,
        xf.nansum(),
        (xf * xf).nansum(),
        xf.nan_to_num(nan=math.inf).amin(),
        xf.nan_to_num(nan=-math.inf).amax(),
        x.numel() - torch.count_nonzero(x),
        nonfinite,
    ]
    return torch.stack([v.double() for v in values])


def _merge(a: Tensor | None, b: Tensor) -> Tensor:
    if a is None:
        return b
    return torch.stack([a[0] + b[0], a[1] + b[1], a[2] + b[2], torch.minimum(a[3], b[3]),
                        torch.maximum(a[4], b[4]), a[5] + b[5], a[6] + b[6]])  # fmt: skip


def _alive(t: Tensor) -> Tensor:
    """Per channel: was any value positive? (its maximum over the other dims is > 0)"""
    x = t.detach()
    dim = 1 if x.dim() >= 4 else x.dim() - 1
    others = tuple(d for d in range(x.dim()) if d != dim)
    return (x.amax(dim=others) > 0) if others else x > 0


def _summary(m: list[float]) -> dict[str, float]:
    count, total, sumsq, lo, hi, zeros, bad = m
    numel = count + bad
    mean = total / count if count else math.nan
    var = (sumsq - count * mean * mean) / (count - 1) if count > 1 else math.nan
    return {
        "norm": math.sqrt(sumsq),
        "mean": mean,
        "std": math.sqrt(max(var, 0.0)) if count > 1 else math.nan,
        "min": lo if count else math.nan,
        "max": hi if count else math.nan,
        "zeros": zeros / numel if numel else math.nan,
        "nonfinite": int(bad),
    }


class Monitor:
    """Per-layer activation, gradient and parameter statistics every ``every`` steps.

    Args:
        model: the model (hooks only while open; nothing else is changed).
        layers: what to watch (any selector); default every module with parameters of its
            own that has no sub-modules (leaf layers) plus activation modules.
        every: log every ``every`` optimizer steps (step 0 included).
        sinks: where records go: paths ending in ``.jsonl`` / ``.csv``, a TensorBoard log
            directory given as ``("tensorboard", dir)``, a ``SummaryWriter``, or sink objects.
        optimizer: follow this optimizer's steps (no ``step()`` calls needed) and record
            update norms (``||w_after - w_before||``) and the update / weight ratio.
        ranks: under ``torch.distributed``: ``"reduce"`` (default) combines every rank's
            statistics (counts and sums added, extremes taken, a channel dead only if it is
            dead on every rank, parameter statistics averaged) with three all-reduces per
            logging step, and only rank 0 writes to the sinks; ``"each"``: every rank logs its
            own, with a ``rank`` key (give each rank its own files).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> with hs.Monitor(net, every=2) as mon:
        ...     for _ in range(3):
        ...         net(torch.randn(8, 3)).pow(2).mean().backward()
        ...         mon.step()  # after optimizer.step() (or pass optimizer=)
        >>> sorted({(r["step"], r["kind"]) for r in mon.records()})[:3]
        [(0, 'activation'), (0, 'gradient'), (0, 'parameter')]
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Any = None,
        *,
        every: int = 10,
        sinks: Iterable[Any] = (),
        optimizer: torch.optim.Optimizer | None = None,
        ranks: str = "reduce",
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be an int >= 1, got {every!r}")
        if ranks not in ("reduce", "each"):
            raise UsageError(f'ranks must be "reduce" or "each", got {ranks!r}')
        self.ranks = ranks
        self.model, self.every, self.optimizer = model, every, optimizer
        self.layers = Layers(model).select(layers) if layers is not None else _default(model)
        self.sinks: list[Sink] = [make_sink(s) for s in sinks]
        if self.ranks == "reduce" and _rank() > 0:
            for sink in self.sinks:  # rank 0 writes the reduced records
                sink.close()
            self.sinks = []
        #: histograms are computed only when a sink draws them (TensorBoard): of parameters
        #: and their gradients, and with ``"all"`` of activations and output gradients too
        wants = [getattr(sink, "histograms", False) for sink in self.sinks]
        self.histograms: bool | str = "all" if "all" in wants else any(wants)
        self._hist: dict[tuple[str, str], Tensor] = {}
        self.count = 0  # optimizer steps so far
        self._records: list[dict[str, Any]] = []
        self._acts: dict[str, Tensor] = {}
        self._alive: dict[str, Tensor] = {}
        self._grads: dict[str, Tensor] = {}
        self._before: dict[str, list[Tensor]] = {}
        self._hooks = HookSet()
        self._opt_handles: list[Any] = []

    @property
    def logging(self) -> bool:
        """Whether the current step is logged."""
        return self.count % self.every == 0

    def __enter__(self) -> Monitor:
        try:
            for name, module in self.layers.items():
                self._hooks.forward(module, self._on_forward(name))
            if self.optimizer is not None:  # optimizer hooks: HookSet holds module/tensor ones
                self._opt_handles = [
                    self.optimizer.register_step_pre_hook(lambda *a: self._snapshot()),
                    self.optimizer.register_step_post_hook(lambda *a: self.step()),
                ]
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and close the sinks (idempotent)."""
        try:
            self._hooks.close()
            while self._opt_handles:
                self._opt_handles.pop().remove()
        finally:
            for sink in self.sinks:
                sink.close()

    def records(self) -> list[dict[str, Any]]:
        """Everything logged so far: flat dicts with ``step``, ``layer``, ``kind`` and one key
        per statistic (the dicts the JSONL sink writes)."""
        return list(self._records)

    def _on_forward(self, name: str) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not self.logging:
                return
            for _, t in leaves(output):
                if not (t.is_floating_point() or t.is_complex()):
                    continue
                self._acts[name] = _merge(self._acts.get(name), _moments(t))
                if self.histograms == "all":
                    self._add_hist(name, "activation", t)
                alive = _alive(t)
                seen = self._alive.get(name)
                self._alive[name] = (
                    alive if seen is None or seen.shape != alive.shape else seen | alive
                )
                if t.requires_grad:
                    self._hooks.tensor(t, self._on_grad(name))
                break  # the first floating tensor of the output

        return hook

    def _on_grad(self, name: str) -> Any:
        def hook(grad: Tensor) -> None:
            self._grads[name] = _merge(self._grads.get(name), _moments(grad))
            if self.histograms == "all":
                self._add_hist(name, "gradient", grad)

        return hook

    def _snapshot(self) -> None:
        if self.logging:
            self._before = {
                n: [p.detach().clone() for p in m.parameters(recurse=False)]
                for n, m in self.layers.items()
            }

    def step(self) -> None:
        """Mark an optimizer step (called for you when an optimizer was given): on a logging
        step, read the statistics (one host transfer) and write them to the sinks."""
        if self.logging:
            self._flush()
        self.count += 1

    def _add_hist(self, name: str, kind: str, t: Tensor) -> None:
        counts = _histogram(t)
        old = self._hist.get((name, kind))
        self._hist[(name, kind)] = counts if old is None else old + counts

    def _flush(self) -> None:
        # (layer, kind, values, reduction op per value); see _reduce
        parts: list[tuple[str, str, Tensor, Tensor]] = []
        for name in self.layers:
            if name in self._acts:
                alive = self._alive[name].double()
                parts.append((name, "activation", torch.cat([self._acts[name], alive]),
                              torch.cat([_MOMENT_OPS, _ops(len(alive), _MAX)])))  # fmt: skip
            if name in self._grads:
                parts.append((name, "gradient", self._grads[name], _MOMENT_OPS))
            params = [p for p in self.layers[name].parameters(recurse=False)]
            grads = [p.grad.reshape(-1) for p in params if p.grad is not None]
            flat_grads = torch.cat(grads) if grads else None
            grad_moments = _moments(flat_grads) if flat_grads is not None else None
            if params:
                stats = self._param_stats(name, params, grad_moments)
                parts.append((name, "parameter", stats, _ops(len(stats), _MEAN)))
            if self.histograms:
                parts += self._histogram_parts(name, params, flat_grads, grad_moments)
        host: list[float] = []
        if parts:  # one transfer: gathered on the first part's device, then read
            device = parts[0][2].device
            values = torch.cat([v.double().to(device) for _, _, v, _ in parts])
            if self.ranks == "reduce" and _world() > 1:
                values = _reduce(values, torch.cat([o for _, _, _, o in parts]).to(device))
            host = values.tolist()
        i = 0
        for name, kind, v, _ in parts:
            values_, i = host[i : i + v.numel()], i + v.numel()
            if kind.startswith("histogram "):
                self._emit_histogram(name, kind.removeprefix("histogram "), values_)
            else:
                self._emit(name, kind, values_)
        for state in (self._acts, self._alive, self._grads, self._before, self._hist):
            state.clear()
        for sink in self.sinks:
            sink.flush()

    def _histogram_parts(
        self,
        name: str,
        params: list[nn.Parameter],
        flat_grads: Tensor | None,
        grad_moments: Tensor | None,
    ) -> list[tuple[str, str, Tensor, Tensor]]:
        """``(7 moments, bucket counts)`` of the step's activations and gradients, and of the
        layer's parameters and their gradients (their moments already computed by the caller)."""
        moments = {"activation": self._acts.get(name), "gradient": self._grads.get(name)}
        counts = {k: self._hist.get((name, k)) for k in moments}
        if params:
            values = torch.cat([p.detach().reshape(-1) for p in params])
            moments["parameter"], counts["parameter"] = _moments(values), _histogram(values)
        if flat_grads is not None:
            moments["parameter_gradient"] = grad_moments
            counts["parameter_gradient"] = _histogram(flat_grads)
        out = []
        for kind, m in moments.items():
            c = counts.get(kind)
            if m is not None and c is not None:
                ops = torch.cat([_MOMENT_OPS, _ops(len(c), _SUM)])
                out.append((name, f"histogram {kind}", torch.cat([m.to(c.device), c]), ops))
        return out

    def _emit_histogram(self, name: str, kind: str, values: list[float]) -> None:
        count, total, sumsq, lo, hi = values[:5]
        stats = {"num": count, "sum": total, "sum_squares": sumsq, "min": lo, "max": hi}
        for sink in self.sinks:
            if getattr(sink, "histograms", False) and count:
                sink.histogram(f"{name}/{kind}", self.count, stats, values[7:], EDGES)  # type: ignore[attr-defined]

    def _param_stats(self, name: str, params: list[nn.Parameter], gm: Tensor | None) -> Tensor:
        """(weight norm, gradient norm, non-finite gradient values, update norm); ``gm``: the
        moments of the layer's parameter gradients, if any."""
        norm = torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in params]))
        gnorm = gm[2].sqrt() if gm is not None else norm.new_tensor(math.nan)
        gbad = gm[6] if gm is not None else norm.new_tensor(math.nan)
        before = self._before.get(name)
        if before is not None and len(before) == len(params):
            diff = [p.detach() - b for p, b in zip(params, before, strict=True)]
            update = torch.linalg.vector_norm(torch.stack([d.norm() for d in diff]))
        else:
            update = norm.new_tensor(math.nan)
        return torch.stack([norm.double(), gnorm.double(), gbad.double(), update.double()])

    def _emit(self, name: str, kind: str, v: list[float]) -> None:
        record: dict[str, Any] = {"step": self.count, "layer": name, "kind": kind}
        if kind == "parameter":
            norm, gnorm, gbad, update = v
            record.update(norm=norm, grad_norm=gnorm, grad_nonfinite=gbad, update_norm=update)
            record["update_ratio"] = update / norm if norm else math.nan
        else:
            record.update(_summary(v[:7]))
            if kind == "activation":
                alive = v[7:]
                record["dead"] = 1 - sum(alive) / len(alive) if alive else math.nan
        if self.ranks == "each" and _world() > 1:
            record["rank"] = _rank()
        self._records.append(record)
        for sink in self.sinks:
            sink.write(record)


# -- distributed -------------------------------------------------------------------------------

_SUM, _MIN, _MAX, _MEAN = 0.0, 1.0, 2.0, 3.0
#: how each of (count, sum, sumsq, min, max, zeros, nonfinite) combines across ranks
_MOMENT_OPS = torch.tensor([_SUM, _SUM, _SUM, _MIN, _MAX, _SUM, _SUM], dtype=torch.float64)


def _ops(n: int, op: float) -> Tensor:
    """``n`` reduction codes, on the CPU (moved with the values only when ranks reduce)."""
    return torch.full((n,), op, dtype=torch.float64)


def _world() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _reduce(values: Tensor, ops: Tensor) -> Tensor:
    """Every rank's ``values`` combined element by element as ``ops`` says (sum, min, max or
    mean): three all-reduces of the whole buffer."""
    dist = torch.distributed
    summed = torch.where((ops == _SUM) | (ops == _MEAN), values, 0.0)
    low = torch.where(ops == _MIN, values, math.inf)
    high = torch.where(ops == _MAX, values, -math.inf)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    out = torch.where(ops == _MEAN, summed / _world(), summed)
    return torch.where(ops == _MIN, low, torch.where(ops == _MAX, high, out))


# -- histograms --------------------------------------------------------------------------------


def _edges() -> Tensor:
    """TensorBoard's bucket edges: ±1e-12 growing by 10 % to ±1e20, and 0."""
    positive = [1e-12]
    while positive[-1] < 1e20:
        positive.append(positive[-1] * 1.1)
    return torch.tensor([-v for v in reversed(positive)] + [0.0] + positive, dtype=torch.float64)


EDGES = _edges()
_EDGES_ON: dict[tuple[torch.device, torch.dtype], Tensor] = {}


def _edges_on(device: torch.device, dtype: torch.dtype) -> Tensor:
    """:data:`EDGES` on ``device``, copied there once (a copy from host memory synchronises)."""
    key = (device, dtype)
    if key not in _EDGES_ON:
        _EDGES_ON[key] = EDGES.to(device, dtype)
    return _EDGES_ON[key]


def _histogram(t: Tensor) -> Tensor:
    """Counts of ``t``'s finite values in the buckets ``(EDGES[i-1], EDGES[i]]`` (the last one
    open above), on ``t``'s device with no synchronisation; NaN and Inf are not counted (the
    statistics count them)."""
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    x = x.contiguous()  # an expanded gradient (of a mean) reshapes to a stride-0 view
    edges = _edges_on(x.device, torch.float64 if x.dtype == torch.float64 else torch.float32)
    index = torch.bucketize(x.to(edges.dtype), edges)
    counts = torch.zeros(len(EDGES) + 1, dtype=torch.float64, device=x.device)
    return counts.scatter_add_(0, index, torch.isfinite(x).double())


_ACTIVATIONS = (nn.ReLU, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.Mish)


def _default(model: nn.Module) -> dict[str, nn.Module]:
    """Leaf layers with parameters of their own, and activation modules."""
    chosen = {
        n: m
        for n, m in Layers(model).modules.items()
        if not any(True for _ in m.children())
        and (any(True for _ in m.parameters(recurse=False)) or isinstance(m, _ACTIVATIONS))
    }
    root = unwrap(model)
    if not chosen and any(True for _ in root.parameters(recurse=False)):
        return {"": root}  # a single layer: watch the model itself
    if not chosen:
        raise UsageError(
            f"{type(model).__name__} has no leaf layer with parameters and no activation module "
            "to watch: pass layers="
        )
    return chosen
