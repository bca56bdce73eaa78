"""The report's interpretability sections: a patching grid as a heatmap (an HTML table whose
cells carry their values, coloured on a scale that diverges at 0) and the logit lens as a
table of the likeliest tokens per layer and position.

Tables rather than images: every number stays readable, selectable and exact (each cell's
``data-value`` is the metric as Python prints the float), the token labels are text, and a
wide grid scrolls inside its box on a phone instead of shrinking."""

from __future__ import annotations

import html
import itertools
import math
import textwrap
from collections.abc import Sequence
from typing import Any

import torch

from .._extras import require
from .._labels import decoder, position_labels
from ..errors import UsageError
from ..explain import Lens, Patching

__all__ = [
    "NAN_COLOUR",
    "NEGATIVE",
    "POSITIVE",
    "cell_colour",
    "interp_sections",
    "lens_html",
    "patching_html",
    "patching_png",
]

#: The diverging scale (ColorBrewer RdBu's ends): the largest |value| of a grid gets the full
#: colour of its sign, 0 is white, and the colours in between are linear in the value.
POSITIVE, NEGATIVE = (178, 24, 43), (33, 102, 172)
NAN_COLOUR = (208, 213, 222)  # a cell whose metric is not finite
_WHITE = (255, 255, 255)
_CSS = (
    "<style>table.heat td { text-align: right; font-variant-numeric: tabular-nums; "
    "min-width: 3.2em; } table.heat td.dark { color: #fff; } "
    ".scale { height: 0.9em; width: 16em; display: inline-block; vertical-align: middle; "
    "border: 1px solid #d0d5de; }</style>"
)


def cell_colour(value: float, largest: float) -> tuple[int, int, int]:
    """The RGB colour of ``value`` on a grid whose largest ``|value|`` is ``largest``."""
    if not math.isfinite(value):
        return NAN_COLOUR
    if largest <= 0:
        return _WHITE
    end = POSITIVE if value > 0 else NEGATIVE
    t = min(abs(value) / largest, 1.0)
    r, g, b = (round(w + (e - w) * t) for w, e in zip(_WHITE, end, strict=True))
    return r, g, b


def _hex(rgb: tuple[int, int, int]) -> str:
    return "#{:02x}{:02x}{:02x}".format(*rgb)


def _dark(rgb: tuple[int, int, int]) -> bool:
    return 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2] < 140


def _head(corner: str, labels: Sequence[str]) -> str:
    cells = "".join(f'<th scope="col">{html.escape(c)}</th>' for c in labels)
    return f'<thead><tr><th scope="col">{html.escape(corner)}</th>{cells}</tr></thead>'


def _heatmap(grid: Patching, tokens: Sequence[str] | None) -> str:
    values = grid.values.double()
    finite = values[values.isfinite()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    rows = []
    for i, layer in enumerate(grid.layers):
        for k, head in enumerate(grid.heads or [None]):
            name = layer if head is None else f"{layer} head {head}"
            cells = []
            for j, position in enumerate(grid.positions):
                value = float(values[i, j] if head is None else values[i, j, k])
                rgb = cell_colour(value, largest)
                dark = ' class="dark"' if _dark(rgb) else ""
                head_attr = "" if head is None else f' data-head="{head}"'
                cells.append(
                    f'<td{dark} style="background:{_hex(rgb)}" data-layer="{html.escape(layer)}"'
                    f' data-position="{position}"{head_attr} data-value="{value!r}"'
                    f' title="{html.escape(name)}, position {position}: {value!r}">'
                    f"{value:.3g}</td>"
                )
            rows.append(f'<tr><th scope="row">{html.escape(name)}</th>{"".join(cells)}</tr>')
    corner = "layer, head \\ position" if grid.heads else "layer \\ position"
    table = f'<table class="heat">{_head(corner, position_labels(grid.positions, tokens))}'
    scale = (
        f'<span class="scale" style="background:linear-gradient(to right, '
        f'{_hex(NEGATIVE)}, #ffffff, {_hex(POSITIVE)})"></span>'
    )
    legend = (
        f'<p class="muted">colour: {-largest:.3g} {scale} {largest:.3g} (0 is white; '
        "grey: not finite)</p>"
    )
    return f'<div class="scroll">{table}<tbody>{"".join(rows)}</tbody></table></div>{legend}'


def patching_html(grids: Patching | Sequence[Patching], tokens: Sequence[str] | None) -> str:
    """The body of the patching section: a heatmap per grid."""
    grids = [grids] if isinstance(grids, Patching) else list(grids)
    if not grids or not all(isinstance(g, Patching) for g in grids):
        raise UsageError("patching must be a Patching (what hs.patching returns) or a list of them")
    out = [
        "<p>Each cell is the metric of the corrupted run with that layer's output at that "
        "position (and head) patched from the clean run (<code>hs.patching</code>). Rows are "
        "layers in the grid's order, columns positions; the colours diverge at 0 on each "
        "grid's own scale.</p>",
        _CSS,
    ]
    for n, grid in enumerate(grids):
        shape = " x ".join(str(s) for s in grid.values.shape)
        axes = "layers x positions x heads" if grid.heads else "layers x positions"
        out.append(f"<h3>Grid {n + 1}: {axes} ({shape})</h3>{_heatmap(grid, tokens)}")
    return "\n".join(out)


def _rows(grid: Patching) -> tuple[list[str], Any]:
    """The grid's row labels and its values as rows (layers, or layers x heads) x positions."""
    if not grid.heads:
        return list(grid.layers), grid.values.double()
    names = [f"{layer} head {h}" for layer in grid.layers for h in grid.heads]
    return names, grid.values.double().permute(0, 2, 1).flatten(0, 1)


def patching_png(grid: Patching, tokens: Sequence[str] | None, title: str) -> bytes:
    """The grid as a PNG heatmap (matplotlib): the same colours as the HTML one (the scale
    diverging at 0, grey where not finite), every row and column labelled, a colour bar, and
    each cell's value written in it when the grid has at most 400 cells."""
    from ._plots import _png, _pyplot

    plt = _pyplot()
    colors = require("matplotlib.colors", "plots", purpose="a PNG heatmap")
    names, values = _rows(grid)
    finite = values[values.isfinite()]
    largest = float(finite.abs().max()) if finite.numel() else 0.0
    ends = [tuple(c / 255 for c in rgb) for rgb in (NEGATIVE, _WHITE, POSITIVE)]
    cmap = colors.LinearSegmentedColormap.from_list("hookscope_diverging", ends)
    cmap = cmap.with_extremes(bad=tuple(c / 255 for c in NAN_COLOUR))
    labels = position_labels(grid.positions, tokens)
    width = min(2.5 + 0.5 * len(labels) + 0.06 * max(map(len, names)), 24)
    fig, ax = plt.subplots(figsize=(width, min(1.6 + 0.32 * len(names), 24)))
    span = largest or 1.0
    image = ax.imshow(values.numpy(), cmap=cmap, vmin=-span, vmax=span, aspect="auto")
    ax.set_xticks(range(len(labels)), labels, rotation=90, fontsize=8)
    ax.set_yticks(range(len(names)), names, fontsize=8)
    ax.set_xlabel("position (token)", fontsize=9)
    ax.set_title(textwrap.fill(title, int(width * 9)), fontsize=9, loc="left")
    fig.colorbar(image, ax=ax, label="metric (0 is white)")
    if values.numel() <= 400:
        for i, j in itertools.product(range(values.shape[0]), range(values.shape[1])):
            v = float(values[i, j])
            colour = "white" if _dark(cell_colour(v, largest)) else "black"
            ax.text(j, i, f"{v:.2g}", ha="center", va="center", fontsize=7, color=colour)
    fig.tight_layout()
    return _png(plt, fig)


def lens_html(lens: Lens, tokens: Sequence[str] | None, tokenizer: Any, k: int = 3) -> str:
    """The body of the logit-lens section: for the first sample, a row per layer and a column
    per position, each cell the ``k`` likeliest tokens with their probabilities (the first
    one's shading its probability)."""
    if not isinstance(lens, Lens):
        raise UsageError(f"lens must be what hs.logit_lens returns, not {type(lens).__name__}")
    decode = decoder(tokenizer)
    probs = torch.softmax(lens.logits[:, 0].double(), dim=-1)  # (layers, positions, vocab)
    top = probs.topk(min(k, probs.shape[-1]), dim=-1)
    rows = []
    for i, layer in enumerate(lens.layers):
        cells = []
        for j, position in enumerate(lens.positions):
            ids, ps = top.indices[i, j].tolist(), top.values[i, j].tolist()
            lines = "<br>".join(
                f"{html.escape(repr(decode(t)))} {p:.2f}" for t, p in zip(ids, ps, strict=True)
            )
            rgb = _hex(cell_colour(ps[0], 1.0))
            cells.append(
                f'<td style="background:{rgb}" data-layer="{html.escape(layer)}" '
                f'data-position="{position}" data-tokens="{" ".join(map(str, ids))}">{lines}</td>'
            )
        rows.append(f'<tr><th scope="row">{html.escape(layer)}</th>{"".join(cells)}</tr>')
    n = lens.logits.shape[1]
    which = "the sample" if n == 1 else f"sample 0 of {n}"
    text = (
        f"<p>Each layer's residual stream through the final norm and the unembedding "
        f"(<code>hs.logit_lens</code>), {which}: the {k} likeliest tokens at each position "
        "with their probabilities (softmax over the vocabulary); the shading is the first "
        "one's.</p>"
    )
    head = _head("layer \\ position", position_labels(lens.positions, tokens))
    table = f'<table class="heat">{head}<tbody>{"".join(rows)}</tbody></table>'
    return f'{text}{_CSS}<div class="scroll">{table}</div>'


def interp_sections(
    patching: Patching | Sequence[Patching] | None,
    lens: Lens | None,
    tokens: Sequence[str] | None,
    tokenizer: Any,
) -> list[tuple[str, str, str]]:
    """The report's sections for what it was given."""
    parts = []
    if patching is not None:
        parts.append(("patching", "Activation patching", patching_html(patching, tokens)))
    if lens is not None:
        parts.append(("lens", "Logit lens", lens_html(lens, tokens, tokenizer)))
    return parts
