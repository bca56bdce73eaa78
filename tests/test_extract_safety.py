"""hs.extract never stores wrong rows silently, and works where it used to crash: per-sample
shapes that vary between batches (refused), reduces that drop the samples' axis (refused), a
resume with permuted weights or another image transform (refused), a DataLoader that pads each
batch, an empty dataset, a kill between the creation of two arrays, nested tensors (a padded
TransformerEncoder in eval), a torch.compile'd model that already ran. Oracles: each sample run
alone through the model by hand (no padding, no hookscope), hand-written forward hooks, and an
uninterrupted run in a child process."""

from __future__ import annotations

import copy
import importlib
import json
import os
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
import zygote
from extract_oracle import cnn as _cnn
from extract_oracle import hand as _hand
from extract_oracle import mlp

zarr = pytest.importorskip("zarr")


X = torch.randn(40, 3, 10, 10, generator=torch.Generator().manual_seed(1))


def _by_batch(model: nn.Module, x: Tensor, layer: str, size: int) -> Tensor:
    """The oracle for a run with ``batch_size=size``: hand-written hooks batch by batch (the
    kernels chosen for another batch size may round differently)."""
    return torch.cat([_hand(model, x[i : i + size], layer) for i in range(0, len(x), size)])


# -- token models: a tokenizer padding each batch to its longest, an embedding + projection ------


class _Tokenizer:
    """Words -> ids, each batch padded to its longest text (as HF tokenizers do)."""

    def __call__(self, texts: list[str], **kwargs: object) -> dict[str, Tensor]:
        rows = [[sum(map(ord, w)) % 60 + 1 for w in t.split()] for t in texts]
        return _pad([torch.tensor(r) for r in rows])


def _pad(seqs: list[Tensor]) -> dict[str, Tensor]:
    longest = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), longest, dtype=torch.long)
    mask = torch.zeros(len(seqs), longest, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)], mask[i, : len(s)] = s, 1
    return {"input_ids": ids, "attention_mask": mask}


class _TokenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.proj = nn.Embedding(64, 8), nn.Linear(8, 8)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        return self.proj(self.emb(input_ids))


def _alone(model: _TokenModel, ids: Tensor) -> Tensor:
    """The oracle: one unpadded sequence through the model by hand, averaged over its tokens."""
    with torch.no_grad():
        return model.proj(model.emb(ids[None]))[0].mean(0)


def test_varying_per_sample_shapes_are_refused_not_truncated(tmp_path: Path) -> None:
    """Texts padded per batch: 5 tokens in the first block, 1 in the next (which used to be
    broadcast into the first block's shape silently), or 3 within one block (a crash). The
    refusal leaves nothing at ``out``, so the run it suggests (reduce='token_mean') works
    there; it used to leave a half-written store that made that run fail ("already
    exists")."""
    model, tok = _TokenModel(), _Tokenizer()
    texts = ["a b c d e"] * 4 + ["a"] * 4
    want = torch.stack([_alone(model, _Tokenizer()([t])["input_ids"][0]) for t in texts])
    for chunk in (4, 8):
        out = tmp_path / f"c{chunk}"
        with pytest.raises(
            hs.UsageError, match=r"rows of shape \(1, 8\) .* per-sample shapes vary"
        ) as refused:
            hs.extract(model, texts, ["proj"], out=out, tokenizer=tok, batch_size=4, chunk=chunk)
        assert f"nothing was kept at {str(out)!r}" in "".join(refused.value.__notes__)
        assert not out.exists()
        store = hs.extract(
            model,
            texts,
            ["proj"],
            out=out,
            tokenizer=tok,
            batch_size=4,
            chunk=chunk,
            reduce="token_mean",
        )
        np.testing.assert_allclose(store.to_numpy("proj"), want.numpy(), rtol=1e-6, atol=1e-6)


def test_a_reduce_that_drops_the_samples_axis_is_refused(tmp_path: Path) -> None:
    model = _cnn()
    with pytest.raises(hs.UsageError, match="batch_mean' averages the samples"):
        hs.extract(model, X, ["1"], out=tmp_path / "a", reduce="batch_mean")
    assert not (tmp_path / "a").exists()  # refused before anything was written
    # t.mean(0) of a batch of 8 with 8 channels keeps 8 rows: only a per-sample check sees it
    for reduce in (lambda t: t.mean(0), lambda t: t.sum()):
        with pytest.raises(hs.UsageError, match=r"keep dim 0 \(the samples\)"):
            hs.extract(
                model, X, ["1"], out=tmp_path / "b", reduce=reduce, batch_size=8, overwrite=True
            )
    store = hs.extract(model, X, ["1"], out=tmp_path / "c", reduce=lambda t: t.amax(dim=(2, 3)))
    want = _hand(model, X, "1").amax(dim=(2, 3))
    assert np.array_equal(store.to_numpy("1"), want.numpy())


def test_a_store_with_nested_chunk_keys_resumes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stores of earlier versions keep chunks at ``c/3/0`` ("/" keys), new ones at ``c.3.0``;
    zarr reads either from the arrays' metadata, and a resume writes each in its own way."""
    store_module = importlib.import_module("hookscope.extract._store")
    model, clean = _cnn(), tmp_path / "clean"
    hs.extract(model, X, ["1", "6"], out=clean, chunk=16, batch_size=8)
    assert (clean / "1" / "c.1.0.0.0").is_file() and not (clean / "1" / "c").exists()
    monkeypatch.setattr(store_module, "_KEYS", {"name": "default", "separator": "/"})
    old = tmp_path / "old"
    hs.extract(model, X, ["1", "6"], out=old, chunk=16, batch_size=8)
    monkeypatch.undo()
    group = zarr.open_group(str(old), mode="r+")
    group["done"][1] = False
    group["1"][16:32] = 0.0  # what a killed run may leave in a block not done
    again = hs.extract(model, X, ["1", "6"], out=old, chunk=16, batch_size=8, resume=True)
    assert (old / "1" / "c" / "1" / "0" / "0" / "0").is_file() and not list(old.rglob("c.*"))
    for layer in ("1", "6"):
        assert np.array_equal(again.to_numpy(layer), hs.open_features(clean).to_numpy(layer))


def test_resume_refuses_permuted_weights_and_accepts_the_same_weights(tmp_path: Path) -> None:
    model, out = _cnn(), tmp_path / "f"
    hs.extract(model, X, ["6"], out=out, chunk=16, batch_size=8)
    zarr.open_group(str(out), mode="r+")["done"][1] = False  # a block still to do
    permuted = copy.deepcopy(model)
    with torch.no_grad():  # same values, other places: same sum and sum of squares
        w = permuted[2].weight
        w.copy_(w.reshape(-1).flip(0).reshape(w.shape))
    assert not torch.equal(_hand(permuted, X, "6"), _hand(model, X, "6"))
    with pytest.raises(hs.UsageError, match="fingerprint: stored"):
        hs.extract(permuted, X, ["6"], out=out, chunk=16, batch_size=8, resume=True)
    again = hs.extract(copy.deepcopy(model), X, ["6"], out=out, chunk=16, batch_size=8, resume=True)
    np.testing.assert_allclose(again.to_numpy("6"), _hand(model, X, "6").numpy(), atol=1e-6)


def test_the_fingerprint_of_fixed_weights_never_changes() -> None:
    """Stores made by earlier versions must still resume: the fingerprint of known weights is
    pinned (one run of weights and two; a short tensor after a long one and before)."""
    from hookscope.extract._identity import fingerprint

    small, big = nn.Linear(4, 3), nn.Linear(1500, 1000)
    with torch.no_grad():
        for p in (*small.parameters(), *big.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float32).reshape(p.shape) % 7 / 7)
    models = (small, big, nn.Sequential(small, big), nn.Sequential(big, small))
    assert [fingerprint(m) for m in models] == [
        "fcef8e2915c07d2e",
        "b33db29be05d7468",
        "542e19727a1628d0",
        "79038a6c885ff25e",
    ]


def test_the_fingerprint_of_weights_of_every_dtype_never_changes() -> None:
    """The CPU sums are taken piece by piece (a faster order of the same float64 additions):
    weights of other dtypes than float32 (float64 over two runs, bfloat16, float16, complex,
    integer and bool buffers) keep the fingerprint the whole-run sums gave them."""
    from hookscope.extract._identity import fingerprint

    model = nn.Sequential(nn.Linear(700, 1600).double(), nn.Linear(40, 30).bfloat16())
    model.append(nn.Linear(8, 4).half())
    model.register_buffer("steps", torch.arange(50_000))
    model.register_buffer("mask", torch.arange(40_000) % 3 == 0)
    model.phase = nn.Parameter(torch.complex(torch.arange(6.0), -torch.arange(6.0)))
    with torch.no_grad():
        for p in model[0].parameters():
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).reshape(p.shape) % 7 / 7)
        for p in (*model[1].parameters(), *model[2].parameters()):
            p.copy_((torch.arange(p.numel()) % 5 / 5).reshape(p.shape))
    assert fingerprint(model) == "6eb8d9dcd1cfe425"  # what the code before the pieces gave


def test_the_fingerprint_does_not_depend_on_the_number_of_torch_threads() -> None:
    """A store made in a process with 2 torch threads resumes in one with 1 or 3 (another
    machine, a worker): sums of 2**20 float32 values added up by a different number of
    threads differ in their last bits, so the sums are float64 (it failed with float32)."""
    from hookscope.extract._identity import fingerprint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2000, 3000), nn.Linear(3000, 10))
    threads = torch.get_num_threads()
    try:
        seen = set()
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            seen.add(fingerprint(model))
    finally:
        torch.set_num_threads(threads)
    assert len(seen) == 1


def test_a_dataloader_that_pads_each_batch(tmp_path: Path) -> None:
    """Batches of 7 padded to their own longest, blocks of 8: batches straddle blocks."""
    model = _TokenModel()
    g = torch.Generator().manual_seed(0)
    seqs = [
        torch.randint(1, 60, (int(n),), generator=g)
        for n in torch.randint(2, 12, (30,), generator=g)
    ]
    loader = lambda: torch.utils.data.DataLoader(seqs, batch_size=7, collate_fn=_pad)  # noqa: E731
    store = hs.extract(model, loader(), ["proj"], out=tmp_path / "f", reduce="token_mean", chunk=8)
    want = torch.stack([_alone(model, s) for s in seqs])
    np.testing.assert_allclose(store.to_numpy("proj"), want.numpy(), rtol=1e-6, atol=1e-6)
    assert store.ids == [str(i) for i in range(30)]
    zarr.open_group(str(tmp_path / "f"), mode="r+")["done"][1] = False  # rows 8..15: 2 batches
    again = hs.extract(
        model, loader(), ["proj"], out=tmp_path / "f", reduce="token_mean", chunk=8, resume=True
    )
    assert np.array_equal(again.to_numpy("proj"), store.to_numpy("proj"))
    with pytest.raises(hs.UsageError, match="reduce='token_mean'"):
        hs.extract(model, loader(), ["proj"], out=tmp_path / "g", chunk=8)


@pytest.mark.parametrize("kind", ["tensor", "dataset", "loader", "list"])
def test_an_empty_dataset_gives_an_empty_store(tmp_path: Path, kind: str) -> None:
    empty = torch.empty(0, 3, 10, 10)
    data = {
        "tensor": empty,
        "dataset": torch.utils.data.TensorDataset(empty),
        "loader": torch.utils.data.DataLoader(torch.utils.data.TensorDataset(empty)),
        "list": [],
    }[kind]
    store = hs.extract(_cnn(), data, ["1", "6"], out=tmp_path / "f")
    assert len(store) == 0 and store.ids == [] and store.meta["samples"] == 0
    assert store.complete and store.to_numpy("6").shape[0] == 0
    again = hs.extract(_cnn(), data, ["1", "6"], out=tmp_path / "f", resume=True)
    assert len(again) == 0


def _killed_run(out: str, kill_at: int) -> None:
    """In a child: the extraction of :func:`_extract`, killed with SIGKILL as the store starts
    making its ``kill_at``-th array."""
    import zarr.api.asynchronous as za

    model, x = mlp(100)
    made = [0]
    create = za.create_array  # what the store makes its arrays with

    async def dying(*args: Any, **kwargs: Any) -> Any:  # the test's own kill
        made[0] += 1
        if made[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return await create(*args, **kwargs)

    za.create_array = dying
    hs.extract(model, x, ["0", "2"], out=out, batch_size=10, chunk=20)


def _killed(out: Path, kill_at: int) -> None:
    """A child process making a store at ``out``, killed as it starts making its
    ``kill_at``-th array (5: after the last, before any row is marked done). It is forked from
    the tests' forkserver (see zygote.py: a fresh interpreter spent most of its time importing
    torch)."""
    child = zygote.Child(_killed_run, str(out), kill_at, stderr_file=out.with_suffix(".stderr"))
    assert child.wait(timeout=120) == -signal.SIGKILL, child.stderr[-2000:]


def _extract(out: Path, resume: bool = False) -> hs.FeatureStore:
    """The children's extraction, in this process, not killed (a resume needs no process of
    its own, and a child's time goes mostly to importing torch)."""
    model, x = mlp(100)
    return hs.extract(model, x, ["0", "2"], out=out, batch_size=10, chunk=20, resume=resume)


@pytest.mark.slow
def test_a_kill_between_creating_the_arrays_then_resume(tmp_path: Path) -> None:
    clean = _extract(tmp_path / "clean")
    points = (1, 2, 5)  # as the arrays are made; after all of them
    with ThreadPoolExecutor(2) as pool:  # the children, two at a time
        list(pool.map(lambda k: _killed(tmp_path / f"k{k}", k), points))
    # killed before any array existed: a partial open says so (it raised a raw KeyError)
    early = hs.open_features(tmp_path / "k1", partial=True)
    assert (len(early), early.ids, early.stored, early.complete) == (0, [], 0, False)
    assert "nothing stored yet" in repr(early)
    with pytest.raises(hs.UsageError, match=r"no rows of layer '0' yet: .* resume=True"):
        early.to_numpy("0")
    for k in points:
        store = _extract(tmp_path / f"k{k}", resume=True)
        for layer in ("0", "2"):
            assert np.array_equal(store.to_numpy(layer), clean.to_numpy(layer))


def test_resume_checks_the_image_transform_and_size(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    rng = np.random.default_rng(0)
    for i in range(6):
        pixels = rng.integers(0, 255, (20, 20, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "imgs" / f"{i}.png")

    def resized(side: int) -> object:
        return lambda im: torch.from_numpy(np.array(im.resize((side, side)))).permute(2, 0, 1) / 255

    model, out = _cnn(), tmp_path / "f"
    hs.extract(model, tmp_path / "imgs", ["6"], out=out, transform=resized(12), chunk=4)
    for other in (resized(16), lambda im: resized(12)(im.rotate(90))):
        with pytest.raises(hs.UsageError, match="the first sample's model input"):
            hs.extract(
                model, tmp_path / "imgs", ["6"], out=out, transform=other, chunk=4, resume=True
            )
    hs.extract(
        model, tmp_path / "imgs", ["6"], out=out, transform=resized(12), chunk=4, resume=True
    )  # the same transform (another function object) resumes


# -- nested tensors ------------------------------------------------------------------------------


def _encoder() -> nn.Module:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
    return nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()


class _Padded(torch.utils.data.Dataset[dict[str, Tensor]]):
    """Sequences of 1..9 tokens right-padded to 9, with TransformerEncoder's padding mask."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(12, 9, 16, generator=g)
        self.lengths = [9, 4, 1, 7, 9, 2, 5, 3, 8, 6, 9, 4]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, Tensor]:
        return {"src": self.x[i], "src_key_padding_mask": torch.arange(9) >= self.lengths[i]}


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensor_outputs_of_a_padded_transformer_encoder(tmp_path: Path) -> None:
    enc, data = _encoder(), _Padded()
    with torch.no_grad():  # the oracle: each sequence alone, unpadded, through layer 0 by hand
        alone = [enc.layers[0](data.x[i, :n][None])[0] for i, n in enumerate(data.lengths)]
    store = hs.extract(
        enc, data, ["layers.0"], out=tmp_path / "m", reduce="token_mean", batch_size=4
    )
    want = torch.stack([a.mean(0) for a in alone])
    np.testing.assert_allclose(store.to_numpy("layers.0"), want.numpy(), atol=1e-5)
    padded = hs.extract(enc, data, ["layers.0"], out=tmp_path / "p", batch_size=4).to_numpy(
        "layers.0"
    )
    assert padded.shape == (12, 9, 16)  # padded back to the inputs' length, as torch pads
    for i, n in enumerate(data.lengths):
        np.testing.assert_allclose(padded[i, :n], alone[i].numpy(), atol=1e-5)
        assert not padded[i, n:].any()
    with pytest.raises(hs.UsageError, match=r"nested tensor .* different"):
        hs.extract(enc, data, ["layers.0"], out=tmp_path / "s", reduce="spatial_mean")


# -- torch.compile -------------------------------------------------------------------------------


@pytest.fixture
def fresh_dynamo() -> object:
    torch._dynamo.reset()
    yield None
    torch._dynamo.reset()


def test_a_compiled_model_that_already_ran_gives_the_eager_features(
    tmp_path: Path, fresh_dynamo: object
) -> None:
    net = _cnn()
    eager = hs.extract(net, X, ["1", "6"], out=tmp_path / "eager", batch_size=16)
    compiled = torch.compile(_cnn(), backend="eager")
    compiled(X[:2])  # its compiled code ran: hooks added now would be ignored by that code
    store = hs.extract(compiled, X, ["1", "6"], out=tmp_path / "c", batch_size=16)
    for layer in ("1", "6"):
        assert np.array_equal(store.to_numpy(layer), eager.to_numpy(layer))
        np.testing.assert_allclose(store.to_numpy(layer), _hand(net, X, layer).numpy(), atol=1e-6)
    # the same weights: the compiled model resumes the eager model's store
    hs.extract(compiled, X, ["1", "6"], out=tmp_path / "eager", batch_size=16, resume=True)


# -- bad arguments and inputs --------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int8, torch.bool, torch.int64, "uint8"])
def test_a_storage_dtype_that_cannot_hold_float_features_is_refused(
    tmp_path: Path, dtype: object
) -> None:
    """int8 stored zeros (the features are in -1..1 here) and bool stored True everywhere."""
    model, out = _cnn(), tmp_path / "f"
    for chunk in (None, 16):  # with a probe of sample 0 and without one
        with pytest.raises(hs.UsageError, match=r"cannot store the float32 values of layer '6'"):
            hs.extract(model, X, ["6"], out=out, dtype=dtype, chunk=chunk)  # type: ignore[arg-type]
        assert not out.exists()
    store = hs.extract(model, X, ["6"], out=out, dtype=torch.float16)
    assert np.array_equal(store.to_numpy("6"), _hand(model, X, "6").half().numpy())


class _Argmax(nn.Module):
    """Integer features: the top channel of each position."""

    def forward(self, x: Tensor) -> Tensor:
        return x.argmax(1)


def test_integer_features_keep_an_integer_storage_dtype(tmp_path: Path) -> None:
    model = nn.Sequential(_cnn()[0], _Argmax())
    store = hs.extract(model, X, ["1"], out=tmp_path / "f", dtype=torch.int32)
    want = model[1](model[0](X)).int()
    assert store["1"].dtype == np.int32 and np.array_equal(store.to_numpy("1"), want.numpy())


def test_on_error_is_checked_for_every_kind_of_data(tmp_path: Path) -> None:
    with pytest.raises(hs.UsageError, match=r'on_error must be "raise" or "skip", got \'skp\''):
        hs.extract(_cnn(), X, ["6"], out=tmp_path / "f", on_error="skp")  # type: ignore[arg-type]
    assert not (tmp_path / "f").exists()


def test_a_list_of_per_sample_tensors_is_a_list_of_samples(tmp_path: Path) -> None:
    """As a DataLoader reads a list: item i is sample i. It used to be read as batches: a
    sample (3, 10, 10) became a batch of 3 images of shape (10, 10), refused by the model's
    first convolution with an error about the layer."""
    model = _cnn()
    for data in (list(X), tuple(X), [x.numpy() for x in X], [(x, 0) for x in X]):
        store = hs.extract(model, data, ["6"], out=tmp_path / "f", overwrite=True)
        assert len(store) == len(X)
        assert np.array_equal(store.to_numpy("6"), _hand(model, X, "6").numpy())
    # batches of unequal sizes in a list cannot be samples: refused naming the input
    batches = [X[:16], X[16:32], X[32:]]
    with pytest.raises(hs.UsageError, match=r"data is a list, read as one sample per item"):
        hs.extract(model, batches, ["6"], out=tmp_path / "g")
    assert not (tmp_path / "g").exists()
    store = hs.extract(model, iter(batches), ["6"], out=tmp_path / "g")  # as the message says
    assert np.array_equal(store.to_numpy("6"), _by_batch(model, X, "6", 16).numpy())


def test_numpy_floats_are_cast_to_the_model_dtype(tmp_path: Path) -> None:
    """NumPy's default float64 into a float32 model (it used to fail inside the model with
    torch's dtype error), float32 into a float64 model; integer arrays (token ids) are kept.
    The oracle is the model run by hand on a tensor of the model's dtype."""
    model = _cnn()
    cases = {
        "array": X.double().numpy(),
        "dataset": _NumpyItems(X.double().numpy()),
        "loader": [{"x": X.double().numpy()}],
    }
    for name, data in cases.items():
        if name == "loader":  # batches as mappings of arrays, keyword inputs
            store = hs.extract(_Keyword(model), iter(data), ["net.6"], out=tmp_path / name)
            got = store.to_numpy("net.6")
        else:
            got = hs.extract(model, data, ["6"], out=tmp_path / name).to_numpy("6")
        assert got.dtype == np.float32
        assert np.array_equal(got, _hand(model, X, "6").numpy()), name
    wide = _cnn().double()
    store = hs.extract(wide, X.numpy(), ["6"], out=tmp_path / "wide")
    assert np.array_equal(store.to_numpy("6"), _hand(wide, X.double(), "6").numpy())
    tokens = _TokenModel()
    ids = np.random.default_rng(0).integers(0, 64, (6, 5))
    store = hs.extract(tokens, ids, ["proj"], out=tmp_path / "ids")
    assert np.array_equal(
        store.to_numpy("proj"), _hand(tokens, torch.from_numpy(ids), "proj").numpy()
    )


class _NumpyItems(torch.utils.data.Dataset[tuple[np.ndarray, int]]):
    def __init__(self, x: np.ndarray) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[np.ndarray, int]:
        return self.x[i], 0


class _Keyword(nn.Module):
    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, *, x: Tensor) -> Tensor:
        out: Tensor = self.net(x)
        return out


# -- where the store goes ------------------------------------------------------------------------


def test_out_that_is_a_file_or_a_folder_of_files_gets_advice_that_works(tmp_path: Path) -> None:
    """It used to say "pass resume=True or overwrite=True", both then refused."""
    model = _cnn()
    plain = tmp_path / "notes.txt"
    plain.write_text("mine")
    for flags in ({}, {"resume": True}, {"overwrite": True}):
        with pytest.raises(hs.UsageError, match=r"is a file, not a feature store .* choose a new"):
            hs.extract(model, X, ["6"], out=plain, **flags)  # type: ignore[arg-type]
    assert plain.read_text() == "mine"
    folder = tmp_path / "photos"
    folder.mkdir()
    (folder / "a.jpg").write_bytes(b"x")
    for flags in ({}, {"resume": True}, {"overwrite": True}):
        with pytest.raises(hs.UsageError, match=r"a folder that holds files but no feature store"):
            hs.extract(model, X, ["6"], out=folder, **flags)  # type: ignore[arg-type]
    assert [p.name for p in folder.iterdir()] == ["a.jpg"]
    empty = tmp_path / "empty"  # what the advice says: an empty folder (or a new path) works
    empty.mkdir()
    store = hs.extract(model, X, ["6"], out=empty)
    assert np.array_equal(store.to_numpy("6"), _hand(model, X, "6").numpy())
    with pytest.raises(hs.UsageError, match=r"already exists: a finished feature store"):
        hs.extract(model, X, ["6"], out=empty)
    zarr.open_group(str(tmp_path / "other"), mode="w")  # a Zarr store of someone else's
    with pytest.raises(hs.UsageError, match=r"a Zarr store that hs.extract did not write"):
        hs.extract(model, X, ["6"], out=tmp_path / "other", resume=True)
    hs.extract(model, X, ["6"], out=tmp_path / "other", overwrite=True)


def _racer(out: Path, me: str, seed: int) -> None:
    """In a child: an extraction to ``out`` that waits, once it has found the path new and is
    about to claim it, for the other child to get there too (so both claim at once, whatever
    the timing of their starts); what happened, as JSON in ``result-<me>``."""
    from hookscope.extract import _store

    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(3))
    made = _store.Store._made.__func__  # type: ignore[attr-defined]

    def claim_together(cls: Any, path: Path, meta: Any) -> Any:  # the test's own barrier
        (out.parent / f"ready-{me}").touch()
        deadline = time.monotonic() + 60
        while len(list(out.parent.glob("ready-*"))) < 2 and time.monotonic() < deadline:
            time.sleep(0.005)
        return made(cls, path, meta)

    _store.Store._made = classmethod(claim_together)  # type: ignore[method-assign,assignment]
    result: dict[str, Any] = {"ok": True}
    try:
        hs.extract(model, x, ["0", "2"], out=out, batch_size=10)
    except hs.UsageError as e:
        result = {"ok": False, "error": str(e)}
    (out.parent / f"result-{me}").write_text(json.dumps(result))


@pytest.mark.slow
def test_two_processes_creating_one_store_one_wins(tmp_path: Path) -> None:
    """Two runs with different models, the same new path, no overwrite: both used to report
    success, and the store held one model's rows (or could not be read). Now one wins and the
    other is refused; the store holds exactly the winner's rows (oracle: the winner's model
    run by hand)."""
    out = tmp_path / "store"
    runs = {  # (forked from the tests' forkserver: see zygote.py)
        me: zygote.Child(_racer, out, me, seed, stderr_file=tmp_path / f"{me}.stderr")
        for me, seed in (("a", 1), ("b", 2))
    }
    results = {}
    for me, run in runs.items():
        assert run.wait(timeout=300) == 0, run.stderr
        results[me] = json.loads((tmp_path / f"result-{me}").read_text())
    winners = [me for me, r in results.items() if r["ok"]]
    assert len(winners) == 1, results
    (loser,) = set(results) - set(winners)
    assert "was created by another run" in results[loser]["error"]
    torch.manual_seed({"a": 1, "b": 2}[winners[0]])
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    x = torch.randn(50, 6, generator=torch.Generator().manual_seed(3))
    store = hs.open_features(out)
    for layer in ("0", "2"):
        assert np.array_equal(store.to_numpy(layer), _by_batch(model, x, layer, 10).numpy())


def test_reading_a_stores_chunk_lets_unexpected_errors_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Resuming reads the chunk of the store at ``out``: no store there is None (the store's
    own checks then say what is wrong), but a permission error is raised as it is."""
    from hookscope.extract import _store

    assert _store.Store.chunk_of(tmp_path / "nothing") is None
    (tmp_path / "plain").write_text("not a store")
    assert _store.Store.chunk_of(tmp_path / "plain") is None

    def denied(*args: object, **kwargs: object) -> None:
        raise PermissionError(13, "Permission denied", str(tmp_path))

    monkeypatch.setattr(_store, "open_group", denied)
    with pytest.raises(PermissionError, match="Permission denied"):
        _store.Store.chunk_of(tmp_path / "x")
