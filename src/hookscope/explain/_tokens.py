"""Text: token ids as the explained input, and token-level maps.

An image or signal is the inputs' first floating-point tensor (``_base.image_of``). A text
model's inputs hold none: its token ids ``(N, T)`` are then what layer integrated gradients,
occlusion and feature ablation explain (baselines are token ids too, e.g. the padding id),
and a layer's output ``(N, T, ...)`` becomes a map over the T tokens, ``(N, T)``, with one
value per token (the sum over its features). Embeddings given as ``inputs_embeds=`` (Hugging
Face's name) are over tokens too: the path methods scale them, and layer maps are per token.
Tabular features ``(N, F)`` have no positions: their methods' maps are the attributions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor

from ..core import leaves
from ..errors import UsageError
from ._base import image_of
from ._layout import Grid, _custom

__all__ = ["explained", "is_table", "is_tokens", "token_grid"]


def is_tokens(x: Any, t: Tensor) -> bool:
    """The explained tensor ``t`` of inputs ``x`` is over tokens: token ids (an integer
    tensor), or embeddings given as Hugging Face's ``inputs_embeds=`` (``(N, T, D)``)."""
    return _integers(t) or (isinstance(x, Mapping) and x.get("inputs_embeds") is t)


def explained(x: Any) -> Tensor:
    """The tensor a method explains: the first floating-point tensor of 3 or more dimensions
    (an image, a signal, embeddings; checked as ``image_of`` checks it), else the first
    integer tensor ``(N, T)`` (token ids: a float padding mask beside them is an input), else
    the first floating-point ``(N, F)`` (tabular features)."""
    found = list(leaves(x))
    image = next((t for _, t in found if t.is_floating_point() and t.dim() >= 3), None)
    ids = next((t for _, t in found if _integers(t) and t.dim() == 2), None)
    table = next((t for _, t in found if t.is_floating_point() and t.dim() == 2), None)
    flat = ids if ids is not None else table
    if image is not None or flat is None:
        return image_of(image if image is not None else x)
    if flat.shape[0] == 0:
        raise UsageError(
            f"the batch is empty (shape {tuple(flat.shape)}): give at least one sample"
        )
    return flat


def is_table(t: Tensor) -> bool:
    """Features ``(N, F)`` without positions: attributions are the maps themselves."""
    return t.dim() == 2 and t.is_floating_point()


def _integers(t: Tensor) -> bool:
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


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
