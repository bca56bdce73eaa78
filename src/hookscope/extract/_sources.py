"""What ``hs.extract`` reads: every kind of input, seen as numbered samples.

An addressable :class:`Source` (tensors, arrays, datasets, folders, texts) has ``len(source)``
samples and ``source.batch(start, stop)`` returning ``(ids, inputs, ok)`` for samples
``start..stop-1``: their ids, the model's inputs for them (a tensor, or a mapping of keyword
arguments) and which of them could be read (a file that cannot be decoded keeps its place,
marked not ok). It jumps to any sample, which resuming and Ray need. A list or tuple is a
list of samples, as ``DataLoader`` reads one. A plain iterable (a DataLoader, an iterator) is
:class:`Batches`: read in order, its own batches used as they come, so that a ``collate_fn``
that pads each batch to its longest sample keeps working.

NumPy data hookscope turns into tensors has its floating arrays cast to the model's floating
dtype (:attr:`Source.floats`): NumPy's default float64 would otherwise reach a float32 model
and fail inside it. Torch tensors are used as given.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from .._extras import require
from .._png import image_to_tensor
from ..errors import UsageError

__all__ = ["IMAGE_SUFFIXES", "Packed", "Source", "Texts", "Unreadable", "from_numpy", "source"]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff")
Batch = tuple[list[str], Any, list[bool]]


class Unreadable(UsageError):
    """A sample that cannot be read (``on_error="raise"``): the blocks before it hold what the
    same run would write, so a store is kept for ``resume=True``."""


class Source:
    """Samples ``0 .. len-1``; subclasses implement :meth:`batch` (and ``__len__``)."""

    description = "samples"
    addressable = True
    #: the dtype floating NumPy data becomes (the model's; set by the job), None: kept
    floats: torch.dtype | None = None
    #: how the data was read, where the model failing could mean it was misread
    hint = ""

    def __len__(self) -> int:
        raise NotImplementedError

    def length(self) -> int | None:
        return len(self)

    def batch(self, start: int, stop: int) -> Batch:
        raise NotImplementedError

    def errors(self) -> dict[str, str]:
        """``{id: reason}`` of the samples that could not be read so far."""
        return {}

    def first(self) -> Any:
        """The model's input for sample 0 alone (a batch of one), or None if there is none."""
        if not len(self):
            return None
        return self.batch(0, 1)[1]


class Tensors(Source):
    def __init__(self, data: Tensor) -> None:
        if data.dim() == 0:
            raise UsageError("data is a 0-d tensor: give samples along the first dimension")
        self.data = data
        self.description = f"tensor {tuple(data.shape)} {data.dtype}"

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, start: int, stop: int) -> Batch:
        return [str(i) for i in range(start, stop)], self.data[start:stop], [True] * (stop - start)


class Arrays(Source):
    """A NumPy array (a memory map too): each batch is copied out of it, so the array may be
    larger than memory, or read-only."""

    def __init__(self, data: Any) -> None:
        self.data = data
        self.description = f"array {tuple(data.shape)} {data.dtype}"

    def __len__(self) -> int:
        return len(self.data)

    def batch(self, start: int, stop: int) -> Batch:
        rows = from_numpy(self.data[start:stop], self.floats, copy=True)
        return [str(i) for i in range(start, stop)], rows, [True] * (stop - start)


class Dataset(Source):
    """A map-style dataset (a list or tuple too: one sample each): an item is the input, or
    a tuple whose first element is."""

    def __init__(self, data: Any) -> None:
        self.data = data
        listed = isinstance(data, (list, tuple))
        self.description = (
            f"{len(data)} samples in a {type(data).__name__}"
            if listed
            else f"dataset {type(data).__name__} of {len(data)}"
        )
        self.hint = (
            f"data is a {type(data).__name__}, read as one sample per item as a DataLoader "
            "reads it; give batches as an iterator (iter(batches)) or a DataLoader"
            if listed
            else ""
        )

    def __len__(self) -> int:
        return len(self.data)

    #: the id that pads ``input_ids`` of mappings of several lengths (unit="token"; None:
    #: such items are refused, as rows of several shapes would be)
    pad: int | None = None

    def batch(self, start: int, stop: int) -> Batch:
        items = [_input_of(self.data[i]) for i in range(start, stop)]
        if self.pad is not None and isinstance(items[0], Mapping):
            inputs = _padded(items, self.pad)
        else:
            inputs = _collate(items, self.floats, self.hint, start)
        return [str(i) for i in range(start, stop)], inputs, [True] * len(items)


class Batches(Source):
    """Any iterable of batches (a DataLoader): read once, in order; its batches are used as
    they come (``batch_size=`` does not apply) and samples are numbered from 0."""

    addressable = False

    def __init__(self, data: Iterable[Any]) -> None:
        self.data = data
        self.description = f"batches from {type(data).__name__}"
        self._iter: Iterator[Any] | None = None
        self._head: list[Any] = []  # batches read ahead by first()

    def __len__(self) -> int:
        n = self.length()
        if n is None:
            raise TypeError("this iterable does not say how many samples it has")
        return n

    def length(self) -> int | None:
        """A DataLoader's dataset length (a hint: ``drop_last`` or a sampler may differ)."""
        dataset = getattr(self.data, "dataset", None)
        if dataset is not None and hasattr(dataset, "__len__"):
            return len(dataset)
        return None

    def first(self) -> Any:
        if not self._head:
            batch = self._next()
            if batch is None:
                return None
            self._head.append(batch)
        x = self._head[0]
        return {k: v[:1] for k, v in x.items()} if isinstance(x, Mapping) else x[:1]

    def stream(self) -> Iterator[tuple[int, list[str], Any, list[bool]]]:
        """``(first index, ids, inputs, ok)`` for each batch, from the start."""
        start = 0
        while True:
            batch = self._head.pop(0) if self._head else self._next()
            if batch is None:
                return
            n = _count(batch)
            if n:
                yield start, [str(i) for i in range(start, start + n)], batch, [True] * n
            start += n

    def _next(self) -> Any:
        if self._iter is None:
            self._iter = iter(self.data)
        try:
            return _as_batch(_input_of(next(self._iter)), self.floats)
        except StopIteration:
            return None


class Images(Source):
    """Image files under a folder (sorted, recursive), decoded with Pillow and turned into
    tensors by ``transform`` (default: RGB, 0..1, no resizing). A file that cannot be decoded
    is skipped (kept as a row marked not ok, with its reason) or raises, by ``on_error``."""

    def __init__(self, folder: Path, transform: Callable[[Any], Any] | None, on_error: str) -> None:
        if on_error not in ("skip", "raise"):
            raise UsageError(f'on_error must be "skip" or "raise", got {on_error!r}')
        self.root = folder
        self.files = sorted(
            p for p in folder.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES
        )
        if not self.files:
            raise UsageError(f"no image files ({', '.join(IMAGE_SUFFIXES)}) under {str(folder)!r}")
        self.transform = transform or image_to_tensor
        self.on_error = on_error
        self._errors: dict[str, str] = {}
        self.description = f"image folder {folder} ({len(self.files)} files)"
        _pil()  # fail now if Pillow is missing

    def __len__(self) -> int:
        return len(self.files)

    def batch(self, start: int, stop: int) -> Batch:
        ids, tensors, ok = [], [], []
        for path in self.files[start:stop]:
            key = path.relative_to(self.root).as_posix()
            ids.append(key)
            try:
                with _pil().open(path) as im:
                    im.load()
                    tensors.append(self.transform(im.convert("RGB")))
                ok.append(True)
            except (OSError, ValueError, SyntaxError) as e:  # Pillow's ways of saying "corrupt"
                if self.on_error == "raise":
                    raise Unreadable(
                        f"cannot decode image {str(path)!r}: {e} (on_error='skip' records such "
                        "files in the store's metadata and goes on; with resume=True it keeps "
                        "the blocks already written)"
                    ) from e
                self._errors[key] = f"{type(e).__name__}: {e}"
                tensors.append(None)
                ok.append(False)
        good = [t for t in tensors if t is not None]
        if not good:
            return ids, None, ok
        filler = torch.zeros_like(good[0]) if isinstance(good[0], Tensor) else good[0]
        batch = _collate([t if t is not None else filler for t in tensors], self.floats)
        return ids, batch, ok

    def errors(self) -> dict[str, str]:
        return dict(self._errors)


class Texts(Source):
    """Strings, tokenized per batch (padding to the batch's longest, truncation to
    ``context`` tokens, or to the tokenizer's own limit)."""

    def __init__(self, texts: Sequence[str], tokenizer: Any, context: int | None = None) -> None:
        if tokenizer is None:
            raise UsageError("a list of strings needs tokenizer= (e.g. an HF AutoTokenizer)")
        self.texts, self.tokenizer, self.context = list(texts), tokenizer, context
        self.description = f"{len(self.texts)} texts, tokenizer {type(tokenizer).__name__}" + (
            f", context {context}" if context else ""
        )

    def __len__(self) -> int:
        return len(self.texts)

    def batch(self, start: int, stop: int) -> Batch:
        encoded = self.tokenizer(
            self.texts[start:stop],
            padding=True,
            truncation=True,
            max_length=self.context,
            return_tensors="pt",
        )
        ids = [str(i) for i in range(start, stop)]
        return ids, dict(encoded), [True] * (stop - start)


class Packed(Source):
    """Texts tokenized once and joined into one stream of tokens, cut into rows of ``context``
    tokens (the last one padded; its ``attention_mask`` says where). Each text keeps the
    special tokens its tokenizer adds (BERT's ``[CLS] .. [SEP]``, Llama's BOS); a tokenizer
    that adds none (GPT-2's) gets its EOS token after each text, as GPT-2 was trained, so
    that texts never run into each other unmarked."""

    def __init__(self, texts: Sequence[str], tokenizer: Any, context: int) -> None:
        if tokenizer is None:
            raise UsageError("pack=True packs texts: give a list of strings and tokenizer=")
        self.context = context
        separator = _separator(tokenizer)
        parts = []
        for i in range(0, len(texts), 1024):  # lists of Python ints: a few texts at a time
            for ids in tokenizer(list(texts[i : i + 1024]))["input_ids"]:
                parts.append(torch.tensor([*ids, *separator], dtype=torch.int32))
        self.stream = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int32)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = pad if pad is not None else getattr(tokenizer, "eos_token_id", None) or 0
        self.description = (
            f"{len(texts)} texts packed into rows of {context} tokens, tokenizer "
            f"{type(tokenizer).__name__}"
        )

    def __len__(self) -> int:
        return -(-len(self.stream) // self.context)

    def batch(self, start: int, stop: int) -> Batch:
        a, b = start * self.context, min(stop * self.context, len(self.stream))
        ids = torch.full(((stop - start) * self.context,), self.pad, dtype=torch.long)
        ids[: b - a] = self.stream[a:b]
        mask = torch.zeros(len(ids), dtype=torch.long)
        mask[: b - a] = 1
        shape = (stop - start, self.context)
        inputs = {"input_ids": ids.view(shape), "attention_mask": mask.view(shape)}
        return [str(i) for i in range(start, stop)], inputs, [True] * (stop - start)


def _separator(tokenizer: Any) -> list[int]:
    """What goes after each packed text: nothing when the tokenizer marks texts itself."""
    eos = getattr(tokenizer, "eos_token_id", None)
    marked = len(tokenizer("a")["input_ids"]) > len(
        tokenizer("a", add_special_tokens=False)["input_ids"]
    )
    return [] if marked or eos is None else [int(eos)]


def source(
    data: Any,
    *,
    tokenizer: Any = None,
    transform: Callable[[Any], Any] | None = None,
    on_error: str = "raise",
    context: int | None = None,
    pack: bool = False,
) -> Source:
    """The :class:`Source` for ``data`` (see :func:`hookscope.extract`)."""
    texts = isinstance(data, (list, tuple)) and data and all(isinstance(t, str) for t in data)
    if (context or pack) and not texts:
        raise UsageError(
            "context= and pack= apply to a list of strings with tokenizer= (tokenize other "
            "data yourself: a Dataset or DataLoader of tokenizer outputs)"
        )
    if pack:
        if not context:
            raise UsageError("pack=True needs context=, the length of each packed row")
        return Packed(data, tokenizer, context)
    if isinstance(data, Source):
        return data
    if isinstance(data, (str, os.PathLike)):
        folder = Path(data)
        if not folder.is_dir():
            raise UsageError(f"data {str(data)!r} is not a folder of images")
        return Images(folder, transform, on_error)
    if isinstance(data, Tensor):
        return Tensors(data)
    if _numpy(data) and hasattr(data, "shape"):
        return Arrays(data)
    if texts:
        return Texts(data, tokenizer, context)
    if hasattr(data, "__getitem__") and hasattr(data, "__len__") and not isinstance(data, Mapping):
        return Dataset(data)  # a list or tuple too: samples, as a DataLoader reads it
    if isinstance(data, Iterable) and not isinstance(data, Mapping):
        return Batches(data)
    raise UsageError(
        f"cannot read samples from {type(data).__name__}: give a tensor, a NumPy array, a "
        "Dataset or DataLoader, an iterable of batches, a folder of images, or a list of "
        "strings with tokenizer="
    )


def _pil() -> Any:
    return require("PIL.Image", "images", purpose="reading an image folder")


def _input_of(item: Any) -> Any:
    """A dataset item or loader batch: ``(input, label, ...)`` gives its input."""
    if isinstance(item, (tuple, list)) and item and not isinstance(item[0], str):
        return item[0]
    return item


def _as_batch(batch: Any, floats: torch.dtype | None) -> Any:
    """A loader's batch as a tensor or a mapping (NumPy arrays become tensors)."""
    if isinstance(batch, Tensor):
        return batch
    if isinstance(batch, Mapping):
        return {k: _tensor(v, floats) if _numpy(v) else v for k, v in batch.items()}
    if _numpy(batch):
        return from_numpy(batch, floats)
    raise UsageError(
        f"a batch must be a tensor, an array or a mapping of tensors, got {type(batch).__name__}"
    )


def _count(batch: Any) -> int:
    if isinstance(batch, Mapping):
        sized = [v for v in batch.values() if isinstance(v, Tensor) and v.dim()]
        if not sized:
            raise UsageError("a batch given as a mapping needs at least one tensor (its samples)")
        return len(sized[0])
    return len(batch)


def _collate(items: list[Any], floats: torch.dtype | None, hint: str = "", start: int = 0) -> Any:
    """Samples stacked into a batch (``start``: the first one's index, for errors)."""
    if isinstance(items[0], Mapping):
        return {k: torch.stack([_tensor(i[k], floats) for i in items]) for k in items[0]}
    tensors = [_tensor(i, floats) for i in items]
    shapes = {tuple(t.shape) for t in tensors}
    if len(shapes) > 1:
        which = ", ".join(
            f"sample {start + k}: {list(t.shape)}"
            for k, t in enumerate(tensors)
            if tuple(t.shape) != tuple(tensors[0].shape)
        )
        raise UsageError(
            f"samples of different shapes cannot form a batch (sample {start}: "
            f"{list(tensors[0].shape)}, {which}); "
            + (hint + "; or " if hint else "")
            + "give transform= that resizes them (images), or a DataLoader whose collate_fn "
            "pads each batch (with reduce='token_mean', or a reduce giving every sample one "
            "shape)"
        )
    return torch.stack(tensors)


def _padded(items: list[Any], pad: int) -> dict[str, Tensor]:
    """Tokenizer outputs of one sample each (mappings of 1-d sequences), padded at the right
    to the longest: ``input_ids`` with ``pad``, the rest with 0; an ``attention_mask`` is
    added where there is none and lengths differ (it is what says which tokens are real)."""
    keys = list(items[0])
    rows = [{k: torch.as_tensor(item[k]) for k in keys} for item in items]
    if bad := [k for k in keys if rows[0][k].dim() != 1]:
        raise UsageError(
            f"a dataset of tokenizer outputs needs 1-d sequences per sample; {bad[0]!r} has "
            f"shape {tuple(rows[0][bad[0]].shape)} (tokenize one text at a time, without "
            "return_tensors, or squeeze the batch dimension)"
        )
    lengths = {len(r[keys[0]]) for r in rows}
    if "attention_mask" not in keys and len(lengths) > 1:
        for r in rows:
            r["attention_mask"] = torch.ones(len(r[keys[0]]), dtype=torch.long)
        keys.append("attention_mask")
    return {
        k: torch.nn.utils.rnn.pad_sequence(
            [r[k] for r in rows], batch_first=True, padding_value=pad if k == "input_ids" else 0
        )
        for k in keys
    }


def _numpy(x: Any) -> bool:
    return type(x).__module__.startswith("numpy") and hasattr(x, "dtype")


def from_numpy(x: Any, floats: torch.dtype | None, *, copy: bool = False) -> Tensor:
    """A NumPy array (a memory map, a NumPy scalar) as a tensor (``copy``: never sharing its
    memory), floating values cast to ``floats`` (see the module docstring)."""
    import numpy as np

    t = torch.from_numpy(np.array(x, copy=True) if copy else np.asarray(x))
    return t.to(floats) if floats is not None and t.is_floating_point() else t


def _tensor(x: Any, floats: torch.dtype | None) -> Tensor:
    if isinstance(x, Tensor):
        return x
    if _numpy(x):
        return from_numpy(x, floats)
    return torch.as_tensor(x)
