"""``hs.extract``: stream a dataset through a model and write selected layers' outputs to a
Zarr store, in blocks of ``chunk`` samples, resumable (see ``_store``), on this process (the
forwards in this thread, the writes in another: ``_writer``) or on Ray Data (``_ray``)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import math
import os
from collections.abc import Callable, Collection, Iterator
from typing import Any, Literal

import torch
from torch import nn

from .._progress import progress, wanted
from .._version import __version__
from ..core import LayerSelector, Reduce, unwrap
from ..errors import CaptureError, UsageError
from ._identity import fingerprint, probe
from ._job import Job
from ._reader import FeatureStore, open_features
from ._rows import check_reduce
from ._sources import Dataset, Source, Texts, Unreadable, source
from ._store import IDENTITY, Codec, Store, check_codec
from ._tokenjob import TokenJob
from ._tokens import Rule
from ._tokenstore import TokenStore
from ._writer import Writer, overlap

__all__ = ["extract", "kept"]


def extract(
    model: nn.Module | Callable[[], nn.Module],
    data: Any,
    layers: LayerSelector,
    *,
    out: str | os.PathLike[str],
    batch_size: int = 64,
    reduce: Reduce | None = None,
    unit: Literal["sample", "token"] = "sample",
    drop_token_ids: Collection[int] | None = None,
    positions: tuple[int, int | None] | None = None,
    dtype: torch.dtype | str | None = None,
    input_device: torch.device | str | None = None,
    chunk: int | None = None,
    stop: bool = True,
    tokenizer: Any = None,
    context: int | None = None,
    pack: bool = False,
    transform: Callable[[Any], Any] | None = None,
    on_error: Literal["raise", "skip"] = "raise",
    resume: bool = False,
    overwrite: bool = False,
    progress: bool | None = None,
    engine: Literal["local", "ray", "distributed"] = "local",
    workers: int = 2,
    codec: Codec | Any = "none",
) -> FeatureStore:
    """Write the outputs of ``layers`` for every sample of ``data`` to a Zarr store at ``out``.

    The forwards run in this thread and each finished block is written by another while the
    next ones run (from CUDA, rows are copied to pinned memory without waiting). A block is
    kept once its rows and then its entry in the store's ledger are written, so an interrupted
    run (a crash, a kill, Ctrl-C, which still writes the finished blocks) resumes where it
    stopped, and the result equals an uninterrupted run bit for bit.

    Args:
        model: the model, or (``engine="ray"``) a function returning it, called once per actor.
            ``torch.compile``d models work (their Python code runs, eagerly).
        data: a tensor or NumPy array (samples along dim 0), a map-style ``Dataset`` or a
            list or tuple of samples (as a ``DataLoader`` reads them: an item is the input or
            an ``(input, label, ...)`` tuple), a ``DataLoader`` or any other iterable of
            batches, an iterator for instance (used as they come: a ``collate_fn`` padding
            each batch works), a folder of images (a path), or a list of strings with
            ``tokenizer=``. Floating NumPy data is cast to the model's floating dtype (NumPy's
            default float64 into a float32 model); torch tensors are used as given.
        layers: any layer selector (see :func:`hookscope.capture`); each layer's output (the
            first tensor of a tuple or ``ModelOutput``) becomes an array named after it.
        out: the store's folder: a new path or an empty folder (or an existing store, with
            ``resume`` or ``overwrite``). It is created exclusively: of two runs making a store
            at one path at once, one wins and the other gets a UsageError.
        batch_size: samples per forward (a DataLoader's own batches are used as they are).
        reduce: ``"spatial_mean"`` (N, C, ...) -> (N, C), ``"token_mean"`` (N, T, D) -> (N, D),
            or a function applied to the batch that keeps one row per sample (checked on one
            sample). ``"token_mean"`` averages only the tokens an ``attention_mask`` (or a
            ``src_key_padding_mask``) in the inputs keeps: sentence-transformers' mean pooling.
            A nested tensor (``nn.TransformerEncoder``'s fast path with a padding mask) is
            reduced sample by sample, or without a reduce padded with zeros to the inputs'
            length. Every sample must give rows of one shape: varying shapes are refused.
        unit: ``"sample"``, a row per sample; or ``"token"``, a row per real token (where the
            inputs' ``attention_mask`` says so; every token of 2-d token ids without one) of
            each layer's ``(samples, tokens, ...)`` output, with the arrays ``sample`` (its
            row in ``ids``), ``position`` (its index among its sample's real tokens, so left
            and right padding agree) and ``token_id`` beside the layers. Samples of several
            lengths are padded per batch (a Dataset of tokenizer outputs; a DataLoader's
            ``collate_fn`` pads its own).
        drop_token_ids: ``unit="token"``: token ids never stored (BOS, special tokens:
            ``tokenizer.all_special_ids``).
        positions: ``unit="token"``: ``(start, stop)``, store only positions ``start`` to
            ``stop - 1`` (``stop`` None: to the end); ``(1, None)`` skips each first token.
        dtype: storage dtype (e.g. ``torch.float16``); default: as computed (bfloat16, which
            NumPy lacks, is stored as float32). Floating features need a floating dtype (a
            cast to an integer or bool type is refused: it would truncate them).
        input_device: where the inputs go before each forward (default: the device of the
            model's parameters). The rows always go to the store.
        chunk: samples per stored chunk and per committed block (default: a multiple of
            ``batch_size`` near 256 samples, fewer for large rows: at most 16 MiB per layer, at
            least one batch; a resumed store's own). Memory holds about three blocks.
        stop: end each forward after the last selected layer.
        tokenizer: for a list of strings (padding and truncation per batch); with
            ``unit="token"``, its ``pad_token_id`` pads a Dataset of tokenizer outputs.
        context: for a list of strings: the most tokens of a text (longer ones are cut), or
            with ``pack`` the length of each packed row.
        pack: for a list of strings: tokenize them all once and join them (each with its
            tokenizer's special tokens; a tokenizer adding none, GPT-2's, gets its EOS token
            after each text) into samples of ``context`` tokens, the last one padded.
        transform: for an image folder: PIL image -> tensor (default: RGB in 0..1).
        on_error: for an image folder: ``"raise"`` at a file that cannot be decoded, or
            ``"skip"``: its row is kept, filled with NaN, with the reason in ``errors`` and
            the store's metadata.
        resume: finish the store at ``out``; blocks already written are kept. It must come from
            the same run: model class and weights (a position-sensitive fingerprint), layers,
            reduce, dtype, chunk, input, and the first sample's input as the model sees it (so
            a changed transform, image size or tokenizer is refused too); what differs is
            named. Another ``batch_size`` (a smaller one after running out of memory) is
            accepted: it changes no sample's input in eval mode, except for texts padded per
            batch, where it is refused. Blocks computed at another batch size equal what that
            batch size computes, which may differ from the first one in the last bits (kernels
            chosen per batch size round differently).
        overwrite: replace whatever store is at ``out``.
        progress: a progress bar counting samples (None: only on a terminal).
        engine: ``"local"`` or ``"ray"`` (Ray Data actors writing their own blocks of the same
            store; ``ray.init(address=...)`` first to use an existing cluster). The model goes
            to the actors pickled; classes from modules that are not installed packages (a
            script, a notebook, a local file) are pickled by value, so actors need not import
            them.
            ``"distributed"``: every process of a ``torch.distributed`` job (``torchrun``)
            calls ``extract`` with the same arguments and computes its own range of the
            blocks not done; the one store equals the local engine's, and a resume may use
            another number of processes. Both need samples addressable by index; with
            ``unit="token"`` they read the inputs once more first, to count each block's
            tokens.
        workers: Ray actors.
        codec: compression of the layer arrays: ``"none"`` (default: writing stays cheap, and
            float features rarely shrink much), ``"lz4"`` (Blosc, byte shuffle: fast, and small
            for maps full of ReLU zeros), ``"zstd"`` (smaller, slower), or zarr codec objects
            (zarr's ``compressors=``). A resumed store keeps its arrays' codec.

    Returns:
        The store, opened for reading (:func:`open_features`).

    Raises:
        UsageError: an argument that cannot work, a store that cannot be resumed, or rows that
            cannot be stored (shapes varying between samples, a reduce that drops the samples'
            axis, a dtype that cannot hold them); before anything is written where it can be
            known then, else the store this run made is removed (a store it resumed is kept),
            so that the run the message suggests can make it again.
        KeyboardInterrupt: passed on after the finished blocks are written (resume=True then
            finishes the store).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, tempfile
        >>> net = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
        >>> store = hs.extract(net, torch.randn(100, 4), ["1"], out=tempfile.mkdtemp() + "/f")
        >>> store["1"].shape, len(store.ids)
        ((100, 8), 100)
    """
    _check(batch_size, workers, chunk, engine, resume, overwrite, reduce, codec, on_error)
    _check_tokens(unit, reduce, drop_token_ids, positions, context)
    wanted(progress)
    model, factory = _model(model, engine)
    src = source(
        data,
        tokenizer=tokenizer,
        transform=transform,
        on_error=on_error,
        context=context,
        pack=pack,
    )
    if engine != "local" and not src.addressable:
        raise UsageError(
            f"engine={engine!r} needs samples it can address by index (a tensor, array, "
            "Dataset, image folder or list of strings), not a one-pass iterable (a "
            "DataLoader's dataset is one: its collate_fn's padding is what unit='token' does "
            "itself)"
        )
    rule = Rule.of(drop_token_ids, positions) if unit == "token" else None
    job = _job(
        model, src, layers, batch_size, reduce, _dtype(dtype), input_device, stop, rule, tokenizer
    )
    kind = TokenStore if rule else Store
    size = chunk or (kind.chunk_of(out) if resume else None)
    # sample 0's rows: the other engines make the arrays from them; they size the default chunk
    shapes = job.probe(strict=True) if engine != "local" else {} if size else job.probe()
    size = size or _chunk(batch_size, shapes, job.length() if isinstance(job, TokenJob) else 1)
    meta = _meta(job, size, codec)
    opening = functools.partial(
        kind.open, out, meta, overwrite=overwrite, resume=resume, same=_same(src)
    )
    if engine == "distributed":
        from ._distributed import run_distributed

        run_distributed(job, kind, out, opening, size, progress, codec, shapes, meta)
        return open_features(out)
    store, done = opening()
    if isinstance(store, TokenStore) and isinstance(job, TokenJob):
        store.expected = size * job.length()
    with kept(store, src, out):
        if engine == "ray":
            from ._ray import run_ray

            rows = run_ray(job, store, done, size, factory, workers, progress, codec, shapes)
            errors = None  # the actors wrote the blocks: read from the store
        else:
            rows = _run_local(job, store, done, size, progress, codec)
            errors = None if done else store.errors_written  # it wrote every block
        store.finish(rows, meta, job.names, errors)
    return open_features(out)


@contextlib.contextmanager
def kept(store: Store, src: Source, out: str | os.PathLike[str]) -> Iterator[None]:
    """What a failed run leaves: the finished blocks, except after a refusal (rows that
    cannot be stored...), where a store this run made is removed."""
    try:
        yield
    except Unreadable:
        raise  # the finished blocks are what a resume with on_error="skip" keeps
    except (UsageError, CaptureError) as e:
        # a refusal (rows of varying shapes, a storage dtype that cannot hold them...): a store
        # this run made would only block the run the message suggests ("already exists")
        store.close()
        if store.created:
            store.discard()
            e.add_note(f"hookscope.extract: nothing was kept at {str(out)!r}")
        raise
    except Exception as e:  # the model failed: a list of batches read as samples?
        if src.hint:
            e.add_note(f"hookscope.extract: {src.hint}")
        raise
    except KeyboardInterrupt as e:
        e.add_note(
            f"hookscope.extract: interrupted; the finished blocks are kept in {str(out)!r}: "
            "run again with resume=True to finish it"
        )
        raise
    finally:
        # this thread's event loop, if it wrote (blocks in line, Ray's arrays, an empty store)
        store.close()


def _model(model: Any, engine: str) -> tuple[nn.Module, Any]:
    """The model, and the factory that made it (``engine="ray"``)."""
    if isinstance(model, nn.Module):
        return model, None
    if engine != "ray" or not callable(model):
        raise UsageError("model must be an nn.Module (a factory is accepted with engine='ray')")
    made = model()
    if not isinstance(made, nn.Module):
        raise UsageError(f"the model factory returned {type(made).__name__}, not an nn.Module")
    return made, model


def _job(
    model: nn.Module,
    src: Source,
    layers: Any,
    batch_size: int,
    reduce: Any,
    dtype: torch.dtype | None,
    device: Any,
    stop: bool,
    rule: Rule | None,
    tokenizer: Any,
) -> Job:
    if rule is None:
        return Job(model, src, layers, batch_size, reduce, dtype, device, stop)
    if isinstance(src, Dataset):  # tokenizer outputs of several lengths: padded per batch
        pad = getattr(tokenizer, "pad_token_id", None)
        src.pad = pad if isinstance(pad, int) else 0
    return TokenJob(model, src, layers, batch_size, dtype, device, stop, rule)


def _check_tokens(unit: Any, reduce: Any, drop: Any, positions: Any, context: Any) -> None:
    if unit not in ("sample", "token"):
        raise UsageError(f'unit must be "sample" or "token", got {unit!r}')
    if unit == "token" and reduce is not None:
        raise UsageError(
            "unit='token' stores every kept token's row; reduce= makes one row per sample "
            "(unit='sample'): use one or the other"
        )
    if unit == "sample" and (drop is not None or positions is not None):
        raise UsageError("drop_token_ids= and positions= choose tokens: they need unit='token'")
    if context is not None and (
        isinstance(context, bool) or not isinstance(context, int) or context < 1
    ):
        raise UsageError(f"context must be an int >= 1 (tokens per row), got {context!r}")


def _check(
    batch_size: Any,
    workers: Any,
    chunk: Any,
    engine: Any,
    resume: bool,
    overwrite: bool,
    reduce: Any,
    codec: Any,
    on_error: Any,
) -> None:
    if engine not in ("local", "ray", "distributed"):
        raise UsageError(f'engine must be "local", "ray" or "distributed", got {engine!r}')
    if on_error not in ("raise", "skip"):
        raise UsageError(f'on_error must be "raise" or "skip", got {on_error!r}')
    for name, value in (("batch_size", batch_size), ("workers", workers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be an int >= 1, got {value!r}")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise UsageError(f"chunk must be an int >= 1, got {chunk!r}")
    if resume and overwrite:
        raise UsageError("resume=True and overwrite=True contradict each other: choose one")
    check_reduce(reduce)
    check_codec(codec)


#: The default chunk holds about 256 samples, and at most this many bytes per layer.
_CHUNK_BYTES = 16 * 2**20


def _chunk(
    batch_size: int, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], tokens: int = 1
) -> int:
    """The default chunk: whole batches, about 256 samples, fewer where rows are large (so
    that a block of large maps is one batch, which the CPU stores without copying it).
    ``tokens``: rows per sample (unit="token": sample 0's tokens, a packed row's context)."""
    batches = max(1, round(256 / batch_size))
    row = tokens * max((math.prod(r) * d.itemsize for r, d in shapes.values()), default=0)
    if row:
        batches = max(1, min(batches, _CHUNK_BYTES // (batch_size * row)))
    return batch_size * batches


def _meta(job: Job, chunk: int, codec: Any) -> dict[str, Any]:
    reduce = job.reduce
    if callable(reduce):
        reduce = f"{getattr(reduce, '__module__', '?')}.{getattr(reduce, '__qualname__', '?')}"
    root = unwrap(job.model)
    return {
        "model": f"{type(root).__module__}.{type(root).__qualname__}",
        "fingerprint": fingerprint(job.model),
        "layers": job.names,
        "reduce": reduce,
        "dtype": str(job.dtype).replace("torch.", "") if job.dtype else None,
        "chunk": chunk,
        "batch_size": job.batch_size,
        "input": job.src.description,
        "unit": "token" if isinstance(job, TokenJob) else "sample",
        "token_rule": job.rule.meta() if isinstance(job, TokenJob) else None,
        "probe": _probe(job.src),
        "codec": codec if isinstance(codec, str) else repr(codec),
        "hookscope": __version__,
        "torch": torch.__version__,
        "created": datetime.datetime.now(datetime.UTC).isoformat(),
    }


def _same(src: Source) -> tuple[str, ...]:
    """What a resume must not change. The batch size changes no sample's input, and so no
    row (extraction runs in eval mode), except where texts are padded to each batch's longest:
    a smaller batch size (the usual answer to running out of memory) resumes any other store.
    Rows computed at another batch size can differ in the last bits, as the kernels chosen
    for another batch size can round differently."""
    return (*IDENTITY, "batch_size") if isinstance(src, Texts) else IDENTITY  # not Packed


def _probe(src: Source) -> str | None:
    """The first sample's input, digested; read twice where the source can be read again, so
    that a random transform is named rather than refusing every resume."""
    first = probe(src.first())
    if src.addressable and first is not None and probe(src.first()) != first:
        return "differs between reads (a random transform): not checked"
    return first


def _run_local(
    job: Job, store: Store, done: set[int], chunk: int, bar: bool | None, codec: Any
) -> int:
    """The local engine: every block not done, in order, written by a writer thread while
    the next forwards run. Returns the number of samples."""
    n = job.src.length()
    total = None if n is None else n - sum(min(chunk, n - k * chunk) for k in done if k * chunk < n)
    job.expect(store.row_shapes())
    rows = n if job.src.addressable else None
    writer = Writer(store, chunk, rows, codec, thread=overlap(job.device))
    with job.running(), writer, progress(total, "extract", bar) as advance:
        for block in job.blocks(chunk, lambda k: k not in done, writer.buffers, advance):
            writer.put(block)
    return job.samples


def _dtype(dtype: torch.dtype | str | None) -> torch.dtype | None:
    if dtype is None:
        return None
    value = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
    if not isinstance(value, torch.dtype):
        raise UsageError(f"dtype {dtype!r} is not a torch dtype such as torch.float16")
    if value == torch.bfloat16:
        raise UsageError("bfloat16 cannot be stored (no NumPy type): use float16 or float32")
    return value
