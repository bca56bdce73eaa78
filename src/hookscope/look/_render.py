"""Render a :class:`Summary`: a plain-text table (stable, for logs and golden files) and a
``rich`` table (the ``rich`` extra), both fitted to a width.

Fitting (:func:`fit`) never truncates: it leaves out empty columns, states a dtype shared
by every call above the table instead of in a column, then leaves out optional columns
(inputs, own parameters, trainable, own FLOPs: in that order) while the table is too wide,
names each row relative to its caller's name (the tree's indentation shows the rest) and
wraps names at dots and shapes after their top-level commas. Where that is still too wide (a
class or attribute name longer than the room, a shape with a long container name such as
``EncoderDecoderCache(...)``), the widest of the name, type and shape columns give way until
the table fits, and their cells break inside words: names and shapes first where they
can, class names between words of their CamelCase. ``max_width=None`` is the full table:
every column, full dotted names, one line per row.

Operation rows (``ops=True``) sit one level under their module call, named relative to it
(``::softmax``) when names are; their Type is how the code called them, shortened
(``F.softmax``, ``Tensor.view``, ``torch.addmm``); parameter cells stay empty.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass
from typing import Any, Protocol

from .._extras import require
from ._row import SummaryRow
from ._shapes import format_shape

__all__ = ["fit", "footer", "rich_renderable", "si", "text"]

_SEP = "  "
_RIGHT = ("Params", "FLOPs", "Time", "Peak")
_OPTIONAL = ("Inputs", "Params", "Trainable", "FLOPs")  # left out in this order to fit


class Summary(Protocol):
    """What the renderer reads of a :class:`~hookscope.look._result.Summary` (the summary
    renders itself through this module, which therefore does not import it)."""

    model: str
    rows: list[SummaryRow]
    total_params: int
    trainable_params: int
    param_bytes: int
    output_bytes: int
    total_flops: int
    uncounted: dict[str, int]
    inputs: dict[str, Any]
    units: str
    world_size: int
    global_rank: int | None
    rank_params: int | None
    rank_param_bytes: int | None
    world_flops: int | None

    @property
    def total_macs(self) -> int: ...


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


@dataclass
class Column:
    """One column: its header and, per row, the lines of its cell."""

    header: str
    cells: list[list[str]]

    @property
    def right(self) -> bool:
        return self.header.startswith(_RIGHT)

    @property
    def width(self) -> int:
        return max([len(self.header), *(len(line) for cell in self.cells for line in cell)])


def _label(summary: Summary, i: int, relative: bool) -> str:
    row = summary.rows[i]
    name = row.name or summary.model
    if relative and row.parent is not None:
        caller = summary.rows[row.parent].name
        if caller and name.startswith(caller + "."):
            name = name[len(caller) + 1 :]
    if relative and row.kind == "op" and row.parent is not None:
        caller = summary.rows[row.parent].name
        if caller and name.startswith(caller + "::"):
            name = name[len(caller) :]
    return f"{name} [{row.call}/{row.calls}]" if row.calls > 1 and row.kind == "module" else name


_SHORT = (("torch.nn.functional.", "F."), ("torch.Tensor.", "Tensor."))


def _type(row: SummaryRow) -> str:
    """A module's class name; how an operation was called, shortened (``F.softmax``)."""
    if row.kind == "op":
        for long, short in _SHORT:
            if row.type.startswith(long):
                return short + row.type[len(long) :]
    return row.type


def _output(row: SummaryRow) -> str:
    if row.opaque:
        return "(TorchScript: not hooked)"
    return "(raised)" if row.raised else format_shape(row.output)


def columns(summary: Summary, *, relative: bool = False) -> list[Column]:
    """Every column of the full table, one line per cell."""
    rows = summary.rows
    cols = {
        "Layer": ["  " * r.depth + _label(summary, i, relative) for i, r in enumerate(rows)],
        "Type": [_type(r) for r in rows],
        "Inputs": [
            ", ".join(f"{k}={format_shape(v, 1)}" for k, v in r.inputs.items()) for r in rows
        ],
        "Output": [_output(r) for r in rows],
        "Dtype": [r.dtype or "" for r in rows],
        "Params": [f"{r.params:,}" if r.kind == "module" else "" for r in rows],
        "Params (all)": [f"{r.params_total:,}" if r.kind == "module" else "" for r in rows],
        "Trainable": [r.trainable if r.kind == "module" else "" for r in rows],
        "FLOPs": [si(r.flops) for r in rows],
        "FLOPs (all)": [si(r.flops_total) for r in rows],
    }
    if any(r.time_ms is not None for r in rows):
        cols["Time ms"] = [f"{r.time_ms:.3g}" if r.time_ms is not None else "" for r in rows]
        cols["Peak mem"] = [_size(r.peak_bytes) if r.peak_bytes is not None else "" for r in rows]
    return [Column(h, [[c] for c in cells]) for h, cells in cols.items()]


def _total(cols: list[Column], sep: int) -> int:
    return sum(c.width for c in cols) + sep * (len(cols) - 1)


def _wrap_name(name: str, width: int) -> list[str]:
    """Split an indented dotted name into lines of at most ``width``, only after dots."""
    indent = len(name) - len(name.lstrip(" "))
    lines: list[str] = []
    current = ""
    for segment in name.replace(".", ".\0").split("\0"):
        if current.strip() and len(current) + len(segment) > width:
            lines.append(current)
            current = " " * (indent + 2)
        current += segment
    return [*lines, current]


def _pieces(shape: str) -> list[str]:
    """A shape's text cut after each top-level comma (``{a: [1, 2], b: [3]}``: two pieces)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(shape):
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 1:
            out.append(shape[start : i + 1])
            start = i + 2
    return [*out, shape[start:]]


def _wrap_shape(shape: str, width: int) -> list[str]:
    lines: list[str] = []
    for piece in _pieces(shape):
        if lines and len(lines[-1]) + 1 + len(piece) <= width:
            lines[-1] += " " + piece
        else:
            lines.append(piece if not lines else " " + piece)
    return lines


def _take(cols: list[Column], header: str) -> Column | None:
    for c in cols:
        if c.header == header:
            cols.remove(c)
            return c
    return None


def _shrink(cols: list[Column], header: str, budget: int, wrap: Any) -> None:
    """Wrap one column's cells to fit ``budget`` characters where they can break."""
    col = next((c for c in cols if c.header == header), None)
    if col is not None and budget < col.width:
        col.cells = [[w for line in cell for w in wrap(line, budget)] for cell in col.cells]


def _name_floor(col: Column) -> int:
    """The narrowest Layer column that cuts no segment of a name (continuations indent 2)."""
    floor = 0
    for cell in col.cells:
        indent = len(cell[0]) - len(cell[0].lstrip(" "))
        for segment in cell[0].strip().split("."):
            floor = max(floor, indent + 2 + len(segment) + 1)
    return floor


def fit(
    summary: Summary, width: int | None, sep: int = len(_SEP)
) -> tuple[list[Column], list[str]]:
    """The columns to show at ``width`` (None: all) and the notes saying what moved where."""
    cols = columns(summary)
    if width is None:
        return cols, []
    cols = [c for c in cols if any(line for cell in c.cells for line in cell)]
    if _total(cols, sep) <= width:
        return cols, []
    cols[0] = columns(summary, relative=True)[0]  # the tree's indentation names the caller
    notes, left_out = [], []
    dtype_cells = next((c.cells for c in cols if c.header == "Dtype"), [])
    dtypes = {line for cell in dtype_cells for line in cell if line}
    if _total(cols, sep) > width and len(dtypes) == 1 and _take(cols, "Dtype"):
        notes.append(f"Dtype of every output: {dtypes.pop()}")
    for header in _OPTIONAL:
        if _total(cols, sep) <= width:
            break
        if _take(cols, header):
            left_out.append(header)
    full = {c.header: c.cells for c in cols}  # one line per cell, before any wrapping
    rest = _total(cols[1:], sep) + sep
    _shrink(cols, "Layer", max(width - rest, _name_floor(cols[0])), _wrap_name)
    others = _total([c for c in cols if c.header != "Output"], sep) + sep
    _shrink(cols, "Output", max(width - others, 24), _wrap_shape)
    if _total(cols, sep) > width:
        _squeeze(cols, full, width, sep)
    if left_out:
        notes.append(
            f"Names are relative to their caller; left out to fit {width} columns: "
            f"{', '.join(left_out)} (everything: to_text(max_width=None))"
        )
    else:
        notes.append("Names are relative to their caller (full names: to_text(max_width=None))")
    return cols, notes


_NARROWEST = 8  # a squeezed column keeps at least this many characters


def _squeeze(cols: list[Column], full: dict[str, list[list[str]]], width: int, sep: int) -> None:
    """Narrow the name, type and shape columns, widest first, until the table is ``width``
    wide, and break their ``full`` (unwrapped) cells to fit, inside words where they must
    (the last resort of :func:`fit`)."""
    breaks = {"Layer": _hard_name, "Type": _hard_type, "Output": _hard_shape}
    squeezed = [c for c in cols if c.header in breaks]
    widths = {c.header: c.width for c in squeezed}
    excess = _total(cols, sep) - width
    while excess > 0:
        header = max(widths, key=lambda h: widths[h])
        if widths[header] <= max(_NARROWEST, len(header)):
            break  # the numbers alone are wider: nothing left to give
        widths[header] -= 1
        excess -= 1
    for c in squeezed:
        room, wrap = widths[c.header], breaks[c.header]
        if room < c.width:
            c.cells = [[w for line in cell for w in wrap(line, room)] for cell in full[c.header]]


def _pack(tokens: list[str], width: int, first: str, rest: str) -> list[str]:
    """``tokens`` joined into lines of at most ``width`` (the first line starts with ``first``,
    the others with ``rest``, each at most half the width); a token that does not fit where
    the line is goes to the next one, and one longer than a whole line is cut."""
    lines = [first]
    for token in tokens:
        if len(lines[-1]) + len(token) > width and lines[-1].strip():
            lines.append(rest)
        while len(lines[-1]) + len(token) > width:
            room = width - len(lines[-1])
            lines[-1] += token[:room]
            token = token[room:]
            lines.append(rest)
        lines[-1] += token
    return [line for line in lines if line.strip()] or [first]


def _hard_name(line: str, width: int) -> list[str]:
    """A name in ``width``: after dots and underscores, else inside a segment; continuation
    lines indented 2 more, the indentation kept to at most half the width."""
    indent = min(len(line) - len(line.lstrip(" ")), width // 2)
    tokens = re.findall(r"[^._]*[._]?", line.lstrip(" "))
    return _pack([t for t in tokens if t], width, " " * indent, " " * min(indent + 2, width // 2))


def _hard_type(line: str, width: int) -> list[str]:
    """A class name in ``width``: between the words of its CamelCase (``Very|Long|Name``),
    inside a word only where one alone is too long."""
    return _pack(re.findall(r"[A-Z]?[^A-Z]*", line), width, "", "")


def _hard_shape(line: str, width: int) -> list[str]:
    """A shape in ``width``: after its top-level commas, else after inner commas and colons,
    else inside a name."""
    pieces = _pieces(line)
    tokens: list[str] = []
    for k, piece in enumerate(pieces):
        token = piece + " " if k < len(pieces) - 1 else piece
        tokens += [token] if len(token) < width else re.findall(r"[^,: ]+[,:]? ?|[,: ]", token)
    return [w.rstrip() for w in _pack(tokens, width, "", " ")]


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
    if s.rank_params is not None and s.rank_param_bytes is not None:  # a sharded model
        lines[3:3] = [
            f"Params on rank {s.global_rank} of {s.world_size}: {s.rank_params:,} "
            f"({_size(s.rank_param_bytes)})"
        ]
        lines[-2:] = [
            f"FLOPs on rank {s.global_rank}: {_exact(s.total_flops)}",
            f"MACs on rank {s.global_rank}: {_exact(s.total_macs)}",
        ]
        if s.world_flops is not None:
            lines.append(f"FLOPs on all {s.world_size} ranks: {_exact(s.world_flops)}")
    if s.uncounted:
        ops = ", ".join(f"{op} x{n}" for op, n in s.uncounted.items())
        lines.append(f"Not counted (no FLOP formula): {ops}")
    return lines


def _wrapped(lines: list[str], width: int | None) -> list[str]:
    if width is None:
        return lines
    return [
        w
        for line in lines
        for w in textwrap.wrap(  # a word longer than the width (a long name) is broken
            line, width, subsequent_indent="  ", break_long_words=True, break_on_hyphens=False
        )
    ]


_OPS_NOTE = (
    "Rows named layer::op are operations of that layer's own code (selectors for hs.capture); "
    "their FLOPs are part of the layer's, counted once in the totals"
)


def _ops_note(summary: Summary) -> list[str]:
    return [_OPS_NOTE] if any(r.kind == "op" for r in summary.rows) else []


def _header(summary: Summary, notes: list[str]) -> list[str]:
    out = [f"{summary.model} summary", summary.units, *_ops_note(summary)]
    if summary.inputs:
        shown = ", ".join(f"{k}={format_shape(v, 1)}" for k, v in summary.inputs.items())
        out.append("Inputs: " + shown)
    return out + notes


def text(summary: Summary, *, max_width: int | None = 120) -> str:
    """The plain-text table: header, one line per call (indented by depth), totals."""
    cols, notes = fit(summary, max_width)
    widths = [c.width for c in cols]

    def line(cells: list[str]) -> str:
        parts = [
            cell.rjust(w) if c.right else cell.ljust(w)
            for c, cell, w in zip(cols, cells, widths, strict=True)
        ]
        return _SEP.join(parts).rstrip()

    out = _wrapped(_header(summary, notes), max_width)
    rule = "-" * (sum(widths) + len(_SEP) * (len(cols) - 1))
    out += ["", line([c.header for c in cols]), rule]
    for i in range(len(summary.rows)):
        cells = [c.cells[i] for c in cols]
        for k in range(max(len(cell) for cell in cells)):
            out.append(line([cell[k] if k < len(cell) else "" for cell in cells]))
    out += [rule, *_wrapped(footer(summary), max_width)]
    return "\n".join(out) + "\n"


class _Rich:
    """Built when rich draws it, for the console's width."""

    def __init__(self, summary: Summary) -> None:
        self.summary = summary

    def __rich_console__(self, console: Any, options: Any) -> Any:
        yield rich_table(self.summary, options.max_width)


def rich_renderable(summary: Summary) -> Any:
    """What ``rich.print(summary)`` draws (needs the ``rich`` extra)."""
    require("rich.table", "rich", purpose="rendering a summary with rich")
    return _Rich(summary)


def rich_table(summary: Summary, width: int) -> Any:
    """A ``rich.table.Table`` fitted to ``width``: type names and numbers never cut."""
    table_mod = require("rich.table", "rich", purpose="rendering a summary with rich")
    # a rich cell takes its text, one space each side and a border (and one closing border)
    cols, notes = fit(summary, width - 4, sep=3)
    caption = "\n".join([summary.units, *_ops_note(summary), *notes, *footer(summary)])
    table = table_mod.Table(title=f"{summary.model} summary", caption=caption)
    for c in cols:
        table.add_column(
            c.header,
            justify="right" if c.right else "left",
            no_wrap=c.header != "Output",
            min_width=c.width if c.header != "Output" else None,
        )
    for i in range(len(summary.rows)):
        table.add_row(*("\n".join(c.cells[i]) for c in cols))
    return table
