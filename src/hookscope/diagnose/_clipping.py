"""``hs.clip_grad_norm``: gradient-norm clipping that says what it did.

Same arithmetic as ``torch.nn.utils.clip_grad_norm_`` (norms per gradient, the total norm of
those norms, one coefficient ``max_norm / (total + 1e-6)`` capped at 1, gradients scaled in
place), plus a report: the total norm before and after, each layer's norm, which layers were
scaled and by what factor, and the parameters whose gradients are not finite. Everything is
computed on the device and read with one host transfer. Sparse gradients
(``nn.Embedding(sparse=True)``) are clipped too: their norms are those of the dense gradients
they stand for (torch's ``clip_grad_norm_`` has no sparse norm kernel).

Sharded gradients (``DTensor``, as FSDP2 and HSDP make them) are measured on each rank's
piece and combined over the process groups that shard them (``_sharded.py``: one all-reduce
per group, of every gradient's ``|g|^p`` sum, or its maximum for the inf norm, with a count of
non-finite pieces), so that every rank finds the norms of the whole gradients and scales its
piece by the same coefficient. Plain gradients (DDP's included) take no collective.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core import ClipReport, _torch
from ..errors import NonFiniteError, UsageError
from . import _sharded

__all__ = ["ClipReport", "clip_grad_norm"]


def _named(target: Any) -> list[tuple[str, str, nn.Parameter | Tensor]]:
    """(layer, parameter name, parameter) for every parameter with a gradient, each once."""
    if isinstance(target, nn.Module):
        items: Iterable[tuple[str, Tensor]] = target.named_parameters()
    elif isinstance(target, Mapping):
        items = target.items()
    elif isinstance(target, Tensor):
        items = [("0", target)]
    else:
        items = [p if isinstance(p, tuple) else (str(i), p) for i, p in enumerate(target)]
    out, seen = [], set()
    for name, p in items:
        if not isinstance(p, Tensor):
            raise UsageError(f"expected parameters (tensors), got {type(p).__name__} for {name!r}")
        if id(p) in seen or p.grad is None:
            continue
        seen.add(id(p))
        # a model's layers are the modules owning the parameters ("" for the root's own)
        layer = _layer_of(name) if isinstance(target, nn.Module) else name
        out.append((layer, name, p))
    return out


_PARAMETRIZED = re.compile(r"\.?parametrizations\.[^.]+\.original\d*$")


def _layer_of(name: str) -> str:
    """The layer owning a parameter: ``"0"`` for ``"0.weight"`` and for a parametrized
    ``"0.parametrizations.weight.original0"`` (``weight_norm``); ``""`` for the root's own."""
    name = _PARAMETRIZED.sub(".p", name)
    return name.rsplit(".", 1)[0] if "." in name else ""


def _norms(grads: list[Tensor], norm_type: float) -> Tensor:
    """Each gradient's norm in its own dtype (``torch._foreach_norm``, one operator per device
    and dtype, as ``clip_grad_norm_``), promoted to the widest and gathered on the first
    gradient's device. A sparse gradient's norm is its stored values' (the rest is zeros);
    an empty one's is 0."""
    device = grads[0].device
    values = [_values(g.detach()) for g in grads]
    groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, v in enumerate(values):
        if v.numel():
            groups.setdefault((v.device, v.dtype), []).append(i)
    dtype = functools.reduce(torch.promote_types, (g.dtype for g in grads), torch.float32)
    norms: list[Tensor] = [torch.zeros((), dtype=dtype, device=device)] * len(grads)
    with torch.no_grad():
        for idx in groups.values():
            found = _torch.foreach_norm([values[i] for i in idx], norm_type)
            for i, n in zip(idx, found, strict=True):
                norms[i] = n
    return torch.stack([n.to(device, dtype) for n in norms])


_COMPRESSED = (torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc)


def _values(g: Tensor) -> Tensor:
    """The values a gradient's norm is taken over: a sparse gradient's stored values, with
    duplicates summed (``nn.Embedding(sparse=True)`` leaves an index once per lookup)."""
    if g.layout == torch.sparse_coo:
        return (g if g.is_coalesced() else g.coalesce()).values()
    if g.layout in _COMPRESSED:
        return g.values()
    return g


def _sharded_norms(plan: _sharded.Plan, norm_type: float) -> tuple[Tensor, Tensor, Tensor]:
    """Each gradient's norm over all its pieces, whether all its pieces are finite, and
    whether this rank's piece is not, for gradients some of which are sharded: every piece's
    ``|g|^p`` sum and non-finite flag summed over the groups that shard it (the inf norm: the
    pieces' maxima and NaN flags, maximised), one all-reduce per group. A gradient sharded
    nowhere keeps its local norm untouched."""
    dist = torch.distributed
    local = _norms(plan.values, norm_type)
    peaks = local if math.isinf(norm_type) else _norms(plan.values, math.inf)
    local_bad = ~torch.isfinite(peaks)
    if math.isinf(norm_type):  # (a maximum over NaN is not defined: NaN travels as a flag)
        nan = local.isnan()
        rows = torch.stack([torch.where(nan, 0.0, local), nan.to(local.dtype)], dim=1)
        out = plan.combine(rows, dist.ReduceOp.MAX)
        reduced = torch.where(out[:, 1] > 0, math.nan, out[:, 0])
        finite = torch.isfinite(reduced)
    else:  # (as torch's DTensor norms: p-th powers summed, then the p-th root)
        rows = torch.stack([local.pow(norm_type), local_bad.to(local.dtype)], dim=1)
        out = plan.combine(rows, dist.ReduceOp.SUM)
        reduced = out[:, 0].pow(1.0 / norm_type)
        finite = out[:, 1] == 0
    which = [plan.combined(i) for i in range(len(plan.values))]
    if all(which):
        return reduced, finite, local_bad
    norms = torch.stack([reduced[i] if w else local[i] for i, w in enumerate(which)])
    finite = torch.stack([finite[i] if w else ~local_bad[i] for i, w in enumerate(which)])
    return norms, finite, local_bad


def _holders(plan: _sharded.Plan, local_bad: Tensor, bad: list[int]) -> list[list[int]]:
    """The ranks whose piece of each of the ``bad`` gradients is not finite (every rank of a
    group that shards one of them finds the same ``bad``: their flags were combined)."""
    flags = local_bad.tolist()
    return plan.holders([flags[j] for j in bad], bad)


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _total(norms: Tensor, norm_type: float) -> Tensor:
    return norms.max() if math.isinf(norm_type) else torch.linalg.vector_norm(norms, norm_type)


def _rows(norms: Tensor, idx: list[int]) -> Tensor:
    """``norms[idx]`` without an index tensor: a slice when contiguous (always, for a model's
    parameters), else a stack of single views."""
    if idx[-1] - idx[0] + 1 == len(idx):
        return norms[idx[0] : idx[-1] + 1]
    return torch.stack([norms[j] for j in idx])


def clip_grad_norm(
    parameters: Any,
    max_norm: float,
    *,
    per_layer: bool = False,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> ClipReport:
    """Clip gradient norms in place, like ``torch.nn.utils.clip_grad_norm_``, and report.

    Sharded gradients (``DTensor``: FSDP2's ``fully_shard``, HSDP) are clipped as their whole
    gradients would be: call it on every rank, as torch's; the ranks' pieces are combined over
    the process groups that shard them (one all-reduce per group), and every rank gets the
    same report.

    Args:
        parameters: a model (layers are named after the modules owning the parameters), a
            mapping ``{name: parameter}``, an iterable of parameters or ``(name, parameter)``
            pairs, or one tensor. Parameters without a gradient are skipped; tied parameters
            count once.
        max_norm: the largest norm allowed (> 0).
        per_layer: clip each layer's gradients to ``max_norm`` on its own instead of all of
            them together.
        norm_type: the p of the p-norm (``float("inf")`` for the max norm).
        error_if_nonfinite: raise :class:`~hookscope.NonFiniteError` naming the parameters
            whose gradients are not finite (the gradients are then left unchanged); by default
            they are reported and scaled as torch does.

    Returns:
        A :class:`ClipReport`. With no gradient at all the total norm is 0 and nothing changes.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Linear(3, 1)
        >>> model(torch.ones(4, 3)).sum().backward()
        >>> report = hs.clip_grad_norm(model, 1.0)
        >>> round(report.total_norm, 3), {k: round(v, 3) for k, v in report.clipped.items()}
        (8.0, {'': 0.125})
        >>> round(report.total_norm_after, 3)
        1.0
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise UsageError(f"max_norm must be a number > 0, got {max_norm!r}")
    norm_type = float(norm_type)
    if not (norm_type > 0 or math.isinf(norm_type)):
        raise UsageError(f"norm_type must be > 0 or inf, got {norm_type!r}")
    named = _named(parameters)
    if not named:
        return ClipReport(0.0, 0.0, float(max_norm), norm_type)
    groups: dict[str, list[int]] = {}  # layer -> its parameters' positions in `named`
    for j, (layer, _, _) in enumerate(named):
        groups.setdefault(layer, []).append(j)
    layers = list(groups)
    grads: list[Tensor] = [p.grad for _, _, p in named]  # type: ignore[misc]
    plan = _sharded.plan(grads)
    if plan is None:
        norms = _norms(grads, norm_type)
    else:
        norms, finite, local_bad = _sharded_norms(plan, norm_type)
    # per layer: views of `norms` only, no index tensor (a host-to-device copy would sync)
    layer_norms = torch.stack([_total(_rows(norms, idx), norm_type) for idx in groups.values()])
    total = _total(norms, norm_type)
    if per_layer:
        coef = (max_norm / (layer_norms + 1e-6)).clamp(max=1.0)
    else:
        coef = (max_norm / (total + 1e-6)).clamp(max=1.0).expand(len(layers))
    if plan is None:
        # the largest magnitude is finite exactly when the gradient is (it cannot overflow)
        peaks = norms if math.isinf(norm_type) else _norms(grads, math.inf)
        finite = torch.isfinite(peaks)
    after = layer_norms * coef  # a norm scales with its gradients
    values = torch.cat(
        [total[None], layer_norms, coef, finite.to(norms.dtype), _total(after, norm_type)[None]]
    )
    host = values.tolist()  # the one host transfer
    k = len(layers)
    total_v, layer_v, coef_v = host[0], host[1 : 1 + k], host[1 + k : 1 + 2 * k]
    finite_v, after_v = host[1 + 2 * k : 1 + 2 * k + len(named)], host[-1]
    bad = [name for (_, name, _), ok in zip(named, finite_v, strict=True) if not ok]
    if bad and error_if_nonfinite:
        stats: dict[str, object] = {"parameters": bad}
        listed = bad[:10]
        if plan is not None:
            where = [j for j, ok in enumerate(finite_v) if not ok]
            held = dict(zip(bad, _holders(plan, local_bad, where), strict=True))
            stats["ranks"] = held
            listed = [f"{n} ({_ranks(held[n])})" if held[n] else n for n in listed]
        raise NonFiniteError(
            f"non-finite gradients in {len(bad)} parameter(s): {', '.join(listed)}; total norm "
            f"{total_v}. Nothing was clipped.",
            phase="backward",
            module=bad[0],
            stats=stats,
        )
    if error_if_nonfinite and not math.isfinite(total_v):
        top = max(range(len(layers)), key=lambda i: layer_v[i])
        raise NonFiniteError(
            f"the total gradient norm is {total_v} although every gradient is finite: the "
            f"{norm_type:g}-norm overflows {norms.dtype} (largest layer norm {layer_v[top]:.4g}, "
            f"in {layers[top]!r}). Nothing was clipped; torch's clip_grad_norm_ raises here "
            "too. Scale the loss down, or clip by value first (torch.nn.utils.clip_grad_value_).",
            phase="backward",
            module=layers[top],
            stats={"total_norm": total_v},
        )
    with torch.no_grad():  # (a sparse tensor's detach() is a copy: scale the gradient itself)
        for i, idx in enumerate(groups.values()):
            for j in idx:
                g = grads[j] if plan is None else _sharded.local(grads[j])  # its own piece
                g.mul_(coef[i].to(g.device, g.dtype))
    clipped = {layer: c for layer, c in zip(layers, coef_v, strict=True) if c < 1.0}
    return ClipReport(
        total_norm=total_v,
        total_norm_after=after_v,
        max_norm=float(max_norm),
        norm_type=norm_type,
        layers=dict(zip(layers, layer_v, strict=True)),
        clipped=clipped,
        nonfinite=bad,
    )
