"""The on-disk store: a Zarr v3 group, written block by block so that a run killed at any
point can be resumed.

Layout: one array per layer (samples along axis 0, ``dimension_names`` for xarray), ``ids``
(strings), ``errors`` (why a sample could not be read, ``""`` when it was) and ``done``, one
boolean per block of ``chunk`` samples. A block's rows are written first (each zarr chunk file
is written to a temporary name and renamed, so a chunk is whole or absent), and only then its
``done`` entry: a block is finished exactly when ``done`` says so, never because chunk files
exist. Resuming recomputes every block not marked done, overwriting whatever it left.
Metadata lives in the group's attributes under ``"hookscope"``.
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .._extras import require
from ..errors import UsageError

__all__ = ["META", "Store"]

META = "hookscope"
_RESERVED = ("ids", "errors", "done")
#: What must be the same to resume a store (the rest of the metadata may differ).
IDENTITY = ("model", "fingerprint", "layers", "reduce", "dtype", "chunk", "batch_size", "input")


def zarr_module() -> Any:
    return require("zarr", "zarr", purpose="writing and reading feature stores")


class Store:
    """A feature store being written (see the module's docstring)."""

    def __init__(self, path: Path, group: Any) -> None:
        self.path, self.group = path, group

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls, path: str | os.PathLike[str], meta: dict[str, Any], *, overwrite: bool, resume: bool
    ) -> tuple[Store, set[int]]:
        """The store and the blocks already done; creates, replaces or resumes it."""
        zarr = zarr_module()
        path = Path(path)
        if path.exists() and not (resume or overwrite):
            raise UsageError(
                f"{str(path)!r} already exists: pass resume=True to finish it or "
                "overwrite=True to replace it"
            )
        if path.exists() and resume:
            try:
                group = zarr.open_group(str(path), mode="r+")
                old = dict(group.attrs[META])
            except Exception as e:
                raise UsageError(f"{str(path)!r} is not a hookscope feature store ({e})") from None
            _check_same(old, meta, path)
            for partial in path.rglob("*.partial"):  # a chunk write cut short by a kill
                partial.unlink()
            store = cls(path, group)
            return store, store.done_blocks()
        if path.exists():
            if not (path / "zarr.json").is_file():
                raise UsageError(
                    f"overwrite=True would delete {str(path)!r}, which is not a zarr store; "
                    "choose another path"
                )
            shutil.rmtree(path)
        group = zarr.open_group(str(path), mode="w")
        group.attrs[META] = {**meta, "complete": False}
        return cls(path, group), set()

    def done_blocks(self) -> set[int]:
        if "done" not in self.group:
            return set()
        return {int(i) for i in self.group["done"][:].nonzero()[0]}

    # -- writing ------------------------------------------------------------------------------
    def ensure(self, features: Mapping[str, Any], rows: int, chunk: int) -> None:
        """Create the arrays on first use (shapes from ``features``, one block's worth) or grow
        them to ``rows`` samples (a source that did not say its length)."""
        blocks = math.ceil(rows / chunk)
        if "done" not in self.group:
            for name, value in features.items():
                if name in _RESERVED:
                    raise UsageError(f"a layer may not be called {name!r} in a feature store")
                dims = ["sample", *(f"{name}_{i}" for i in range(1, value.ndim))]
                self.group.create_array(
                    name,
                    shape=(rows, *value.shape[1:]),
                    chunks=(chunk, *value.shape[1:]),
                    dtype=value.dtype,
                    fill_value=_fill(value.dtype),
                    dimension_names=dims,
                )
            for name in ("ids", "errors"):
                self.group.create_array(
                    name, shape=(rows,), chunks=(chunk,), dtype=str, dimension_names=["sample"]
                )
            self.group.create_array(
                "done", shape=(blocks,), chunks=(1,), dtype=bool, fill_value=False,
                dimension_names=["block"],
            )  # fmt: skip
        elif self.group["ids"].shape[0] < rows:
            for name in (*features, "ids", "errors"):
                array = self.group[name]
                array.resize((rows, *array.shape[1:]))
            self.group["done"].resize((blocks,))

    def write(
        self, block: int, start: int, features: Mapping[str, Any], ids: list[str],
        errors: list[str],
    ) -> None:  # fmt: skip
        """Rows ``start ..`` of every array, then the block's ``done`` entry."""
        stop = start + len(ids)
        for name, value in features.items():
            self.group[name][start:stop] = value
        self.group["ids"][start:stop] = _strings(ids)
        self.group["errors"][start:stop] = _strings(errors)
        self.group["done"][block] = True

    def finish(self, rows: int, meta: dict[str, Any], features: list[str]) -> None:
        """Trim to ``rows`` samples and mark the store complete in its metadata."""
        if "ids" in self.group and self.group["ids"].shape[0] != rows:
            for name in (*features, "ids", "errors"):
                array = self.group[name]
                array.resize((rows, *array.shape[1:]))
        errors = {}
        if "errors" in self.group and rows:
            reasons = self.group["errors"][:]
            ids = self.group["ids"][:]
            errors = {str(ids[i]): str(reasons[i]) for i in reasons.nonzero()[0]}
        old = dict(self.group.attrs[META])
        self.group.attrs[META] = {
            **old, **meta, "samples": rows, "errors": errors, "complete": True,
            "arrays": {n: {"shape": list(self.group[n].shape), "dtype": str(self.group[n].dtype)}
                       for n in features},
        }  # fmt: skip


def _check_same(old: Mapping[str, Any], new: Mapping[str, Any], path: Path) -> None:
    differ = [k for k in IDENTITY if old.get(k) != new.get(k)]
    if differ:
        what = "; ".join(f"{k}: stored {old.get(k)!r}, now {new.get(k)!r}" for k in differ)
        raise UsageError(
            f"cannot resume {str(path)!r}: the run differs from the one that made it ({what}). "
            "Use the same settings, or overwrite=True to start again"
        )


def _fill(dtype: Any) -> Any:
    return float("nan") if dtype.kind == "f" else 0


def _strings(values: list[str]) -> Any:
    import numpy as np

    return np.array(values, dtype=object).astype(str)
