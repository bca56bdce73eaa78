"""``hs.extract``: stream a dataset through a model and write selected layers' outputs to a
Zarr store, in blocks of ``chunk`` samples, resumable (see ``_store``), on this process or on
Ray Data (``_ray``)."""

from __future__ import annotations

import datetime
import hashlib
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from .._progress import progress, wanted
from .._version import __version__
from ..core import Layers, features, leaves, map_tensors
from ..errors import UsageError
from ._reader import FeatureStore, open_features
from ._sources import Source, source
from ._store import Store

__all__ = ["Job", "extract"]


def extract(
    model: nn.Module | Callable[[], nn.Module],
    data: Any,
    layers: Any,
    *,
    out: str | os.PathLike[str],
    batch_size: int = 64,
    reduce: Any = None,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    chunk: int | None = None,
    stop: bool = True,
    tokenizer: Any = None,
    transform: Callable[[Any], Any] | None = None,
    on_error: str = "raise",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    engine: str = "local",
    workers: int = 2,
) -> FeatureStore:
    """Write the outputs of ``layers`` for every sample of ``data`` to a Zarr store at ``out``.

    Args:
        model: the model, or (``engine="ray"``) a function returning it, called once per actor.
        data: a tensor or NumPy array (samples along dim 0), a map-style ``Dataset`` (an item
            is the input or an ``(input, label, ...)`` tuple), a ``DataLoader`` or any iterable
            of batches, a folder of images (a path), or a list of strings with ``tokenizer=``.
        layers: any layer selector (see :func:`hookscope.capture`); each layer's output (the
            first tensor of a tuple or ``ModelOutput``) becomes an array named after it.
        out: the store's folder.
        batch_size: samples per forward.
        reduce: as in :func:`hookscope.capture` (``"spatial_mean"``, ``"token_mean"``,
            ``"batch_mean"`` or a function); ``"token_mean"`` on tokenized text averages only
            the tokens the attention mask keeps (sentence-transformers' mean pooling).
        dtype: storage dtype (e.g. ``torch.float16``); default: as computed.
        device: where inputs go (default: the model's parameters' device).
        chunk: samples per stored chunk and per committed block (default: ``batch_size``
            rounded up to a multiple of it near 256). Memory holds one block.
        stop: end each forward after the last selected layer.
        tokenizer: for a list of strings (padding and truncation per batch).
        transform: for an image folder: PIL image -> tensor (default: RGB in 0..1).
        on_error: for an image folder: ``"raise"`` at a file that cannot be decoded, or
            ``"skip"``: its row is kept, filled with NaN, with the reason in ``errors`` and
            the store's metadata.
        resume: finish the store at ``out`` (made by the same model, layers and settings:
            anything else is refused, saying what differs); blocks already written are kept.
        overwrite: replace whatever store is at ``out``.
        progress: a progress bar (None: only on a terminal).
        engine: ``"local"`` or ``"ray"`` (Ray Data actors writing their own blocks of the same
            store; ``ray.init(address=...)`` first to use an existing cluster).
        workers: Ray actors.

    Returns:
        The store, opened for reading (:func:`open_features`).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, tempfile
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> store = hs.extract(net, torch.randn(100, 4), ["1"], out=tempfile.mkdtemp() + "/f")
        >>> store["1"].shape, len(store.ids)
        ((100, 8), 100)
    """
    if engine not in ("local", "ray"):
        raise UsageError(f'engine must be "local" or "ray", got {engine!r}')
    for name, value in (("batch_size", batch_size), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an int >= 1, got {value!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UsageError(f"chunk must be an int >= 1, got {chunk!r}")
    if resume and overwrite:
        raise UsageError("resume=True and overwrite=True contradict each other: choose one")
    wanted(progress)
    factory = None
    if not isinstance(model, nn.Module):
        if engine != "ray" or not callable(model):
            raise UsageError("model must be an nn.Module (a factory is accepted with engine='ray')")
        factory, model = model, model()
        if not isinstance(model, nn.Module):
            raise UsageError(f"the model factory returned {type(model).__name__}, not an nn.Module")
    src = source(data, tokenizer=tokenizer, transform=transform, on_error=on_error)
    if engine == "ray" and not src.addressable:
        raise UsageError(
            "engine='ray' needs samples it can address by index (a tensor, array, Dataset, "
            "image folder or list of strings), not a one-pass iterable"
        )
    job = Job(model, src, layers, batch_size, reduce, dtype, device, stop)
    size = chunk or batch_size * max(1, round(256 / batch_size))
    meta = job.meta(size)
    store, done = Store.open(out, meta, overwrite=overwrite, resume=resume)
    if engine == "ray":
        from ._ray import run_ray

        rows = run_ray(job, store, done, size, factory, workers, progress)
    else:
        rows = job.run(store, done, size, progress)
    store.finish(rows, {k: v for k, v in meta.items() if k != "created"}, job.names)
    return open_features(out)


class Job:
    """One extraction's settings and the forward of one block (shared by both engines)."""

    def __init__(
        self, model: nn.Module, src: Source, layers: Any, batch_size: int, reduce: Any,
        dtype: torch.dtype | str | None, device: torch.device | str | None, stop: bool,
    ) -> None:  # fmt: skip
        self.model, self.src, self.batch_size, self.reduce = model, src, batch_size, reduce
        self.names = list(Layers(model).select(layers))  # fails now for an unknown layer
        self.dtype = _dtype(dtype)
        first = next(iter(model.parameters()), None)
        self.device = torch.device(device) if device is not None else (
            first.device if first is not None else torch.device("cpu")
        )  # fmt: skip
        self.stop = stop
        self._shapes: dict[str, tuple[Any, ...]] = {}  # layer -> (dtype, *row shape)

    def meta(self, chunk: int) -> dict[str, Any]:
        reduce = self.reduce
        if callable(reduce):
            reduce = f"{getattr(reduce, '__module__', '?')}.{getattr(reduce, '__qualname__', '?')}"
        return {
            "model": f"{type(self.model).__module__}.{type(self.model).__qualname__}",
            "fingerprint": fingerprint(self.model),
            "layers": self.names,
            "reduce": reduce,
            "dtype": str(self.dtype).replace("torch.", "") if self.dtype else None,
            "chunk": chunk,
            "batch_size": self.batch_size,
            "input": self.src.description,
            "hookscope": __version__,
            "torch": torch.__version__,
            "created": datetime.datetime.now(datetime.timezone.utc).isoformat(),
        }

    def block(self, start: int, stop: int) -> tuple[dict[str, Any], list[str], list[str]]:
        """Features (NumPy, by layer), ids and errors of samples ``start .. stop-1`` (fewer
        at the end of a source that did not say its length)."""
        parts: dict[str, list[Tensor]] = {n: [] for n in self.names}
        ids: list[str] = []
        errors: list[str] = []
        for b in range(start, stop, self.batch_size):
            batch_ids, x, ok = self.src.batch(b, min(b + self.batch_size, stop))
            if not batch_ids:
                break
            ids += batch_ids
            reasons = self.src.errors()
            errors += [
                "" if good else reasons.get(i, "unreadable")
                for i, good in zip(batch_ids, ok, strict=True)
            ]
            for name, value in self.forward(x, ok).items():
                parts[name].append(value)
            if len(batch_ids) < min(self.batch_size, stop - b):
                break  # the source ended
        if not ids:
            return {}, [], []
        return {n: torch.cat(v).numpy() for n, v in parts.items()}, ids, errors

    def forward(self, x: Any, ok: list[bool]) -> dict[str, Tensor]:
        n = len(ok)
        if x is None:  # nothing in this batch could be read: NaN rows of the known shapes
            if not self._shapes:
                raise UsageError("no sample of the first batch could be read (see errors)")
            return {
                k: torch.full((n, *s[1:]), float("nan"), dtype=s[0])
                for k, s in self._shapes.items()
            }
        x = map_tensors(lambda _, t: t.to(self.device), x)
        mask = None
        if self.reduce == "token_mean" and isinstance(x, Mapping):
            mask = x.get("attention_mask")
        outputs = features(
            self.model, x, self.names, reduce=None if mask is not None else self.reduce,
            stop=self.stop,
        )  # fmt: skip
        result = {}
        bad = torch.tensor([not good for good in ok])
        for name in self.names:
            t = next(t for _, t in leaves(outputs[name]))
            if mask is not None and t.dim() == 3:
                m = mask.to(t.dtype).unsqueeze(-1)
                t = (t * m).sum(1) / m.sum(1).clamp(min=1e-9)
            t = t.detach().to("cpu", self.dtype or t.dtype)
            if bad.any():
                t = t.clone()
                t[bad] = float("nan") if t.is_floating_point() else 0
            result[name] = t
            self._shapes[name] = (t.dtype, *t.shape[1:])
        return result

    def run(self, store: Store, done: set[int], chunk: int, bar: bool | None) -> int:
        """The local engine: every block not done, in order. Returns the number of samples."""
        n = self.src.length()
        total = (
            None if n is None else n - sum(min(chunk, n - k * chunk) for k in done if k * chunk < n)
        )
        start, block = 0, 0
        with progress(total, "extract", bar) as advance:
            while n is None or start < n:
                stop = start + chunk if n is None else min(start + chunk, n)
                if block in done:
                    if not self.src.addressable:  # read past it, to know where the source ends
                        read = self._count(start, stop)
                        if read < stop - start:
                            return start + read
                    start, block = stop, block + 1
                    continue
                values, ids, errors = self.block(start, stop)
                if not ids:
                    return start
                store.ensure(values, n if n is not None else start + len(ids), chunk)
                store.write(block, start, values, ids, errors)
                advance(len(ids))
                if len(ids) < stop - start:
                    return start + len(ids)
                start, block = stop, block + 1
        return n

    def _count(self, start: int, stop: int) -> int:
        """Read samples ``start .. stop-1`` without a forward; how many there were."""
        return sum(
            len(self.src.batch(b, min(b + self.batch_size, stop))[0])
            for b in range(start, stop, self.batch_size)
        )


def fingerprint(model: nn.Module) -> str:
    """A hash of the parameters' and buffers' names, shapes, dtypes and values (through their
    sums and sums of squares, reduced on the device without copies and read once)."""
    tensors = [(n, t) for n, t in model.state_dict(keep_vars=True).items() if isinstance(t, Tensor)]
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    floats = [t.detach().reshape(-1) for _, t in tensors if t.numel() and t.is_floating_point()]
    if floats:
        device = floats[0].device
        with torch.no_grad():
            sums = [
                torch.stack([t.sum(dtype=torch.float64), torch.dot(t, t).double()]) for t in floats
            ]
            values = torch.stack([v.to(device) for v in sums]).flatten().tolist()
        h.update(repr([float(f"{v:.6g}") for v in values]).encode())
    return h.hexdigest()[:16]


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype):
        raise UsageError(f"dtype {dtype!r} is not a torch dtype such as torch.float16")
    if value == torch.bfloat16:
        raise UsageError("bfloat16 cannot be stored (no NumPy type): use float16 or float32")
    return value
