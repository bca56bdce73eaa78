"""``hookscope patching`` and ``hookscope lens`` on a Hugging Face causal LM saved with its
tokenizer (a 2-block GPT-2, random weights, a word-level tokenizer). Oracles: the model's own
logits (the metric of the clean and corrupted runs by hand; the last block's lens row is the
model's prediction), causality (patching the last block's output at an earlier position
cannot change the last position's logits), and the library called directly."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch

import hookscope as hs

click_testing = pytest.importorskip("click.testing")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
Image = pytest.importorskip("PIL.Image")
pytest.importorskip("matplotlib")
from extract_oracle import word_tokenizer  # noqa: E402
from hookscope.show._cli import cli  # noqa: E402

pytestmark = pytest.mark.hf
CLEAN, CORRUPTED = "w1 w2 w3 w4 w5", "w9 w2 w3 w4 w5"


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("lm") / "gpt2"
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=44, bos_token_id=1, eos_token_id=2
    )
    transformers.GPT2LMHeadModel(config).save_pretrained(folder)
    word_tokenizer().save_pretrained(folder)
    return folder


def run(*args: str) -> Any:
    return click_testing.CliRunner().invoke(cli, list(args))


def _model(folder: Path) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(folder).eval()


def _ids(text: str) -> torch.Tensor:
    return torch.tensor([[4 + int(w[1:]) for w in text.split()]])  # w0 is id 4


def test_patching_prints_the_grid_and_writes_its_heatmap(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.html"
    args = ["patching", str(saved), "--clean", CLEAN, "--corrupted", CORRUPTED]
    result = run(*args, "--answer", "w7", "--wrong", "w8", "--out", str(out), "--json")
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    model = _model(saved)
    with torch.no_grad():
        clean, corrupt = (model(_ids(t)).logits[0, -1] for t in (CLEAN, CORRUPTED))
    assert got["clean"] == pytest.approx(float(clean[11] - clean[12]), abs=1e-6)  # w7, w8
    assert got["corrupted"] == pytest.approx(float(corrupt[11] - corrupt[12]), abs=1e-6)
    assert got["layers"] == ["transformer.h.0", "transformer.h.1"]
    assert got["tokens"] == CLEAN.split() and got["positions"] == [0, 1, 2, 3, 4]
    values = torch.tensor(got["values"], dtype=torch.float64)
    # the last block's output: at the last position it is the clean run's, before it the
    # corrupted run's (a causal model's last logits do not see a later block's earlier rows)
    assert values[1, -1] == pytest.approx(got["clean"], abs=1e-5)
    assert values[1, :-1].tolist() == pytest.approx([got["corrupted"]] * 4, abs=1e-5)
    assert abs(got["clean"] - got["corrupted"]) > 1e-3  # the oracle tells the runs apart

    def metric(o: Any) -> torch.Tensor:
        return o.logits[0, -1, 11] - o.logits[0, -1, 12]

    direct = hs.patching(model, _ids(CLEAN), _ids(CORRUPTED), metric, got["layers"])
    torch.testing.assert_close(values, direct.values.double(), rtol=0, atol=1e-6)
    page = out.read_text()
    cells = [float(v) for v in re.findall(r'data-value="([^"]+)"', page)]
    assert cells == pytest.approx(values.flatten().tolist(), abs=1e-12)
    assert "logit(&#x27;w7&#x27;) - logit(&#x27;w8&#x27;)" in page

    png = tmp_path / "grid.png"
    shared = ["--answer", "w7", "--wrong", "w8", "--out", str(out), "--json", "--png", str(png)]
    share = run(*args, *shared, "--normalized")
    assert share.exit_code == 0, share.output
    normalized = torch.tensor(json.loads(share.stdout)["values"], dtype=torch.float64)
    gap = got["clean"] - got["corrupted"]
    torch.testing.assert_close(normalized, (values - got["corrupted"]) / gap, rtol=0, atol=1e-4)
    assert normalized[1].tolist() == pytest.approx([0, 0, 0, 0, 1], abs=1e-3)  # causality
    with Image.open(png) as figure:
        assert figure.size[0] > 300  # a figure, decoded

    text = run(*args, "--answer", "w7", "--wrong", "w8", "--out", str(out), "--layer", "*.h.1")
    assert text.exit_code == 0, text.output
    lines = text.stdout.splitlines()
    assert lines[1].split()[:3] == ["layer", "\\", "position"] and "4 'w5'" in lines[1]
    assert lines[2].split()[0] == "transformer.h.1" and len(lines) == 3


def test_patching_heads_sweeps_every_sdpa_call(saved: Path, tmp_path: Path) -> None:
    args = ["patching", str(saved), "--clean", CLEAN, "--corrupted", CORRUPTED, "--heads"]
    result = run(*args, "--answer", "w7", "--wrong", "w8", "--out", str(tmp_path / "h.html"))
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[1].startswith("layer, head \\ position") and len(lines) == 2 + 2 * 4
    as_json = run(
        *args, "--answer", "w7", "--wrong", "w8", "--json", "--out", str(tmp_path / "h.html")
    )
    got = json.loads(as_json.stdout)
    sites = [f"transformer.h.{i}.attn::scaled_dot_product_attention" for i in range(2)]
    assert got["layers"] == sites and got["heads"] == [0, 1, 2, 3]
    model = _model(saved)

    def metric(o: Any) -> torch.Tensor:
        return o.logits[0, -1, 11] - o.logits[0, -1, 12]

    direct = hs.patching(model, _ids(CLEAN), _ids(CORRUPTED), metric, sites, heads=True)
    values = torch.tensor(got["values"], dtype=torch.float64)  # (layers, positions, heads)
    torch.testing.assert_close(values, direct.values.double(), rtol=0, atol=1e-6)
    # the last block's heads before the last position cannot reach the last logits
    assert values[1, :-1].flatten().tolist() == pytest.approx([got["corrupted"]] * 16, abs=1e-5)


def test_lens_prints_the_likeliest_tokens_per_layer(saved: Path, tmp_path: Path) -> None:
    out = tmp_path / "l.html"
    result = run("lens", str(saved), "--text", CLEAN, "--top-k", "2", "--json", "--out", str(out))
    assert result.exit_code == 0, result.output
    got = json.loads(result.stdout)
    assert got["norm"] == "transformer.ln_f" and got["unembed"] == "lm_head"
    with torch.no_grad():
        logits = _model(saved)(_ids(CLEAN)).logits[0]
    top = torch.softmax(logits.double(), -1).topk(2, dim=-1)
    words = ["<pad>", "<bos>", "<eos>", "<unk>"] + [f"w{i}" for i in range(40)]
    for position, cell in enumerate(got["top"][-1]):  # the last block: the model's prediction
        assert [t for t, _ in cell] == [words[i] for i in top.indices[position].tolist()]
        assert [p for _, p in cell] == pytest.approx(top.values[position].tolist(), abs=1e-6)
    assert len(got["top"]) == 2 and out.read_text().count("data-tokens") == 2 * 5
    text = run("lens", str(saved), "--text", CLEAN, "--device", "cpu")
    assert text.exit_code == 0 and text.stdout.splitlines()[0].startswith("layer \\ position")


@pytest.mark.parametrize(
    ("extra", "hint"),
    [
        (["--corrupted", "w9 w2"], "give prompts of as many tokens"),
        (["--answer", "w7 w8"], "is 2 tokens for this tokenizer"),
        (["--out", "grid.png"], "must be an .html file"),
        (["--device", "nonsense"], "is not a torch device"),
    ],
)
def test_patching_usage_errors(saved: Path, extra: list[str], hint: str) -> None:
    base = {"--clean": CLEAN, "--corrupted": CORRUPTED, "--answer": "w7", "--wrong": "w8"}
    for flag, value in zip(extra[::2], extra[1::2], strict=True):
        base[flag] = value
    args = [item for pair in base.items() for item in pair]
    if "--out" not in base:
        args += ["--out", str(saved.parent / "x.html")]
    result = run("patching", str(saved), *args)
    assert result.exit_code == 2, result.output
    assert hint in result.output


def test_a_model_that_is_not_a_directory(tmp_path: Path) -> None:
    result = run("lens", str(tmp_path / "nothing"), "--text", CLEAN)
    assert result.exit_code == 2 and "saved with its tokenizer" in result.output
