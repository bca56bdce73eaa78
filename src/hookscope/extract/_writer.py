"""Blocks of rows on their way to the store, and the thread that writes them while the next
forwards run.

A :class:`Block` holds ``chunk`` rows per layer in host buffers (pinned on CUDA, so the copies
from the device do not wait) that the forwards fill, then goes to the :class:`Writer`'s small
queue. The writer thread waits for the block's copies, writes its rows and then its ``done``
entry (the store's ledger: see ``_store``), one block after another, and hands the buffers
back for a later block: memory holds at most ``depth + 2`` blocks. An error in the thread is
raised in the caller at its next hand-over (or when the writer closes); when the caller stops
early (an exception, Ctrl-C) the blocks already queued, which are finished, are still written.

The thread pays only where the forwards leave a core to it (:func:`overlap`): a model on an
accelerator, or CPU forwards on fewer threads than the process has cores. When torch's CPU
threads fill every core, a writer thread can only take time from them, and one of them
descheduled stalls the whole parallel operator: an IO-bound extraction (a 1x1 convolution,
16 MiB written a batch) ran its convolutions at 11 ms instead of 2.5 beside the thread, and
took 1.6x a loop that writes in line. There each block is written by the caller, in line.
"""

from __future__ import annotations

import os
import queue
import threading
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from ._store import COLUMNS, Store

__all__ = ["Block", "TokenBlock", "Writer", "overlap", "pinned"]

_POLL = 0.1  # seconds between looks at the writer thread while waiting for it


class Block:
    """Samples ``start ..`` of block ``index``: rows per layer (host buffers of at least
    ``capacity`` rows), ids, reasons of unreadable samples and where they are."""

    def __init__(self, index: int, start: int, capacity: int, buffers: dict[str, Tensor]) -> None:
        self.index, self.start, self.capacity, self.buffers = index, start, capacity, buffers
        self.ids: list[str] = []
        self.errors: list[str] = []
        self.bad: list[int] = []  # rows of samples that could not be read: NaN
        self.held: dict[str, Tensor] = {}  # rows kept as the forward gave them (no copy)
        self.event: Any = None  # a CUDA event recorded after the block's last copy

    @property
    def rows(self) -> int:
        return len(self.ids)

    @property
    def full(self) -> bool:
        return self.rows >= self.capacity

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()

    def arrays(self) -> dict[str, Any]:
        """The rows as NumPy arrays (views of the buffers), unreadable samples' rows NaN."""
        out = {}
        for name, buffer in {**self.buffers, **self.held}.items():
            rows = buffer[: self.rows]
            if self.bad:
                rows = rows.clone() if name in self.held else rows  # never the model's inputs
                rows[self.bad] = float("nan") if rows.is_floating_point() else 0
            out[name] = rows.numpy()
        return out


class TokenBlock(Block):
    """A block of ``unit="token"``: its samples' ids as a :class:`Block`'s, and the rows of
    their kept tokens: ``count`` rows per layer (buffers of at least that many), and per token
    its ``sample``, ``position`` and ``token_id`` (``columns``, a part per batch)."""

    def __init__(self, index: int, start: int, capacity: int, buffers: dict[str, Tensor]) -> None:
        super().__init__(index, start, capacity, buffers)
        self.count = 0
        self.columns: list[tuple[Tensor, Tensor, Tensor]] = []

    def arrays(self) -> dict[str, Any]:
        out = {name: buffer[: self.count].numpy() for name, buffer in self.buffers.items()}
        dtypes = (torch.int64, torch.int32, torch.int32)
        for i, (name, dtype) in enumerate(zip(COLUMNS, dtypes, strict=True)):
            parts = [c[i] for c in self.columns]
            out[name] = (torch.cat(parts) if parts else torch.zeros(0, dtype=dtype)).numpy()
        return out


class Writer:
    """Write blocks in order on a background thread (see the module's docstring); use as a
    context manager, which waits for the queued blocks on exit."""

    def __init__(
        self,
        store: Store,
        chunk: int,
        rows: int | None,
        codec: Any,
        depth: int = 1,
        thread: bool = True,
    ) -> None:
        self._store, self._chunk, self._rows, self._codec = store, chunk, rows, codec
        self.thread = thread  # else every block is written in line, by put
        self._queue: queue.Queue[Block | None] = queue.Queue(maxsize=depth)
        self._free: queue.Queue[dict[str, Tensor]] = queue.Queue()
        self._sets, self._max_sets = 0, depth + 2
        self._held = 0  # sets the caller holds (being filled)
        self._error: BaseException | None = None
        self._abandon = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="hookscope-extract", daemon=True)

    def __enter__(self) -> Writer:
        if self.thread:
            self._thread.start()
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        if not self.thread:  # written in line: the caller closes its own event loop
            return
        try:
            self._hand(None, check=False)  # the queued blocks are finished: write them, stop
            while self._thread.is_alive():
                self._thread.join(_POLL)
        except BaseException:
            self._abandon.set()  # a second Ctrl-C: stop after the block being written
            raise
        if self._error is not None and self._error is not ev:
            if ev is None:
                raise self._error
            ev.add_note(f"hookscope.extract: writing also failed: {self._error!r}")

    def buffers(self) -> dict[str, Tensor]:
        """Buffers for a new block: a set handed back by the writer, or a new (empty) one
        while fewer than ``depth + 2`` exist (or the caller holds them all: a batch spanning
        several blocks); otherwise waits for the writer to hand one back."""
        while True:
            try:
                found = (
                    self._free.get(timeout=_POLL) if self._waiting() else self._free.get_nowait()
                )
            except queue.Empty:
                if self._waiting():
                    self._check()
                    continue
                self._sets += 1
                found = {}
            self._held += 1
            return found

    def _waiting(self) -> bool:
        return self.thread and self._sets >= self._max_sets and self._held < self._sets

    def put(self, block: Block) -> None:
        """Queue a finished block (waits while the queue is full), or write it now."""
        self._held -= 1
        if not self.thread:
            self._write(block)
            self._done(block)
            return
        self._hand(block)

    def _hand(self, item: Block | None, check: bool = True) -> None:
        while True:
            if check:
                self._check()
            try:
                self._queue.put(item, timeout=_POLL)
                return
            except queue.Full:
                continue

    def _check(self) -> None:
        if self._error is not None:
            raise self._error
        if not self._thread.is_alive():
            raise RuntimeError("hookscope.extract's writer thread is gone")

    def _loop(self) -> None:
        try:
            while (block := self._queue.get()) is not None:
                if self._error is None and not self._abandon.is_set():
                    try:
                        self._write(block)
                    except BaseException as e:  # raised in the caller (see _check)
                        self._error = e
                self._done(block)
        finally:
            self._store.close()  # the event loop of the store's writes lives in this thread

    def _done(self, block: Block) -> None:
        """A written block: its buffers go back for a later block, and the rows it kept
        without a copy are let go now, not when the caller's loop drops the block after the
        next forward (during which they kept a third batch of memory in use: the forwards of
        an IO-bound extraction ran 1.4x slower than the same forwards in a hand loop)."""
        block.held.clear()
        self._free.put(block.buffers)

    def _write(self, block: Block) -> None:
        block.wait()
        arrays = block.arrays()
        shapes = {n: (tuple(a.shape[1:]), a.dtype) for n, a in arrays.items()}
        end = block.start + block.rows
        self._store.ensure(shapes, max(self._rows or 0, end), self._chunk, self._codec)
        self._store.write(block.index, block.start, arrays, block.ids, block.errors)


def overlap(device: torch.device) -> bool:
    """Whether a writer thread can overlap the forwards on ``device`` (module docstring)."""
    if device.type != "cpu":
        return True
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return torch.get_num_threads() < (cores or 1)


def pinned(device: torch.device) -> bool:
    """Whether host buffers for copies from ``device`` are pinned (non-blocking copies)."""
    return device.type == "cuda"
