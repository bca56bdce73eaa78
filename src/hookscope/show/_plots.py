"""Figures for the report, drawn with matplotlib (the ``plots`` extra) as PNG bytes (dpi 100: a
few KiB each, cheap to embed).

Layers are categories, not a series: each layer is one row (its name and type on the y axis,
every row labelled, in execution order from the top), values are points or bars along x,
and every axis says what it measures.
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._extras import require

__all__ = ["Panel", "colour_scale", "layer_plot"]

_PURPOSE = "plots in the HTML report"


@dataclass(frozen=True)
class Panel:
    """One panel: ``series`` maps a legend label to one value per layer, drawn as points (with
    ``errors`` as ± bars, same labels) or bars; ``xlabel`` says what and in which unit."""

    title: str
    xlabel: str
    series: Mapping[str, Sequence[float]]
    kind: Literal["points", "bars"] = "points"
    log: bool = False
    errors: Mapping[str, Sequence[float]] = field(default_factory=dict)


def _pyplot() -> Any:
    matplotlib = require("matplotlib", "plots", purpose=_PURPOSE)
    matplotlib.use("Agg", force=False)
    return require("matplotlib.pyplot", "plots", purpose=_PURPOSE)


def layer_plot(labels: Sequence[str], panels: Sequence[Panel]) -> bytes:
    """Panels side by side sharing the layer axis (one labelled row per layer). Non-finite
    values, and non-positive ones on a log axis, are left out (the table beside shows them)."""
    plt = _pyplot()
    height = max(2.6, 0.24 * len(labels) + 1.4)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(4.0 * len(panels) + 2.5, height), sharey=True, squeeze=False
    )
    rows = list(range(len(labels)))
    for ax, panel in zip(axes[0], panels, strict=True):
        _draw_panel(ax, rows, panel)
    first = axes[0][0]
    first.set_yticks(rows, list(labels), fontsize=8)
    first.set_ylim(len(labels) - 0.5, -0.5)  # first layer at the top
    first.set_ylabel("layer (type), in execution order", fontsize=9)
    fig.tight_layout()
    return _png(plt, fig)


def _draw_panel(ax: Any, rows: list[int], panel: Panel) -> None:
    count = len(panel.series)
    for k, (label, values) in enumerate(panel.series.items()):
        xs = [_shown(v, panel.log) for v in values]
        if panel.kind == "bars":
            height = 0.8 / count
            offsets = [r - 0.4 + height * (k + 0.5) for r in rows]
            ax.barh(offsets, [0 if math.isnan(x) else x for x in xs], height=height, label=label)
        else:
            errors = [_shown(v, False) for v in panel.errors.get(label, [math.nan] * len(xs))]
            ax.errorbar(
                xs, rows, xerr=[0 if math.isnan(e) else e for e in errors], fmt="o", ms=4,
                capsize=2, linestyle="none", label=label,
            )  # fmt: skip
    if panel.log:
        ax.set_xscale("log")
    ax.set_title(panel.title, fontsize=10, loc="left")
    ax.set_xlabel(panel.xlabel, fontsize=9)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=8)
    if count > 1 or panel.errors:
        ax.legend(fontsize=7, loc="best")


def _shown(value: float, log: bool) -> float:
    if not math.isfinite(value) or (log and value <= 0):
        return math.nan
    return value


def colour_scale(cmap: str, low: str, high: str) -> bytes:
    """A horizontal colour bar of ``cmap`` from ``low`` to ``high`` (what the overlays' colours
    mean)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.0, 0.75))
    gradient = [[i / 255 for i in range(256)]]
    ax.imshow(gradient, aspect="auto", cmap=cmap, extent=(0, 1, 0, 1))
    ax.set_yticks([])
    ax.set_xticks([0, 0.5, 1], [low, "0.5", high], fontsize=8)
    fig.tight_layout()
    return _png(plt, fig)


def _png(plt: Any, fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()
