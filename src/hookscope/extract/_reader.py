"""``hs.open_features``: read a store written by ``hs.extract``. The store is plain Zarr v3,
so ``zarr.open_group(path)`` and ``xarray.open_zarr(path, consolidated=False)`` read it too
(``ids`` and ``errors`` are coordinates along ``sample`` there: the layer arrays' CF
``coordinates`` attribute says so); :meth:`FeatureStore.to_xarray` indexes ``sample`` by id."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch

from .._extras import require
from ..errors import UsageError
from ._store import COLUMNS, META, zarr_module

if TYPE_CHECKING:
    from ._shuffle import Shuffled

__all__ = ["FeatureStore", "open_features"]


class FeatureStore:
    """A feature store: ``store[layer]`` is the layer's zarr array (array-like, lazily read),
    ``store.ids`` the sample ids, ``store.meta`` what made it, ``store.layers`` its layers.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, tempfile
        >>> path = tempfile.mkdtemp() + "/f"
        >>> _ = hs.extract(nn.Sequential(nn.Linear(3, 2)), torch.ones(10, 3), ["0"], out=path)
        >>> store = hs.open_features(path)
        >>> store.layers, store.to_numpy("0").shape, store.ids[:2]
        (['0'], (10, 2), ['0', '1'])
    """

    def __init__(self, path: Path, group: Any) -> None:
        self.path, self.group = path, group
        self.meta: dict[str, Any] = dict(group.attrs[META])
        self.layers: list[str] = list(self.meta["layers"])

    def __repr__(self) -> str:
        if not self._made:
            return f"<FeatureStore {str(self.path)!r}: unfinished, nothing stored yet>"
        shapes = ", ".join(f"{n} {tuple(self.group[n].shape)}" for n in self.layers)
        if self.unit == "token":
            shapes += f"; tokens of {len(self)} samples"
        return f"<FeatureStore {str(self.path)!r}: {shapes}>"

    @property
    def unit(self) -> str:
        """``"sample"`` (a row per sample) or ``"token"`` (a row per kept token)."""
        return str(self.meta.get("unit", "sample"))

    @property
    def tokens(self) -> int:
        """A token store's rows: its kept tokens (0 in a store of samples)."""
        return int(self.group["sample"].shape[0]) if self.unit == "token" and self._made else 0

    @property
    def _made(self) -> bool:
        """Whether the arrays exist (a run stopped early may have made none yet)."""
        return "ids" in self.group

    def __getitem__(self, layer: str) -> Any:
        """A layer's array (a token store's ``sample``, ``position`` and ``token_id`` too)."""
        if self.unit == "token" and layer in COLUMNS and layer in self.group:
            return self.group[layer]
        if layer not in self.layers:
            raise UsageError(f"no layer {layer!r} in this store; it has {self.layers}")
        if layer not in self.group:
            raise UsageError(
                f"{str(self.path)!r} has no rows of layer {layer!r} yet: its run stopped "
                "before it made the arrays (stored is 0). Finish it with "
                "hs.extract(..., resume=True)"
            )
        return self.group[layer]

    def __len__(self) -> int:
        return int(self.group["ids"].shape[0]) if "ids" in self.group else 0

    @property
    def complete(self) -> bool:
        """Whether the run that writes it has finished."""
        return bool(self.meta.get("complete"))

    @property
    def stored(self) -> int:
        """How many samples are in finished blocks (all of them once complete); the others
        read as NaN until a resumed run writes them."""
        if self.complete:
            return len(self)
        if "done" not in self.group:
            return 0
        n, chunk = len(self), int(self.meta["chunk"])
        return sum(min(chunk, n - int(k) * chunk) for k in self.group["done"][:].nonzero()[0])

    @property
    def ids(self) -> list[str]:
        """Every sample's id, in row order: file paths for an image folder, running indices
        (``"0"``, ``"1"``...) otherwise."""
        return [str(i) for i in self.group["ids"][:]] if self._made else []

    @property
    def errors(self) -> dict[str, str]:
        """``{id: reason}`` of the samples that could not be read (their rows are NaN)."""
        return dict(self.meta.get("errors", {}))

    def to_numpy(self, layer: str) -> Any:
        """The whole array of ``layer`` read into memory as a NumPy array (samples along
        axis 0, in the store's dtype); :meth:`batches` reads it a block at a time."""
        return self[layer][:]

    def to_torch(self, layer: str) -> torch.Tensor:
        """The whole array of ``layer`` as a CPU tensor sharing :meth:`to_numpy`'s memory."""
        return torch.from_numpy(self.to_numpy(layer))

    def batches(self, batch_size: int = 1024) -> Iterator[dict[str, Any]]:
        """``{"ids": [...], layer: array, ...}`` for consecutive samples, ``batch_size`` at a
        time (only one batch in memory); for a token store ``{layer: array, "sample": ...,
        "position": ..., "token_id": ...}`` for consecutive tokens."""
        if self.unit == "token":
            for start in range(0, self.tokens, batch_size):
                stop = min(start + batch_size, self.tokens)
                yield {n: self.group[n][start:stop] for n in (*self.layers, *COLUMNS)}
            return
        for start in range(0, len(self), batch_size):
            stop = min(start + batch_size, len(self))
            batch: dict[str, Any] = {"ids": [str(i) for i in self.group["ids"][start:stop]]}
            batch.update({n: self.group[n][start:stop] for n in self.layers})
            yield batch

    def to_xarray(self) -> Any:
        """The store as an ``xarray.Dataset`` (lazily read, needs xarray): one variable per
        layer, dimensions ``sample`` and ``<layer>_1``, ``<layer>_2``...; ``sample`` is
        indexed by the ids (``ds.sel(sample="img/3.png")``) and ``errors`` is a coordinate
        beside it.

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs, tempfile
            >>> path = tempfile.mkdtemp() + "/f"
            >>> store = hs.extract(nn.Sequential(nn.Linear(3, 2)), torch.ones(4, 3), ["0"],
            ...                    out=path)
            >>> ds = store.to_xarray()
            >>> list(ds.data_vars), ds["0"].dims, list(ds["sample"].values[:2])
            (['0'], ('sample', '0_1'), ['0', '1'])
        """
        xarray = require("xarray", "xarray", purpose="reading a feature store with xarray")
        if not self._made:
            raise UsageError(f"{str(self.path)!r} has no arrays yet: finish it with resume=True")
        ds = xarray.open_zarr(self.path, consolidated=False)
        if self.unit == "token":  # dimensions token (rows) and input (ids, errors)
            ds = ds.set_coords([*COLUMNS, "ids", "errors"])
            return ds.drop_vars([n for n in ("done", "block_tokens") if n in ds.variables])
        ds = ds.set_coords([n for n in ("ids", "errors") if n in ds.data_vars])
        ds = ds.drop_vars([n for n in ("done",) if n in ds.variables])
        return ds.assign_coords(sample=ds["ids"].values).drop_vars("ids")

    def shuffled(
        self,
        batch_size: int,
        *,
        seed: int = 0,
        buffer: int = 2**16,
        layers: list[str] | None = None,
        drop_last: bool = False,
    ) -> Shuffled:
        """A token store's rows in a seeded random order, each exactly once per epoch: a
        PyTorch ``IterableDataset`` of batches (give it to a ``DataLoader`` with
        ``batch_size=None``; its workers share the rows out).

        The rows are read a chunk at a time in a random order of the chunks into a buffer of
        ``buffer`` rows, from which each row is drawn uniformly at random; host memory holds
        the buffer (``buffer`` x the bytes of a row of ``layers``), one chunk and one batch
        per worker, and every chunk is read once (see ``hookscope/extract/_shuffle.py`` for
        what the order guarantees).

        Args:
            batch_size: rows per batch (the last one of each worker may be smaller).
            seed: the order's seed; ``set_epoch(e)`` on the dataset gives epoch ``e`` its own.
            buffer: rows mixed at once (all workers together): the order is a uniform
                permutation within windows of about this many rows.
            layers: the layers to read (default: all of them).
            drop_last: leave out each worker's last, smaller batch.

        Returns:
            A ``torch.utils.data.IterableDataset`` of dicts: each layer's rows, and ``sample``,
            ``position``, ``token_id`` and ``token`` (the row's index in the store).

        Example:
            >>> import torch, torch.nn as nn, hookscope as hs, tempfile
            >>> ids = torch.randint(0, 50, (40, 6))
            >>> store = hs.extract(nn.Sequential(nn.Embedding(50, 4)), ids, ["0"],
            ...                    out=tempfile.mkdtemp() + "/t", unit="token")
            >>> batches = list(store.shuffled(64, seed=1))
            >>> sorted(torch.cat([b["token"] for b in batches]).tolist()) == list(range(240))
            True
        """
        if self.unit != "token":
            raise UsageError("shuffled() reads a token store (hs.extract(..., unit='token'))")
        chosen = self._chosen(layers)
        for name, value in (("batch_size", batch_size), ("buffer", buffer)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UsageError(f"{name} must be an int >= 1, got {value!r}")
        from ._shuffle import Shuffled

        return Shuffled(self.path, chosen, batch_size, seed, buffer, drop_last)

    def to_hf_dataset(
        self,
        path: str | os.PathLike[str],
        *,
        layers: list[str] | None = None,
        names: dict[str, str] | None = None,
        rows: Literal["token", "sequence"] = "token",
    ) -> Any:
        """Write a token store as a Hugging Face ``datasets`` dataset at ``path`` (Arrow files,
        ``datasets.load_from_disk(path)`` reads it; the ``datasets`` extra) and return it.

        Args:
            path: a new folder.
            layers: the layers to write (default: all of them).
            names: column names for layers (SAELens names a column by its hook:
                ``{"transformer.h.6": "blocks.6.hook_resid_pre"}``).
            rows: ``"token"``, a row per token (each layer's vector, ``sample``, ``position``,
                ``token_id``); or ``"sequence"``, a row per sample with each layer's
                ``(tokens, d)`` array and ``token_ids``, the layout SAELens' cached
                activations have, for stores whose samples all keep the same number of
                tokens (``pack=True`` without dropped tokens; the last packed row, shorter,
                is left out).

        Returns:
            The ``datasets.Dataset``, memory-mapped from ``path``.
        """
        from ._hf import export

        return export(self, Path(path), self._chosen(layers), names or {}, rows)

    def _chosen(self, layers: list[str] | None) -> list[str]:
        chosen = list(self.layers) if layers is None else list(layers)
        if missing := [n for n in chosen if n not in self.layers]:
            raise UsageError(f"no layer {missing[0]!r} in this store; it has {self.layers}")
        return chosen


def open_features(path: str | os.PathLike[str], *, partial: bool = False) -> FeatureStore:
    """Open a store written by :func:`hookscope.extract`.

    Raises:
        UsageError: ``path`` is not such a store, or its run has not finished (unless
            ``partial=True``: unfinished blocks then read as NaN).
    """
    zarr = zarr_module()
    try:
        group = zarr.open_group(str(path), mode="r")
        meta = dict(group.attrs[META])
    except Exception as e:
        raise UsageError(f"{str(path)!r} is not a hookscope feature store ({e})") from None
    if not meta.get("complete") and not partial:
        raise UsageError(
            f"{str(path)!r} is unfinished (its run was interrupted): finish it with "
            "hs.extract(..., resume=True), or open_features(path, partial=True)"
        )
    return FeatureStore(Path(path), group)
