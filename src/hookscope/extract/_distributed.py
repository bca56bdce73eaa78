"""``engine="distributed"``: every process of a ``torch.distributed`` job (``torchrun``) runs
the same ``hs.extract`` call, and each computes and writes its own range of the blocks not
done, into the one store, without locks.

The processes talk through a gloo group of their own (made from the default group, whatever
its backend, and destroyed after): they check that they run the same extraction (model
fingerprint, layers, inputs...), then rank 0 creates, resumes or replaces the store and makes
its arrays while the others wait. The blocks not done are cut into one contiguous range per
rank, so the number of ranks may change between a run and its resume: ``done`` says what is
left. With ``unit="token"`` each rank first counts its blocks' tokens from the inputs (no
forward), the counts are shared and written in the store's ledger, and every block then knows
where its rows go (``_tokenstore``). At the end rank 0 writes the rows each rank held back
and marks the store complete; a rank that failed (or was killed) leaves the blocks it
finished, and ``resume=True`` with any number of ranks finishes the store.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._progress import progress
from ..errors import CaptureError, UsageError
from ._job import Job
from ._sources import Unreadable
from ._store import IDENTITY, Store, open_group
from ._tokenjob import TokenJob
from ._tokens import count
from ._tokenstore import TokenStore
from ._writer import Writer, overlap

__all__ = ["run_distributed"]

#: how long a rank waits for the others at a step (the last one: for the slowest to finish)
_TIMEOUT = datetime.timedelta(days=7)
#: what the identity check compares between ranks
_SAME = (*IDENTITY, "codec")


def run_distributed(
    job: Job,
    kind: type[Store],
    out: Any,
    opening: Callable[[], tuple[Store, set[int]]],
    chunk: int,
    bar: bool | None,
    codec: Any,
    shapes: dict[str, Any],
    meta: dict[str, Any],
) -> None:
    """This rank's part of the extraction (see the module's docstring)."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized():
        raise UsageError(
            "engine='distributed' runs in every process of a torch.distributed job: launch "
            "the script with torchrun and call torch.distributed.init_process_group() before "
            "hs.extract"
        )
    group = dist.new_group(backend="gloo", timeout=_TIMEOUT)
    try:
        _Run(job, kind, Path(out), chunk, bar, codec, meta, group).run(opening, shapes)
    finally:
        dist.destroy_process_group(group)


class _Run:
    """One rank's steps, each followed by a word from rank 0 where the others must wait."""

    def __init__(
        self,
        job: Job,
        kind: type[Store],
        out: Path,
        chunk: int,
        bar: bool | None,
        codec: Any,
        meta: dict[str, Any],
        group: Any,
    ) -> None:
        self.job, self.kind, self.out, self.chunk, self.bar = job, kind, out, chunk, bar
        self.codec, self.meta, self.group = codec, meta, group
        dist = torch.distributed
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def run(self, opening: Callable[[], tuple[Store, set[int]]], shapes: dict[str, Any]) -> None:
        self._same_run()
        store, done = self._opened(opening)
        n = len(self.job.src)
        pending = [k for k in range(math.ceil(n / self.chunk)) if k not in done]
        mine = [
            int(k) for k in np.array_split(np.array(pending, dtype=np.int64), self.world)[self.rank]
        ]
        counts = self._counted(mine)
        store = self._made(store, shapes, n, counts)
        self.job.expect(store.row_shapes())
        if isinstance(store, TokenStore) and mine:
            store.hold_from(mine[0])
        outcome = self._computed(store, mine, n)
        self._finished(store, outcome, n)

    # -- the steps ------------------------------------------------------------------------------
    def _same_run(self) -> None:
        mine = {k: self.meta.get(k) for k in _SAME}
        every = self._gather(mine)
        if differ := [r for r, theirs in enumerate(every) if theirs != every[0]]:
            what = [k for k in _SAME if every[differ[0]][k] != every[0][k]]
            raise UsageError(
                f"engine='distributed': rank {differ[0]} runs another extraction than rank 0 "
                f"(it differs in {', '.join(what)}): every rank must call hs.extract with the "
                "same model, data and settings"
            )

    def _opened(self, opening: Callable[[], tuple[Store, set[int]]]) -> tuple[Store, set[int]]:
        """Rank 0 creates, resumes or replaces the store; the others open it after."""
        found: tuple[Store, set[int]] | None = None
        error = None
        if self.rank == 0:
            try:
                found = opening()
            except UsageError as e:
                error = e
        self._word(error)
        if found is not None:
            return found
        store = self.kind(self.out, open_group(self.out, mode="r+"))
        return store, store.done_blocks()

    def _counted(self, mine: list[int]) -> dict[int, int]:
        """Every pending block's tokens (unit="token"): each rank counts its own blocks."""
        if not isinstance(self.job, TokenJob):
            return {}
        counts: dict[int, int] = dict.fromkeys(mine, 0)
        counts.update(count(self.job.selections(self.chunk, set(mine)), self.chunk))
        merged: dict[int, int] = {}
        for part in self._gather(counts):
            merged.update(part)
        return merged

    def _made(self, store: Store, shapes: dict[str, Any], n: int, counts: dict[int, int]) -> Store:
        """Rank 0 makes (or grows) the arrays and writes the token plan; the others wait, then
        open the store again (the arrays are new to them)."""
        error = None
        if self.rank == 0:
            try:
                if isinstance(store, TokenStore) and isinstance(self.job, TokenJob):
                    store.expected = self.chunk * self.job.length()
                    store.plan(counts)
                    store.capacity = store.total()
                as_numpy = {
                    k: (row, torch.empty(0, dtype=d).numpy().dtype)
                    for k, (row, d) in shapes.items()
                }
                store.ensure(as_numpy, n, self.chunk, self.codec)
                if isinstance(store, TokenStore):
                    store.grow(store.capacity)
                    store.save_plan()
            except UsageError as e:
                error = e
        self._word(error)
        if self.rank != 0:
            store = self.kind(self.out, open_group(self.out, mode="r+"))
            if isinstance(store, TokenStore):
                store.plan(counts)
        return store

    def _computed(self, store: Store, mine: list[int], n: int) -> BaseException | None:
        """This rank's blocks, written as the local engine writes; what stopped it, if
        anything (the others are told at the end)."""
        wanted = set(mine)
        total = sum(min(self.chunk, n - k * self.chunk) for k in mine)
        writer = Writer(store, self.chunk, n, self.codec, thread=overlap(self.job.device))
        try:
            label = f"extract (rank {self.rank})"
            with self.job.running(), writer, progress(total, label, self.bar) as advance:
                for block in self.job.blocks(
                    self.chunk, wanted.__contains__, writer.buffers, advance
                ):
                    writer.put(block)
        except BaseException as e:  # told to every rank, raised after
            return e
        finally:
            store.close()
        return None

    def _finished(self, store: Store, outcome: BaseException | None, n: int) -> None:
        """Rank 0 writes the rows held back, then finishes the store if every rank did."""
        held = (store.held, store.held_blocks) if isinstance(store, TokenStore) else ([], set())
        every = self._gather((_status(outcome), held))
        failed = [(r, s) for r, (s, _) in enumerate(every) if s[0] != "ok"]
        error = None
        if self.rank == 0:
            try:
                if isinstance(store, TokenStore):
                    pieces = [p for _, (part, _) in every for p in part]
                    store.write_held(pieces, {b for _, (_, blocks) in every for b in blocks})
                if not failed:
                    store.finish(n, self.meta, self.job.names, None)
                elif store.created and any(s[0] == "refusal" for _, s in failed):
                    store.discard()  # as the local engine: a refusal keeps nothing
            except BaseException as e:  # every rank is told
                error = e
            finally:
                store.close()
        if outcome is not None:
            self._word(error)
            outcome.add_note(f"hookscope.extract: rank {self.rank} stopped; {_advice(self.out)}")
            raise outcome
        self._word(error)
        if failed:
            rank, (kind, message) = failed[0]
            raised = UsageError if kind == "refusal" else RuntimeError
            raise raised(f"hookscope.extract: rank {rank} stopped ({message}); {_advice(self.out)}")

    # -- talking -----------------------------------------------------------------------------
    def _gather(self, value: Any) -> list[Any]:
        every: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(every, value, group=self.group)
        return every

    def _word(self, error: BaseException | None) -> None:
        """Rank 0's error of a step, if any, raised on every rank (as it is on rank 0)."""
        box = [None if error is None else (type(error).__name__, str(error))]
        torch.distributed.broadcast_object_list(box, src=0, group=self.group)
        if self.rank == 0 and error is not None:
            raise error
        if box[0] is not None:
            name, message = box[0]
            raise UsageError(message) if name == "UsageError" else RuntimeError(message)


def _status(outcome: BaseException | None) -> tuple[str, str]:
    if outcome is None:
        return ("ok", "")
    if isinstance(outcome, (UsageError, CaptureError)) and not isinstance(outcome, Unreadable):
        return ("refusal", str(outcome))
    kind = "interrupt" if isinstance(outcome, KeyboardInterrupt) else "error"
    return (kind, f"{type(outcome).__name__}: {outcome}")


def _advice(out: Path) -> str:
    return (
        f"the finished blocks are kept in {str(out)!r}: run again with resume=True (with any "
        "number of ranks) to finish it"
    )
