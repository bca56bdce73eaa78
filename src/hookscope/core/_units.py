"""Units as sites: ``positions=``, ``heads=`` and ``neurons=`` narrow a capture to some token
positions, attention heads or neurons of each selected site, and an edit to changing only them.

Where the units lie in a site's tensor (its :class:`Axes`) depends on the kind of site:

=========================================  ===================  =========  =====  =======
site                                       tensor               positions  heads  neurons
=========================================  ===================  =========  =====  =======
a layer, an operation                      ``(N, T, ..., D)``   1          —      -1
``"attn::scaled_dot_product_attention"``   ``(N, H, T, d)``     2          1      -1
``"attn::attention_weights"``              ``(N, H, Tq, Tk)``   2 (query)  1      —
an attention projection (``q_proj``...)    ``(N, T, H·d)``      1          -1     -1
a fused projection (``c_attn``...)         ``(N, T, 3·H·d)``    1          -1     -1
=========================================  ===================  =========  =====  =======

The output of an SDPA call is each head's output before the output projection
(TransformerLens' ``hook_z``, whose layout is ``(N, T, H, d)``: the same values, transposed);
its query, key and value inputs (``inputs=True``) are narrowed to the heads too, key and value
to the key/value head each selected query head reads under grouped-query attention
(:func:`kv_heads`). A decoding step that transformers packed (grouped-query attention with a
mask: the query ``(N, H, 1, d)`` passed as ``(N, H/g, g, d)``, see ``ops/_attention``) is
narrowed in the unpacked layout, so head ``h`` is query head ``h`` at every step. The head
layout thus comes from the call itself: every model that calls
``F.scaled_dot_product_attention`` (Hugging Face models with ``attn_implementation="sdpa"``,
the default) has it without declaring anything.

The query, key and value projections of a Hugging Face model (``q_proj``, ``k_proj``,
``v_proj``; BERT's ``query``, ``key``, ``value``) hold their heads side by side in the last
axis: the config gives their number and size (:func:`config_heads`), and a query head selects
its ``d`` columns of ``q_proj`` and those of the key/value head it reads in ``k_proj`` and
``v_proj`` (key/value heads in increasing order, each once). Fused projections hold the
queries, keys and values of every head (:data:`FUSED`): GPT-2's ``c_attn`` as three blocks
``q | k | v`` of ``H·d`` columns each, GPT-NeoX's ``query_key_value`` head by head
``[q_h | k_h | v_h]`` of ``3·d`` columns; a head selects its query, key and value columns,
kept in that layout (``c_attn`` narrowed to heads ``[3, 1]`` is ``q3 q1 | k3 k1 | v3 v1``).

A tensor without the axes of its site's layout is refused (:meth:`Axes.fits`) rather than
narrowed along another axis: an output ``(N, D)`` has no positions (its axis 1 is the
features), an SDPA call without a batch axis ``(H, T, d)`` no heads at axis 1.

Narrowing keeps every axis: a capture of ``positions=[-1]`` has a position axis of size 1. An
edit sees the narrowed tensor, of the shape a capture with the same units records (so
``hs.patch`` of a narrowed capture fits), and its result is written back into the selected
units of the full tensor, out of place; the other units are left exactly as they were.

``positions="last"`` is each sample's last real token: the last position its forward's
``attention_mask`` keeps (right or left padding alike), read from the model's own inputs as
``reduce="token_mean"`` reads it. A call over fewer positions than the mask has columns (a
decoding step with a KV cache) covers the mask's last columns. Without a mask every position
is real, and ``"last"`` is the last one; so it is for a layer called by itself, outside a
forward of the model (the sessions forget the mask when the forward ends).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeAlias

import torch
from torch import Tensor, nn

from ..errors import UsageError
from ._placement import is_dtensor
from ._reduce import keep_mask
from .ops._attention import pack, packed_rows, unpack
from .ops._select import SDPA, WEIGHTS, OpSelector

__all__ = [
    "Axes",
    "Indices",
    "MaskNote",
    "Narrow",
    "Positions",
    "Units",
    "axes_of",
    "config_heads",
    "kv_heads",
    "last_positions",
    "narrows",
    "parse_layout",
]

Indices: TypeAlias = int | Sequence[int]
"""The type of ``heads=`` and ``neurons=``: an index or a list of them (negative from the
end)."""
Positions: TypeAlias = int | Sequence[int] | Literal["last"]
"""The type of ``positions=``: an index or a list of them (negative from the end), or
``"last"``, each sample's last real token (from the forward's ``attention_mask``)."""
Fused: TypeAlias = Literal["blocks", "interleaved"]
"""Where a fused query/key/value projection holds each head's columns (:data:`FUSED`)."""


def _indices(value: Any, what: str) -> tuple[int, ...] | None:
    if value is None:
        return None
    items = [value] if isinstance(value, int) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Sequence):
        raise UsageError(f"{what}={value!r}: give an int or a list of ints")
    if not items or not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
        raise UsageError(f"{what}={value!r}: give an int or a non-empty list of ints")
    if len(set(items)) != len(items):
        raise UsageError(f"{what}={value!r} names an index twice; give each once")
    return tuple(items)


@dataclass(frozen=True)
class Units:
    """What ``positions=``, ``heads=`` and ``neurons=`` ask for, checked."""

    positions: tuple[int, ...] | Literal["last"] | None
    heads: tuple[int, ...] | None
    neurons: tuple[int, ...] | None

    @classmethod
    def of(
        cls, positions: Positions | None, heads: Indices | None, neurons: Indices | None
    ) -> Units | None:
        """The units asked for, or None when none is."""
        if positions is None and heads is None and neurons is None:
            return None
        if isinstance(positions, str) and positions != "last":
            raise UsageError(
                f"positions={positions!r}: give an index, a list of indices (negative from the "
                "end), or 'last' (each sample's last real token)"
            )
        if positions == "last":
            return cls("last", _indices(heads, "heads"), _indices(neurons, "neurons"))
        chosen = _indices(positions, "positions")
        return cls(chosen, _indices(heads, "heads"), _indices(neurons, "neurons"))

    @property
    def named(self) -> str:
        """The keywords given, as the user wrote them: ``"heads=, positions="``."""
        given = (("positions", self.positions), ("heads", self.heads), ("neurons", self.neurons))
        return ", ".join(f"{name}=" for name, value in given if value is not None)

    @property
    def needs_mask(self) -> bool:
        """Whether the forward's token mask is needed (``positions="last"``)."""
        return self.positions == "last"


@dataclass(frozen=True)
class Axes:
    """Where a site's tensor holds positions, heads and neurons (None: it has no such axis)."""

    positions: int | None
    heads: int | None
    neurons: int | None
    kind: str
    #: heads packed side by side in the heads axis (a projection's output ``(N, T, H·d)``):
    #: each head's size ``d``, and how many query heads read each of them (1 for queries,
    #: ``H / H_kv`` for the keys and values of grouped-query attention)
    packed: tuple[int, int] | None = None
    #: a fused projection's layout of queries, keys and values (:data:`FUSED`), None for one
    #: of them alone
    fused: Fused | None = None
    #: how many axes the layout names, None where it leaves some unnamed (a layer's output
    #: ``(N, T, ..., D)``: a batch, then positions before the features, if it has positions)
    rank: int | None = None

    def fits(self, t: Tensor, units: Units, site: str) -> None:
        """Refuse a tensor without this layout's axes: its units would be taken from other
        axes (an output ``(N, D)`` has no positions; its axis 1 is the features)."""
        if self.rank is not None:
            fits = t.dim() == self.rank
        else:
            fits = t.dim() >= (3 if units.positions is not None else 2)
        if not fits:
            raise UsageError(
                f"{units.named} on {site!r}: its tensor {tuple(t.shape)} does not have the "
                f"axes of {self.kind}, so the units would be taken from other axes; select "
                "another site, or declare its axes with layout="
            )

    def check(self, units: Units, site: str) -> None:
        """Refuse units this site has no axis for, naming the sites that have one."""
        if self.packed is not None and units.heads is not None and units.neurons is not None:
            raise UsageError(
                f"heads= and neurons= on {site!r}: its heads lie side by side in its last "
                "axis, which neurons= would narrow too; give one of them"
            )
        if units.heads is not None and self.heads is None:
            raise UsageError(
                f"heads= narrows attention heads, and {site!r} ({self.kind}) has no head axis: "
                "select the attention's SDPA call, '<attention layer>::scaled_dot_product_"
                "attention' (each head's output before the output projection), or "
                "'<attention layer>::attention_weights' (each head's attention pattern), or "
                "a query, key or value projection (q_proj, k_proj, v_proj; query, key, "
                "value; fused: GPT-2's c_attn, GPT-NeoX's query_key_value) of a model whose "
                "config gives its heads; for attention written by "
                "hand, declare the axes of its site with layout= "
                "(e.g. layout={'blocks.*.attn::softmax': 'batch heads positions keys'})"
            )
        if units.neurons is not None and self.neurons is None:
            raise UsageError(
                f"neurons= narrows the last axis, and that of {site!r} ({self.kind}) is not "
                "neurons (the last axis of attention weights is the key positions); narrow "
                "it with positions= and heads=, select another site, or declare its axes "
                "with layout="
            )
        if units.positions is not None and self.positions is None:
            raise UsageError(
                f"positions= on {site!r}: its declared layout ({self.kind}) names no "
                "positions axis; add one to layout=, or leave positions= out"
            )


_NAMED = ("positions", "heads", "neurons")


def parse_layout(text: object, site: str) -> Axes:
    """A declared layout: the names of a site's axes in order, ``"batch heads positions
    keys"``; ``positions``, ``heads`` and ``neurons`` are narrowed, any other word names an
    axis left whole. The first axis must be the batch (``positions="last"`` reads a mask row
    per sample)."""
    words = text.split() if isinstance(text, str) else []
    named = [w for w in words if w in _NAMED]
    if len(words) < 2 or words[0] != "batch" or len(set(named)) != len(named):
        raise UsageError(
            f"layout {text!r} for {site!r}: name the axes of its output in order, the batch "
            "first, e.g. 'batch heads positions keys' (positions, heads and neurons are "
            "narrowed, each named once; other words name axes left whole)"
        )
    where = {w: i for i, w in enumerate(words) if w in _NAMED}
    kind = f"declared ({' '.join(words)})"
    axes = (where.get("positions"), where.get("heads"), where.get("neurons"))
    return Axes(*axes, kind, rank=len(words))


#: the last name of an attention projection module, and whether it makes keys or values
#: (grouped-query heads) rather than queries: Llama, Mistral, Qwen2, Gemma, ViT (``q_proj``...),
#: BERT (``query``...)
PROJECTIONS = {"q_proj": False, "k_proj": True, "v_proj": True}
PROJECTIONS |= {"query": False, "key": True, "value": True}


#: fused query/key/value projections per ``config.model_type``: its last name, and where head
#: ``h``'s ``d`` query, key and value columns lie: ``"blocks"`` (GPT-2's ``c_attn``: ``q | k |
#: v``, each ``H·d`` wide, head ``h`` at ``h·d`` in each), ``"interleaved"`` (GPT-NeoX's
#: ``query_key_value``: ``3·d`` columns per head, ``[q_h | k_h | v_h]``, as its
#: ``view(..., H, 3·d).chunk(3)`` reads them)
FUSED: dict[str, tuple[str, Fused]] = {
    "gpt2": ("c_attn", "blocks"),
    "gpt_neox": ("query_key_value", "interleaved"),
}


def config_heads(model: object) -> tuple[int, int, int] | None:
    """``(query heads, key/value heads, head size)`` from a Hugging Face model's config
    (``num_attention_heads``, ``num_key_value_heads``, ``head_dim`` or ``hidden_size / heads``),
    or None where it has none."""
    config = getattr(model, "config", None)
    heads = getattr(config, "num_attention_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = getattr(config, "num_key_value_heads", None)
    size = getattr(config, "head_dim", None)
    if not isinstance(size, int):
        hidden = getattr(config, "hidden_size", None)
        size = hidden // heads if isinstance(hidden, int) else None
    if size is None:
        return None
    return heads, kv if isinstance(kv, int) and kv > 0 else heads, size


def projection_axes(name: str, model: object) -> Axes | None:
    """The axes of an attention projection's output ``(N, T, H·d)``, heads side by side in
    the last axis, from the model's config; None for any other layer."""
    last = name.rsplit(".", 1)[-1]
    kind_of = getattr(getattr(model, "config", None), "model_type", None)
    fused = FUSED.get(kind_of) if isinstance(kind_of, str) else None
    if fused is not None and last == fused[0] and ".crossattention." not in f".{name}":
        # (GPT-2's cross-attention c_attn makes keys and values only: not this layout)
        found = config_heads(model)
        if found is None or found[1] != found[0]:
            return None
        size = found[2]
        kind = f"a fused projection's output (N, positions, 3 x heads x {size}), from the config"
        return Axes(1, -1, -1, kind, packed=(size, 1), fused=fused[1])
    found = config_heads(model) if last in PROJECTIONS else None
    if found is None:
        return None
    heads, kv, size = found
    group = heads // kv if PROJECTIONS[last] else 1
    kind = f"an attention projection's output (N, positions, heads x {size}), from the config"
    return Axes(1, -1, -1, kind, packed=(size, group))


def axes_of(
    op: OpSelector | None, declared: Axes | None = None, projection: Axes | None = None
) -> Axes:
    """The axes of a site's output: a layer's (``op`` None) or an operation's, unless a
    layout was declared for it; ``projection``: a layer's as an attention projection."""
    if declared is not None:
        return declared
    if op is None and projection is not None:
        return projection
    if op is not None and op.op == WEIGHTS:
        return Axes(2, 1, None, "attention weights (N, heads, query, key)", rank=4)
    if op is not None and op.op == SDPA:
        return Axes(2, 1, -1, "an SDPA call's output (N, heads, positions, head size)", rank=4)
    return Axes(1, None, -1, "an output (N, positions, ..., features)")


def narrows(
    units: Units | None,
    sites: Mapping[str, tuple[nn.Module, OpSelector | None]],
    layout: Mapping[str, str] | None,
    resolve: Callable[[str], Iterable[str]],
    masks: MaskNote | None,
    model: object = None,
) -> dict[str, Narrow]:
    """The :class:`Narrow` of each of ``sites`` (name: its module and its operation, None for
    a layer), with
    the axes ``layout`` declares (``{selector: "batch heads positions keys"}``, each selector
    resolved by ``resolve`` to site names) where it declares them."""
    if units is None:
        if layout:
            raise UsageError(
                "layout= declares where units lie: give positions=, heads= or neurons="
            )
        return {}
    declared: dict[str, Axes] = {}
    for selector, text in (layout or {}).items():
        names = [n for n in resolve(selector) if n in sites]
        if not names:
            raise UsageError(
                f"layout key {selector!r} matches none of the selected sites {list(sites)}; "
                "declare the layout of sites the call selects"
            )
        for name in names:
            declared[name] = parse_layout(text, name)
    narrowed: dict[str, Narrow] = {}
    for name, (module, op) in sites.items():
        projection = projection_axes(name, model) if units.heads else None
        axes = axes_of(op, declared.get(name), projection)
        sdpa = op is not None and op.op == SDPA and name not in declared
        narrowed[name] = Narrow(units, axes, name, masks, module if sdpa else None)
    return narrowed


def kv_heads(heads: Sequence[int], query_heads: int, key_heads: int) -> list[int]:
    """The key/value heads that ``heads`` (query heads, non-negative) read: with grouped-query
    attention, query head ``h`` reads key/value head ``h // (query_heads // key_heads)``, as
    ``repeat_interleave`` and SDPA's ``enable_gqa`` arrange them."""
    if key_heads == query_heads:
        return list(heads)
    group = query_heads // key_heads
    return sorted({h // group for h in heads})


def last_positions(mask: Tensor | None, n: int, length: int, device: torch.device) -> Tensor:
    """``(n,)``: each sample's last real position among a call's ``length`` positions."""
    if mask is None:
        return torch.full((n,), length - 1, dtype=torch.long, device=device)
    if mask.size(0) != n or mask.size(1) < length:
        raise UsageError(
            f"positions='last': the forward's attention_mask is {tuple(mask.shape)}, and this "
            f"site has {n} samples of {length} positions; 'last' needs a mask with a row per "
            "sample and a column per position (give the model its attention_mask as it is)"
        )
    window = mask[:, mask.size(1) - length :].to(device)
    steps = torch.arange(length, device=device).expand(n, length)
    found = torch.where(window, steps, torch.full_like(steps, -1)).amax(dim=1)
    if bool((found < 0).any()):
        raise UsageError(
            "positions='last': a sample's attention_mask keeps none of this call's positions, "
            "so it has no last real token here"
        )
    return found


class MaskNote:
    """The token mask of the forward running on each thread (``positions="last"``)."""

    def __init__(self) -> None:
        self._local = threading.local()

    def note(self, inputs: dict[str, Any]) -> None:
        """The inputs of the forward starting on this thread; ``{}`` when it ended."""
        self._local.value = keep_mask(inputs)

    @property
    def mask(self) -> Tensor | None:
        """This thread's forward's mask, if it has one."""
        value: Tensor | None = getattr(self._local, "value", None)
        return value


class Narrow:
    """The units of one site: :meth:`take` them from its tensor, :meth:`put` new values back.

    ``attention``: for an SDPA call's output, the attention module that makes the call, whose
    packed decoding steps (:func:`~.ops._attention.packed_rows`) are narrowed unpacked."""

    def __init__(
        self,
        units: Units,
        axes: Axes,
        site: str,
        masks: MaskNote | None,
        attention: nn.Module | None = None,
    ) -> None:
        axes.check(units, site)
        self.units, self.axes, self.site, self._masks = units, axes, site, masks
        self._attention = attention

    def _unpacked(self, t: Tensor) -> tuple[Tensor, int]:
        """``t`` in eager attention's layout ``(N, H, 1, d)`` if it is the output (or its
        gradient) of a packed call ``(N, H/g, g, d)``, and ``g`` (1: as it was)."""
        groups = 1 if self._attention is None else packed_rows(self._attention, t)
        return unpack(t, groups), groups

    def _plan(self, t: Tensor) -> list[tuple[int, Tensor]]:
        """``(axis, index)`` per narrowed axis: ``(N, 1)`` for ``"last"`` (a position per
        sample), else ``(k,)`` indices along the axis."""
        plan: list[tuple[int, Tensor]] = []
        units, axes = self.units, self.axes
        if is_dtensor(t):
            raise UsageError(
                f"positions=/heads=/neurons= on {self.site!r}: its output is a DTensor (a "
                "tensor-parallel plan with use_local_output=False), and units narrow plain "
                "tensors. Keep the plan's default local outputs (each rank narrows its own "
                "piece), or capture without units (gather=True: the global tensor) and index it"
            )
        axes.fits(t, units, self.site)
        for wanted, axis, what in (
            (units.positions, axes.positions, "positions"),
            (units.heads, axes.heads, "heads"),
            (units.neurons, axes.neurons, "neurons"),
        ):
            if wanted is None or axis is None:
                continue
            axis %= t.dim()  # in range: the tensor fits the layout
            size = t.size(axis)
            if wanted == "last":
                mask = self._masks.mask if self._masks is not None else None
                found = last_positions(mask, t.size(0), size, t.device)
                plan.append((axis, found.view(-1, 1)))  # (N, 1): one position per sample
                continue
            assert not isinstance(wanted, str)
            if what == "heads" and axes.packed is not None:
                plan.append((axis, self._packed(wanted, size, t)))
                continue
            bad = [i for i in wanted if not -size <= i < size]
            if bad:
                raise UsageError(
                    f"{what}={list(wanted)} on {self.site!r}: {bad} out of range for its "
                    f"{size} {what} (tensor {tuple(t.shape)})"
                )
            plan.append((axis, torch.tensor([i % size for i in wanted], device=t.device)))
        return plan

    def _packed(self, heads: tuple[int, ...], width: int, t: Tensor) -> Tensor:
        """The columns of ``heads`` (query heads) in a last axis of heads side by side; keys
        and values of grouped-query attention: the key/value head each query head reads."""
        assert self.axes.packed is not None
        size, group = self.axes.packed
        fused = self.axes.fused
        parts = 1 if fused is None else 3  # a fused head: its query, key and value
        count = width // (size * parts) * group  # query heads
        if width % (size * parts):
            what = f"{parts} x " if fused else ""
            raise UsageError(
                f"heads= on {self.site!r}: its last axis ({width}) is not a whole number of "
                f"heads of {what}{size} (the config's head size)"
            )
        bad = [h for h in heads if not -count <= h < count]
        if bad:
            raise UsageError(
                f"heads={list(heads)} on {self.site!r}: {bad} out of range for its {count} "
                f"heads (tensor {tuple(t.shape)})"
            )
        chosen = kv_heads([h % count for h in heads], count, count // group)
        if fused == "blocks":  # q | k | v, each of count x size columns
            starts = [b * count * size + h * size for b in range(3) for h in chosen]
        elif fused == "interleaved":  # [q_h | k_h | v_h] head after head
            starts = [h * 3 * size + j * size for h in chosen for j in range(3)]
        else:
            starts = [h * size for h in chosen]
        columns = [c for start in starts for c in range(start, start + size)]
        return torch.tensor(columns, device=t.device)

    def take(self, t: Tensor) -> Tensor:
        """The selected units of ``t``, every axis kept."""
        t, _ = self._unpacked(t)
        for axis, index in self._plan(t):
            t = _take(t, axis, index)
        return t

    def put(self, t: Tensor, new: Tensor) -> Tensor:
        """``t`` with its selected units replaced by ``new`` (of :meth:`take`'s shape), out of
        place."""
        full, groups = self._unpacked(t)
        return pack(_put(full, self._plan(full), new), groups)


def _take(t: Tensor, axis: int, index: Tensor) -> Tensor:
    if index.dim() == 2:  # "last": one position per sample
        return t.gather(axis, _per_sample(t, axis, index))
    return t.index_select(axis, index)


def _per_sample(t: Tensor, axis: int, index: Tensor) -> Tensor:
    """A per-sample index ``(N, 1)`` spread over ``t``'s other axes, for gather / scatter."""
    shape = [1] * t.dim()
    shape[0] = t.size(0)
    full = list(t.shape)
    full[axis] = 1
    return index.view(shape).expand(full)


def _put(t: Tensor, plan: list[tuple[int, Tensor]], new: Tensor) -> Tensor:
    """``t`` with ``new`` written at the units ``plan`` selects, axis by axis (outermost
    first), out of place: autograd sees a ``scatter`` / ``index_copy``."""
    if not plan:
        return new
    (axis, index), rest = plan[0], plan[1:]
    inner = _put(_take(t, axis, index), rest, new) if rest else new
    inner = inner.to(t.dtype)
    if index.dim() == 2:
        return t.scatter(axis, _per_sample(t, axis, index), inner)
    return t.index_copy(axis, index, inner)
