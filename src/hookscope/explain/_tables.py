"""Plain-text tables of a patching grid and of the logit lens, for the terminal
(``Patching.to_text``, ``Lens.to_text``). The HTML of the same tables is the report's
(``hookscope.show``)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from .._labels import decoder, position_labels
from ..errors import UsageError

__all__ = ["grid_text", "lens_text"]


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Columns right-aligned but the first, each as wide as its widest cell."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: Sequence[str]) -> str:
        padded = [c.rjust(w) for c, w in zip(cells, widths, strict=True)]
        return "  ".join([cells[0].ljust(widths[0]), *padded[1:]])

    return "\n".join([line(header), *(line(r) for r in rows)])


def grid_text(
    values: Tensor,
    layers: Sequence[str],
    positions: Sequence[int],
    heads: Sequence[int],
    tokens: Sequence[str] | None,
) -> str:
    """A row per layer (per layer and head), a column per position: the metric of each cell."""
    labels = position_labels(positions, tokens)
    rows = []
    for i, layer in enumerate(layers):
        for k, head in enumerate(heads or [None]):
            cells = values[i] if head is None else values[i, :, k]
            name = layer if head is None else f"{layer} head {head}"
            rows.append([name, *(_number(float(v)) for v in cells)])
    what = "layer, head" if heads else "layer"
    return _table([f"{what} \\ position", *labels], rows)


def lens_text(
    logits: Tensor,
    layers: Sequence[str],
    positions: Sequence[int],
    *,
    tokenizer: Any,
    tokens: Sequence[str] | None,
    k: int,
    sample: int,
) -> str:
    """A row per layer, a column per position: the ``k`` likeliest tokens and their
    probabilities (softmax over the vocabulary) for one sample."""
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise UsageError(f"k must be an int >= 1, not {k!r}")
    if isinstance(sample, bool) or not isinstance(sample, int) or not 0 <= sample < logits.shape[1]:
        raise UsageError(
            f"sample must be an index of the {logits.shape[1]} samples, not {sample!r}"
        )
    decode = decoder(tokenizer)
    probs = torch.softmax(logits[:, sample].float(), dim=-1)
    top = probs.topk(min(k, probs.shape[-1]), dim=-1)
    rows = []
    for i, layer in enumerate(layers):
        cells = [
            ", ".join(
                f"{decode(int(t))!r} {float(p):.2f}"
                for p, t in zip(top.values[i, j], top.indices[i, j], strict=True)
            )
            for j in range(len(positions))
        ]
        rows.append([layer, *cells])
    return _table(["layer \\ position", *position_labels(positions, tokens)], rows)
