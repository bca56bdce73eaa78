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

A store is created exclusively: the group's ``zarr.json`` is linked into place (never replaced
there), so of two runs making a store at one new path (or empty folder), one wins and the
other is refused before writing anything. Its metadata holds a token of the run that made it
(``store``); a run finishes only a store that still holds its token, so a store replaced by
another run meanwhile is refused rather than marked complete. Something else at the path (a
file, a folder of files) is never taken, replaced or resumed.

A block that fills whole chunks of arrays with no compressor (the default codec, and ``ids``
and ``done``) is written as the files' bytes directly (:meth:`Store._whole_chunk`: what zarr
itself would write); the rest (a compressed layer, the last, partial block) goes through
zarr's asynchronous API, all arrays at once on an event loop of the writing thread, then its
``done`` entry. Either way files are written on that thread: the store is zarr's
``LocalStore`` except that a file is not handed to a file thread to be read or written
(:func:`_local_store`), and a new group is made and the finished store's attributes written
through the same event loop (zarr's synchronous API runs them on its own thread). On a busy
machine every hand-over waits for the other thread to be scheduled, which made a small
``done`` entry cost as much as 0.6 ms, a block of an IO-bound extraction 1.7 ms more than
``np.save`` of the same rows, and making the arrays 6.4 ms instead of 2.6. Each array made
asks for its group's file if absent: a check that it exists, not a write of it to a
temporary file thrown away (1.7 to 1.5 ms for the arrays of a quiet store). ``ids``,
``errors`` and ``done`` are stored uncompressed (a compressor is another hand-over to a
thread, for a few bytes). Layer arrays are written with ``write_empty_chunks``,
so zarr does not compare every 16 MiB chunk with the fill value (an all-NaN block, every
sample unreadable, is then a chunk file rather than none: it reads the same). Chunk keys use
zarr's ``"."`` separator (``1/c.3.0.0.0``, not ``1/c/3/0/0/0``): one folder per array instead
of one per chunk and dimension, to make on every write and remove on every overwrite (the key
encoding is in each array's metadata, so stores made with ``"/"`` resume and read as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import sys
import threading
import uuid
from collections.abc import Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from .._extras import require
from ..errors import UsageError

__all__ = [
    "CODECS",
    "COLUMNS",
    "IDENTITY",
    "META",
    "Codec",
    "Store",
    "check_codec",
    "open_group",
    "zarr_module",
]

META = "hookscope"
#: a token store's arrays beside its layers' (``unit="token"``): which sample each token
#: row comes from, its position among the sample's real tokens, its token id
COLUMNS = ("sample", "position", "token_id")
_RESERVED = ("ids", "errors", "done", "block_tokens", *COLUMNS)
#: What must be the same to resume a store (the rest of the metadata may differ).
IDENTITY = (
    "model",
    "fingerprint",
    "layers",
    "reduce",
    "dtype",
    "chunk",
    "input",
    "probe",
    "unit",
    "token_rule",
)
#: what a store made before a setting existed had (a store of samples has no token rule)
_DEFAULTS: dict[str, Any] = {"unit": "sample"}
_LABELS = {
    "probe": "the first sample's model input (transform, image size, tokenizer, order)",
    "batch_size": "batch size (texts are padded to each batch's longest)",
}
Codec = Literal["none", "lz4", "zstd"]
_KEYS: dict[str, Any] = {"name": "default", "separator": "."}  # see the module docstring
CODECS = ("none", "lz4", "zstd")
#: CF's way of saying that ``ids`` and ``errors`` are coordinates (not data) of each layer's
#: samples, which xarray follows
_COORDINATES = {"coordinates": "ids errors"}
#: ``{layer: (row shape, numpy dtype)}``
Shapes = Mapping[str, tuple[tuple[int, ...], Any]]


def zarr_module() -> Any:
    return require("zarr", "zarr", purpose="writing and reading feature stores")


_STORE: list[Any] = []  # the LocalStore subclass, made on first use (zarr is an extra)


def _local_store(path: Path, claim: bool = False) -> Any:
    """zarr's ``LocalStore`` at ``path``, reading and writing each file on the calling thread
    (see the module docstring); files are written to a temporary name renamed into place, as
    zarr does. ``claim``: the group's ``zarr.json`` is created exclusively (linked into place,
    FileExistsError if it exists), so of two processes making a store at one path, one wins."""
    if not _STORE:
        from zarr.core.buffer import default_buffer_prototype
        from zarr.storage import LocalStore

        class _Local(LocalStore):
            async def _opened(self, writing: bool = False) -> None:
                if not self._is_open:
                    await self._open()
                if writing:
                    self._check_writable()

            claim = False

            async def set(self, key: str, value: Any) -> None:
                await self._opened(writing=True)
                exclusive = self.claim and key == "zarr.json"
                _put(self.root / key, value.as_buffer_like(), exclusive=exclusive)
                if exclusive:  # claimed: later writes (the finished metadata) replace it
                    self.claim = False

            async def set_if_not_exists(self, key: str, value: Any) -> None:
                await self._opened(writing=True)
                if (self.root / key).is_file():  # each array made asks so of its parent group
                    return
                with contextlib.suppress(FileExistsError):
                    _put(self.root / key, value.as_buffer_like(), exclusive=True)

            async def get(self, key: str, prototype: Any = None, byte_range: Any = None) -> Any:
                if byte_range is not None:  # parts of files: not read by the writing code
                    return await super().get(key, prototype, byte_range)
                await self._opened()
                try:
                    data = (self.root / key).read_bytes()
                except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                    return None
                return (prototype or default_buffer_prototype()).buffer.from_bytes(data)

            async def exists(self, key: str) -> bool:
                return (self.root / key).is_file()

        _STORE.append(_Local)
    store = _STORE[0](path)
    store.claim = claim
    return store


def _put(target: Path, data: Any, exclusive: bool = False) -> None:
    """``data`` (bytes-like) in the file ``target``: written to a temporary name, renamed
    (``exclusive``: linked, so that an existing file is kept and FileExistsError raised)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f"{target.name}.{uuid.uuid4().hex}.partial")
    try:
        with open(partial, "wb") as f:
            f.write(data)
        if exclusive:
            os.link(partial, target)
            partial.unlink()
        else:
            os.replace(partial, target)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def open_group(path: str | os.PathLike[str], mode: Literal["r", "r+", "w"], **kwargs: Any) -> Any:
    """The zarr group of a store, through :func:`_local_store` where it is written."""
    where = str(path) if mode == "r" else _local_store(Path(path))
    return zarr_module().open_group(where, mode=mode, **kwargs)


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

    def __init__(self, path: Path, group: Any, *, new: bool = False) -> None:
        self.path, self.group = path, group
        self._arrays: dict[str, Any] = {}
        self._writable: dict[str, Any] = {}  # zarr AsyncArrays that write() uses
        self._ready = False  # the arrays exist (checked once)
        self._new = new  # the group was just made: it has no arrays
        self.created = new  # this run made the store (a refusal then removes it: discard())
        self.owner: str | None = None  # the run that made it (a token in its metadata)
        self._fresh = False  # this object made the arrays: no chunk of any block exists yet
        self._loops = threading.local()  # an event loop per writing thread (see _run)
        #: ``{id: reason}`` of unreadable samples in the blocks written through this object
        self.errors_written: dict[str, str] = {}

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(
        cls,
        path: str | os.PathLike[str],
        meta: dict[str, Any],
        *,
        overwrite: bool,
        resume: bool,
        same: tuple[str, ...] = IDENTITY,
    ) -> tuple[Store, set[int]]:
        """The store and the blocks already done; creates, replaces or resumes it. ``same``:
        what must not differ from the stored run to resume it.

        A new store is created exclusively: its group's ``zarr.json`` is linked into place, so
        of two runs (two processes) making a store at one path, one wins and the other gets a
        UsageError, never a store mixing their rows."""
        path = Path(path)
        found = _found(path)
        if found == "store" and resume:
            try:
                group = open_group(path, mode="r+")
                old = dict(group.attrs[META])
            except Exception as e:
                raise UsageError(
                    f"{str(path)!r} is a Zarr store that hs.extract did not write ({e}), so it "
                    "cannot be resumed: choose another path, or overwrite=True to replace it"
                ) from None
            _check_same(old, meta, path, same)
            for partial in path.rglob("*.partial"):  # a chunk write cut short by a kill
                partial.unlink()
            store = cls(path, group)
            store.owner = old.get("store")
            return store, store.done_blocks()
        if found == "store" and overwrite:
            _remove(path)
        elif found != "new":
            raise UsageError(_taken(path, found))
        return cls._made(path, meta), set()

    @classmethod
    def _made(cls, path: Path, meta: dict[str, Any]) -> Store:
        """A new store at ``path`` (absent or an empty folder), claimed exclusively."""
        store = cls(path, None, new=True)
        store.owner = uuid.uuid4().hex  # which run made it: see finish()
        try:  # on this thread's event loop, as the writes (zarr's own would be a thread away)
            from zarr.api.asynchronous import create_group
            from zarr.errors import BaseZarrError

            attributes: dict[str, Any] = {META: {**meta, "complete": False, "store": store.owner}}
            claimed = create_group(store=_local_store(path, claim=True), attributes=attributes)
            try:
                (made,) = store._run([claimed])
            except (FileExistsError, BaseZarrError):
                raise UsageError(
                    f"{str(path)!r} was created by another run while this one started (two "
                    "hs.extract runs writing one store?): nothing was written there by this "
                    "one. Choose another path, or let the other run finish (then resume=True "
                    "or overwrite=True)"
                ) from None
        except BaseException:
            store.close()
            raise
        store.group = zarr_module().Group(made)
        return store

    @staticmethod
    def chunk_of(path: str | os.PathLike[str]) -> int | None:
        """The chunk of the store at ``path``, if there is one (resuming keeps it)."""
        try:
            return int(open_group(path, mode="r").attrs[META]["chunk"])
        except (FileNotFoundError, NotADirectoryError, KeyError, ValueError):
            return None  # no store there, or not one of ours: Store.open says what is wrong
        # (anything else, a permission error, is raised as it is)

    def done_blocks(self) -> set[int]:
        if "done" not in self.group:
            return set()
        return {int(i) for i in self.group["done"][:].nonzero()[0]}

    def row_shapes(self) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``{layer: (row shape, dtype)}`` of the arrays a resumed store already has."""
        if self._new or "done" not in self.group:
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
            if self._new or "done" not in self.group:
                self._create(shapes, rows, chunk, codec)
            self._ready = True
        self._resize((*shapes, "ids", "errors"), rows)
        self._resize(["done"], math.ceil(rows / chunk))

    def _resize(self, names: Iterable[str], rows: int, *, grow_only: bool = True) -> None:
        """Each of ``names`` made ``rows`` long (``grow_only``: those that are shorter). Each
        array is looked at: a run killed between two resizes left them of several lengths."""
        for name in names:
            length = self._async(name).shape[0]
            if length < rows or (length != rows and not grow_only):
                array = self._array(name)
                array.resize((rows, *array.shape[1:]))
                self._writable.pop(name, None)  # it holds the old shape

    #: The dimension of ``ids`` and ``errors``: a row is a sample here.
    _INPUT_DIM = "sample"

    def _create(self, shapes: Shapes, rows: int, chunk: int, codec: Any) -> None:
        """The arrays, together through zarr's async API (as :meth:`write`), then ``done``."""
        if reserved := [name for name in shapes if name in _RESERVED]:
            raise UsageError(f"a layer may not be called {reserved[0]!r} in a feature store")
        made = self._layer_arrays(shapes, rows, chunk, codec)
        for name in ("ids", "errors"):  # uncompressed, as ``done`` (see the module docstring)
            made[name] = self._new_array(
                name,
                shape=(rows,),
                chunks=(chunk,),
                dtype=str,
                dimension_names=[self._INPUT_DIM],
                compressors=None,
            )
        self._arrays.clear()
        self._writable = dict(zip(made, self._run(list(made.values())), strict=True))
        (self._writable["done"],) = self._run(
            [
                self._new_array(
                    "done",
                    shape=(max(1, math.ceil(rows / chunk)),),
                    chunks=(1,),
                    dtype=bool,
                    fill_value=False,
                    dimension_names=["block"],
                    compressors=None,
                )
            ]
        )
        self._fresh = True

    def _layer_arrays(
        self, shapes: Shapes, rows: int, chunk: int, codec: Any
    ) -> dict[str, Coroutine[Any, Any, Any]]:
        """The layers' arrays (a row per sample), to be created."""
        compressors, made = _compressors(codec), {}
        for name, (row, dtype) in shapes.items():
            dims = ["sample", *(f"{name}_{i}" for i in range(1, len(row) + 1))]
            made[name] = self._new_array(
                name,
                shape=(rows, *row),
                chunks=(chunk, *row),
                dtype=dtype,
                fill_value=_fill(dtype),
                dimension_names=dims,
                compressors=compressors,
                config={"write_empty_chunks": True},  # see the module's docstring
                attributes=_COORDINATES,
            )
        return made

    def _new_array(self, name: str, **kwargs: Any) -> Coroutine[Any, Any, Any]:
        # overwrite: arrays left by a run killed before ``done`` existed hold nothing done
        from zarr.api.asynchronous import create_array

        return create_array(
            self.group.store_path, name=name, overwrite=True, chunk_key_encoding=_KEYS, **kwargs
        )

    def write(
        self,
        block: int,
        start: int,
        features: Mapping[str, Any],
        ids: list[str],
        errors: list[str],
    ) -> None:
        """Rows ``start ..`` of every array, then the block's ``done`` entry."""
        import numpy as np

        rows = slice(start, start + len(ids))
        columns = {**features, "ids": _strings(ids)}
        if any(errors) or not self._fresh:  # in a new array, no chunk already reads as ""
            columns["errors"] = _strings(errors)
        sets = [
            self._async(name).setitem(rows, value)
            for name, value in columns.items()
            if not self._whole_chunk(name, start, value)
        ]
        if sets:
            self._run(sets)
        if not self._whole_chunk("done", block, np.ones(1, dtype=bool)):
            self._run([self._async("done").setitem(block, True)])
        self.errors_written.update((i, e) for i, e in zip(ids, errors, strict=True) if e)

    def _whole_chunk(self, name: str, start: int, value: Any) -> bool:
        """Write ``value`` as the chunk of ``name`` that starts at row ``start`` without zarr's
        machinery, where the chunk file's bytes are easy to make: the whole chunk, under one
        codec, ``bytes`` (layers, ``done``) or ``vlen-utf8`` (``ids``), with no compressor.
        False (nothing written) otherwise. zarr's own write of such a chunk writes the same
        bytes (tests read them back with zarr), after a few hundred Python calls and
        event-loop steps: about 0.5 ms a chunk on a busy machine, against 3 ms to write
        16 MiB of rows."""
        array = self._async(name)
        meta = array.metadata
        chunk = getattr(meta.chunk_grid, "chunk_shape", None)
        codecs: tuple[Any, ...] = tuple(getattr(meta, "codecs", ()))
        if (
            chunk is None
            or len(codecs) != 1
            or tuple(value.shape) != tuple(chunk)
            or start % chunk[0]
            or tuple(array.shape[1:]) != tuple(chunk[1:])
        ):
            return False
        data = _encoded(codecs[0], value, array.dtype)
        if data is None:
            return False
        key = meta.encode_chunk_key((start // chunk[0], *(0 for _ in chunk[1:])))
        _put(self.path / name / key, data)
        return True

    def _async(self, name: str) -> Any:
        if name not in self._writable:
            array = self._array(name).async_array
            if name not in _RESERVED:  # no comparison of each chunk with NaN (see above)
                array = array.with_config({"write_empty_chunks": True})
            self._writable[name] = array
        return self._writable[name]

    def _run(self, calls: list[Coroutine[Any, Any, Any]]) -> list[Any]:
        """Run zarr coroutines together on the calling thread's event loop (kept until
        :meth:`close`); their results, or the first error once all of them ended."""

        async def together() -> list[Any]:
            outcomes: list[Any] = await asyncio.gather(*calls, return_exceptions=True)
            return outcomes  # all of them finished, none left running on the loop

        loop = getattr(self._loops, "loop", None)
        if loop is None:
            loop = self._loops.loop = asyncio.new_event_loop()
        outcomes = loop.run_until_complete(together())
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
        return outcomes

    def close(self) -> None:
        """Stop the calling thread's event loop of :meth:`_run` and its file threads."""
        loop = getattr(self._loops, "loop", None)
        if loop is not None:
            self._loops.loop = None
            loop.run_until_complete(loop.shutdown_default_executor())
            loop.close()

    def finish(
        self,
        rows: int,
        meta: dict[str, Any],
        features: list[str],
        errors: dict[str, str] | None = None,
    ) -> None:
        """Trim to ``rows`` samples and mark the store complete in its metadata (``meta`` over
        what it holds, but for its creation time, the first run's). A source with
        no samples gives arrays of no rows (of shape ``(0,)``: no sample gave their shape).
        ``errors``: every unreadable sample's reason, where the caller wrote every block (else
        they are read from the store)."""
        import numpy as np

        if not self._ready and "done" not in self.group:
            self._create({n: ((), np.dtype("float32")) for n in features}, 0, 1, "none")
        self._trim(rows, features)
        if errors is None and rows:
            reasons = self._array("errors")[:]
            ids = self._array("ids")[:]
            errors = {str(ids[i]): str(reasons[i]) for i in reasons.nonzero()[0]}
        errors = errors or {}
        if not self.ours():
            raise UsageError(
                f"{str(self.path)!r} was replaced or removed by another run while this one "
                "wrote it (overwrite=True elsewhere?), so its rows may mix both runs: run again "
                "with overwrite=True, one run at a time"
            )
        attributes = self.group.attrs.asdict()  # the whole set is replaced: keep the others
        attributes[META] = {
            **attributes[META],
            **{k: v for k, v in meta.items() if k != "created"},  # the first run's creation
            "samples": rows,
            "errors": errors,
            "complete": True,
            **self._totals(),
            "arrays": {
                n: {"shape": list(self._async(n).shape), "dtype": str(self._async(n).dtype)}
                for n in features
            },
        }
        (self.group,) = self._run([self.group.update_attributes_async(attributes)])

    def _trim(self, rows: int, features: list[str]) -> None:
        """The arrays cut (or grown) to ``rows`` samples, the store's final length."""
        self._resize((*features, "ids", "errors"), rows, grow_only=False)

    def _totals(self) -> dict[str, Any]:
        """What a finished store's metadata says beside its samples (a token store: tokens)."""
        return {}

    def ours(self) -> bool:
        """Whether the store at the path is still the one this object made or resumed (not
        replaced by another run meanwhile)."""
        return (self.path / "zarr.json").is_file() and _owner(self.path) == self.owner

    def discard(self) -> None:
        """Delete a store this run made, when a refusal leaves it of no use (so that the run
        the refusal suggests can make it again); a store of another run is left alone."""
        if self.created and self.ours():
            _remove(self.path)


def _owner(path: Path) -> str | None:
    """The token of the run that made the store at ``path`` (None: none, or no store)."""
    try:
        meta = json.loads((path / "zarr.json").read_bytes())["attributes"][META]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    owner = meta.get("store") if isinstance(meta, dict) else None
    return owner if isinstance(owner, str) else None


def _found(path: Path) -> Literal["new", "store", "file", "folder"]:
    """What is at ``path``: nothing or an empty folder (``"new"``), a Zarr store, a file, or a
    folder holding something else."""
    if not path.exists():
        return "new"
    if not path.is_dir():
        return "file"
    if (path / "zarr.json").is_file():
        return "store"
    # a file cut short by a kill (while a store was being made here) is not the user's
    return "folder" if any(not p.name.endswith(".partial") for p in path.iterdir()) else "new"


def _taken(path: Path, found: str) -> str:
    """Why ``out`` cannot be used as it is, with advice that works for what is there."""
    where = repr(str(path))
    if found == "file":
        return (
            f"{where} is a file, not a feature store (a store is a folder): choose a new path "
            "for out= (or an empty folder); resume= and overwrite= apply to feature stores only"
        )
    if found == "folder":
        return (
            f"{where} is a folder that holds files but no feature store: choose a new path "
            "for out= (or an empty folder); overwrite=True only replaces a Zarr store"
        )
    try:
        meta = dict(open_group(path, mode="r").attrs[META])
    except Exception:
        return (
            f"{where} already exists: a Zarr store that hs.extract did not write. Choose "
            "another path, or pass overwrite=True to replace it"
        )
    if meta.get("complete"):
        return (
            f"{where} already exists: a finished feature store (hs.open_features reads it). "
            "Pass overwrite=True to replace it, or choose another path"
        )
    return f"{where} already exists: pass resume=True to finish it or overwrite=True to replace it"


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


def _check_same(
    old: Mapping[str, Any], new: Mapping[str, Any], path: Path, same: tuple[str, ...]
) -> None:
    def stored(k: str) -> Any:
        return old.get(k, _DEFAULTS.get(k))

    differ = [k for k in same if stored(k) != new.get(k)]
    if differ:
        what = "; ".join(
            f"{_LABELS.get(k, k)}: stored {stored(k)!r}, now {new.get(k)!r}" for k in differ
        )
        raise UsageError(
            f"cannot resume {str(path)!r}: the run differs from the one that made it ({what}). "
            "Use the same settings, or overwrite=True to start again"
        )


def _fill(dtype: Any) -> Any:
    return float("nan") if dtype.kind == "f" else 0


def _encoded(codec: Any, value: Any, dtype: Any) -> Any:
    """A whole chunk's file contents under zarr's ``codec``, or None where it is not made
    here: the ``bytes`` codec's is the rows' own bytes (C order, in the codec's byte order);
    ``vlen-utf8``'s is numcodecs' ``VLenUTF8`` encoding, which zarr's codec calls."""
    import numpy as np
    from zarr.codecs import BytesCodec, VLenUTF8Codec

    if isinstance(codec, BytesCodec):
        if value.dtype != dtype or not value.flags.c_contiguous:
            return None
        return memoryview(value).cast("B") if _same_order(value.dtype, codec.endian) else None
    if isinstance(codec, VLenUTF8Codec) and value.dtype.kind == "U":
        from numcodecs.vlen import VLenUTF8  # type: ignore[import-untyped]

        return VLenUTF8().encode(np.asarray(value, dtype=object))
    return None


def _same_order(dtype: Any, endian: Any) -> bool:
    """Whether ``dtype``'s bytes are in the order of zarr's ``endian`` (``None``: one byte)."""
    order = dtype.byteorder
    if order == "|":
        return True
    if order == "=":
        order = "<" if sys.byteorder == "little" else ">"
    return endian is not None and order == ("<" if endian.value == "little" else ">")


def _strings(values: list[str]) -> Any:
    import numpy as np

    return np.array(values, dtype=object).astype(str)
