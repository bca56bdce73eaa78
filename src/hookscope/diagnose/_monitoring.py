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
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise UsageError(f"every must be an int >= 1, got {every!r}")
        self.model, self.every, self.optimizer = model, every, optimizer
        self.layers = Layers(model).select(layers) if layers is not None else _default(model)
        self.sinks: list[Sink] = [make_sink(s) for s in sinks]
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

    def _flush(self) -> None:
        parts: list[tuple[str, str, Tensor]] = []
        for name in self.layers:
            if name in self._acts:
                alive = self._alive[name]
                dead = 1 - alive.double().mean()
                parts.append((name, "activation", torch.cat([self._acts[name], dead[None]])))
            if name in self._grads:
                parts.append((name, "gradient", self._grads[name]))
            params = [p for p in self.layers[name].parameters(recurse=False)]
            if params:
                parts.append((name, "parameter", self._param_stats(name, params)))
        host: list[float] = []
        if parts:  # one transfer: gathered on the first part's device, then read
            device = parts[0][2].device
            host = torch.cat([v.double().to(device) for _, _, v in parts]).tolist()
        i = 0
        for name, kind, v in parts:
            values, i = host[i : i + v.numel()], i + v.numel()
            self._emit(name, kind, values)
        for state in (self._acts, self._alive, self._grads, self._before):
            state.clear()
        for sink in self.sinks:
            sink.flush()

    def _param_stats(self, name: str, params: list[nn.Parameter]) -> Tensor:
        norm = torch.linalg.vector_norm(torch.stack([p.detach().norm() for p in params]))
        grads = [p.grad for p in params if p.grad is not None]
        gm = _moments(torch.cat([g.reshape(-1) for g in grads])) if grads else None
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
                record["dead"] = v[7]
        self._records.append(record)
        for sink in self.sinks:
            sink.write(record)


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
