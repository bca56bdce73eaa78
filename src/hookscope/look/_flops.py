"""Count FLOPs at the operator level, as the forward runs.

A ``TorchDispatchMode`` sees every aten operator a forward executes, whoever calls it: layers,
functional calls in a parent's ``forward`` (``q @ k.T``), fused kernels. Formulas come from
PyTorch's own registry (``torch.utils.flop_counter.flop_registry``), plus a few operators it
has no formula for, which run on the CPU or in fused fast paths (the CPU flash-attention kernel
behind ``scaled_dot_product_attention``, pytorch/pytorch#195460; the MKL-DNN LSTM layer;
``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` fast paths; matrix-vector products).

Convention (PyTorch's): one multiply-accumulate is 2 FLOPs; only matrix products,
convolutions and attention are counted. Operators that do arithmetic but have no formula
(elementwise ops, norms, softmax, pooling) are reported with their call counts, never counted
as zero silently; operators that do no arithmetic (views, copies, creation, indexing) are not.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

__all__ = ["FREE_OPS", "Counter"]

aten = torch.ops.aten
Shape = Sequence[int]


def _sdpa(q: Shape, k: Shape, v: Shape) -> int:
    """Q @ K^T and A @ V, with grouped key/value heads broadcast to the query's heads."""
    *batch, s_q, d = q
    s_k, d_v = k[-2], v[-1]
    heads = math.prod(batch)
    return int(2 * heads * s_q * s_k * (d + d_v))


def _attention(b: int, s_q: int, s_k: int, e: int, qkv_rows: int) -> int:
    """Input projections (``qkv_rows`` token rows, E x E each), attention, output projection."""
    return 2 * qkv_rows * e * e + 2 * b * s_q * s_k * e * 2 + 2 * b * s_q * e * e


def _native_mha(q: Shape, k: Shape, v: Shape, embed_dim: int, *args: Any, **kw: Any) -> int:
    b, s_q, s_k = q[0], q[-2], k[-2]
    return _attention(b, s_q, s_k, embed_dim, b * (s_q + 2 * s_k))


def _encoder_layer(src: Shape, embed_dim: int, *args: Any, **kw: Any) -> int:
    ffn_1 = args[12] if len(args) > 12 else kw["ffn_weight_1"]
    b, s = src[0], src[-2]
    ffn = int(2 * 2 * b * s * ffn_1[0] * ffn_1[1])  # two linears, E x F each
    return _attention(b, s, s, embed_dim, 3 * b * s) + ffn


def _rnn_layer(inp: Shape, w_ih: Shape, w_hh: Shape, *args: Any, **kw: Any) -> int:
    rows = math.prod(inp[:-1])  # timesteps x batch, packed or not
    return 2 * rows * w_ih[0] * (w_ih[1] + w_hh[1])


def _mv(a: Shape, x: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0] * a[1]


def _addmv(bias: Shape, a: Shape, x: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0] * a[1]


def _dot(a: Shape, b: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0]


def _addbmm(bias: Shape, a: Shape, b: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0] * a[1] * a[2] * b[2]


def _cpu_flash(q: Shape, k: Shape, v: Shape, *args: Any, **kw: Any) -> int:
    return _sdpa(q, k, v)


def _addmm_act(bias: Shape, a: Shape, b: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0] * a[1] * b[1]


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, Tensor) else x


def _by_shape(formula: Callable[..., int]) -> Callable[..., int]:
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*map(_shape, args), **{k: _shape(v) for k, v in kwargs.items()})

    return count


def _ours() -> dict[Any, Callable[..., int]]:
    table: dict[str, Callable[..., int]] = {
        "_scaled_dot_product_flash_attention_for_cpu": _cpu_flash,
        "mkldnn_rnn_layer": _rnn_layer,
        "_native_multi_head_attention": _native_mha,
        "_transformer_encoder_layer_fwd": _encoder_layer,
        "mv": _mv,
        "addmv": _addmv,
        "dot": _dot,
        "vdot": _dot,
        "addbmm": _addbmm,
        "_addmm_activation": _addmm_act,
    }
    return {getattr(aten, n): _by_shape(f) for n, f in table.items() if hasattr(aten, n)}


#: overload packet -> formula(*args, out_val=..., **kwargs) -> FLOPs
FORMULAS: dict[Any, Callable[..., int]] = {**flop_registry, **_ours()}

#: Operators that do no arithmetic: creation, copies, layout, indexing, concatenation,
#: random numbers. Views are recognised from their schema.
_FREE = """
    _to_copy clone copy copy_ contiguous detach alias lift_fresh lift_fresh_copy _unsafe_view
    empty empty_like empty_strided new_empty new_empty_strided new_zeros new_ones new_full
    zeros zeros_like ones ones_like full full_like fill fill_ zero_ scalar_tensor arange
    linspace triu_indices tril_indices rand randn randint randperm normal_ uniform_ bernoulli_
    cat stack split split_with_sizes unsafe_split chunk unbind repeat tile flip roll narrow
    constant_pad_nd pad tril triu index index_select gather embedding slice_scatter
    select_scatter masked_fill masked_fill_ where resize_ set_ _local_scalar_dense item
    eq ne lt le gt ge logical_not logical_and logical_or argmax argmin any all nonzero sort topk
"""
FREE_OPS = frozenset(getattr(aten, n) for n in _FREE.split() if hasattr(aten, n))


@dataclass(frozen=True)
class _Op:
    formula: Callable[..., int] | None
    composite: bool  # has a decomposition into other operators
    uncounted: str | None  # its name if it does arithmetic but has no formula
    allocates: bool  # returns new tensors (not a view, not in place)


class Counter(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Reports every operator that runs while active.

    ``sink(flops, name)`` is called once per operator: ``name`` is None for an operator with
    a formula or one that does no arithmetic, else the operator's name (it has no formula).
    ``on_alloc``, if given, gets the bytes of every tensor an operator allocates (``+n``) and,
    when that tensor is freed, ``-n``: enough for an approximate peak of live memory.
    """

    def __init__(
        self,
        sink: Callable[[int, str | None], None],
        on_alloc: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self._sink = sink
        self._on_alloc = on_alloc
        self._ops: dict[Any, _Op] = {}  # what is known of each operator overload

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        op = self._ops.get(func) or self._learn(func)
        if op.composite:
            # Composite operators (linear, matmul, einsum, sdpa) reach a dispatch mode whole
            # when autograd is off (inference_mode): run their decomposition under this mode
            # so the operators they are made of are counted, as FlopCounterMode does.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        flops = 0 if op.formula is None else int(op.formula(*args, **kwargs, out_val=out))
        self._sink(flops, op.uncounted)
        if self._on_alloc is not None and op.allocates:
            self._track(out)
        return out

    def _learn(self, func: Any) -> _Op:
        packet = func.overloadpacket
        formula = FORMULAS.get(packet)
        free = func.is_view or packet in FREE_OPS
        composite = formula is None and torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), "CompositeImplicitAutograd"
        )
        op = _Op(
            formula=formula,
            composite=composite,
            uncounted=None if formula is not None or free else f"aten.{packet.__name__}",
            allocates=not func.is_view and not func._schema.is_mutable,
        )
        self._ops[func] = op
        return op

    def _track(self, out: Any) -> None:
        assert self._on_alloc is not None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor):
                n = t.untyped_storage().nbytes()
                self._on_alloc(n)
                weakref.finalize(t, self._on_alloc, -n)
