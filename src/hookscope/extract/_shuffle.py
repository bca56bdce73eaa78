"""``FeatureStore.shuffled``: a token store's rows in a seeded random order, every row exactly
once per epoch, as a PyTorch ``IterableDataset`` (DataLoader workers share the rows out).

Reading single rows at random from disk is slow; reading whole chunks in order is not random.
The rows are read a chunk at a time, in a random order of the chunks (each worker reads its
own share of that order), into a buffer of ``buffer`` rows (``buffer // workers`` per worker);
once the buffer is full, each row read takes the place of a row chosen uniformly at random in
the buffer, which is emitted. So:

- every row is emitted exactly once (the buffer is emptied, in a random order, at the end);
- each emitted row is a uniform draw from the rows in the buffer at that moment, which come
  from about ``buffer / token_chunk`` chunks: a batch mixes rows of many chunks, never one
  chunk's rows in order (a shuffle of chunks alone would);
- the order is a function of ``seed``, the epoch (:meth:`Shuffled.set_epoch`) and the number
  of workers; another seed gives another permutation;
- host memory holds the buffer, one chunk being read and one batch per worker;
- reads are whole chunks, each once: the store is read at the speed of reading it in order.

The first rows of an epoch can only come from the first chunks read: the order is a uniform
permutation within a window of about ``buffer`` rows, not over the whole store (a larger
buffer widens it; ``buffer >= tokens`` makes it a uniform permutation of all of them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ._store import COLUMNS, zarr_module

__all__ = ["Shuffled"]


class Shuffled(torch.utils.data.IterableDataset[dict[str, torch.Tensor]]):
    """Batches of a token store's rows in a seeded random order (see the module docstring):
    dicts of tensors, one per layer ``(batch_size, ...)``, with each row's ``sample``,
    ``position``, ``token_id`` and ``token`` (its row in the store). Give it to a
    ``DataLoader`` with ``batch_size=None`` (its items are batches already)."""

    def __init__(
        self, path: Path, layers: list[str], batch_size: int, seed: int, buffer: int,
        drop_last: bool,
    ) -> None:  # fmt: skip
        self.path, self.layers, self.batch_size = str(path), layers, batch_size
        self.seed, self.buffer, self.drop_last = seed, buffer, drop_last
        self.epoch = 0
        group = zarr_module().open_group(self.path, mode="r")
        self.tokens = int(group["sample"].shape[0])
        self.chunk = int(group["sample"].chunks[0])

    def __repr__(self) -> str:
        return (
            f"<Shuffled {self.tokens} tokens of {self.path!r}: batches of {self.batch_size}, "
            f"buffer {self.buffer}, seed {self.seed}, epoch {self.epoch}>"
        )

    def set_epoch(self, epoch: int) -> None:
        """Another epoch, another order (as ``DistributedSampler.set_epoch``): call it before
        each epoch's loop, since DataLoader workers get a copy of this object."""
        self.epoch = epoch

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        chunks = math.ceil(self.tokens / self.chunk)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(chunks)
        rng = np.random.default_rng([self.seed, self.epoch, workers, worker])
        capacity = max(self.chunk, self.buffer // workers)
        group = zarr_module().open_group(self.path, mode="r")
        arrays = {name: group[name] for name in (*self.layers, *COLUMNS)}
        reads = (self._read(arrays, int(c)) for c in order[worker::workers])
        batches = _Batches(self.batch_size)
        for rows in _mixed(reads, capacity, rng):
            yield from batches.add(rows)
        if (last := batches.rest()) is not None and not self.drop_last:
            yield last

    def _read(self, arrays: dict[str, Any], chunk: int) -> dict[str, np.ndarray[Any, Any]]:
        a, b = chunk * self.chunk, min((chunk + 1) * self.chunk, self.tokens)
        rows = {name: np.asarray(array[a:b]) for name, array in arrays.items()}
        rows["token"] = np.arange(a, b, dtype=np.int64)
        return rows


Rows = dict[str, np.ndarray[Any, Any]]


def _mixed(reads: Iterator[Rows], capacity: int, rng: np.random.Generator) -> Iterator[Rows]:
    """Rows out of a buffer of ``capacity`` rows (see the module docstring)."""
    buffer: Rows = {}
    filled = 0
    for rows in reads:
        if not buffer:
            buffer = {k: np.empty((capacity, *v.shape[1:]), v.dtype) for k, v in rows.items()}
        n = len(rows["token"])
        first = min(n, capacity - filled)  # room left: no row is emitted yet
        for k, v in rows.items():
            buffer[k][filled : filled + first] = v[:first]
        filled += first
        if first < n:  # each row read replaces one drawn at random, which goes out
            slots = rng.choice(capacity, n - first, replace=False)
            yield {k: b[slots] for k, b in buffer.items()}
            for k, v in rows.items():
                buffer[k][slots] = v[first:]
    order = rng.permutation(filled)
    if filled:
        yield {k: b[order] for k, b in buffer.items()}


class _Batches:
    """Rows cut into batches of ``size`` (what is left waits for the next rows)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._rest: Rows | None = None

    def add(self, rows: Rows) -> Iterator[dict[str, torch.Tensor]]:
        if self._rest is not None:
            rows = {k: np.concatenate([self._rest[k], v]) for k, v in rows.items()}
            self._rest = None
        n, start = len(rows["token"]), 0
        while n - start >= self.size:
            yield {k: torch.from_numpy(v[start : start + self.size]) for k, v in rows.items()}
            start += self.size
        if start < n:
            self._rest = {k: v[start:].copy() for k, v in rows.items()}

    def rest(self) -> dict[str, torch.Tensor] | None:
        if self._rest is None:
            return None
        return {k: torch.from_numpy(v) for k, v in self._rest.items()}
