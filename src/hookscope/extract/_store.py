"""The on-disk store: a Zarr v3 group, written block by block so that a run killed at any
point can be resumed.

Layout: one array per layer (samples along axis 0, ``dimension_names`` for xarray), ``ids``
(strings), ``errors`` (why a sample could not be read, ``""`` when it was) and ``done``, one
boolean per block of ``chunk`` samples. A block's rows are written first (each zarr chunk file
is written to a temporary name and renamed, so a chunk is whole or absent), and only then its
``done`` entry: a block is finished exactly when ``done`` says so, never because chunk files
exist. ``done`` is also created last, so a store without it has nothing finished and its
arrays are made again. Resuming recomputes every block not marked done, overwriting whatever
it left. Metadata lives in the group's attributes under ``"hookscope"``, written with the group
itself (one file, replaced atomically).
"""

from __future__ import annotations

import math
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from .._extras import require
from ..errors import UsageError

__all__ = ["CODECS", "IDENTITY", "META", "Codec", "Store", "check_codec", "zarr_module"]

META = "hookscope"
_RESERVED = ("ids", "errors", "done")
#: What must be the same to resume a store (the rest of the metadata may differ).
IDENTITY = (
    "model", "fingerprint", "layers", "reduce", "dtype", "chunk", "batch_size", "input", "probe",
)  # fmt: skip
_LABELS = {"probe": "the first sample's model input (transform, image size, tokenizer, order)"}
Codec = Literal["none", "lz4", "zstd"]
CODECS = ("none", "lz4", "zstd")
#: ``{layer: (row shape, numpy dtype)}``
Shapes = Mapping[str, tuple[tuple[int, ...], Any]]


def zarr_module() -> Any:
    return require("zarr", "zarr", purpose="writing and reading feature stores")


def check_codec(codec: Any) -> None:
    if isinstance(codec, str) and codec not in CODECS:
        raise UsageError(f"codec={codec!r}: use one of {list(CODECS)} or zarr codec objects")


def _compressors(codec: Any) -> Any:
    """zarr's ``compressors=`` for the layer arrays."""
    if codec is None or codec == "none":
        return None  # float features rarely shrink much, and writing is the cost to avoid
    from zarr.codecs import BloscCodec, ZstdCodec

    if codec == "lz4":  # byte shuffle + lz4: fast, and small for maps full of ReLU zeros
        return BloscCodec(cname="lz4", clevel=5, shuffle="shuffle")
    if codec == "zstd":
        return ZstdCodec(level=3)
    return codec


class Store:
    """A feature store being written (see the module's docstring)."""

    def __init__(self, path: Path, group: Any) -> None:
        self.path, self.group = path, group
        self._arrays: dict[str, Any] = {}
        self._ready = False  # the arrays exist (checked once)

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
            _remove(path)
        group = zarr.open_group(str(path), mode="w", attributes={META: {**meta, "complete": False}})
        return cls(path, group), set()

    @staticmethod
    def chunk_of(path: str | os.PathLike[str]) -> int | None:
        """The chunk of the store at ``path``, if there is one (resuming keeps it)."""
        try:
            return int(zarr_module().open_group(str(path), mode="r").attrs[META]["chunk"])
        except Exception:  # no store there (yet): Store.open says what is wrong
            return None

    def done_blocks(self) -> set[int]:
        if "done" not in self.group:
            return set()
        return {int(i) for i in self.group["done"][:].nonzero()[0]}

    def row_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``{layer: (row shape, dtype)}`` of the arrays a resumed store already has."""
        if "done" not in self.group:
            return {}
        meta = self.group.attrs[META]
        return {
            name: (tuple(a.shape[1:]), a.dtype)
            for name in meta["layers"]
            if (a := self._array(name)) is not None
        }

    def _array(self, name: str) -> Any:
        if name not in self._arrays:
            if name not in self.group:
                return None
            self._arrays[name] = self.group[name]
        return self._arrays[name]

    # -- writing ------------------------------------------------------------------------------
    def ensure(self, shapes: Shapes, rows: int, chunk: int, codec: Any = "none") -> None:
        """Create the arrays on first use (``done`` last) or grow them to ``rows`` samples (a
        source that did not say its length)."""
        if not self._ready:
            if "done" not in self.group:
                self._create(shapes, rows, chunk, codec)
            self._ready = True
        if self._array("ids").shape[0] < rows:
            for name in (*shapes, "ids", "errors"):
                array = self._array(name)
                array.resize((rows, *array.shape[1:]))
            self._array("done").resize((math.ceil(rows / chunk),))

    def _create(self, shapes: Shapes, rows: int, chunk: int, codec: Any) -> None:
        # overwrite=True: arrays left by a run killed before ``done`` existed hold nothing done
        compressors = _compressors(codec)
        for name, (row, dtype) in shapes.items():
            if name in _RESERVED:
                raise UsageError(f"a layer may not be called {name!r} in a feature store")
            dims = ["sample", *(f"{name}_{i}" for i in range(1, len(row) + 1))]
            self.group.create_array(
                name, shape=(rows, *row), chunks=(chunk, *row), dtype=dtype,
                fill_value=_fill(dtype), dimension_names=dims, compressors=compressors,
                overwrite=True,
            )  # fmt: skip
        for name in ("ids", "errors"):
            self.group.create_array(
                name, shape=(rows,), chunks=(chunk,), dtype=str, dimension_names=["sample"],
                overwrite=True,
            )  # fmt: skip
        self.group.create_array(
            "done", shape=(max(1, math.ceil(rows / chunk)),), chunks=(1,), dtype=bool,
            fill_value=False, dimension_names=["block"], overwrite=True,
        )  # fmt: skip
        self._arrays.clear()

    def write(
        self, block: int, start: int, features: Mapping[str, Any], ids: list[str],
        errors: list[str],
    ) -> None:  # fmt: skip
        """Rows ``start ..`` of every array, then the block's ``done`` entry."""
        stop = start + len(ids)
        for name, value in features.items():
            self._array(name)[start:stop] = value
        self._array("ids")[start:stop] = _strings(ids)
        self._array("errors")[start:stop] = _strings(errors)
        self._array("done")[block] = True

    def finish(self, rows: int, meta: dict[str, Any], features: list[str]) -> None:
        """Trim to ``rows`` samples and mark the store complete in its metadata. A source with
        no samples gives arrays of no rows (of shape ``(0,)``: no sample gave their shape)."""
        import numpy as np

        if "done" not in self.group:
            self._create({n: ((), np.dtype("float32")) for n in features}, 0, 1, "none")
        if self._array("ids").shape[0] != rows:
            for name in (*features, "ids", "errors"):
                array = self._array(name)
                array.resize((rows, *array.shape[1:]))
        errors = {}
        if rows:
            reasons = self._array("errors")[:]
            ids = self._array("ids")[:]
            errors = {str(ids[i]): str(reasons[i]) for i in reasons.nonzero()[0]}
        old = dict(self.group.attrs[META])
        self.group.attrs[META] = {
            **old, **meta, "samples": rows, "errors": errors, "complete": True,
            "arrays": {n: {"shape": list(self._array(n).shape), "dtype": str(self._array(n).dtype)}
                       for n in features},
        }  # fmt: skip


def _remove(path: Path) -> None:
    """Delete an old store: renamed first (one atomic step), so that a kill during the deletion
    leaves no half store at ``path``."""
    if not (path / "zarr.json").is_file():
        raise UsageError(
            f"overwrite=True would delete {str(path)!r}, which is not a zarr store; "
            "choose another path"
        )
    trash = path.with_name(f".{path.name}.deleting-{uuid.uuid4().hex[:8]}")
    path.rename(trash)
    shutil.rmtree(trash)


def _check_same(old: Mapping[str, Any], new: Mapping[str, Any], path: Path) -> None:
    differ = [k for k in IDENTITY if old.get(k) != new.get(k)]
    if differ:
        what = "; ".join(
            f"{_LABELS.get(k, k)}: stored {old.get(k)!r}, now {new.get(k)!r}" for k in differ
        )
        raise UsageError(
            f"cannot resume {str(path)!r}: the run differs from the one that made it ({what}). "
            "Use the same settings, or overwrite=True to start again"
        )


def _fill(dtype: Any) -> Any:
    return float("nan") if dtype.kind == "f" else 0


def _strings(values: list[str]) -> Any:
    import numpy as np

    return np.array(values, dtype=object).astype(str)
