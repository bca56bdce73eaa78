"""hs.extract's pipeline: the forwards run while another thread writes the finished blocks.
Progress counts samples as they are computed; an error while writing reaches the caller (and
the blocks written before it stay done); an interruption (Ctrl-C inside a forward) still writes
every finished block, and resuming then equals an uninterrupted run; memory holds a bounded
number of blocks however slow the writes; the codec is chosen per store. Oracles: hand-written
forward hooks, an uninterrupted run, the store's own ledger read with plain zarr."""

from __future__ import annotations

import importlib
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef

import hookscope as hs
from extract_oracle import hand

zarr = pytest.importorskip("zarr")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 4))


X = torch.randn(100, 6, generator=torch.Generator().manual_seed(3))


def _done(out: Path) -> list[bool]:
    return [bool(v) for v in zarr.open_group(str(out), mode="r")["done"][:]]


@contextmanager
def _writes(monkeypatch: pytest.MonkeyPatch, fn: Callable[[str, Any], None]) -> Iterator[None]:
    """Call ``fn(array name, bytes as a uint8 array)`` before every chunk file the store writes
    (in whatever thread), whether through zarr or directly (a whole chunk)."""
    store = importlib.import_module("hookscope.extract._store")
    real = store._put

    def spy(target: Path, data: Any, exclusive: bool = False) -> None:
        if target.name != "zarr.json":
            fn(target.parent.name, np.frombuffer(data, dtype=np.uint8))
        real(target, data, exclusive)

    monkeypatch.setattr(store, "_put", spy)
    yield
    monkeypatch.setattr(store, "_put", real)


def _writer_thread(monkeypatch: pytest.MonkeyPatch, thread: bool) -> str:
    """Make extract write from its writer thread, or in line (what it chooses when torch's
    threads fill every core); the name of the thread that writes."""
    module = importlib.import_module("hookscope.extract._extract")  # hs.extract is the function
    monkeypatch.setattr(module, "overlap", lambda device: thread)
    return "hookscope-extract" if thread else threading.current_thread().name


def test_progress_counts_samples_as_they_are_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module("hookscope.extract._extract")  # hs.extract is the function
    calls: list[tuple[Any, ...]] = []

    @contextmanager
    def recorder(total: int | None, description: str, setting: bool | None) -> Iterator[Any]:
        calls.append(("total", total))
        yield lambda n=1: calls.append(("advance", n))

    monkeypatch.setattr(module, "progress", recorder)
    hs.extract(_mlp(), X[:70], ["1"], out=tmp_path / "f", batch_size=16, chunk=32)
    assert calls == [("total", 70)] + [("advance", n) for n in (16, 16, 16, 16, 6)]
    zarr.open_group(str(tmp_path / "f"), mode="r+")["done"][1] = False
    calls.clear()
    hs.extract(_mlp(), X[:70], ["1"], out=tmp_path / "f", batch_size=16, chunk=32, resume=True)
    assert calls == [("total", 32), ("advance", 16), ("advance", 16)]  # only what is left


@pytest.mark.parametrize("thread", [True, False])
def test_an_error_while_writing_reaches_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    writes: list[str] = []
    writer = _writer_thread(monkeypatch, thread)

    def disk_full(name: str, value: Any) -> None:
        if name == "1":
            writes.append(threading.current_thread().name)
            if len(writes) == 3:
                raise OSError(28, "No space left on device (raised by the test)")

    model, out = _mlp(), tmp_path / "f"
    with _writes(monkeypatch, disk_full), pytest.raises(OSError, match="No space left"):
        hs.extract(model, X, ["1"], out=out, batch_size=10, chunk=20)
    assert set(writes) == {writer}  # written by the writer thread, or in line...
    assert _done(out) == [True, True, False, False, False]  # ...the blocks before the error kept
    assert not any(t.name == "hookscope-extract" for t in threading.enumerate())
    with pytest.raises(hs.UsageError, match="unfinished"):
        hs.open_features(out)
    store = hs.extract(model, X, ["1"], out=out, batch_size=10, chunk=20, resume=True)
    np.testing.assert_allclose(store.to_numpy("1"), hand(model, X, "1").numpy(), atol=1e-6)


@pytest.mark.parametrize("thread", [True, False])
def test_an_interrupt_writes_every_finished_block_then_resume_equals_a_clean_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    _writer_thread(monkeypatch, thread)
    model = _mlp()
    clean = hs.extract(model, X, ["1", "2"], out=tmp_path / "clean", batch_size=10, chunk=20)
    calls = [0]

    def ctrl_c(module: nn.Module, args: Any, output: Any) -> None:  # as if SIGINT came now
        calls[0] += 1
        if calls[0] == 8:  # blocks 0..2 finished (batches 1..6), block 3 half done
            raise KeyboardInterrupt

    out = tmp_path / "f"
    handle = model[0].register_forward_hook(ctrl_c)
    slow = lambda name, value: time.sleep(0.2)  # noqa: E731 - the writer lags behind
    try:
        with _writes(monkeypatch, slow), pytest.raises(KeyboardInterrupt) as caught:
            hs.extract(model, X, ["1", "2"], out=out, batch_size=10, chunk=20)
    finally:
        handle.remove()
    assert "resume=True" in str(caught.value.__notes__)
    assert _done(out) == [True, True, True, False, False]
    partial = hs.open_features(out, partial=True)
    assert not partial.complete and partial.stored == 60
    again = hs.extract(model, X, ["1", "2"], out=out, batch_size=10, chunk=20, resume=True)
    for layer in ("1", "2"):
        assert np.array_equal(again.to_numpy(layer), clean.to_numpy(layer))


def test_memory_holds_a_bounded_number_of_blocks_however_slow_the_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _writer_thread(monkeypatch, True)
    forwards, lag, buffers = [0], [], set()

    class Counted(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            forwards[0] += 1
            return super().forward(x)

    model = Counted(*_mlp())

    def slow(name: str, value: Any) -> None:
        if name == "1":
            buffers.add(value.__array_interface__["data"][0])  # which host memory is written
            lag.append(forwards[0] - len(lag))  # blocks computed but not yet written
            time.sleep(0.05)

    with _writes(monkeypatch, slow):  # blocks of 2 batches: copied into reused buffers
        copied = hs.extract(model, X, ["1"], out=tmp_path / "c", batch_size=5, chunk=10)
    assert len(buffers) <= 3  # 10 blocks, 3 buffers: one filled, one queued, one written
    forwards[0], lag[:] = 0, []
    with _writes(monkeypatch, slow):  # blocks of 1 batch: the forward's own tensors, held
        held = hs.extract(model, X, ["1"], out=tmp_path / "h", batch_size=5, chunk=5)
    assert len(lag) == 20 and max(lag) <= 4  # the forwards wait for the writes: never far ahead
    want = hand(model, X, "1").numpy()
    for store in (copied, held):
        np.testing.assert_allclose(store.to_numpy("1"), want, atol=1e-6)


def test_a_loader_batch_spanning_many_blocks(tmp_path: Path) -> None:
    model = _mlp()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X), batch_size=25)
    store = hs.extract(model, loader, ["1"], out=tmp_path / "f", chunk=4)  # 7 blocks per batch
    np.testing.assert_allclose(store.to_numpy("1"), hand(model, X, "1").numpy(), atol=1e-6)
    assert store.ids == [str(i) for i in range(100)] and len(_done(tmp_path / "f")) == 25


def test_codecs(tmp_path: Path) -> None:
    from zarr.codecs import BloscCodec, GzipCodec, ZstdCodec

    model = _mlp()
    want = hand(model, X, "1").numpy()
    kinds = {"none": (), "lz4": (BloscCodec,), "zstd": (ZstdCodec,), "gzip": (GzipCodec,)}
    for name, types in kinds.items():
        codec = GzipCodec(level=1) if name == "gzip" else name
        store = hs.extract(model, X, ["1"], out=tmp_path / name, codec=codec)
        compressors = zarr.open_group(str(tmp_path / name), mode="r")["1"].compressors
        assert tuple(type(c) for c in compressors) == types
        assert np.array_equal(
            store.to_numpy("1"), hs.open_features(tmp_path / "none").to_numpy("1")
        )
        np.testing.assert_allclose(store.to_numpy("1"), want, atol=1e-6)
        assert store.meta["codec"] == (name if name != "gzip" else repr(codec))
    with pytest.raises(
        hs.UsageError, match=r"codec='snappy': use one of \['none', 'lz4', 'zstd'\]"
    ):
        hs.extract(model, X, ["1"], out=tmp_path / "bad", codec="snappy")


@pytest.mark.mutates_model  # Static writes its outputs into its own tensor
@pytest.mark.parametrize("thread", [True, False])
def test_rows_kept_without_a_copy_are_let_go_once_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """A block of one batch keeps the forward's output itself; once written, the store must
    not hold it through the next forwards (it did until the caller's loop moved on, one
    forward later: a third batch of memory in use, and forwards 1.4x slower in an IO-bound
    extraction). Written in line, no earlier output is alive when a forward starts; from the
    writer thread, at most the queued block and the one being written."""
    _writer_thread(monkeypatch, thread)
    outputs: list[StorageWeakRef] = []  # the storage: the store keeps a view of the output
    alive: list[int] = []  # per forward: earlier outputs still alive when it starts

    class Recorded(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            alive.append(sum(not r.expired() for r in outputs))
            out = super().forward(x)
            outputs.append(StorageWeakRef(out.untyped_storage()))
            return out

    torch.manual_seed(0)
    model = Recorded(nn.Linear(6, 8), nn.ReLU())
    store = hs.extract(model, X, ["1"], out=tmp_path / "s", batch_size=10, chunk=10, stop=False)
    np.testing.assert_allclose(store.to_numpy("1"), hand(model, X, "1").numpy(), atol=1e-6)
    assert len(alive) == 11  # sample 0 (the probe), then ten batches
    assert max(alive) <= (2 if thread else 0), alive


def test_rows_kept_without_a_copy_are_the_rows_computed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks of one batch keep the forward's own tensors. Not when the forward changes them
    after the hook (an in-place ReLU), nor when the model writes every output into storage of
    its own (as static-memory code does), which the next forward overwrites while the writer
    still holds the previous rows (slowed down here)."""
    torch.manual_seed(0)
    inplace = nn.Sequential(nn.Linear(6, 8), nn.ReLU(inplace=True), nn.Linear(8, 2))
    store = hs.extract(inplace, X, ["0", "2"], out=tmp_path / "i", batch_size=10, chunk=10)
    np.testing.assert_array_equal(store.to_numpy("0") < 0, hand(inplace, X, "0").numpy() < 0)
    np.testing.assert_allclose(store.to_numpy("0"), hand(inplace, X, "0").numpy(), atol=1e-6)

    class Static(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(6, 8)
            self.out = torch.zeros(10, 8)  # a plain attribute: not a buffer

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # made for batches of 10
            self.out.copy_(self.lin(x))
            return self.out

    static = nn.Sequential(Static(), nn.ReLU())
    want = np.concatenate([hand(static, X[i : i + 10], "0.lin").numpy() for i in range(0, 100, 10)])
    _writer_thread(monkeypatch, True)  # in line, the rows are written before the next forward
    with _writes(monkeypatch, lambda name, value: time.sleep(0.02)):
        store = hs.extract(static, X, ["0"], out=tmp_path / "s", batch_size=10, chunk=10)
    np.testing.assert_allclose(store.to_numpy("0"), want, atol=1e-6)


def test_large_rows_are_stored_a_batch_at_a_time_without_a_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of 256 KiB, batches of 64: the default chunk is one batch (at most 16 MiB per layer
    and chunk), and on the CPU each block writes the tensor the layer returned."""
    made: list[int] = []

    class Wide(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out = x.repeat(1, 65536 // x.shape[1])
            made.append(out.data_ptr())
            return out

    model = nn.Sequential(nn.Linear(6, 8), Wide(), nn.ReLU())
    written: list[int] = []

    def spy(name: str, value: Any) -> None:
        if name == "1":
            written.append(value.__array_interface__["data"][0])

    x = torch.randn(130, 6, generator=torch.Generator().manual_seed(0))
    with _writes(monkeypatch, spy):
        store = hs.extract(model, x, ["1"], out=tmp_path / "f", batch_size=64)
    assert store.meta["chunk"] == 64 and store["1"].chunks == (64, 65536)
    # made[0]: the forward of sample 0 that sized the chunk; the last block (2 rows) is not a
    # whole chunk: zarr pads it with NaN rows into a chunk of its own
    assert written[:2] == made[1:3] and len(written) == 3
    want = store.to_numpy("1")
    np.testing.assert_allclose(want, hand(model, x, "1").numpy(), atol=1e-6)
    small = hs.extract(model, x, ["0"], out=tmp_path / "g", batch_size=32)
    assert small.meta["chunk"] == 256  # small rows: about 256 samples a chunk
    zarr.open_group(str(tmp_path / "f"), mode="r+")["done"][1] = False
    again = hs.extract(model, x, ["1"], out=tmp_path / "f", batch_size=64, resume=True)
    assert again.meta["chunk"] == 64 and np.array_equal(again.to_numpy("1"), want)


@pytest.mark.parametrize("thread", [True, False])
def test_chunk_files_are_written_by_the_writer_thread_itself(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, thread: bool
) -> None:
    """Every chunk file (rows, ids, done) is written and renamed into place by the thread
    that writes (the writer thread, or the caller's in line), not handed to a file thread
    (each hand-over waits for a busy CPU), and none is compressed but the layers' (a
    compressor is another hand-over, for a few bytes)."""
    import os

    writer = _writer_thread(monkeypatch, thread)
    real = os.replace
    seen: list[tuple[str, str]] = []

    def spy(src: Any, dst: Any) -> None:
        seen.append(
            (Path(dst).relative_to(tmp_path / "f").as_posix(), threading.current_thread().name)
        )
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store = hs.extract(_mlp(), X, ["1"], out=tmp_path / "f", batch_size=16, chunk=32)
    monkeypatch.setattr(os, "replace", real)
    chunks = [(key, thread) for key, thread in seen if "/c" in key]
    assert {key.split("/")[0] for key, _ in chunks} == {
        "1",
        "ids",
        "done",
    }  # no error: no errors array
    assert len([k for k, _ in chunks if k.startswith("done/")]) == 4  # 100 samples, 4 blocks
    assert {name for _, name in chunks} == {writer}
    assert not list((tmp_path / "f").rglob("*.partial"))
    group = zarr.open_group(str(tmp_path / "f"), mode="r")
    assert all(not group[name].compressors for name in ("ids", "errors", "done"))
    np.testing.assert_allclose(store.to_numpy("1"), hand(_mlp(), X, "1").numpy(), atol=1e-6)


def test_written_in_line_every_file_of_the_store_is_written_by_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In line, the whole store (the group's and arrays' metadata, the chunks, the final
    attributes that say it is complete) is written on the calling thread: zarr's synchronous
    API would hand each metadata write to its own thread and wait for it."""
    import os

    caller = _writer_thread(monkeypatch, False)
    real = os.replace
    seen: list[tuple[str, str]] = []

    def spy(src: Any, dst: Any) -> None:
        seen.append((Path(dst).name, threading.current_thread().name))
        real(src, dst)

    monkeypatch.setattr(os, "replace", spy)
    store = hs.extract(_mlp(), X, ["1"], out=tmp_path / "f", batch_size=16, chunk=32)
    monkeypatch.setattr(os, "replace", real)
    assert {name for name, _ in seen} >= {"zarr.json", "c.0", "c.0.0"}
    assert {thread for _, thread in seen} == {caller}
    assert store.meta["complete"] and store.meta["samples"] == len(X)
    np.testing.assert_allclose(store.to_numpy("1"), hand(_mlp(), X, "1").numpy(), atol=1e-6)


def test_whole_chunks_written_directly_are_the_bytes_zarr_writes(tmp_path: Path) -> None:
    """The store writes whole chunks of uncompressed layers, ids and done without zarr's
    machinery: each file is byte for byte what plain zarr writes for the same values into an
    array made with the same metadata (the oracle), and the last, partial block (zarr's own
    write) reads back too."""
    store = hs.extract(_mlp(), X, ["1"], out=tmp_path / "f", batch_size=16, chunk=32)
    ours = zarr.open_group(str(tmp_path / "f"), mode="r")
    plain = zarr.open_group(str(tmp_path / "plain"), mode="w")
    for name in ("1", "ids", "done"):
        array = ours[name]
        oracle = plain.create_array(
            name,
            shape=array.shape,
            chunks=array.chunks,
            dtype=array.dtype,
            fill_value=array.fill_value,
            compressors=array.compressors,
            filters=array.filters,
            chunk_key_encoding=array.metadata.chunk_key_encoding,
        )
        oracle[:] = array[:]
        files = sorted(p.name for p in (tmp_path / "f" / name).iterdir() if p.name != "zarr.json")
        assert files == sorted(
            p.name for p in (tmp_path / "plain" / name).iterdir() if p.name != "zarr.json"
        )
        for file in files:
            assert (tmp_path / "f" / name / file).read_bytes() == (
                tmp_path / "plain" / name / file
            ).read_bytes(), (name, file)
    assert list(store.ids) == [str(i) for i in range(100)]
    np.testing.assert_allclose(store.to_numpy("1"), hand(_mlp(), X, "1").numpy(), atol=1e-6)
