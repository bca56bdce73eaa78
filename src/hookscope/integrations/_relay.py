"""The trainer's loggers as Monitor sinks, written from the training thread.

The Monitor writes its sinks on a background thread. A trainer's loggers are not all safe to
call from another thread (Lightning's ``CSVLogger`` keeps a list its ``save()`` empties), so
the monitor's sink for them is a :class:`Relay`: it queues each logged step, and the callback
hands the queue to the loggers at the next batch end (:meth:`Relay.drain`), on the training
thread, and once more when the run ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Sequence
from typing import Any

__all__ = ["Locked", "Relay", "histogram_level"]

_PARAMETER_TAGS = ("/parameter", "/parameter_gradient")


def histogram_level(sinks: Sequence[Any]) -> bool | str:
    """What the sinks draw: ``"all"`` if one draws activations, else whether one draws any."""
    wants = [getattr(sink, "histograms", False) for sink in sinks]
    return "all" if "all" in wants else any(wants)


def _draws(sink: Any, tag: str) -> bool:
    level = getattr(sink, "histograms", False)
    return level == "all" or (level is True and tag.endswith(_PARAMETER_TAGS))


class Relay:
    """A Monitor sink that queues each logged step for ``targets`` (sinks written by
    :meth:`drain`, on the thread calling it)."""

    def __init__(self, targets: Sequence[Any]) -> None:
        self.targets = list(targets)
        self.histograms = histogram_level(self.targets)
        self._records: list[dict[str, Any]] = []
        self._hists: list[tuple[str, int, dict[str, float], list[float], Any]] = []
        self._queue: queue.SimpleQueue[tuple[list[Any], list[Any]]] = queue.SimpleQueue()

    # -- the Monitor's side (its writer thread) -----------------------------------------------
    def write(self, record: dict[str, Any]) -> None:
        """Keep ``record`` for the step being written."""
        self._records.append(record)

    def histogram(
        self, tag: str, step: int, stats: dict[str, float], counts: list[float], edges: Any
    ) -> None:
        """Keep one histogram for the step being written."""
        self._hists.append((tag, step, stats, counts, edges))

    def flush(self) -> None:
        """The step is written: queue it."""
        self._queue.put((self._records, self._hists))
        self._records, self._hists = [], []

    def close(self) -> None:
        """Nothing: the targets are closed by :meth:`close_targets`, after the last drain."""

    # -- the training thread's side ------------------------------------------------------------
    def drain(self) -> None:
        """Write every queued step to every target, one flush per step."""
        while True:
            try:
                records, hists = self._queue.get_nowait()
            except queue.Empty:
                return
            for target in self.targets:
                for record in records:
                    target.write(record)
                for tag, step, stats, counts, edges in hists:
                    if _draws(target, tag):
                        target.histogram(tag, step, stats, counts, edges)
                target.flush()

    def close_targets(self) -> None:
        """Close every target (sinks made around a trainer's logger leave the logger open)."""
        for target in self.targets:
            target.close()


class Locked:
    """A sink whose calls hold a lock: the Monitor writes it on its thread while the callback
    sends it images from the training thread."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.histograms = getattr(sink, "histograms", False)
        self._lock = threading.Lock()

    def write(self, record: dict[str, Any]) -> None:
        """The sink's ``write``."""
        with self._lock:
            self.sink.write(record)

    def histogram(
        self, tag: str, step: int, stats: dict[str, float], counts: list[float], edges: Any
    ) -> None:
        """The sink's ``histogram``."""
        with self._lock:
            self.sink.histogram(tag, step, stats, counts, edges)

    def image(self, tag: str, step: int, image: Any) -> None:
        """The sink's ``image``, then its ``flush``."""
        with self._lock:
            self.sink.image(tag, step, image)
            self.sink.flush()

    def flush(self) -> None:
        """The sink's ``flush``."""
        with self._lock:
            self.sink.flush()

    def close(self) -> None:
        """The sink's ``close``."""
        with self._lock:
            self.sink.close()
