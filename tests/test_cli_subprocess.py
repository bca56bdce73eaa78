"""A newcomer's everyday tasks through the real ``hookscope`` program, run as a shell runs it
(a subprocess): exit statuses, what reaches stdout and stderr, Ctrl-C. Commands that are read
for their statuses and messages run several to a process (``cli_batch``: each still sees a
fresh process's state and is captured at the file descriptors); a real process of its own
shows the same for one of them, and runs Ctrl-C and the images. Oracles: the library called
directly on the same model and inputs, images read back, analytic maps."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import hookscope as hs

pytest.importorskip("click")
import cli_batch
from cli_models import small_cnn

pytestmark = pytest.mark.slow  # each process imports torch

MODELS = Path(__file__).parent / "cli_models.py"
CNN = f"{MODELS}:small_cnn"


def hookscope(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "hookscope", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
    )


@pytest.fixture(scope="module")
def bert_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Two saved BERT folders (random weights): one without tokenizer files, one with a
    7-word vocabulary; and the commands the two BERT tests run on them, in one process (it
    imports transformers once). ``model`` is the first folder's model."""
    transformers = pytest.importorskip("transformers")
    tmp_path = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        vocab_size=100,
    )
    torch.manual_seed(0)
    model = transformers.BertModel(config).eval()
    model.save_pretrained(tmp_path / "bert")
    bert = str(tmp_path / "bert")
    folder = tmp_path / "worded"
    config = transformers.BertConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=10,
    )
    transformers.BertModel(config).save_pretrained(folder)
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "hello", "world"]))
    transformers.BertTokenizer(str(vocab)).save_pretrained(folder)
    names = ("done", "floats", "text", "known", "unknown")
    runs = cli_batch.run(
        ("summary", bert, "--input-size", "2,64", "--json"),
        ("summary", bert, "--input-size", "2,64", "--dtype", "float32"),
        ("summary", bert, "--text", "hello world"),
        ("summary", str(folder), "--text", "hello world", "--json"),
        ("summary", str(folder), "--text", "bonjour le monde"),
    )
    return {"model": model, **dict(zip(names, runs, strict=True))}


@pytest.mark.hf
def test_a_saved_bert_folder_gets_token_ids(bert_runs: dict[str, Any]) -> None:
    done, floats, text = (bert_runs[k] for k in ("done", "floats", "text"))
    assert done.returncode == 0, done.stderr
    ours = hs.Summary.from_json(done.stdout)
    direct = hs.summary(bert_runs["model"], torch.randint(0, 100, (2, 64)))
    assert ours.total_flops == direct.total_flops and ours.inputs == {"input_ids": (2, 64)}
    assert done.stderr == ""  # no progress bar or warning in the way

    assert floats.returncode == 1 and floats.stdout == ""
    assert floats.stderr.count("\n") == 1 and "Traceback" not in floats.stderr
    assert (
        "failed in 'embeddings.word_embeddings' (Embedding) called with input=Tensor[2, 64] "
        "float32 - token ids must be integers: pass --dtype long" in floats.stderr
    )

    assert text.returncode == 2 and "has no tokenizer files" in text.stderr


def test_text_of_unknown_words_warns(bert_runs: dict[str, Any]) -> None:
    known, unknown = bert_runs["known"], bert_runs["unknown"]
    assert known.returncode == 0 and "warning" not in known.stderr, known.stderr
    assert hs.Summary.from_json(known.stdout).inputs["input_ids"] == (1, 4)  # CLS 2 words SEP
    assert unknown.returncode == 0
    assert "warning: every token of --text became the unknown token '[UNK]'" in unknown.stderr


def test_exit_statuses(tmp_path: Path) -> None:
    out = str(tmp_path / "r.html")
    failing = [("summary",), ("report", "--out", out), ("cam", "--layer", "0")]
    crash = ("nan", CNN, "--input-size", "1,5,8,8")  # 5 channels into 3
    found, crashed, usage, *failed = cli_batch.run(
        ("nan", f"{MODELS}:nan_model", "--input-size", "8,4"),
        crash,
        ("summary", CNN, "--input-size", "1,x,3"),
        *((*args, CNN, "--input-size", "1,5,8,8") for args in failing),
    )
    alone = hookscope(*crash)  # a process of its own: the same status and output
    assert (alone.returncode, alone.stdout, alone.stderr) == (3, crashed.stdout, crashed.stderr)
    assert found.returncode == 1 and "aten.log" in found.stdout
    assert crashed.returncode == 3 and "Traceback" not in crashed.stderr
    assert "failed in '0' (Conv2d) called with input=Tensor[1, 5, 8, 8] float32" in crashed.stderr
    for args, done in zip(failing, failed, strict=True):
        assert done.returncode == 1, (args, done.stderr)
        assert "failed in '0' (Conv2d)" in done.stderr and done.stderr.count("\n") == 1
    assert usage.returncode == 2
    assert usage.stderr.startswith("Usage: hookscope summary [OPTIONS] MODEL\n")
    assert "--input-size must be positive integers" in usage.stderr


def test_a_pickle_named_pt2_is_refused_in_one_line(tmp_path: Path) -> None:
    names = ("model.pt2", "model.pt", "weights.bin")
    for name in names:
        torch.save(small_cnn(), tmp_path / name)
    exported = tmp_path / "cnn.pt"  # an export archive under TorchScript's suffix
    torch.export.save(torch.export.export(small_cnn(), (torch.randn(1, 3, 8, 8),)), str(exported))
    *refused, done = cli_batch.run(
        *(("names", str(tmp_path / n)) for n in names), ("names", str(exported), "--json")
    )
    for name, no in zip(names, refused, strict=True):
        assert no.returncode == 2, (name, no.stderr)
        assert "written by torch.save" in no.stderr and "Traceback" not in no.stderr
        assert "deserializ" not in no.stderr  # torch.export's own logged traceback
    assert done.returncode == 0, done.stderr


def test_every_help_documents_the_exit_statuses() -> None:
    top, nan = cli_batch.run(("--help",), ("nan", "--help"))
    assert top.returncode == 0 and "Exit status:" in top.stdout
    from click.testing import CliRunner

    from hookscope.show._cli import cli

    for command in ("names", "summary", "cam", "nan", "report", "extract", "demo"):
        shown = CliRunner().invoke(cli, [command, "--help"]).output  # the same text, faster
        assert "Exit status:" in shown and "130  interrupted" in shown, command
    assert "3    the model failed otherwise" in nan.stdout


def _interruptible() -> None:
    """In the child: Ctrl-C's default action, which Python turns into KeyboardInterrupt (a
    shell starts background jobs, and so this test's runner maybe, with SIGINT ignored)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_ctrl_c_exits_130(tmp_path: Path) -> None:
    mark = tmp_path / "running"
    process = subprocess.Popen(
        [sys.executable, "-m", "hookscope", "summary", f"{MODELS}:sleepy", "--input-size", "1,2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_interruptible,
        env={**os.environ, "HOOKSCOPE_TEST_MARK": str(mark)},
    )
    try:
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline and process.poll() is None:
            time.sleep(0.1)
        assert mark.exists(), process.communicate()
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()  # closes the pipes
    assert process.returncode == 130, stderr
    assert "interrupted" in stderr and "Traceback" not in stderr


def test_cam_overlays_keep_each_image_size_and_land_on_the_bright_part(tmp_path: Path) -> None:
    """brightness_cnn's Grad-CAM for class 0 is the image's brightness: each overlay must be
    red (jet's high end) where the white patch is and blue elsewhere, at the image's size."""
    image_module = pytest.importorskip("PIL.Image")
    pytest.importorskip("matplotlib")
    folder = tmp_path / "photos"
    folder.mkdir()
    wide = image_module.new("RGB", (60, 24))  # black, a white patch on the left third
    wide.paste((255, 255, 255), (0, 0, 20, 24))
    wide.save(folder / "a_wide.png")
    tall = image_module.new("RGB", (30, 50))  # black, a white patch at the bottom
    tall.paste((255, 255, 255), (0, 34, 30, 50))
    tall.save(folder / "b_tall.png")
    done = hookscope(
        "cam",
        f"{MODELS}:brightness_cnn",
        "--input",
        str(folder),
        "--image-size",
        "16",
        "--layer",
        "1",
        "--target",
        "0",
        "--out",
        str(tmp_path / "maps"),
        "--json",
    )
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)
    assert [Path(r["image"]).name for r in rows] == ["a_wide.png", "b_tall.png"]
    regions = [((2, 2, 16, 22), (40, 2, 58, 22)), ((2, 38, 28, 48), (2, 2, 28, 28))]
    for row, size, (bright, dark) in zip(rows, [(60, 24), (30, 50)], regions):
        with image_module.open(row["png"]) as shown:
            assert shown.size == size  # width, height of the original
            rgb = shown.convert("RGB")
            hot = _mean(rgb.crop(bright))
            cold = _mean(rgb.crop(dark))
        assert hot[0] > cold[0] + 100 and cold[2] > cold[0]  # red on the patch, blue elsewhere


def _mean(image: object) -> list[float]:
    from PIL import ImageStat

    return list(ImageStat.Stat(image).mean)


def test_budgets_device_and_seed_from_a_shell(tmp_path: Path) -> None:
    args = ("cam", CNN, "--input-size", "4,3,16,16", "--layer", "3", "--out", str(tmp_path))
    budgeted, *seeded = cli_batch.run(
        (*args, "--method", "scorecam", "--top-k", "2", "--batch-size", "3"),
        *((*args, "--json", "--device", "cpu", "--seed", seed) for seed in ("3", "3", "4")),
    )
    assert budgeted.returncode == 0, budgeted.stderr
    # 4 images x 2 of layer 3's 6 channels, 3 images per forward
    assert "scorecam: 8 extra image forwards in 3 calls of up to 3 images" in budgeted.stderr
    assert all(done.returncode == 0 for done in seeded), [done.stderr for done in seeded]
    maps = [json.loads(done.stdout) for done in seeded]
    assert maps[0] == maps[1] != maps[2]
