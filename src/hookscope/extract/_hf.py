"""``FeatureStore.to_hf_dataset``: a token store as a Hugging Face ``datasets`` dataset.

The rows are read a chunk (or a sample) at a time and written to one Arrow file in a folder
beside ``path`` with ``datasets``' own writer, which ``Dataset.save_to_disk`` then lays out at
``path`` (Arrow shards, ``dataset_info.json``, ``state.json``: what ``load_from_disk`` reads,
SAELens' ``cached_activations_path`` included); the folder is removed after. Host memory holds
one chunk or one sample's rows.
"""

from __future__ import annotations

import importlib
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from .._extras import require
from ..errors import UsageError


class TokenStore(Protocol):
    """What this module reads of a :class:`~hookscope.extract.FeatureStore` (its type is not
    imported: the store imports this module when it exports)."""

    @property
    def unit(self) -> str: ...
    @property
    def tokens(self) -> int: ...

    def __len__(self) -> int: ...
    def __getitem__(self, name: str) -> Any: ...


__all__ = ["export"]


def export(
    store: TokenStore, path: Path, layers: list[str], names: dict[str, str], rows: str
) -> Any:
    """Write ``store``'s ``layers`` at ``path`` (see :meth:`FeatureStore.to_hf_dataset`)."""
    datasets = require("datasets", "datasets", purpose="writing a Hugging Face dataset")
    writer_module = require("datasets.arrow_writer", "datasets", purpose="writing Arrow files")

    if store.unit != "token":
        raise UsageError("to_hf_dataset() writes a token store (hs.extract(..., unit='token'))")
    if rows not in ("token", "sequence"):
        raise UsageError(f'rows must be "token" or "sequence", got {rows!r}')
    if path.exists():
        raise UsageError(f"{str(path)!r} already exists: give a new folder")
    column = {layer: names.get(layer, layer) for layer in layers}
    if len(set(column.values())) != len(column) or {
        "sample",
        "position",
        "token_id",
        "token_ids",
    } & set(column.values()):
        raise UsageError(
            f"names give columns {sorted(column.values())}: they must differ "
            "from each other and from sample, position, token_id, token_ids"
        )
    if rows == "sequence":
        features, parts = _sequences(store, layers, column, *_length(store))
    else:
        features, parts = _tokens(store, layers, column)
    staging = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    staging.mkdir(parents=True)
    try:
        rows_file = str(staging / "rows.arrow")
        with writer_module.ArrowWriter(
            features=datasets.Features(features), path=rows_file
        ) as writer:
            for part in parts:
                writer.write_batch(part)
            writer.finalize()
        made = datasets.Dataset.from_file(rows_file)
        quiet = datasets.utils.are_progress_bars_disabled()
        datasets.disable_progress_bars()  # the library never prints
        try:
            made.save_to_disk(str(path))
        finally:
            if not quiet:
                datasets.enable_progress_bars()
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return datasets.load_from_disk(str(path))


def _dtype(array: Any) -> str:
    return str(np.dtype(array.dtype))


def _tokens(
    store: TokenStore, layers: list[str], column: dict[str, str]
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """A row per token: each layer's vector (a fixed-length list), sample, position, id."""
    datasets = importlib.import_module("datasets")

    features: dict[str, Any] = {}
    for layer in layers:
        array = store[layer]
        size = int(np.prod(array.shape[1:]))
        features[column[layer]] = datasets.List(datasets.Value(_dtype(array)), length=size)
    for name in ("sample", "position", "token_id"):
        features[name] = datasets.Value(_dtype(store[name]))

    def parts() -> Iterator[dict[str, Any]]:
        step = int(store["sample"].chunks[0])
        for start in range(0, store.tokens, step):
            stop = min(start + step, store.tokens)
            part = {column[n]: store[n][start:stop].reshape(stop - start, -1) for n in layers}
            part.update({n: store[n][start:stop] for n in ("sample", "position", "token_id")})
            yield part

    return features, parts()


def _length(store: TokenStore) -> tuple[int, int]:
    """``(tokens, samples)``: the tokens every sample keeps (the one context a sequence layout
    has), and how many samples keep them (all, or all but a packed store's last, shorter row,
    which is left out)."""
    counts = np.bincount(store["sample"][:], minlength=len(store))
    whole = counts[:-1] if len(counts) > 1 and counts[-1] < counts[0] else counts
    if len(whole) == 0 or whole.min() != whole.max():
        seen = f"{counts.min()}..{counts.max()}" if len(counts) else "no"
        raise UsageError(
            f"rows='sequence' needs every sample to keep the same number of tokens; they keep "
            f"{seen}. Extract with pack=True (rows of context tokens) and no drop_token_ids "
            "or positions, or write rows='token'"
        )
    return int(whole[0]), len(whole)


def _sequences(
    store: TokenStore, layers: list[str], column: dict[str, str], length: int, samples: int
) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """A row per sample: each layer's ``(length, d)`` array and ``token_ids`` (SAELens)."""
    datasets = importlib.import_module("datasets")

    features: dict[str, Any] = {}
    for layer in layers:
        array = store[layer]
        shape = (length, int(np.prod(array.shape[1:])))
        features[column[layer]] = datasets.Array2D(shape=shape, dtype=_dtype(array))
    features["token_ids"] = datasets.List(datasets.Value("int32"), length=length)

    def parts() -> Iterator[dict[str, Any]]:
        per = max(1, int(store["sample"].chunks[0]) // max(length, 1))  # samples a part
        for first in range(0, samples, per):
            last = min(first + per, samples)
            a, b = first * length, last * length
            part = {column[n]: store[n][a:b].reshape(last - first, length, -1) for n in layers}
            part["token_ids"] = store["token_id"][a:b].reshape(last - first, length)
            yield part

    return features, parts()
