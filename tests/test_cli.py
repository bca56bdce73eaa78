"""The ``hookscope`` command line through click's runner (every command, every usage error:
exit 2 and a one-line hint, no traceback unless -v), and once as a real subprocess. Oracles:
the library's own functions called directly on the same model and inputs, files read back."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import hookscope as hs

click_testing = pytest.importorskip("click.testing")
from cli_models import small_cnn  # noqa: E402
from hookscope.show._cli import cli  # noqa: E402

MODELS = Path(__file__).parent / "cli_models.py"
CNN = f"{MODELS}:small_cnn"


def run(*args: str) -> click_testing.Result:
    return click_testing.CliRunner().invoke(cli, list(args))


def test_version_and_help() -> None:
    assert run("--version").output.strip() == f"hookscope, version {hs.__version__}"
    result = run("--help")
    assert result.exit_code == 0
    for command in ("demo", "names", "summary", "cam", "nan", "report"):
        assert command in result.output


def test_names_text_and_json() -> None:
    result = run("names", CNN, "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout) == hs.names(small_cnn())
    lines = run("names", CNN, "--kwargs", '{"classes": 5}').output.splitlines()
    assert lines[-1].split() == ["6", "Linear"] and len(lines) == 7


def test_summary_json_equals_the_library(tmp_path: Path) -> None:
    result = run("summary", CNN, "--input-size", "2,3,8,8", "--json")
    assert result.exit_code == 0, result.output
    ours = hs.Summary.from_json(result.stdout)
    direct = hs.summary(small_cnn(), torch.randn(2, 3, 8, 8))
    assert ours.total_flops == direct.total_flops and ours.total_params == direct.total_params
    assert [r.name for r in ours.rows] == [r.name for r in direct.rows]
    folded = run("summary", CNN, "--input-size", "2,3,8,8", "--depth", "0")
    assert folded.exit_code == 0 and f"{direct.total_flops:,}" in folded.output


def test_cam_writes_one_overlay_per_image(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    pytest.importorskip("PIL")
    out = tmp_path / "maps"
    args = ("cam", CNN, "--input-size", "3,3,16,16", "--layer", "3", "--out", str(out))
    result = run(*args, "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    exp = hs.GradCAM(small_cnn(), "3")(
        torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    )
    assert [r["target"] for r in rows] == exp.targets.tolist()
    assert [r["score"] for r in rows] == pytest.approx(exp.scores.tolist(), rel=1e-5)
    from PIL import Image

    for row in rows:
        with Image.open(row["png"]) as image:
            assert image.size == (16, 16)
    one = run(*args, "--target", "2", "--method", "layercam")
    assert one.exit_code == 0 and one.output.count("class 2 (logit ") == 3  # one target broadcast


def test_cam_on_an_image_folder(tmp_path: Path) -> None:
    from PIL import Image

    for i, color in enumerate([(255, 0, 0), (0, 0, 255)]):
        Image.new("RGB", (20, 12), color).save(tmp_path / f"{i}.png")
    (tmp_path / "notes.txt").write_text("not an image")
    args = ("cam", CNN, "--input", str(tmp_path), "--image-size", "16", "--layer", "3")
    result = run(*args, "--out", str(tmp_path / "maps"), "--json")
    assert result.exit_code == 0, result.output
    assert len(json.loads(result.stdout)) == 2


def test_nan_names_the_producer_and_exits_1() -> None:
    result = run("nan", f"{MODELS}:nan_model", "--input-size", "8,4", "--json")
    assert result.exit_code == 1
    found = json.loads(result.stdout)
    assert (found["finite"], found["phase"], found["module"], found["op"]) == (
        False,
        "forward",
        "1",
        "aten.log",
    )
    clean = run("nan", CNN, "--input-size", "2,3,8,8")
    assert clean.exit_code == 0 and "no NaN or Inf" in clean.output


def test_nan_runs_in_training_mode_by_default_and_says_so() -> None:
    """Dropout then log: -Inf wherever dropout zeroes a value, so on every training step and
    never in eval mode. The command ran eval mode only, said nothing, and exited 0."""
    from cli_models import dropout_log_model

    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))
    model = dropout_log_model()
    with torch.no_grad():  # the oracle: plain torch in each mode
        assert not torch.isfinite(model.train()(x)).all()
        assert torch.isfinite(model.eval()(x)).all()
    trained = run("nan", f"{MODELS}:dropout_log_model", "--input-size", "8,4", "--json")
    assert trained.exit_code == 1, trained.output
    found = json.loads(trained.stdout)
    assert (found["finite"], found["mode"], found["module"], found["op"]) == (
        False,
        "train",
        "3",
        "aten.log",
    )
    text = run("nan", f"{MODELS}:dropout_log_model", "--input-size", "8,4")
    assert "run in train mode, loss: the sum of every floating output" in text.output
    evaluated = run("nan", f"{MODELS}:dropout_log_model", "--input-size", "8,4", "--eval")
    assert evaluated.exit_code == 0 and "(run in eval mode" in evaluated.output


def test_nan_takes_a_real_loss_and_inputs_from_a_npy_file(tmp_path: Path) -> None:
    """A batch from a .npy file (float64, cast to the model's float32), labels from another:
    NaN labels reach only the loss's gradient, which the sum of the outputs never sees."""
    import numpy as np

    rng = np.random.default_rng(0)
    np.save(tmp_path / "x.npy", rng.standard_normal((6, 3, 8, 8)))  # float64
    np.save(tmp_path / "classes.npy", np.array([0, 1, 2, 0, 1, 2]))
    values = rng.standard_normal((6, 3))
    values[2, 1] = np.nan
    np.save(tmp_path / "values.npy", values)
    x = ("nan", CNN, "--input", str(tmp_path / "x.npy"), "--json")
    plain = run(*x)
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["loss"] == "sum"
    entropy = run(*x, "--loss", "cross_entropy", "--labels", str(tmp_path / "classes.npy"))
    assert entropy.exit_code == 0 and json.loads(entropy.stdout)["loss"] == "cross_entropy"
    assert run(*x, "--loss", "cross_entropy", "--target", "1").exit_code == 0
    squared = run(*x, "--loss", "mse", "--labels", str(tmp_path / "values.npy"))
    assert squared.exit_code == 1, squared.output
    found = json.loads(squared.stdout)
    assert (found["phase"], found["module"]) == ("backward", "<loss>")
    for bad, hint in (
        (("--loss", "mse"), "--loss mse needs labels"),
        (("--loss", "cross_entropy"), "--loss cross_entropy needs labels"),
        (("--target", "1"), "--target and --labels go with --loss cross_entropy or mse"),
        (("--loss", "cross_entropy", "--target", "1", "--target", "2"), "2 --target classes"),
    ):
        refused = run(*x, *bad)
        assert refused.exit_code == 2 and hint in refused.output, refused.output


def test_report_command(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "r.html"
    result = run("report", CNN, "--input-size", "2,3,16,16", "--out", str(out))
    assert result.exit_code == 0, result.output
    assert str(out.resolve()) in result.output and '<section id="cam">' in out.read_text()
    args = ("report", CNN, "--input-size", "2,3,16,16", "--out", str(out), "--features", "2")
    result = run(*args, "--target", "1", "--cam-layer", "1")
    text = out.read_text()
    assert result.exit_code == 0 and text.count("every channel of the first input") == 1
    assert text.count("(logit ") == 2 and "Grad-CAM at <code>1</code>" in text
    assert len(re.findall(r"<figcaption>#\d: class 1 ", text)) == 2  # the target asked for
    result = run(*args, "--cam-method", "integrated_gradients")
    text = out.read_text()
    assert result.exit_code == 0 and "integrated_gradients over the input" in text


def test_extract_command(tmp_path: Path) -> None:
    pytest.importorskip("zarr")
    import numpy as np

    x = np.random.default_rng(0).standard_normal((20, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    args = ["extract", CNN, str(tmp_path / "x.npy"), "--layer", "3", "--out", str(tmp_path / "s")]
    result = run(*args, "--reduce", "spatial_mean", "--batch-size", "8", "--json")
    assert result.exit_code == 0, result.output
    meta = json.loads(result.stdout)
    assert meta["samples"] == 20 and meta["layers"] == ["3"] and meta["reduce"] == "spatial_mean"
    want = hs.features(small_cnn(), torch.from_numpy(x), ["3"], reduce="spatial_mean")["3"]
    np.testing.assert_allclose(
        hs.open_features(tmp_path / "s").to_numpy("3"), want.numpy(), rtol=1e-6, atol=1e-6
    )
    again = run(*args)
    assert again.exit_code == 2 and "finished feature store" in again.output
    assert "Pass --overwrite" in again.output  # the flag, not the Python argument
    from PIL import Image

    (tmp_path / "imgs").mkdir()
    for i in range(3):
        Image.new("RGB", (30, 20), (40 * i, 0, 0)).save(tmp_path / "imgs" / f"{i}.png")
    (tmp_path / "imgs" / "broken.png").write_bytes(b"nope")
    images = ["extract", CNN, str(tmp_path / "imgs"), "--layer", "3", "--image-size", "16"]
    result = run(*images, "--out", str(tmp_path / "i"), "--on-error", "skip")
    assert result.exit_code == 0, result.output
    assert (
        "4 samples" in result.output and "1 unreadable (rows are NaN): broken.png" in result.output
    )
    text = run(
        "extract", CNN, str(tmp_path / "x.npy.txt"), "--layer", "3", "--out", str(tmp_path / "t")
    )
    assert text.exit_code == 2 and "needs a Hugging Face model directory" in text.output


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (("names", "no_such_thing"), "package.module:factory"),
        (("names", "no_such_module_xyz:build"), "cannot import 'no_such_module_xyz'"),
        (("names", f"{MODELS}:missing"), "has no callable 'missing'"),
        (("names", f"{MODELS}:not_a_module"), "returned int, not an nn.Module"),
        (("names", CNN, "--kwargs", "{bad"), "--kwargs is not valid JSON"),
        (("names", CNN, "--kwargs", "[1]"), "must be a JSON object"),
        (("summary", CNN, "--input-size", "1,x,3"), "--input-size must be positive integers"),
        (("summary", CNN), "give exactly one input"),
        (("summary", CNN, "--input-size", "1,3,8,8", "--dtype", "floaty"), "not a torch dtype"),
        (("summary", CNN, "--input", "/no/such/dir"), "no such image file or folder"),
        (("cam", CNN, "--input-size", "1,3,8,8", "--layer", "conv9"), "conv9"),
        (("cam", CNN, "--input-size", "1,3,8,8", "--layer", "3", "--method", "nope"), "nope"),
        (("summary", CNN, "--text", "hi"), "--text needs a Hugging Face model directory"),
        (("summary", CNN, "--input-size", "1,3,8,8", "--depth", "-1"), "depth must be"),
        (("frobnicate",), "No such command"),
        (("extract", CNN, "data.npy", "--out", "s"), "Missing option '--layer'"),
    ],
)
def test_usage_errors_exit_2_with_a_hint(args: tuple[str, ...], hint: str) -> None:
    result = run(*args)
    assert result.exit_code == 2, result.output
    assert hint in result.output and "Traceback" not in result.output


def test_pickled_modules_are_refused_and_verbose_shows_tracebacks(tmp_path: Path) -> None:
    pickled = tmp_path / "model.pt"
    torch.save(small_cnn(), pickled)
    result = run("names", str(pickled))
    assert result.exit_code == 2 and "pickles are never loaded" in result.output
    verbose = run("-v", "names", str(pickled))
    assert verbose.exit_code == 2 and "Traceback" in verbose.output


def test_verbose_works_after_the_command_name_too() -> None:
    """Where the one-line error sends users ("run with -v"): it was refused there."""
    wrong = ("summary", CNN, "--input-size", "1,5,8,8")
    assert "(run with -v for the traceback)" in run(*wrong).output
    for args in (("-v", *wrong), (*wrong, "-v"), (wrong[0], "--verbose", *wrong[1:])):
        result = run(*args)
        assert result.exit_code == 1 and "Traceback" in result.output, args


@pytest.mark.parametrize("command", ["summary", "nan", "cam", "report"])
def test_a_torchscript_archive_is_a_usage_error(command: str, tmp_path: Path) -> None:
    """It loads, but hooks cannot run inside it: refused as a bad model (exit 2), not as a
    model that failed (exit 1)."""
    scripted = tmp_path / "model.ts"
    with pytest.warns(DeprecationWarning, match="deprecated"):
        torch.jit.save(torch.jit.script(small_cnn()), str(scripted))
    extra = ("--out", str(tmp_path / "out")) if command in ("cam",) else ()
    extra = ("--out", str(tmp_path / "r.html")) if command == "report" else extra
    result = run(command, str(scripted), "--input-size", "1,3,8,8", *extra)
    assert result.exit_code == 2, result.output
    assert "is TorchScript" in result.output and "torch.export" in result.output


def test_summary_width_and_full_options() -> None:
    """The advice to see everything named a Python call; the command has --full now."""
    args = ("summary", CNN, "--input-size", "1,3,8,8")
    narrow = run(*args, "--width", "60")
    assert narrow.exit_code == 0 and max(map(len, narrow.output.splitlines())) <= 60
    assert "--full" in narrow.output and "to_text(" not in narrow.output
    full = run(*args, "--full")
    library = hs.summary(small_cnn(), torch.randn(1, 3, 8, 8)).to_text(max_width=None)
    assert full.output == library + "\n"
    assert run(*args, "--width", "20").exit_code == 2


def test_saved_programs_and_runtime_errors(tmp_path: Path) -> None:
    scripted = tmp_path / "cnn.pt"
    with pytest.warns(DeprecationWarning, match="deprecated"):  # torch 2.13 deprecates TorchScript
        torch.jit.save(torch.jit.script(small_cnn()), str(scripted))
    result = run("names", str(scripted), "--json")
    assert result.exit_code == 0 and json.loads(result.stdout) == hs.names(small_cnn())
    exported = tmp_path / "cnn.pt2"
    torch.export.save(torch.export.export(small_cnn(), (torch.randn(1, 3, 8, 8),)), str(exported))
    result = run("summary", str(exported), "--input-size", "1,3,8,8", "--json")
    assert result.exit_code == 0, result.output
    assert (
        hs.Summary.from_json(result.stdout).total_params
        == hs.summary(small_cnn(), torch.randn(1, 3, 8, 8)).total_params
    )
    wrong = run("summary", CNN, "--input-size", "1,5,8,8")  # 5 channels into a 3-channel conv
    assert wrong.exit_code == 1 and wrong.output.startswith("error: RuntimeError: ")
    assert "-v for the traceback" in wrong.output and wrong.output.count("\n") == 1
    assert "failed in '0' (Conv2d) called with input=Tensor[1, 5, 8, 8] float32" in wrong.output


@pytest.mark.hf
def test_hugging_face_directory(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.ResNetConfig(
        embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=3
    )
    torch.manual_seed(0)
    model = transformers.ResNetForImageClassification(config).eval()
    model.save_pretrained(tmp_path)  # safetensors
    args = ("summary", str(tmp_path), "--hf-class", "AutoModelForImageClassification")
    result = run(*args, "--input-size", "1,3,32,32", "--json")
    assert result.exit_code == 0, result.output
    direct = hs.summary(model, torch.randn(1, 3, 32, 32))
    assert hs.Summary.from_json(result.stdout).total_flops == direct.total_flops
    bad = run("names", str(tmp_path), "--hf-class", "AutoNothing")
    assert bad.exit_code == 2 and "AutoModelForImageClassification" in bad.output
    # cam with the default --hf-class (AutoModel: no head) used to give a Python-only hint
    headless = run("cam", str(tmp_path), "--input-size", "1,3,32,32", "--out", str(tmp_path / "c"))
    assert headless.exit_code == 2, headless.output
    assert "--hf-class AutoModelForImageClassification" in headless.output
    assert "targets=" not in headless.output


def test_a_real_subprocess(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "hookscope", "names", CNN, "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == hs.names(small_cnn())  # stdout holds only the JSON
    bad = subprocess.run(
        [sys.executable, "-m", "hookscope", "names", "nope"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and "hint" not in bad.stdout
