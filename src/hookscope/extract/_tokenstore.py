"""A store of token rows (``unit="token"``), written block by block as ``_store`` writes
samples, so that a run killed at any point resumes exactly.

Layout: per layer a ``(tokens, ...)`` array, and the ``sample``, ``position`` and ``token_id``
of each token row beside them (dimension ``token``, chunks of ``token_chunk`` rows); per
sample ``ids`` and ``errors`` (dimension ``input``); per block of ``chunk`` samples ``done``
and ``block_tokens``, how many token rows the block has (-1: not known yet). A block's rows
follow those of every block before it, at an offset that the ledger's counts give, so the
arrays are dense: row ``i`` of every array is one token, in sample order.

Writing a block: its rows, then its ``block_tokens`` entry, then ``done``. Offsets need the
counts of the blocks before: the local engine writes blocks in order, so it knows them (from
the ledger for blocks done earlier, from this run for the others); the multi-process engines
count every block's tokens from the inputs before any forward (and write the counts in the
ledger, so that a later run with other inputs is refused rather than misplaced). A block's
rows rarely fill whole chunks: the chunks it shares with its neighbours are read, changed and
written (zarr does that), which is safe where one writer writes them in turn. Where several
processes write, each holds back its rows in the chunk where its first block starts (a chunk
it may share with another writer: :attr:`TokenStore.hold`); the process that finishes the
store writes them once every writer is done, then marks those blocks done.
"""

from __future__ import annotations

import math
from collections.abc import Coroutine, Mapping
from typing import Any

import numpy as np

from ..errors import UsageError
from ._store import COLUMNS, Shapes, Store, _compressors, _fill, _strings

__all__ = ["TokenStore", "token_chunk"]

_INTS = {"sample": np.dtype("int64"), "position": np.dtype("int32"), "token_id": np.dtype("int32")}
#: a token chunk holds about this many bytes of the largest layer
_CHUNK_BYTES = 2 * 2**20


def token_chunk(shapes: Shapes, block: int) -> int:
    """Rows per chunk of the token arrays: a power of two, about 2 MiB of the widest layer's
    rows, at most a quarter of the rows ``block`` samples are expected to keep, 16 to 65,536.
    A shuffled reader mixes whole chunks, so they stay small."""
    row = max((math.prod(r) * int(np.dtype(d).itemsize) for r, d in shapes.values()), default=4)
    rows = min(_CHUNK_BYTES // max(row, 1), max(1, block // 4))
    return min(65536, max(16, 1 << int(math.log2(max(1, rows)))))


class TokenStore(Store):
    """A token store being written (see the module's docstring)."""

    def __init__(self, path: Any, group: Any, *, new: bool = False) -> None:
        super().__init__(path, group, new=new)
        self.capacity = 0  # token rows the arrays are made with (the multi-process engines)
        self.expected = 0  # token rows a block may hold (sizes the chunks): set by the engine
        self.hold: tuple[int, int] | None = None  # rows this writer leaves to the finisher
        #: rows held back: (array, first row, values); and the blocks they belong to
        self.held: list[tuple[str, int, Any]] = []
        self.held_blocks: set[int] = set()
        self._counts: np.ndarray[Any, Any] | None = None
        self._cum = [0]  # token offsets of blocks 0, 1, ... as far as counts are known

    # -- the ledger of token counts -------------------------------------------------------------
    def counts(self) -> np.ndarray[Any, Any]:
        """Token rows per block (-1: unknown), from the ledger of the store as opened."""
        if self._counts is None:
            found = "block_tokens" in self.group and not self._new and "done" in self.group
            self._counts = (
                self.group["block_tokens"][:].astype(np.int64)
                if found
                else np.zeros(0, dtype=np.int64)
            )
        return self._counts

    def plan(self, counts: Mapping[int, int]) -> None:
        """Counts known before the blocks are computed (the multi-process engines)."""
        for k, n in counts.items():
            self._count(k, n)

    def save_plan(self) -> None:
        """Write every known count in the ledger (before any row: see the module docstring)."""
        counts = self.counts()
        self._resize(["block_tokens"], len(counts))
        self._run([self._async("block_tokens").setitem(slice(0, len(counts)), counts)])

    def hold_from(self, block: int) -> None:
        """Hold back this writer's rows in the chunk where ``block``, its first, starts (unless
        the block starts a chunk): another writer may write that chunk's first rows."""
        offset, size = self.offset(block), self._async("sample").metadata.chunk_grid.chunk_shape[0]
        self.hold = (offset, (offset // size + 1) * size) if offset % size else None

    def _count(self, block: int, n: int) -> None:
        counts = self.counts()
        if block >= len(counts):
            counts = self._counts = np.concatenate(
                [counts, np.full(block + 1 - len(counts), -1, dtype=np.int64)]
            )
        if counts[block] >= 0 and counts[block] != n:
            raise UsageError(
                f"block {block} of {str(self.path)!r} now keeps {n} tokens where its run "
                f"counted {int(counts[block])}: the inputs changed since the store was started "
                "(other texts, another tokenizer or token rule). Use the same inputs, or "
                "overwrite=True to start again"
            )
        counts[block] = n

    def offset(self, block: int) -> int:
        """The first token row of ``block``: the rows of every block before it."""
        counts = self.counts()
        while len(self._cum) <= block:
            j = len(self._cum) - 1
            if j >= len(counts) or counts[j] < 0:
                raise RuntimeError(f"hookscope: block {j}'s tokens are not counted before {block}")
            self._cum.append(self._cum[-1] + int(counts[j]))
        return self._cum[block]

    def total(self) -> int:
        counts = self.counts()
        return int(counts[counts > 0].sum())

    # -- arrays -------------------------------------------------------------------------------
    def ensure(self, shapes: Shapes, rows: int, chunk: int, codec: Any = "none") -> None:
        """Create the arrays on first use (``done`` last), or grow the per-sample ones."""
        layers = {n: s for n, s in shapes.items() if n not in COLUMNS}
        if not self._ready:
            if self._new or "done" not in self.group:
                self._create(layers, rows, chunk, codec)
            self._ready = True
        self._resize(("ids", "errors"), rows)
        self._resize(("done", "block_tokens"), math.ceil(rows / chunk))

    _INPUT_DIM = "input"

    def _layer_arrays(
        self, shapes: Shapes, rows: int, chunk: int, codec: Any
    ) -> dict[str, Coroutine[Any, Any, Any]]:
        """Each layer's ``(tokens, ...)`` array, the columns beside them and the block ledger."""
        size, tokens, made = token_chunk(shapes, self.expected), self.capacity, {}
        for name, (row, dtype) in shapes.items():
            made[name] = self._new_array(
                name,
                shape=(tokens, *row),
                chunks=(size, *row),
                dtype=dtype,
                fill_value=_fill(np.dtype(dtype)),
                compressors=_compressors(codec),
                dimension_names=["token", *(f"{name}_{i}" for i in range(1, len(row) + 1))],
                config={"write_empty_chunks": True},
                attributes={"coordinates": " ".join(COLUMNS)},
            )
        for name, dtype in _INTS.items():
            made[name] = self._new_array(
                name,
                shape=(tokens,),
                chunks=(size,),
                dtype=dtype,
                fill_value=-1,
                dimension_names=["token"],
                compressors=None,
            )
        made["block_tokens"] = self._new_array(
            "block_tokens",
            shape=(max(1, math.ceil(rows / chunk)),),
            chunks=(1,),
            dtype="int64",
            fill_value=-1,
            dimension_names=["block"],
            compressors=None,
        )
        return made

    def _token_arrays(self) -> list[str]:
        return [*self.group.attrs["hookscope"]["layers"], *COLUMNS]

    def grow(self, need: int) -> None:
        """Token arrays of at least ``need`` rows (twice as many: few resizes)."""
        have = min(self._async(name).shape[0] for name in self._token_arrays())
        if need > have:
            chunk = self._async("sample").metadata.chunk_grid.chunk_shape[0]
            self._resize(self._token_arrays(), max(need, 2 * have, chunk))

    # -- writing ------------------------------------------------------------------------------
    def write(
        self,
        block: int,
        start: int,
        features: Mapping[str, Any],
        ids: list[str],
        errors: list[str],
    ) -> None:
        """A block's token rows at its offset, its samples' ids, then its ``block_tokens`` and
        ``done`` entries (``done`` only if no row was held back)."""
        n = len(features["sample"])
        self._count(block, n)
        offset = self.offset(block)
        self.grow(offset + n)
        sets, held = [], False
        for name, values in features.items():
            for a, b in _pieces(offset, n, self._async(name).metadata.chunk_grid.chunk_shape[0]):
                part = values[a - offset : b - offset]
                if self.hold is not None and self.hold[0] <= a < self.hold[1]:
                    self.held.append((name, a, np.array(part)))
                    held = True
                elif not self._whole_chunk(name, a, part):
                    sets.append(self._async(name).setitem(slice(a, b), part))
        rows = slice(start, start + len(ids))
        sets.append(self._async("ids").setitem(rows, _strings(ids)))
        if any(errors) or not self._fresh:
            sets.append(self._async("errors").setitem(rows, _strings(errors)))
        self._run(sets)
        self._mark("block_tokens", block, np.full(1, n, dtype=np.int64))
        if held:
            self.held_blocks.add(block)
        else:
            self._mark("done", block, np.ones(1, dtype=bool))
        self.errors_written.update((i, e) for i, e in zip(ids, errors, strict=True) if e)

    def _mark(self, name: str, block: int, value: Any) -> None:
        if not self._whole_chunk(name, block, value):
            self._run([self._async(name).setitem(block, value[0])])

    def write_held(self, held: list[tuple[str, int, Any]], blocks: set[int]) -> None:
        """The rows writers held back (each array's rows in order, contiguous runs together),
        then the ``done`` entries of their blocks: by the one process finishing the store."""
        by_name: dict[str, list[tuple[int, Any]]] = {}
        for name, a, values in held:
            by_name.setdefault(name, []).append((a, values))
        sets = []
        for name, parts in by_name.items():
            parts.sort(key=lambda p: p[0])
            runs: list[tuple[int, list[Any]]] = []
            for a, values in parts:
                if runs and runs[-1][0] + sum(len(v) for v in runs[-1][1]) == a:
                    runs[-1][1].append(values)
                else:
                    runs.append((a, [values]))
            for a, pieces in runs:
                values = np.concatenate(pieces)
                sets.append(self._async(name).setitem(slice(a, a + len(values)), values))
        if sets:
            self._run(sets)
        for block in sorted(blocks):
            self._mark("done", block, np.ones(1, dtype=bool))

    # -- finishing ----------------------------------------------------------------------------
    def _trim(self, rows: int, features: list[str]) -> None:
        super()._trim(rows, [])
        self._resize(self._token_arrays(), self.total(), grow_only=False)

    def _totals(self) -> dict[str, Any]:
        return {"tokens": self.total()}


def _pieces(offset: int, n: int, size: int) -> list[tuple[int, int]]:
    """Rows ``offset .. offset+n-1`` split at chunk boundaries (chunks of ``size`` rows)."""
    pieces, a = [], offset
    while a < offset + n:
        b = min(offset + n, (a // size + 1) * size)
        pieces.append((a, b))
        a = b
    return pieces
