"""FLOP formulas per aten operator: PyTorch's registry plus the operators it lacks or gets
wrong, and nested (ragged) tensors counted per component.

PyTorch's ``torch.utils.flop_counter.flop_registry`` covers matrix products, convolutions
and the attention kernels. Added here: the CPU flash-attention kernel behind
``scaled_dot_product_attention`` (pytorch/pytorch#195460), the MKL-DNN LSTM layer, the fused
``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` fast paths, matrix-vector
products, and every attention kernel again with grouped-query attention (fewer key/value
heads than query heads: the CUDA kernels take K and V unexpanded; torch < 2.13 asserts
equal heads) and each kernel's own layout (``_flash_attention_forward`` and
``_efficient_attention_forward`` take ``(batch, seq, heads, dim)``, the registry reads them
as ``(batch, heads, seq, dim)``).

Every formula takes the operator's arguments (tensors or their shapes) and ``out_val``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.flop_counter import conv_flop_count, flop_registry

from ..core import _torch

__all__ = ["FORMULAS", "nested_flops"]

aten = torch.ops.aten
Shape = Sequence[int]
Formula = Callable[..., int]


def _attention(b_h: int, s_q: int, s_k: int, d: int, d_v: int) -> int:
    """Q @ K^T and A @ V for ``b_h`` (batch x query heads) independent heads."""
    return int(2 * b_h * s_q * s_k * (d + d_v))


def _bhsd(q: Shape, k: Shape, v: Shape, *args: Any, **kw: Any) -> int:
    """``(batch..., heads, seq, dim)`` kernels; K/V heads may be fewer (grouped queries)."""
    return _attention(math.prod(q[:-2]), q[-2], k[-2], q[-1], v[-1])


def _bshd(q: Shape, k: Shape, v: Shape) -> int:
    """``(batch, seq, heads, dim)``: the layout of the raw flash / efficient kernels."""
    return _attention(q[0] * q[2], q[1], k[1], q[3], v[3])


def _lengths(offsets: Tensor | None, bound: Any, count: int) -> list[int]:
    """Per-sequence lengths from cumulative offsets; where the values are unknown (meta or
    fake tensors), ``bound`` (the kernel's max length) for each, as PyTorch does."""
    if offsets is None:
        return []
    if offsets.device.type == "meta" or type(offsets) is not Tensor:
        return [int(bound)] * count
    return [int(n) for n in offsets.diff().tolist()]  # a host sync on CUDA


def _varlen(q: Tensor, k: Tensor, v: Tensor, cq: Tensor, ck: Tensor, mq: Any, mk: Any) -> int:
    """Packed sequences: ``(total, heads, dim)`` with offsets (a leading 1 is allowed)."""
    n = cq.shape[0] - 1
    heads, d, d_v = q.shape[-2], q.shape[-1], v.shape[-1]
    pairs = zip(_lengths(cq, mq, n), _lengths(ck, mk, n), strict=True)
    return sum(_attention(heads, lq, lk, d, d_v) for lq, lk in pairs)


def _flash_forward(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cq: Any,
    ck: Any,
    mq: Any,
    mk: Any,
    *args: Any,
    out_val: Any = None,
    **kw: Any,
) -> int:
    if cq is not None:
        return _varlen(q, k, v, cq, ck, mq, mk)
    return _bshd(tuple(q.shape), tuple(k.shape), tuple(v.shape))


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, bias: Any, *args: Any, **kw: Any) -> int:
    """The flash kernel's count: the efficient kernel's arguments are the same but for an
    attention bias after V (adding it is not counted)."""
    return _flash_forward(q, k, v, *args, **kw)


def _projections(b: int, s_q: int, s_k: int, e: int, qkv_rows: int) -> int:
    """Input projections (``qkv_rows`` token rows, E x E each), attention, output projection."""
    return 2 * qkv_rows * e * e + _attention(b, s_q, s_k, e, e) + 2 * b * s_q * e * e


def _native_mha(q: Shape, k: Shape, v: Shape, embed_dim: int, *args: Any, **kw: Any) -> int:
    b, s_q, s_k = q[0], q[-2], k[-2]
    return _projections(b, s_q, s_k, embed_dim, b * (s_q + 2 * s_k))


def _encoder_layer(src: Shape, embed_dim: int, *args: Any, **kw: Any) -> int:
    ffn_1 = args[12] if len(args) > 12 else kw["ffn_weight_1"]
    b, s = src[0], src[-2]
    ffn = int(2 * 2 * b * s * ffn_1[0] * ffn_1[1])  # two linears, E x F each
    return _projections(b, s, s, embed_dim, 3 * b * s) + ffn


def _linear(x: Shape, w: Shape, *args: Any, **kw: Any) -> int:
    return 2 * math.prod(x[:-1]) * w[0] * w[1]


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


def _addmm_act(bias: Shape, a: Shape, b: Shape, *args: Any, **kw: Any) -> int:
    return 2 * a[0] * a[1] * b[1]


def _shape(x: Any) -> Any:
    return tuple(x.shape) if isinstance(x, Tensor) else x


def _by_shape(formula: Formula) -> Formula:
    def count(*args: Any, out_val: Any = None, **kwargs: Any) -> int:
        return formula(*map(_shape, args), **{k: _shape(v) for k, v in kwargs.items()})

    return count


# The operators of nearly every model, read straight from the tensors (the registry's
# formulas first map every argument and the output through pytree): same counts, a
# fraction of the cost per call. tests/test_summary_flops.py holds them to the registry.
def _mm(a: Any, b: Any, *args: Any, **kw: Any) -> int:
    (m, k), n = _shape(a), _shape(b)[1]
    return int(2 * m * k * n)


def _addmm(bias: Any, a: Any, b: Any, *args: Any, **kw: Any) -> int:
    return _mm(a, b)


def _bmm(a: Any, b: Any, *args: Any, **kw: Any) -> int:
    (batch, m, k), n = _shape(a), _shape(b)[2]
    return int(2 * batch * m * k * n)


def _baddbmm(bias: Any, a: Any, b: Any, *args: Any, **kw: Any) -> int:
    return _bmm(a, b)


def _convolution(
    x: Any,
    w: Any,
    bias: Any,
    stride: Any,
    padding: Any,
    dilation: Any,
    transposed: bool,
    *args: Any,
    out_val: Any = None,
    **kw: Any,
) -> int:
    return int(conv_flop_count(_shape(x), _shape(w), _shape(out_val), transposed=transposed))


_FAST: dict[str, Formula] = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "baddbmm": _baddbmm,
    "convolution": _convolution,
}
_BY_SHAPE: dict[str, Formula] = {
    "_scaled_dot_product_flash_attention_for_cpu": _bhsd,
    "_scaled_dot_product_flash_attention": _bhsd,
    "_scaled_dot_product_efficient_attention": _bhsd,
    "_scaled_dot_product_cudnn_attention": _bhsd,
    "_scaled_dot_product_fused_attention_overrideable": _bhsd,
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
_RAW: dict[str, Formula] = {  # take the tensors: they read offsets
    "_flash_attention_forward": _flash_forward,
    "_efficient_attention_forward": _efficient_forward,
}


def _ours() -> dict[Any, Formula]:
    table = {n: _by_shape(f) for n, f in _BY_SHAPE.items()}
    table.update(_RAW)
    table.update(_FAST)
    return {getattr(aten, n): f for n, f in table.items() if hasattr(aten, n)}


#: overload packet -> formula(*args, out_val=..., **kwargs) -> FLOPs
FORMULAS: dict[Any, Formula] = {**flop_registry, **_ours()}
#: composite operators that reach a dispatch mode whole for nested tensors (their nested
#: kernels are explicit): counted per component
_NESTED_ONLY: dict[Any, Formula] = {aten.linear: _by_shape(_linear)}


# -- nested tensors ----------------------------------------------------------------------------


def _components(t: Tensor) -> list[tuple[int, ...]]:
    return [(1, *s) for s in _torch.nested_sizes(t)]


def _per_component(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Iterator[tuple[Any, Any]]:
    """The call once per component, nested tensors replaced by one component's shape
    (with a batch of 1): matrix products and attention never mix components."""
    found: dict[int, list[tuple[int, ...]]] = {}

    def nested(x: Any) -> bool:
        return isinstance(x, Tensor) and x.is_nested

    for x in (*args, *kwargs.values()):
        if nested(x):
            found[id(x)] = _components(x)
    counts = {len(c) for c in found.values()}
    if len(counts) != 1:
        raise ValueError("nested arguments with different numbers of components")

    def pick(x: Any, i: int) -> Any:
        return found[id(x)][i] if nested(x) else _shape(x)

    for i in range(counts.pop()):
        yield tuple(pick(a, i) for a in args), {k: pick(v, i) for k, v in kwargs.items()}


def nested_flops(packet: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """FLOPs of an operator called with nested tensors, summed over components; None if no
    formula applies (the operator is then listed as uncounted)."""
    formula = FORMULAS.get(packet) or _NESTED_ONLY.get(packet)
    if formula is None or packet in _torch.FUSED_ATTENTION:
        return None
    return sum(int(formula(*a, **k)) for a, k in _per_component(args, kwargs))
