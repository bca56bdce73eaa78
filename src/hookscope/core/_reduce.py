"""The reductions ``reduce=`` names, one table with one meaning per name for every entry point
(``capture``, ``features``, ``FeatureExtractor``, ``extract``).

* ``"spatial_mean"``: ``(N, C, *spatial) -> (N, C)``, the mean over every dim after the second
  (a tensor of two dims or fewer is kept as it is);
* ``"token_mean"``: ``(N, T, *rest) -> (N, *rest)``, each sample's mean over its **real**
  tokens: those its token mask keeps. The mask is the forward's ``attention_mask`` (true or 1
  where a token counts), or the negation of ``src_key_padding_mask`` (true at padding), when
  it has the shape ``(N, T)`` of the tensor's first two dims; without one, every token counts
  (a plain mean over dim 1). This is sentence-transformers' mean pooling, and what a padded
  batch needs: padding never moves a sample's mean. A tensor of two dims or fewer is kept;
* ``"batch_mean"``: the mean over dim 0 (one row for the batch; refused by ``extract``, whose
  stores keep one row per sample).

Built-in reductions keep integer and boolean tensors (token ids, masks) as they are. A
function given instead is called as ``fn(tensor)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import Tensor

from ..errors import UsageError

__all__ = ["REDUCERS", "check_reduce", "keep_mask", "reduce_tensor", "token_mean"]


def _spatial_mean(t: Tensor, mask: Tensor | None) -> Tensor:
    return t.mean(dim=tuple(range(2, t.ndim))) if t.ndim > 2 else t


def token_mean(t: Tensor, mask: Tensor | None) -> Tensor:
    """``(N, T, ...) -> (N, ...)``: each sample's mean over the tokens ``mask`` keeps (all of
    them when ``mask`` is None or not of shape ``(N, T)``)."""
    if t.ndim <= 2:
        return t
    if mask is None or tuple(mask.shape) != tuple(t.shape[:2]):
        return t.mean(dim=1)
    m = mask.to(t.dtype).reshape(*mask.shape, *([1] * (t.ndim - 2)))
    return (t * m).sum(1) / m.sum(1).clamp(min=1e-9)


def _batch_mean(t: Tensor, mask: Tensor | None) -> Tensor:
    if t.is_nested:
        raise UsageError(
            "reduce='batch_mean' of a nested tensor: its samples have different lengths, so "
            "they have no mean over the batch; use 'token_mean' (each sample's mean) or a "
            "function"
        )
    return t.mean(dim=0) if t.ndim > 0 else t


#: name -> ``fn(tensor, token mask or None)``
REDUCERS: dict[str, Callable[[Tensor, Tensor | None], Tensor]] = {
    "spatial_mean": _spatial_mean,
    "token_mean": token_mean,
    "batch_mean": _batch_mean,
}


def reduce_tensor(reduce: Any, t: Tensor, mask: Tensor | None = None) -> Any:
    """``t`` reduced by a name of :data:`REDUCERS` (integer tensors kept) or a function."""
    if isinstance(reduce, str):
        if not (t.is_floating_point() or t.is_complex()):
            return t
        return REDUCERS[reduce](t, mask)
    return reduce(t)


def keep_mask(inputs: Any) -> Tensor | None:
    """``(N, T)``, true where a token counts, from a forward's inputs (a mapping of argument
    names): a tokenizer's ``attention_mask``, or the negation of ``TransformerEncoder``'s
    ``src_key_padding_mask`` (true at padding). None when there is neither."""
    if not isinstance(inputs, Mapping):
        return None
    mask = inputs.get("attention_mask")
    if isinstance(mask, Tensor) and mask.dim() == 2:
        return mask.bool()
    padding = inputs.get("src_key_padding_mask")
    if isinstance(padding, Tensor) and padding.dim() == 2:
        return ~padding.bool()
    return None


def check_reduce(reduce: Any) -> None:
    """Refuse a ``reduce=`` that is neither a name of :data:`REDUCERS` nor a function."""
    if isinstance(reduce, str) and reduce not in REDUCERS:
        raise UsageError(f"reduce={reduce!r}: use one of {sorted(REDUCERS)} or a function")
    if reduce is not None and not isinstance(reduce, str) and not callable(reduce):
        raise UsageError(f"reduce must be a name or a function Tensor -> Tensor, not {reduce!r}")
