"""``hs.open_features``: read a store written by ``hs.extract``. The store is plain Zarr v3,
so ``zarr.open_group(path)`` and ``xarray.open_zarr(path, consolidated=False)`` read it too."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

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
        shapes = ", ".join(f"{n} {tuple(self.group[n].shape)}" for n in self.layers)
        return f"<FeatureStore {str(self.path)!r}: {shapes}>"

    def __getitem__(self, layer: str) -> Any:
        if layer not in self.layers:
            raise UsageError(f"no layer {layer!r} in this store; it has {self.layers}")
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
        return [str(i) for i in self.group["ids"][:]]

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
