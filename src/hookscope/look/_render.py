"""Render a :class:`Summary`: a plain-text table (stable, for logs and golden files) and a
``rich`` table (the ``rich`` extra)."""

from __future__ import annotations

from typing import Any

from .._extras import require
from ._result import Summary, SummaryRow

__all__ = ["columns", "footer", "rich_table", "si", "text"]

_SEP = "  "


def si(n: float, unit: str = "") -> str:
    """``1234567`` -> ``1.23 M``; small numbers exactly."""
    if abs(n) < 1000:
        return f"{n:g}{' ' + unit if unit else ''}"
    for prefix in "KMGTPE":
        n /= 1000
        if abs(n) < 1000 or prefix == "E":
            return f"{n:.3g} {prefix}{unit}"
    raise AssertionError("unreachable")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.4g} {unit}" if unit != "B" else f"{n} B"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _exact(n: int) -> str:
    """``1,234,567 (1.23 M)``; ``240``."""
    return f"{n:,} ({si(n)})" if n >= 1000 else str(n)


def _label(row: SummaryRow, model: str) -> str:
    name = row.name or model
    return f"{name} [{row.call}/{row.calls}]" if row.calls > 1 else name


def columns(summary: Summary) -> list[tuple[str, list[str]]]:
    """``[(header, cells)]``: the table's columns, cells as text, one per row."""
    rows = summary.rows
    cols = [
        ("Layer", [_label(r, summary.model) for r in rows]),
        ("Type", [r.type for r in rows]),
        ("Inputs", [", ".join(f"{k}={v}" for k, v in r.inputs.items()) for r in rows]),
        ("Output", ["(raised)" if r.raised else r.output for r in rows]),
        ("Dtype", [r.dtype or "" for r in rows]),
        ("Params", [f"{r.params:,}" for r in rows]),
        ("Params (all)", [f"{r.params_total:,}" for r in rows]),
        ("Trainable", [r.trainable for r in rows]),
        ("FLOPs", [si(r.flops) for r in rows]),
        ("FLOPs (all)", [si(r.flops_total) for r in rows]),
    ]
    if any(r.time_ms is not None for r in rows):
        times = [f"{r.time_ms:.3g}" if r.time_ms is not None else "" for r in rows]
        cols.append(("Time ms", times))
        cols.append(("Peak mem", [_size(r.peak_bytes or 0) for r in rows]))
    return cols


def footer(summary: Summary) -> list[str]:
    s = summary
    lines = [
        f"Total params: {s.total_params:,} (each tensor once)",
        f"Trainable params: {s.trainable_params:,}",
        f"Non-trainable params: {s.total_params - s.trainable_params:,}",
        f"Param size: {_size(s.param_bytes)}",
        f"Output size (calls without sub-calls): {_size(s.output_bytes)}",
        f"Total FLOPs: {_exact(s.total_flops)}",
        f"Total MACs: {_exact(s.total_macs)}",
    ]
    if s.uncounted:
        ops = ", ".join(f"{op} x{n}" for op, n in s.uncounted.items())
        lines.append(f"Not counted (no FLOP formula): {ops}")
    return lines


def _wrap_name(name: str, width: int, indent: int) -> list[str]:
    """Split a dotted name into lines of at most ``width`` characters, only after dots."""
    lines: list[str] = []
    current = ""
    for segment in name.replace(".", ".\0").split("\0"):
        if current and len(current) + len(segment) > width:
            lines.append(current)
            current = " " * (indent + 2)
        current += segment
    return [*lines, current]


def text(summary: Summary, *, max_width: int | None = None) -> str:
    """The plain-text table: header, one line per call (indented by depth), totals."""
    cols = columns(summary)
    names = ["  " * r.depth + cell for r, cell in zip(summary.rows, cols[0][1], strict=True)]
    cols[0] = (cols[0][0], names)
    widths = [max(len(h), *(len(c) for c in cells)) if cells else len(h) for h, cells in cols]
    if max_width is not None:  # wrap names at dots; a segment is never cut
        rest = sum(widths[1:]) + len(_SEP) * (len(widths) - 1)
        pieces = (
            2 * r.depth + 2 + len(part) + 1  # continuation indent, segment, its dot
            for r, name in zip(summary.rows, cols[0][1], strict=True)
            for part in name.split(".")
        )
        segment = max(pieces, default=0)
        widths[0] = min(widths[0], max(max_width - rest, segment))
    right = {h for h, _ in cols if h.startswith(("Params", "FLOPs", "Time", "Peak"))}

    def line(cells: list[str]) -> str:
        parts = [
            c.rjust(w) if h in right else c.ljust(w)
            for (h, _), c, w in zip(cols, cells, widths, strict=True)
        ]
        return _SEP.join(parts).rstrip()

    out = [f"{summary.model} summary", summary.units]
    if summary.inputs:
        out.append("Inputs: " + ", ".join(f"{k}={v}" for k, v in summary.inputs.items()))
    rule = "-" * (sum(widths) + len(_SEP) * (len(cols) - 1))
    out += ["", line([h for h, _ in cols]), rule]
    for i, row in enumerate(summary.rows):
        cells = [c[i] for _, c in cols]
        first, *more = _wrap_name(cells[0], widths[0], 2 * row.depth)
        out.append(line([first, *cells[1:]]))
        out += [line([m] + [""] * (len(cols) - 1)) for m in more]
    out += [rule, *footer(summary)]
    return "\n".join(out) + "\n"


def rich_table(summary: Summary) -> Any:
    """A ``rich.table.Table`` of the summary (what ``rich.print(summary)`` shows)."""
    table_mod = require("rich.table", "rich", purpose="rendering a summary with rich")
    table = table_mod.Table(
        title=f"{summary.model} summary", caption="\n".join([summary.units, *footer(summary)])
    )
    cols = columns(summary)
    for header, _ in cols:
        right = header.startswith(("Params", "FLOPs", "Time", "Peak"))
        table.add_column(header, justify="right" if right else "left", no_wrap=header == "Layer")
    for i, row in enumerate(summary.rows):
        table.add_row(*("  " * row.depth + c[i] if h == "Layer" else c[i] for h, c in cols))
    return table
