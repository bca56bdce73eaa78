"""Per-layer statistics drawn with matplotlib (the ``plots`` extra) as PNG bytes (dpi 100:
a few KiB each, cheap to embed)."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import Any

from .._extras import require

__all__ = ["layer_plot"]


def layer_plot(
    layers: Sequence[str], panels: Sequence[tuple[str, Mapping[str, Sequence[float]], bool]]
) -> bytes:
    """One panel per ``(title, {series label: value per layer}, log scale)``, layers along the
    x axis in execution order; non-finite and (on a log axis) non-positive values are gaps."""
    matplotlib = require("matplotlib", "plots", purpose="plots in the HTML report")
    matplotlib.use("Agg", force=False)
    plt: Any = require("matplotlib.pyplot", "plots", purpose="plots in the HTML report")
    width = min(max(6.0, 0.22 * len(layers) + 2), 16.0)
    fig, axes = plt.subplots(len(panels), 1, figsize=(width, 2.4 * len(panels)), sharex=True)
    axes = [axes] if len(panels) == 1 else list(axes)
    x = list(range(len(layers)))
    for ax, (title, series, log) in zip(axes, panels, strict=True):
        for label, values in series.items():
            ys = [_gap(v, log) for v in values]
            ax.plot(x, ys, marker="o", markersize=3, linewidth=1.2, label=label)
        if log:
            ax.set_yscale("log")
        ax.set_title(title, fontsize=10, loc="left")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    step = max(1, math.ceil(len(layers) / 40))  # at most ~40 labels
    axes[-1].set_xticks(x[::step], [layers[i] for i in x[::step]], rotation=70, fontsize=7)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    plt.close(fig)
    return buffer.getvalue()


def _gap(value: float, log: bool) -> float:
    if not math.isfinite(value) or (log and value <= 0):
        return math.nan
    return value
