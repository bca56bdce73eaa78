"""Activation patching over a grid of layers x positions, many cells per forward, and its
first-order estimate from one forward and one backward (attribution patching).

A cell ``(layer, position)`` is one forward of the corrupted input with that layer's output at
that position replaced by the clean run's (TransformerLens' ``get_act_patch_resid_pre`` and
its relatives, on the unmodified model). Cells are batched: ``cells_per_forward`` copies of the
corrupted input run as one batch, each copy with its own cell patched, and the user's metric
is called on each copy's slice of the output, so that the numbers are those of one forward per
cell.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import (
    Edit,
    EditContext,
    Layers,
    LayerSelector,
    capture,
    edit,
    leaves,
    map_tensors,
    run_eagerly,
)
from ..errors import UsageError
from ._path import need_grad

#: operations whose output is ``(batch, heads, positions, ...)``: an SDPA call's (each head's
#: output) and its attention weights (each head's pattern, positions = queries)
HEADED = ("scaled_dot_product_attention", "attention_weights")


@dataclass(frozen=True)
class Patching:
    """What :func:`patching` found: ``values[i, j]`` is the metric with ``layers[i]``'s
    output at ``positions[j]`` patched from the clean run (``values[i, j, k]``: of head
    ``heads[k]`` only).

    Attributes:
        values: ``(len(layers), len(positions))``, or ``(len(layers), len(positions),
            len(heads))`` for a sweep over heads; float, on the CPU.
        layers: the grid's layers, canonical names in selection order.
        positions: the grid's positions (non-negative).
        heads: the grid's heads (empty unless the sweep is over heads).
    """

    values: Tensor
    layers: tuple[str, ...]
    positions: tuple[int, ...]
    heads: tuple[int, ...] = ()

    def at(self, layer: str, position: int, head: int | None = None) -> float:
        """The metric of one cell (``head`` for a sweep over heads)."""
        if layer not in self.layers:
            raise UsageError(f"{layer!r} is not in this grid; its layers: {list(self.layers)}")
        if position not in self.positions:
            raise UsageError(f"position {position} is not in this grid: {list(self.positions)}")
        if (head is None) != (not self.heads) or (head is not None and head not in self.heads):
            raise UsageError(f"head {head!r}: this grid's heads are {list(self.heads)}")
        cell = [self.layers.index(layer), self.positions.index(position)]
        if head is not None:
            cell.append(self.heads.index(head))
        return float(self.values[tuple(cell)])

    def to_text(self, tokens: Sequence[str] | None = None) -> str:
        """The grid as a plain-text table: a row per layer (per layer and head), a column per
        position, labelled with ``tokens`` (one string per position of the input) if given."""
        from ._tables import grid_text

        return grid_text(self.values, self.layers, self.positions, self.heads, tokens)

    def __str__(self) -> str:
        return self.to_text()


def patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Callable[[Any], Tensor | float],
    layers: LayerSelector,
    *,
    positions: Sequence[int] | None = None,
    heads: bool = False,
    cells_per_forward: int = 16,
) -> Patching:
    """Activation patching of a clean run into a corrupted one, cell by cell over a grid of
    layers x positions.

    For each layer and position, the corrupted input runs with that layer's output at that
    position (every sample of the batch) replaced by the clean run's, and ``metric`` scores
    the result. ``cells_per_forward`` cells share one forward: the corrupted batch is repeated
    once per cell, each copy patched at its own cell, and ``metric`` gets each copy's output
    alone, so the values are those of one forward per cell (up to the float reordering a
    larger batch may bring). The model runs as it is, under ``torch.no_grad()``: call
    ``model.eval()`` first for dropout-free numbers.

    Args:
        model: the model.
        clean: the clean input: a tensor (``model(x)``), a dict (``model(**x)``) or a tuple
            (``model(*x)``); its batch is the corrupted one's or 1.
        corrupted: the corrupted input, of the same kind and sequence length.
        metric: the score of one cell: ``metric(output)`` gets the model's output for the
            corrupted batch (every tensor in it sliced to that cell's copy) and returns a
            number or a 0-d tensor, e.g. ``lambda out: out.logits[:, -1, a] - ...``.
        layers: the layers whose outputs are patched (any layer selector); each must return
            one tensor of shape ``(batch, positions, ...)`` and run once per forward. For a
            Hugging Face GPT-2, the residual stream before block ``i`` (TransformerLens'
            ``resid_pre``) is the output of ``transformer.drop`` (``i = 0``) or of
            ``transformer.h.{i-1}``. An SDPA call (``"...attn::scaled_dot_product_attention"``,
            ``(batch, heads, positions, head size)``) or its attention weights
            (``"...attn::attention_weights"``, ``(batch, heads, queries, keys)``) has its
            positions in axis 2: a cell patches every head at that position (query position).
        positions: the positions patched (negative from the end); default every position.
        heads: sweep over attention heads too: each layer is an SDPA call, whose output is
            each head's output before the output projection (TransformerLens' ``hook_z``),
            or its attention weights (``hook_pattern``), and a cell patches one head at one
            position: TransformerLens' ``get_act_patch_attn_head_out_by_pos``, or for the
            weights ``get_act_patch_attn_head_pattern_by_pos`` (transposed: ours is layers x
            positions x heads): the head's clean pattern at that query position, every key,
            its output then recomputed from it in the corrupted run (the SDPA call runs
            explicitly, ``weights @ values``, in the patched forwards). A query, key or value
            projection of a model whose config gives its heads (``q_proj``, ``k_proj``,
            ``v_proj``; BERT's ``query``, ``key``, ``value``) has its heads side by side in
            its last axis, and a cell patches one head's columns at one position
            (``get_act_patch_attn_head_q_by_pos`` and its ``k`` / ``v`` relatives; the keys
            and values of grouped-query attention have their own, fewer heads). Every layer
            of a sweep has as many heads as the first.
        cells_per_forward: how many cells run in one forward (memory grows with it).

    Returns:
        A :class:`Patching`: ``values`` of shape ``(len(layers), len(positions))``.

    Raises:
        UsageError: bad arguments, inputs of different kinds or lengths, a layer that does not
            return one tensor with a position axis or runs more than once per forward.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1)).eval()
        >>> clean, corrupted = torch.ones(1, 3, 2), torch.zeros(1, 3, 2)
        >>> grid = hs.patching(model, clean, corrupted, lambda out: out.sum(), ["0", "1"])
        >>> grid.values.shape
        torch.Size([2, 3])
    """
    if isinstance(cells_per_forward, bool) or not isinstance(cells_per_forward, int):
        raise UsageError(f"cells_per_forward must be a positive int, not {cells_per_forward!r}")
    if cells_per_forward < 1:
        raise UsageError(f"cells_per_forward must be at least 1, not {cells_per_forward}")
    if not callable(metric):
        raise UsageError(f"metric must be a function of the model's output, not {metric!r}")
    batch = _batch_size(corrupted, "corrupted")
    if not isinstance(heads, bool):
        raise UsageError(f"heads must be True or False, not {heads!r}")
    names, sources, grid, axes, sizes = _clean_run(
        model, clean, layers, positions, batch, heads=heads
    )
    n_heads = sources[names[0]].shape[1] if heads else 1
    cells = [(n, p, h) for n in names for p in grid for h in range(n_heads)]
    scores: list[Tensor] = []
    for start in range(0, len(cells), cells_per_forward):
        chunk = cells[start : start + cells_per_forward]
        edits = {
            name: Edit(
                _patcher(name, chunk, sources[name], batch, heads, axes[name], sizes[name]),
                name="patch cells",
            )
            for name in dict.fromkeys(name for name, _, _ in chunk)
        }
        with (
            run_eagerly(model),
            torch.no_grad(),
            edit(model, edits, recompile=True, this_thread=True),
        ):
            out = _run(model, _repeat(corrupted, len(chunk)))
        for i in range(len(chunk)):
            scores.append(_score(metric, _copy(out, i, batch, len(chunk))))
    device = scores[0].device  # one copy to the CPU at the end, not a sync per cell
    values = torch.stack([s.to(device) for s in scores]).float().cpu()
    if not heads:
        return Patching(values.reshape(len(names), len(grid)), names, tuple(grid))
    shape = (len(names), len(grid), n_heads)
    return Patching(values.reshape(shape), names, tuple(grid), tuple(range(n_heads)))


def attribution_patching(
    model: nn.Module,
    clean: Any,
    corrupted: Any,
    metric: Callable[[Any], Tensor],
    layers: LayerSelector,
    *,
    positions: Sequence[int] | None = None,
    heads: bool = False,
) -> Patching:
    """The first-order estimate of :func:`patching`'s grid from one clean forward, one
    corrupted forward and one backward (attribution patching).

    Each cell is ``metric(corrupted) + sum(grad * (clean - corrupted))`` at its layer and
    position, summed over the batch and the other axes, where ``grad`` is the gradient of the
    metric with respect to the layer's output in the corrupted run: the metric the patch would
    give if the model were linear from that layer on. With ``heads=True`` a cell is one head
    at one position, summed over the batch and the head size. Gradients are taken with
    ``torch.autograd.grad``: the parameters' ``.grad`` are left as they are.

    Args:
        model: the model.
        clean: the clean input, as for :func:`patching`.
        corrupted: the corrupted input, as for :func:`patching`.
        metric: as for :func:`patching`, returning a 0-d tensor computed from the output.
        layers: the layers, as for :func:`patching`.
        positions: the positions (negative from the end); default every position.
        heads: estimate :func:`patching`'s sweep over attention heads: each layer is an SDPA
            call (``"...attn::scaled_dot_product_attention"``), its attention weights
            (``"...attn::attention_weights"``, summed over the keys) or a query, key or value
            projection, as for :func:`patching`, a cell one head at one position; ``values``
            is then ``(len(layers), len(positions), len(heads))``.

    Returns:
        A :class:`Patching` of the estimates, comparable cell by cell with :func:`patching`'s
        (with the same ``heads``).

    Raises:
        UsageError: as :func:`patching`, or a metric that does not depend on the layers.
    """
    if not callable(metric):
        raise UsageError(f"metric must be a function of the model's output, not {metric!r}")
    if not isinstance(heads, bool):
        raise UsageError(f"heads must be True or False, not {heads!r}")
    need_grad("attribution_patching")
    batch = _batch_size(corrupted, "corrupted")
    names, sources, grid, axes, sizes = _clean_run(
        model, clean, layers, positions, batch, heads=heads
    )
    live: dict[str, Tensor] = {}

    def keep(name: str) -> Callable[[Tensor, EditContext], Tensor]:
        def fn(t: Tensor, ctx: EditContext) -> Tensor:
            if ctx.call:
                raise UsageError(f"patching: {name!r} ran more than once in a forward")
            live[name] = t if t.requires_grad else t.detach().requires_grad_()
            return live[name]

        return fn

    edits = {n: Edit(keep(n), name="keep") for n in names}
    with (
        run_eagerly(model),
        torch.enable_grad(),
        edit(model, edits, recompile=True, this_thread=True),
    ):
        score = metric(_run(model, corrupted))
        if not isinstance(score, Tensor) or score.numel() != 1 or not score.requires_grad:
            raise UsageError(
                "metric must return a 0-d tensor computed from the output (with its gradient), "
                f"got {score!r}"
            )
        score = score.reshape(())  # (with its gradient under the caller's torch.no_grad())
    grads = torch.autograd.grad(score, [live[n] for n in names], allow_unused=True)
    rows = []
    for name, grad in zip(names, grads, strict=True):
        now = _as_heads(live[name].detach(), sizes[name])
        if grad is None or now.shape[1:] != sources[name].shape[1:]:
            raise UsageError(
                f"attribution_patching: {name!r} is not on the metric's path, or the runs "
                "differ in length"
            )
        change = _as_heads(grad, sizes[name]) * (sources[name].to(now.dtype) - now)
        rows.append(_first_order(change, grid, heads, axes[name]))
    values = score.detach().reshape(()) + torch.stack(rows)
    if not heads:
        return Patching(values.float().cpu(), names, tuple(grid))
    n_heads = sources[names[0]].shape[1]
    return Patching(values.float().cpu(), names, tuple(grid), tuple(range(n_heads)))


def _first_order(change: Tensor, grid: list[int], heads: bool, axis: int) -> Tensor:
    """One layer's row of estimates from ``grad * (clean - corrupted)``: summed over the batch
    and every other axis at each position (``axis``: the positions'), ``(positions,)``; with
    heads (``change`` is ``(N, H, T, d)``, or ``(N, H, Tq, Tk)`` for attention weights) over
    the batch and the last axis at each position and head, ``(positions, H)``."""
    if heads:
        return change[:, :, grid].sum((0, 3)).transpose(0, 1)
    at = change.movedim(axis, 0)[grid]  # (P, ...)
    return at.flatten(1).sum(1)


def _clean_run(
    model: nn.Module,
    clean: Any,
    layers: LayerSelector,
    positions: Sequence[int] | None,
    batch: int,
    *,
    heads: bool = False,
) -> tuple[tuple[str, ...], dict[str, Tensor], list[int], dict[str, int], dict[str, int | None]]:
    """The layers' outputs in the clean run (checked), the grid's positions, each layer's
    position axis (2 for an SDPA call or its attention weights, whose axis 1 is the heads),
    and with ``heads`` the head size of each projection (its heads side by side in the last
    axis, None for the others); its output is then returned as ``(N, heads, T, size)``
    (:func:`_as_heads`)."""
    with (
        run_eagerly(model),
        torch.no_grad(),
        capture(model, layers, recompile=True, this_thread=True) as cap,
    ):
        _run(model, clean)
    names = tuple(cap.records)
    sources = {name: _clean_value(name, cap[name].calls, batch) for name in names}
    sites = Layers(model).sites(layers)
    headed = {n for n, site in sites.items() if site.op is not None and site.op.op in HEADED}
    axes = {name: 2 if heads or name in headed else 1 for name in names}
    sizes: dict[str, int | None] = dict.fromkeys(names)
    if heads:
        sizes |= _head_sizes(model, clean, {n: v for n, v in sources.items() if v.dim() == 3})
        sources = {name: _as_heads(value, sizes[name]) for name, value in sources.items()}
    first = sources[names[0]].shape[axes[names[0]]]
    for name, value in sources.items():
        if heads and (value.dim() != 4 or value.shape[1] != sources[names[0]].shape[1]):
            raise UsageError(
                f"patching heads: {name!r} returned {tuple(value.shape)}; with heads=True each "
                "layer is an SDPA call (batch, heads, positions, head size), its attention "
                "weights (batch, heads, queries, keys) or a query, key or value projection "
                "(q_proj, k_proj, v_proj), each with as many heads as the first (keys and "
                "values of grouped-query attention have fewer: sweep them apart), e.g. "
                "'transformer.h.0.attn::scaled_dot_product_attention' or "
                "'transformer.h.0.attn::attention_weights'"
            )
        if value.dim() <= axes[name] or value.shape[axes[name]] != first:
            raise UsageError(
                f"patching: {name!r} returned {tuple(value.shape)}, positions along axis "
                f"{axes[name]}; the first layer has {first}: patch layers that share the "
                "position axis"
            )
    return names, sources, _positions(positions, first), axes, sizes


def _head_sizes(model: nn.Module, clean: Any, outputs: Mapping[str, Tensor]) -> dict[str, int]:
    """The head size of each layer of ``outputs`` (its clean output ``(N, T, width)``): the
    width a capture of head 0 keeps, where core's narrowing knows the layer's heads (an
    attention projection, from the model's config); its heads must lie side by side, head
    ``h`` in columns ``h * size`` to ``(h + 1) * size``."""
    names = list(outputs)
    if not names:
        return {}
    try:
        with (
            run_eagerly(model),
            torch.no_grad(),
            capture(model, names, heads=[0], recompile=True, this_thread=True) as cap,
        ):
            _run(model, clean)
    except UsageError as err:
        raise UsageError(
            f"patching heads: with heads=True each layer is an SDPA call, its attention "
            f"weights or a query, key or value projection (q_proj, k_proj, v_proj) of a model "
            f"whose config gives its heads, e.g. "
            f"'transformer.h.0.attn::scaled_dot_product_attention' ({err})"
        ) from err
    sizes = {}
    for name, full in outputs.items():
        one = cap[name].calls[0].output
        if full.shape[-1] % one.shape[-1] or not torch.equal(one, full[..., : one.shape[-1]]):
            raise UsageError(
                f"patching heads: the heads of {name!r} do not lie side by side in its last "
                "axis (a fused projection's queries, keys and values, or a model that is not "
                "deterministic: call model.eval()); sweep its SDPA call's heads instead"
            )
        sizes[name] = int(one.shape[-1])
    return sizes


def _as_heads(t: Tensor, size: int | None) -> Tensor:
    """A projection's output ``(N, T, heads x size)`` as ``(N, heads, T, size)``, a view of a
    contiguous ``t`` (writing into it writes into ``t``); ``t`` itself where ``size`` is None."""
    return t if size is None else t.reshape(*t.shape[:-1], -1, size).transpose(1, 2)


def _run(model: nn.Module, inputs: Any) -> Any:
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _batch_size(inputs: Any, what: str) -> int:
    if not isinstance(inputs, (Tensor, Mapping, tuple)):
        raise UsageError(
            f"{what} must be a tensor, a dict of keyword inputs or a tuple of positional "
            f"inputs, not {type(inputs).__name__}"
        )
    sizes = {t.shape[0] for _, t in leaves(inputs) if t.dim() > 0}
    if len(sizes) != 1:
        raise UsageError(
            f"{what}: its tensors must share one batch size (dimension 0), found "
            f"{sorted(sizes) or 'no tensor'}"
        )
    return sizes.pop()


def _repeat(inputs: Any, copies: int) -> Any:
    """``copies`` copies of the batch, one after another (copy ``i``: rows ``i*B:(i+1)*B``)."""

    def repeated(_: Any, t: Tensor) -> Tensor:
        return t.repeat(copies, *(1,) * (t.dim() - 1)) if t.dim() else t

    return map_tensors(repeated, inputs)


def _copy(output: Any, i: int, batch: int, copies: int) -> Any:
    """Copy ``i``'s part of the output of a repeated batch."""

    def part(_: Any, t: Tensor) -> Tensor:
        if t.dim() and t.shape[0] == batch * copies:
            return t[i * batch : (i + 1) * batch]
        return t

    return map_tensors(part, output)


def _clean_value(name: str, calls: Sequence[Any], batch: int) -> Tensor:
    if len(calls) != 1:
        raise UsageError(
            f"patching: {name!r} ran {len(calls)} times in the clean forward; a layer patched "
            "by position must run once per forward"
        )
    value = calls[0].output
    if not isinstance(value, Tensor) or value.dim() < 2:
        what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise UsageError(
            f"patching: {name!r} returned {what}; a patched layer must return one tensor "
            "(batch, positions, ...): choose the module whose output is the activation"
        )
    if value.shape[0] not in (1, batch):
        raise UsageError(
            f"patching: the clean run's batch is {value.shape[0]} at {name!r}, the corrupted "
            f"one's {batch}: give a clean batch of the same size or of 1"
        )
    return value


def _positions(positions: Sequence[int] | None, length: int) -> list[int]:
    if positions is None:
        return list(range(length))
    if isinstance(positions, (str, bytes)) or not isinstance(positions, Sequence) or not positions:
        raise UsageError(f"positions must be a non-empty list of ints, not {positions!r}")
    grid = []
    for p in positions:
        if isinstance(p, bool) or not isinstance(p, int) or not -length <= p < length:
            raise UsageError(f"position {p!r} is not an index of the {length} positions")
        grid.append(p % length)
    if len(set(grid)) != len(grid):
        raise UsageError(f"positions {list(positions)} name a position twice")
    return grid


def _patcher(
    name: str,
    chunk: Sequence[tuple[str, int, int]],
    clean: Tensor,
    batch: int,
    heads: bool,
    axis: int,
    size: int | None,
) -> Callable[[Tensor, EditContext], Tensor]:
    """The edit of ``name`` for this forward's cells: copy ``i`` of the batch gets the clean
    values at its cell's position (along ``axis``; every head of an SDPA call or its weights
    unless ``heads``) and head."""
    mine = [(i, p, h) for i, (layer, p, h) in enumerate(chunk) if layer == name]

    def fn(t: Tensor, ctx: EditContext) -> Tensor:
        if ctx.call:
            raise UsageError(
                f"patching: {name!r} ran more than once in a forward; a layer patched by "
                "position must run once per forward"
            )
        if t.shape[0] != batch * len(chunk) or _as_heads(t, size).shape[1:] != clean.shape[1:]:
            raise UsageError(
                f"patching: {name!r} returned {tuple(t.shape)} on the corrupted input, "
                f"{tuple(clean.shape)} on the clean one: the runs must have the same length"
            )
        out = t.clone()
        view = _as_heads(out, size)  # (writes into out)
        for i, p, h in mine:
            rows = slice(i * batch, (i + 1) * batch)
            if heads:
                view[rows, h, p] = clean[:, h, p].to(t.dtype)
            else:
                at = (slice(None),) * (axis - 1) + (p,)  # every head before the positions
                out[(rows, *at)] = clean[(slice(None), *at)].to(t.dtype)
        return out

    return fn


def _score(metric: Callable[[Any], Tensor | float], output: Any) -> Tensor:
    value = metric(output)
    score = value.detach() if isinstance(value, Tensor) else torch.tensor(value)
    if score.numel() != 1:
        raise UsageError(
            f"metric returned a tensor of shape {tuple(score.shape)}; it must return one "
            "number per cell (reduce over the batch, e.g. .mean())"
        )
    return score.reshape(())
