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
- host memory holds the buffer, two chunks (one mixed, the next being read meanwhile by a
  thread) and one batch per worker;
- reads are whole chunks, each once: the store is read at the speed of reading it in order,
  and each row is copied twice more (into the buffer, and from it into its batch).

The first rows of an epoch can only come from the first chunks read: the order is a uniform
permutation within a window of about ``buffer`` rows, not over the whole store (a larger
buffer widens it; ``buffer >= tokens`` makes it a uniform permutation of all of them).
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
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
        self,
        path: Path,
        layers: list[str],
        batch_size: int,
        seed: int,
        buffer: int,
        drop_last: bool,
    ) -> None:
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
        mixer = _Mixer(max(self.chunk, self.buffer // workers), self.batch_size, rng)
        group = zarr_module().open_group(self.path, mode="r")
        arrays = {name: group[name].async_array for name in (*self.layers, *COLUMNS)}
        loop = asyncio.new_event_loop()  # the reading thread's: every array of a chunk at once
        try:
            with ThreadPoolExecutor(1, thread_name_prefix="hookscope-shuffled") as reader:
                mine = [int(c) for c in order[worker::workers]]

                def read(i: int) -> Future[Rows] | None:
                    return (
                        reader.submit(self._read, loop, arrays, mine[i]) if i < len(mine) else None
                    )

                ahead = read(0)
                for i in range(len(mine)):  # the next chunk is read while this one is mixed
                    assert ahead is not None
                    rows, ahead = ahead.result(), read(i + 1)
                    yield from mixer.add(rows)
        finally:
            loop.close()
        yield from mixer.drain(self.drop_last)

    def _read(self, loop: asyncio.AbstractEventLoop, arrays: dict[str, Any], chunk: int) -> Rows:
        a, b = chunk * self.chunk, min((chunk + 1) * self.chunk, self.tokens)

        async def every() -> list[Any]:
            return list(await asyncio.gather(*(x.getitem(slice(a, b)) for x in arrays.values())))

        rows = {
            name: np.asarray(v)
            for name, v in zip(arrays, loop.run_until_complete(every()), strict=True)
        }
        rows["token"] = np.arange(a, b, dtype=np.int64)
        return rows


Rows = dict[str, np.ndarray[Any, Any]]


class _Mixer:
    """The buffer of ``capacity`` rows (see the module docstring), and the batch being filled:
    rows drawn from the buffer are gathered straight into it."""

    def __init__(self, capacity: int, batch: int, rng: np.random.Generator) -> None:
        self.capacity, self.batch, self.rng = capacity, batch, rng
        self.buffer: Rows = {}
        self.filled = 0
        self._out: Rows = {}
        self._at = 0

    def add(self, rows: Rows) -> Iterator[dict[str, torch.Tensor]]:
        """Rows read: they fill the buffer, then each takes the place of one drawn."""
        if not self.buffer:
            self.buffer = {
                k: np.empty((self.capacity, *v.shape[1:]), v.dtype) for k, v in rows.items()
            }
        n = len(rows["token"])
        first = min(n, self.capacity - self.filled)
        for k, v in rows.items():
            self.buffer[k][self.filled : self.filled + first] = v[:first]
        self.filled += first
        if first < n:
            slots = self.rng.choice(self.capacity, n - first, replace=False)
            yield from self._emit(slots)
            for k, v in rows.items():
                self.buffer[k][slots] = v[first:]

    def drain(self, drop_last: bool) -> Iterator[dict[str, torch.Tensor]]:
        """The rows left, in a random order; then the last, smaller batch."""
        order = self.rng.permutation(self.filled)
        for i in range(0, len(order), self.batch):
            yield from self._emit(order[i : i + self.batch])
        if self._at and not drop_last:
            yield {k: torch.from_numpy(v[: self._at]) for k, v in self._out.items()}

    def _emit(self, slots: np.ndarray[Any, Any]) -> Iterator[dict[str, torch.Tensor]]:
        """The rows at ``slots``, gathered into the batch being filled (whole ones yielded)."""
        done = 0
        while done < len(slots):
            if not self._out:
                self._out = {
                    k: np.empty((self.batch, *b.shape[1:]), b.dtype) for k, b in self.buffer.items()
                }
            part = slots[done : done + self.batch - self._at]
            for k, b in self.buffer.items():
                np.take(b, part, axis=0, out=self._out[k][self._at : self._at + len(part)])
            self._at, done = self._at + len(part), done + len(part)
            if self._at == self.batch:
                yield {k: torch.from_numpy(v) for k, v in self._out.items()}
                self._out, self._at = {}, 0
