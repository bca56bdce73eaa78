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
import sys
from typing import Any

import torch
from torch import nn

from .._extras import require
from .._progress import progress
from ._store import Store, open_group

__all__ = ["run_ray"]


class _Worker:
    """A Ray actor: the model and the source, built once; ``__call__`` computes and writes
    the blocks of a Ray batch."""

    def __init__(self, payload: dict[str, Any]) -> None:
        from ._job import Job

        torch.set_num_threads(payload["threads"])
        model = _loads(payload["model"])
        model = model() if payload["factory"] else model
        if not isinstance(model, nn.Module):
            raise TypeError(f"the model factory returned {type(model).__name__}")
        self.job = Job(model, *payload["job"])
        self.job.expect(payload["shapes"])
        self.chunk = payload["chunk"]
        self.store = Store(payload["path"], open_group(payload["path"], mode="r+"))

    def __call__(self, batch: dict[str, Any]) -> dict[str, Any]:
        rows = []
        with self.job.running(), contextlib.closing(self.store):
            for index in batch["block"].tolist():
                for block in self.job.blocks(self.chunk, index.__eq__, dict, _nothing):
                    block.wait()
                    self.store.write(block.index, block.start, block.arrays(), block.ids,
                                     block.errors)  # fmt: skip
                    rows.append(block.rows)
        return {"block": batch["block"], "rows": rows}


def _nothing(n: int = 1) -> None:
    return None


def run_ray(
    job: Any, store: Store, done: set[int], chunk: int, factory: Any, workers: int,
    bar: bool | None, codec: Any, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
) -> int:  # fmt: skip
    """Every block not done, on a Ray actor pool; returns the number of samples. The arrays
    are made here from ``shapes`` (sample 0's rows), before any actor writes."""
    ray = require("ray", "ray", purpose="engine='ray'")
    require("ray.data", "ray", purpose="engine='ray'")
    n = len(job.src)
    pending = [k for k in range(math.ceil(n / chunk)) if k not in done]
    if not pending:
        return n
    as_numpy = {k: (row, torch.empty(0, dtype=d).numpy().dtype) for k, (row, d) in shapes.items()}
    store.ensure(as_numpy, n, chunk, codec)
    payload = {
        "model": _dumps(factory if factory is not None else job.model),
        "factory": factory is not None,
        "job": job.spec(),
        "shapes": store.row_shapes(),
        "chunk": chunk,
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
