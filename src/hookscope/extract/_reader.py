"""``hs.open_features``: read a store written by ``hs.extract``. The store is plain Zarr v3,
so ``zarr.open_group(path)`` and ``xarray.open_zarr(path, consolidated=False)`` read it too
(``ids`` and ``errors`` are coordinates along ``sample`` there: the layer arrays' CF
``coordinates`` attribute says so); :meth:`FeatureStore.to_xarray` indexes ``sample`` by id."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .._extras import require
from ..errors import UsageError
from ._store import META, zarr_module

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
        return f"<FeatureStore {str(self.path)!r}: {shapes}>"

    @property
    def _made(self) -> bool:
        """Whether the arrays exist (a run stopped early may have made none yet)."""
        return "ids" in self.group

    def __getitem__(self, layer: str) -> Any:
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
        time (only one batch in memory)."""
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
        ds = ds.set_coords([n for n in ("ids", "errors") if n in ds.data_vars])
        ds = ds.drop_vars([n for n in ("done",) if n in ds.variables])
        return ds.assign_coords(sample=ds["ids"].values).drop_vars("ids")


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
