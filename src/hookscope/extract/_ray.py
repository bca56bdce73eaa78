"""``engine="ray"``: the blocks of one extraction as a Ray Data dataset, mapped by a pool of
actors that each build the model once and write their blocks straight into the store.

Each block is one item, written to its own rows and marked ``done`` by the actor that computed
it, so a block Ray runs twice (a retried task) writes the same rows twice and nothing is lost or
duplicated; the resume rule is the local engine's. The arrays are created here, before any actor
starts, from a forward of one sample. Actors use this process's thread count, so every block is
computed exactly as the local engine computes it: the stores are equal bit for bit.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .._extras import require
from .._progress import progress
from ._store import Store, zarr_module

__all__ = ["run_ray"]


class _Worker:
    """A Ray actor: the model and the source, built once; ``__call__`` computes and writes
    the blocks of a Ray batch."""

    def __init__(self, payload: dict[str, Any]) -> None:
        from ._extract import Job

        torch.set_num_threads(payload["threads"])
        model = payload["model"]
        model = model() if payload["factory"] else model
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}")
        self.job = Job(model, *payload["job"])
        self.chunk, self.n = payload["chunk"], payload["n"]
        self.store = Store(
            payload["path"], zarr_module().open_group(str(payload["path"]), mode="r+")
        )

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        for block in batch["block"].tolist():
            start = block * self.chunk
            values, ids, errors = self.job.block(start, min(start + self.chunk, self.n))
            self.store.write(block, start, values, ids, errors)
        return {"block": batch["block"], "rows": [len(ids)] * len(batch["block"])}


def run_ray(
    job: Any, store: Store, done: set[int], chunk: int, factory: Any, workers: int,
    bar: bool | None,
) -> int:  # fmt: skip
    """Every block not done, on a Ray actor pool; returns the number of samples."""
    ray = require("ray", "ray", purpose="engine='ray'")
    require("ray.data", "ray", purpose="engine='ray'")
    n = len(job.src)
    values, _, _ = job.block(0, 1)  # shapes and dtypes of every layer's rows
    store.ensure(values, n, chunk)
    pending = [k for k in range(math.ceil(n / chunk)) if k not in done]
    if not pending:
        return n
    payload = {
        "model": factory if factory is not None else job.model,
        "factory": factory is not None,
        "job": (job.src, job.names, job.batch_size, job.reduce, job.dtype, job.device, job.stop),
        "chunk": chunk,
        "n": n,
        "path": store.path,
        "threads": torch.get_num_threads(),
    }
    context = ray.data.DataContext.get_current()
    context.enable_progress_bars = False  # ours counts samples
    items = ray.data.from_items([{"block": k} for k in pending])
    mapped = items.map_batches(
        _Worker,
        fn_constructor_kwargs={"payload": payload},
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=min(workers, len(pending))),
        num_cpus=1,
    )
    total = sum(min(chunk, n - k * chunk) for k in pending)
    with progress(total, "extract (ray)", bar) as advance:
        for row in mapped.iter_rows():
            advance(int(row["rows"]))
    return n
