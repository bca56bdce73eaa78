"""``engine="ray"``: the blocks of one extraction as a Ray Data dataset, mapped by a pool of
actors that each build the model once and write their blocks straight into the store.

Each block is one item, written to its own rows and marked ``done`` by the actor that computed
it, so a block Ray runs twice (a retried task) writes the same rows twice and nothing is lost or
duplicated; the resume rule is the local engine's. The arrays are created here, before any actor
starts, from a forward of one sample. Actors use this process's thread count, so every block is
computed exactly as the local engine computes it: the stores are equal bit for bit.

The model (or its factory) travels pickled. Ray's workers import the modules that classes and
functions come from; a module that is not part of an installed distribution (``__main__``, a
file next to a script, a notebook's helpers) is pickled by value instead, so the actors need
not find it on their path.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import math
import pickle
import sys
from typing import Any

import numpy as np
import torch
from torch import nn

from .._extras import require
from .._progress import progress
from ._store import Store, open_group
from ._tokens import count
from ._tokenstore import TokenStore

__all__ = ["run_ray"]


class _Worker:
    """A Ray actor: the model and the source, built once; ``__call__`` computes and writes
    the parts (ranges of blocks) of a Ray batch."""

    def __init__(self, payload: dict[str, Any]) -> None:
        from ._job import Job
        from ._tokenjob import TokenJob

        torch.set_num_threads(payload["threads"])
        model = _loads(payload["model"])
        model = model() if payload["factory"] else model
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}")
        self.job = (TokenJob if payload["tokens"] else Job)(model, *payload["job"])
        self.job.expect(payload["shapes"])
        self.chunk, self.parts = payload["chunk"], payload["parts"]
        kind = TokenStore if payload["tokens"] else Store
        self.store = kind(payload["path"], open_group(payload["path"], mode="r+"))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        rows, held = [], []
        with self.job.running(), contextlib.closing(self.store):
            for part in batch["part"].tolist():
                blocks = self.parts[part]
                if isinstance(self.store, TokenStore):  # rows another actor's chunk may share
                    self.store.held, self.store.held_blocks = [], set()
                    self.store.hold_from(blocks[0])
                done = 0
                for block in self.job.blocks(self.chunk, set(blocks).__contains__, dict, _nothing):
                    block.wait()
                    self.store.write(
                        block.index, block.start, block.arrays(), block.ids, block.errors
                    )
                    done += block.rows
                rows.append(done)
                kept = self.store if isinstance(self.store, TokenStore) else None
                held.append(pickle.dumps((kept.held, kept.held_blocks) if kept else ([], set())))
        return {"part": batch["part"], "rows": rows, "held": held}


def _nothing(n: int = 1) -> None:
    return None


def run_ray(
    job: Any,
    store: Store,
    done: set[int],
    chunk: int,
    factory: Any,
    workers: int,
    bar: bool | None,
    codec: Any,
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> int:
    """Every block not done, on a Ray actor pool; returns the number of samples. The arrays
    are made here from ``shapes`` (sample 0's rows), before any actor writes. Token stores
    (unit="token") count every block's tokens here first, which places their rows, and give
    each actor a range of blocks: it holds back the rows of the chunk its range starts in,
    which are written here once every range is done (``_tokenstore``)."""
    ray = require("ray", "ray", purpose="engine='ray'")
    require("ray.data", "ray", purpose="engine='ray'")
    n = len(job.src)
    pending = [k for k in range(math.ceil(n / chunk)) if k not in done]
    if not pending:
        return n
    parts = [[k] for k in pending]
    if isinstance(store, TokenStore):
        store.expected = chunk * job.length()
        counts = dict.fromkeys(pending, 0)
        counts.update(count(job.selections(chunk, set(pending)), chunk))
        store.plan(counts)
        store.capacity = store.total()
        cut = np.array_split(np.array(pending), min(len(pending), 4 * workers))
        parts = [[int(k) for k in p] for p in cut if len(p)]
    as_numpy = {k: (row, torch.empty(0, dtype=d).numpy().dtype) for k, (row, d) in shapes.items()}
    store.ensure(as_numpy, n, chunk, codec)
    if isinstance(store, TokenStore):
        store.grow(store.capacity)
        store.save_plan()
    payload = {
        "model": _dumps(factory if factory is not None else job.model),
        "factory": factory is not None,
        "tokens": isinstance(store, TokenStore),
        "job": job.spec(),
        "shapes": store.row_shapes(),
        "chunk": chunk,
        "parts": parts,
        "path": store.path,
        "threads": torch.get_num_threads(),
    }
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours counts samples
    items = ray.data.from_items([{"part": i} for i in range(len(parts))])
    mapped = items.map_batches(
        _Worker,
        fn_constructor_kwargs={"payload": payload},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=min(workers, len(parts))),
        num_cpus=1,
    )
    total = sum(min(chunk, n - k * chunk) for k in pending)
    held: dict[int, Any] = {}  # per part: a part Ray ran twice held the same rows twice
    with progress(total, "extract (ray)", bar) as advance:
        for row in mapped.iter_rows():
            advance(int(row["rows"]))
            held[int(row["part"])] = pickle.loads(row["held"])
    if isinstance(store, TokenStore):
        store.write_held(
            [p for pieces, _ in held.values() for p in pieces],
            {b for _, blocks in held.values() for b in blocks},
        )
    return n


def _dumps(obj: Any) -> bytes:
    """``obj`` pickled by Ray's cloudpickle, modules outside installed packages by value."""
    cloudpickle: Any = importlib.import_module("ray.cloudpickle")
    local = _local_modules()
    registered = set(cloudpickle.list_registry_pickle_by_value())
    added = [m for m in local if m.__name__ not in registered]
    for module in added:
        cloudpickle.register_pickle_by_value(module)
    try:
        return bytes(cloudpickle.dumps(obj))
    finally:
        for module in added:  # the registry is global: leave it as found
            cloudpickle.unregister_pickle_by_value(module)


def _loads(data: bytes) -> Any:
    return importlib.import_module("ray.cloudpickle").loads(data)


def _local_modules() -> list[Any]:
    """Imported modules that no installed distribution provides (a script's neighbours, a
    notebook's helpers): the model's classes, and what they use, may come from them.
    ``__main__`` is left out (cloudpickle pickles it by value already), and hookscope too:
    the workers run it, so they must import it anyway."""
    known = set(importlib.metadata.packages_distributions())
    known |= set(sys.stdlib_module_names) | set(sys.builtin_module_names) | {"hookscope"}
    return [
        module
        for name, module in list(sys.modules.items())
        if module is not None and name != "__main__" and name.split(".")[0] not in known
    ]
