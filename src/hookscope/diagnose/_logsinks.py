"""Where :class:`~hookscope.Monitor` records go: JSONL, CSV and TensorBoard.

Files are flushed after every logging step, so a run that crashes leaves complete lines.
"""

from __future__ import annotations

import csv
import json
import math
import os
from pathlib import Path
from typing import Any, Protocol

from .._extras import require
from ..errors import UsageError

__all__ = [
    "CSV_FIELDS",
    "ROOT",
    "CSVSink",
    "JSONLSink",
    "Sink",
    "TensorBoardSink",
    "histogram_name",
    "make_sink",
    "scalars",
]

#: The CSV header: every key a record can have (empty where a record has none).
CSV_FIELDS = (
    "step",
    "layer",
    "kind",
    "norm",
    "mean",
    "std",
    "min",
    "max",
    "zeros",
    "nonfinite",
    "dead",
    "grad_norm",
    "grad_nonfinite",
    "update_norm",
    "update_ratio",
    "value",
)


#: the name of the model itself (layer ``""``) in a metric's name, where a name cannot be empty
ROOT = "_root"
_NOT_STATISTICS = ("step", "layer", "kind", "rank")


def scalars(record: dict[str, Any], prefix: str = "", root: str = ROOT) -> list[tuple[str, float]]:
    """A record's numbers as ``(name, value)``: ``{prefix}{layer}/{kind}/{statistic}``, and a
    value given to ``Monitor.log`` under ``{prefix}{its name}`` (the model itself, layer
    ``""``, is ``root`` here)."""
    if record["kind"] == "scalar":
        return [(f"{prefix}{record['layer']}", record["value"])]
    head = f"{prefix}{record['layer'] or root}/{record['kind']}"
    return [
        (f"{head}/{key}", value)
        for key, value in record.items()
        if key not in _NOT_STATISTICS and isinstance(value, (int, float))
    ]


def histogram_name(tag: str, prefix: str = "") -> str:
    """A histogram's name, ``{prefix}{layer}/{kind}``, from the Monitor's tag (the model
    itself, layer ``""``, as :data:`ROOT`)."""
    return f"{prefix}{ROOT}{tag}" if tag.startswith("/") else f"{prefix}{tag}"


class Sink(Protocol):
    """What a Monitor sink is: any object with these three methods (your own too).

    A sink that draws histograms also has ``histograms`` (``True`` for parameters and their
    gradients, ``"all"`` for activations and output gradients too) and
    ``histogram(tag, step, stats, counts, edges)`` (:meth:`TensorBoardSink.histogram`); one
    that shows images has ``image(tag, step, image)`` (an RGB ``uint8`` array ``(H, W, 3)``:
    the maps of ``hookscope.integrations``)."""

    def write(self, record: dict[str, Any]) -> None:
        """Take one record: a flat dict with ``step``, ``layer``, ``kind`` and statistics."""

    def flush(self) -> None:
        """Make what was written durable (called after every logging step)."""

    def close(self) -> None:
        """Release files and writers (called once, when the monitor closes)."""


def _json_value(v: Any) -> Any:
    """NaN / Inf as strings: JSON has no such numbers, and they must not vanish."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    return v


class JSONLSink:
    """One JSON object per record per line (NaN/Inf written as the strings "NaN",
    "Infinity", "-Infinity"; pandas: ``pd.read_json(path, lines=True)``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one line."""
        self._file.write(json.dumps({k: _json_value(v) for k, v in record.items()}) + "\n")

    def flush(self) -> None:
        """Flush the file, so that a crash leaves complete lines."""
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class CSVSink:
    """Rows with the fixed header :data:`CSV_FIELDS` (``pd.read_csv(path)``)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        p = Path(path)
        p.parent.mkdir(parents=True, exist_ok=True)
        new = not p.exists() or p.stat().st_size == 0
        self._file = open(p, "a", encoding="utf-8", newline="")  # noqa: SIM115
        self._writer = csv.DictWriter(self._file, fieldnames=CSV_FIELDS)
        if new:
            self._writer.writeheader()

    def write(self, record: dict[str, Any]) -> None:
        """Append ``record`` as one row (empty cells for the fields it does not have)."""
        self._writer.writerow({k: record.get(k, "") for k in CSV_FIELDS})

    def flush(self) -> None:
        """Flush the file, so that a crash leaves complete lines."""
        self._file.flush()

    def close(self) -> None:
        """Close the file."""
        self._file.close()


class TensorBoardSink:
    """Scalars ``{layer}/{kind}/{statistic}`` at the optimizer step (values given to
    ``Monitor.log`` under their own name), and histograms: of each
    layer's parameters and their gradients (``{layer}/parameter``,
    ``{layer}/parameter_gradient``; ``histograms=True``, the default), also of its activations
    and output gradients (``{layer}/activation``, ``{layer}/gradient``; ``histograms="all"``,
    which costs a pass over every watched activation), or none (``False``); through a
    ``SummaryWriter`` (given, or made for a log directory: the ``tensorboard`` extra).
    Histogram buckets are TensorBoard's own (±1e-12 growing by 10 % to ±1e20), counted on the
    device; min, max, count, sum and sum of squares are exact, over finite values.
    ``("tensorboard", dir, "all")`` as a Monitor sink is ``TensorBoardSink(dir, histograms="all")``.
    With a ``prefix`` (``"hookscope/"``), every tag starts with it and the model itself
    (layer ``""``) is named ``_root``.
    """

    def __init__(
        self, writer_or_dir: Any, *, histograms: bool | str = True, prefix: str = ""
    ) -> None:
        if histograms not in (True, False, "all"):
            raise UsageError(f'histograms must be True, False or "all", got {histograms!r}')
        self.histograms, self.prefix = histograms, prefix
        if isinstance(writer_or_dir, (str, os.PathLike)):
            tb = require("torch.utils.tensorboard", "tensorboard", purpose="TensorBoard logging")
            self._writer, self._own = tb.SummaryWriter(log_dir=str(writer_or_dir)), True
        else:
            self._writer, self._own = writer_or_dir, False

    def write(self, record: dict[str, Any]) -> None:
        """Add ``record``'s numbers as scalars at its step."""
        root = ROOT if self.prefix else ""  # unprefixed tags are as they always were
        for tag, value in scalars(record, self.prefix, root):
            self._writer.add_scalar(tag, value, global_step=record["step"])

    def histogram(
        self, tag: str, step: int, stats: dict[str, float], counts: list[float], edges: Any
    ) -> None:
        """One histogram: ``counts[i]`` values in ``(edges[i-1], edges[i]]`` (the last bucket
        open above, closed by the maximum). Empty buckets are left out."""
        limits, kept = [], []
        for i, c in enumerate(counts):
            if c:
                limits.append(float(edges[i]) if i < len(edges) else stats["max"])
                kept.append(c)
        if self.prefix:
            tag = histogram_name(tag, self.prefix)
        self._writer.add_histogram_raw(
            tag,
            min=stats["min"],
            max=stats["max"],
            num=int(stats["num"]),
            sum=stats["sum"],
            sum_squares=stats["sum_squares"],
            bucket_limits=limits,
            bucket_counts=kept,
            global_step=step,
        )

    def image(self, tag: str, step: int, image: Any) -> None:
        """One RGB image ``(H, W, 3)``, ``uint8``, named ``{prefix}{tag}``."""
        self._writer.add_image(f"{self.prefix}{tag}", image, global_step=step, dataformats="HWC")

    def flush(self) -> None:
        """Flush the writer's event file."""
        self._writer.flush()

    def close(self) -> None:
        """Close the writer if this sink made it (a writer you gave stays open)."""
        if self._own:
            self._writer.close()


def make_sink(spec: Any) -> Sink:
    """A sink from a path (``.jsonl`` / ``.csv``), ``("tensorboard", dir)``, a
    ``SummaryWriter``, or an object with ``write`` / ``flush`` / ``close``."""
    if isinstance(spec, (str, os.PathLike)):
        suffix = Path(spec).suffix
        if suffix == ".jsonl":
            return JSONLSink(spec)
        if suffix == ".csv":
            return CSVSink(spec)
        raise UsageError(
            f"cannot tell the sink from {str(spec)!r}: use a .jsonl or .csv path, "
            "('tensorboard', log_dir), a SummaryWriter or a sink object"
        )
    if isinstance(spec, tuple) and len(spec) == 2 and spec[0] == "tensorboard":
        return TensorBoardSink(spec[1])
    if isinstance(spec, tuple) and len(spec) == 3 and spec[0] == "tensorboard":
        return TensorBoardSink(spec[1], histograms=spec[2])
    if hasattr(spec, "add_scalar"):
        return TensorBoardSink(spec)
    if all(hasattr(spec, a) for a in ("write", "flush", "close")):
        sink: Sink = spec
        return sink
    raise UsageError(f"not a sink: {spec!r}")
