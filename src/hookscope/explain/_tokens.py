"""Text: token ids as the explained input, and token-level maps.

An image or signal is the inputs' first floating-point tensor (``_base.image_of``). A text
model's inputs hold none: its token ids ``(N, T)`` are then what layer integrated gradients,
occlusion and feature ablation explain (baselines are token ids too, e.g. the padding id),
and a layer's output ``(N, T, ...)`` becomes a map over the T tokens, ``(N, T)``, with one
value per token (the sum over its features).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import Tensor

from ..core import leaves
from ..errors import UsageError
from ._base import image_of
from ._layout import Grid, _custom

__all__ = ["explained", "is_ids", "token_grid"]


def is_ids(t: Tensor) -> bool:
    """Token ids ``(N, T)``, not an image: an integer tensor."""
    return not t.is_floating_point()


def explained(x: Any) -> Tensor:
    """The tensor a method explains: the image (or signal, or embeddings) as ``image_of``
    finds it, else the first integer tensor ``(N, T)`` of the inputs: token ids."""
    floats = any(t.is_floating_point() for _, t in leaves(x))
    if floats:
        return image_of(x)
    ids = next((t for _, t in leaves(x) if t.dim() == 2 and not t.is_complex()), None)
    if ids is None:
        raise UsageError(
            "the inputs hold neither a floating-point tensor (an image (N, C, H, W), a signal "
            "or embeddings) nor token ids (N, T) to explain"
        )
    if ids.shape[0] == 0:
        raise UsageError(f"the batch is empty (shape {tuple(ids.shape)}): give at least one text")
    return ids


def token_grid(
    shape: tuple[int, ...], layer: str, tokens: int, reshape: Callable[[Tensor], Tensor] | None
) -> Grid:
    """A layer's output ``(N, T, ...)`` for ``T`` input tokens as maps ``(N, C, 1, T)``.

    Raises:
        UsageError: the output's second dimension is not the tokens.
    """
    if reshape is not None:
        return _custom(reshape, line=True)
    if len(shape) < 2 or shape[1] != tokens:
        raise UsageError(
            f"layer {layer!r} returns shape {tuple(shape)} for {tokens} input tokens: a token "
            "map needs (N, tokens, ...) outputs. Pick a layer over the tokens (embeddings, an "
            "encoder layer) or pass reshape= (a function returning (N, C, tokens))"
        )

    def place(t: Tensor) -> Tensor:
        return t.reshape(t.shape[0], t.shape[1], -1).transpose(1, 2)[:, :, None]

    return Grid(f"tokens ({tokens})", place, 2, line=True)
