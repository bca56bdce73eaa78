"""Figures for the report, drawn with matplotlib (the ``plots`` extra) as PNG bytes (dpi 100: a
few KiB each, cheap to embed).

Layers are categories, not a series: each layer is one row (its name and type on the y axis,
every row labelled, in execution order from the top), values are points or bars along x,
and every axis says what it measures.

Each panel is its own image, :data:`PANEL_WIDTH` pixels wide, with its own layer labels: the
page sets them side by side where they fit (three across at 1280 px) and one above the other
on a phone, at about their own size, so that no text is shown smaller than about 10 CSS
pixels (three panels drawn as one image were shrunk to a quarter at 390 px: 3 px text).
"""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from .._extras import require

__all__ = ["PANEL_WIDTH", "Panel", "colour_scale", "layer_panels"]

_PURPOSE = "plots in the HTML report"
_DPI = 100
#: each panel's width in pixels: three and their gaps fit the report's 1,150 px column, one
#: fits a 390 px phone's
PANEL_WIDTH = 370
_SMALL, _TEXT, _TITLE = 8, 9, 10  # font sizes in points: legends, ticks and labels, titles


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


def layer_panels(labels: Sequence[str], panels: Sequence[Panel]) -> list[bytes]:
    """One image per panel, each with the layer axis (one labelled row per layer, the first
    at the top). Non-finite values, and non-positive ones on a log axis, are left out (the
    table beside shows them)."""
    plt = _pyplot()
    height = max(2.8, 0.26 * len(labels) + 1.6)
    rows = list(range(len(labels)))
    images = []
    for panel in panels:
        fig, ax = plt.subplots(figsize=(PANEL_WIDTH / _DPI, height))
        _draw_panel(ax, rows, panel)
        ax.set_yticks(rows, list(labels), fontsize=_TEXT)
        ax.set_ylim(len(labels) - 0.5, -0.5)
        ax.set_ylabel("layer (type), in execution order", fontsize=_TEXT)
        fig.tight_layout()
        images.append(_png(plt, fig))
    return images


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
                xs,
                rows,
                xerr=[0 if math.isnan(e) else e for e in errors],
                fmt="o",
                ms=4,
                capsize=2,
                linestyle="none",
                label=label,
            )
    if panel.log:
        ax.set_xscale("log")
    ax.set_title(panel.title, fontsize=_TITLE, loc="left")
    ax.set_xlabel(panel.xlabel, fontsize=_TEXT)
    ax.grid(axis="x", alpha=0.3)
    ax.tick_params(axis="x", labelsize=_TEXT)
    if count > 1 or panel.errors:
        ax.legend(fontsize=_SMALL, loc="best")


def _shown(value: float, log: bool) -> float:
    if not math.isfinite(value) or (log and value <= 0):
        return math.nan
    return value


def colour_scale(cmap: str, low: str, high: str) -> bytes:
    """A horizontal colour bar of ``cmap`` from ``low`` to ``high`` (what the overlays' colours
    mean)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(PANEL_WIDTH / _DPI, 0.8))
    gradient = [[i / 255 for i in range(256)]]
    ax.imshow(gradient, aspect="auto", cmap=cmap, extent=(0, 1, 0, 1))
    ax.set_yticks([])
    ax.set_xticks([0, 0.5, 1], [low, "0.5", high], fontsize=_TEXT)
    fig.tight_layout()
    return _png(plt, fig)


def _png(plt: Any, fig: Any) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=_DPI)
    plt.close(fig)
    return buffer.getvalue()
