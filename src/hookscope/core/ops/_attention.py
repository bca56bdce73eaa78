"""Attention weights of ``F.scaled_dot_product_attention`` calls: ``"layer::attention_weights"``.

Fused attention kernels never materialise the probabilities ``softmax(Q Kᵀ · scale + mask)``,
which is why Hugging Face refuses ``output_attentions=True`` with SDPA. hookscope keeps the
fused call and computes them from the call's own arguments (query, key, mask, scale,
``is_causal``, ``enable_gqa``), as the SDPA documentation's reference implementation does:

* a capture stores the call's inputs and computes the probabilities when they are read
  (:func:`probabilities`); their gradient is ``dL/dO · Vᵀ``, from the gradient of the call's
  output ``O = P V`` (it needs no change to the forward);
* an edit replaces that one call by the explicit computation (:func:`explicit`), with the
  edited probabilities in the middle: ``edit(P) @ V`` (dropout, when the call has
  ``dropout_p > 0``, is applied after the edit, as eager attention does).

With ``dropout_p > 0`` (training) the probabilities are those before dropout: the fused
kernel's random mask cannot be observed.

**Packed grouped-query heads.** To decode one token with grouped-query attention and a mask
(every decoding step of a sliding-window model), Hugging Face transformers reshapes the query
``(B, H, 1, D)`` into ``(B, H/g, g, D)``, its ``g = module.num_key_value_groups`` heads per
key/value head in the query-length axis, so that SDPA needs no repeated keys; it undoes this
after the call. The weights are returned and edited in eager attention's layout,
``(B, H, 1, S)`` (:func:`packed_groups`, :func:`unpack`): an edit of head ``h`` addresses
head ``h``.

Sessions stack (see ``_watch``): the explicit computation is itself a call named
``scaled_dot_product_attention`` that sessions below the edit see, and a capture opened after
an edit records the edited probabilities (:data:`_WAITING`), one opened before the unedited.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.overrides import handle_torch_function, has_torch_function

__all__ = [
    "CHAIN",
    "WAITING",
    "Chain",
    "attention_args",
    "chain_of",
    "explicit",
    "pack",
    "packed_groups",
    "packed_rows",
    "probabilities",
    "unpack",
    "weights_grad",
]

#: attribute of an explicit SDPA function: the edits it applies, lowest session first
CHAIN = "__hookscope_chain__"
#: per stage of the chain: the edit, and the captures above it waiting for its result
Chain = list[tuple[Callable[[Tensor], Tensor], list[list[Tensor]]]]
#: captures of attention weights running an SDPA call now (outermost first): each appends a
#: slot that the edits below it fill with the probabilities they produce
WAITING: list[list[Tensor]] = []


def _repeat(t: Tensor, heads: int) -> Tensor:
    """Key or value heads repeated for grouped-query attention (``enable_gqa=True``)."""
    return t.repeat_interleave(heads // t.size(-3), dim=-3)


def _heads(module: nn.Module) -> int | None:
    """The number of query heads a transformers attention module declares, if it does."""
    for owner, attr in (
        (getattr(module, "config", None), "num_attention_heads"),
        (module, "num_heads"),
        (module, "num_attention_heads"),
    ):
        value = getattr(owner, attr, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def packed_groups(module: nn.Module, query: Tensor, key: Tensor) -> int:
    """How many query heads per key/value head transformers packed into the query-length
    axis of this SDPA call of ``module`` (1: none; see the module docstring).

    A packed call has as many query heads as key heads, ``H / g``, and ``g`` queries, where
    ``g = module.num_key_value_groups > 1`` and ``H`` the module's head count: no other of
    transformers' paths gives the query ``H / g`` heads (repeated keys give both ``H``,
    SDPA's ``enable_gqa`` gives the query ``H``).
    """
    if key.dim() < 3 or query.dim() < 3 or query.size(-3) != key.size(-3):
        return 1
    return packed_rows(module, query)


def packed_rows(module: nn.Module, t: Tensor) -> int:
    """:func:`packed_groups` of a call from its query alone, or from its output or the
    gradient w.r.t. it (both of the query's shape): ``g`` where ``t`` is ``(..., H/g, g, D)``
    for ``g = module.num_key_value_groups > 1`` and ``H`` the module's head count, else 1."""
    groups = getattr(module, "num_key_value_groups", None)
    if not isinstance(groups, int) or isinstance(groups, bool) or groups <= 1:
        return 1
    if t.dim() < 3 or t.size(-2) != groups or _heads(module) != t.size(-3) * groups:
        return 1
    return groups


def unpack(weights: Tensor, groups: int) -> Tensor:
    """Weights (or their gradient) of a packed call, ``(..., H/g, g, S)``, in eager
    attention's layout ``(..., H, 1, S)``: head ``k·g + r`` is row ``r`` of key head ``k``.
    The same for the call's query and output ``(..., H/g, g, D)`` (``S`` is then ``D``)."""
    if groups == 1:
        return weights
    *batch, kv_heads, rows, keys = weights.shape
    return weights.reshape(*batch, kv_heads * rows, 1, keys)


def pack(weights: Tensor, groups: int) -> Tensor:
    """The inverse of :func:`unpack`: back in the packed call's layout."""
    if groups == 1:
        return weights
    *batch, heads, _, keys = weights.shape
    return weights.reshape(*batch, heads // groups, groups, keys)


def attention_args(bound: dict[str, Any]) -> dict[str, Any]:
    """The arguments of :func:`probabilities` among an SDPA call's bound arguments."""
    keys = ("query", "key", "attn_mask", "is_causal", "scale", "enable_gqa")
    return {k: bound[k] for k in keys if k in bound}


def probabilities(
    query: Tensor,
    key: Tensor,
    attn_mask: Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor:
    """``softmax(Q Kᵀ · scale + mask)`` of an SDPA call, shape ``(..., heads, L, S)``.

    Masks as SDPA takes them: boolean (True = attend) or float (added), broadcast;
    ``is_causal`` keeps the lower triangle aligned to the top left. A row whose keys are all
    masked is zeros, as SDPA's own kernels return it, rather than NaN.
    """
    if enable_gqa:
        key = _repeat(key, query.size(-3))
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = query @ key.transpose(-2, -1) * factor
    if is_causal:
        size = (query.size(-2), key.size(-2))
        keep = torch.ones(size, dtype=torch.bool, device=query.device).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, -math.inf)
        else:
            scores = scores + attn_mask
    if attn_mask is None:  # the causal triangle leaves every row a key: no row is masked
        return scores.softmax(dim=-1)
    # A row with no key: softmax of all -inf is NaN, and its backward sends NaN through an
    # added float mask to the query and every key even after the row is zeroed. Give the
    # softmax finite scores there, then zero the row: zeros and zero gradients, as SDPA's
    # math kernel gives.
    dead = scores.isneginf().all(dim=-1, keepdim=True)
    return scores.masked_fill(dead, 0.0).softmax(dim=-1).masked_fill(dead, 0.0)


def weights_grad(value: Tensor, heads: int | None, grad_out: Tensor) -> Tensor:
    """``dL/dP = dL/dO · Vᵀ`` for ``O = P V``: the gradient of the probabilities (``heads``:
    the query's heads, to repeat the value's for grouped-query attention)."""
    if heads is not None:
        value = _repeat(value, heads)
    return grad_out @ value.transpose(-2, -1)


def explicit(chain: Chain, module: nn.Module) -> Callable[..., Tensor]:
    """An SDPA function computing ``dropout(edits(P)) @ V`` explicitly for a call made by
    ``module``'s code; ``chain``'s edits apply in order (the session opened first first), in
    eager attention's layout (:func:`unpack`), each filling the slots of the captures waiting
    above it."""

    def scaled_dot_product_attention(
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attn_mask: Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> Tensor:
        if has_torch_function((query, key, value)):  # sessions below see it as the SDPA call
            out: Tensor = handle_torch_function(
                scaled_dot_product_attention,
                (query, key, value),
                query,
                key,
                value,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
            return out
        groups = packed_groups(module, query, key)
        probs = unpack(probabilities(query, key, attn_mask, is_causal, scale, enable_gqa), groups)
        for edit, waiting in chain:
            probs = edit(probs)
            for slot in waiting:
                slot[:] = [probs]
        probs = pack(probs, groups)
        if dropout_p > 0:
            probs = torch.dropout(probs, dropout_p, True)
        return probs @ (_repeat(value, query.size(-3)) if enable_gqa else value)

    setattr(scaled_dot_product_attention, CHAIN, chain)
    return scaled_dot_product_attention


def chain_of(func: Any) -> Chain:
    """The edits an explicit SDPA function already applies (none for the real SDPA)."""
    found: Chain = getattr(func, CHAIN, [])
    return found
