"""``hookscope cam`` builds every method of the registry (``--method``), gives each what it
needs (``--fc``, ``--base``, ``--top-k``, ``--batch-size``), and ``--dtype``, ``--device``,
``--seed`` and token-id inputs work in every command that runs a model. Oracles: the library's
classes called by hand with arguments the test chooses, counted forwards, hand-made inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs

click_testing = pytest.importorskip("click.testing")
pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")
import cli_models  # noqa: E402
from hookscope.show._cli import cli  # noqa: E402
from hookscope.show._methods import choices, default_fc, path_methods  # noqa: E402

MODELS = Path(__file__).parent / "cli_models.py"
CNN = f"{MODELS}:small_cnn"
X = ("--input-size", "2,3,16,16")


def run(*args: str) -> click_testing.Result:
    return click_testing.CliRunner().invoke(cli, list(args))


def test_every_registered_method_is_offered() -> None:
    assert set(choices()) == set(hs.explain.METHODS)  # each one's requires can be filled


@pytest.mark.parametrize("method", choices())
def test_every_method_runs_from_the_command_line(method: str, tmp_path: Path) -> None:
    """On a small CNN, and on a small vision transformer for the attention maps."""
    extra = ("--samples", "2") if method == "smoothgrad" else ()
    extra += ("--steps", "4") if method in path_methods() else ()
    attention = hs.explain.METHODS[method].kind == "attention"
    model = f"{MODELS}:small_vit" if attention else CNN
    result = run("cam", model, *X, "--method", method, *extra, "--out", str(tmp_path), "--json")
    assert result.exit_code == 0, result.output
    rows = json.loads(result.stdout)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = (cli_models.small_vit() if attention else cli_models.small_cnn())(x)
    assert [r["target"] for r in rows] == logits.argmax(1).tolist()
    top = logits.max(1).values.tolist()
    assert [r["score"] for r in rows] == pytest.approx(top, rel=1e-4)
    assert [r["probability"] for r in rows] == pytest.approx(
        logits.softmax(1).max(1).values.tolist(), rel=1e-4
    )
    for row in rows:
        with Image.open(row["png"]) as png:
            assert png.size == (16, 16)


def test_cam_finds_its_classifier(tmp_path: Path) -> None:
    result = run(
        "cam",
        CNN,
        *X,
        "--method",
        "cam",
        "--layer",
        "3",
        "--target",
        "1",
        "--out",
        str(tmp_path / "a"),
        "--json",
    )
    assert result.exit_code == 0, result.output
    by_hand = run(
        "cam",
        CNN,
        *X,
        "--method",
        "cam",
        "--layer",
        "3",
        "--fc",
        "6",
        "--target",
        "1",
        "--out",
        str(tmp_path / "b"),
        "--json",
    )
    assert by_hand.exit_code == 0, by_hand.output
    for a, b in zip(json.loads(result.stdout), json.loads(by_hand.stdout)):
        with Image.open(a["png"]) as one, Image.open(b["png"]) as other:
            assert one.tobytes() == other.tobytes()
    none = run(
        "cam", f"{MODELS}:flat_cnn", "--input-size", "1,3,8,8", "--method", "cam", "--layer", "3"
    )
    assert none.exit_code == 2 and "no nn.Linear has 6 inputs" in none.output
    assert "--fc" in none.output and "Usage: cli cam" in none.output
    wrong = run("cam", CNN, *X, "--method", "cam", "--layer", "3", "--fc", "5")
    assert wrong.exit_code == 2 and "Flatten" in wrong.output


def test_the_default_classifier_is_the_last_linear_fed_by_the_channels() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 6, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, 6),
        nn.Linear(6, 3),
        nn.Linear(3, 2),
    )
    assert default_fc(model, torch.randn(1, 3, 8, 8), "1") == "5"


def test_perturbation_methods_are_budgeted(tmp_path: Path) -> None:
    """small_cnn's layer 3 has 6 channels: 4 images x top 2 channels = 8 masked forwards, in
    batches of 3 images: 3, 3, 2."""
    cli_models.CALLS.clear()
    # by module name (tests/ is on sys.path), so that the command fills this module's CALLS
    args = ("cam", "cli_models:counting_cnn", "--input-size", "4,3,16,16", "--layer", "3")
    result = run(
        *args, "--method", "scorecam", "--top-k", "2", "--batch-size", "3", "--out", str(tmp_path)
    )
    assert result.exit_code == 0, result.output
    assert "scorecam: 8 extra image forwards in 3 calls of up to 3 images" in result.stderr
    assert [n for n in cli_models.CALLS if n != 4] == [3, 3, 2]  # the others: the whole batch
    cli_models.CALLS.clear()
    full = run(*args, "--method", "ablationcam", "--batch-size", "7", "--out", str(tmp_path))
    assert full.exit_code == 0, full.output
    assert f"24 extra image forwards in {math.ceil(24 / 7)} calls" in full.stderr
    assert [n for n in cli_models.CALLS if n != 4] == [7, 7, 7, 3]
    refused = run("cam", CNN, *X, "--top-k", "2")
    assert refused.exit_code == 2 and "gradcam runs no extra forwards" in refused.output


def test_occlusion_window_stride_and_path_steps(tmp_path: Path) -> None:
    """--window 4 --stride 4 on 16x16: 16 windows over 3 channels for each of 2 images; the
    maps equal the library's with the same arguments."""
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    args = ("cam", CNN, *X, "--out", str(tmp_path), "--json")
    result = run(*args, "--method", "occlusion", "--window", "4", "--stride", "4")
    assert result.exit_code == 0, result.output
    assert "occlusion: 32 extra image forwards in 1 calls of up to 32 images" in result.stderr
    exp = hs.Occlusion(cli_models.small_cnn(), (3, 4, 4), strides=(1, 4, 4))(x)
    picture = hs.overlay(x[0], exp.maps[0].abs().amax(0), alpha=0.45)
    with Image.open(tmp_path / "occlusion_0.png") as png:
        assert torch.equal(
            torch.frombuffer(bytearray(png.tobytes()), dtype=torch.uint8), picture.flatten()
        )
    refused = run(*args, "--method", "gradcam", "--window", "4")
    assert refused.exit_code == 2 and "--window and --stride are occlusion's" in refused.output
    refused = run(*args, "--method", "saliency", "--steps", "4")
    assert refused.exit_code == 2 and "--steps is for the path methods" in refused.output
    refused = run(*args, "--method", "occlusion", "--top-k", "2")
    assert refused.exit_code == 2 and "occlusion has none" in refused.output


def test_smoothgrad_over_a_base_method_and_input_methods_take_no_layer(tmp_path: Path) -> None:
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(5))  # --seed 5
    args = ("cam", CNN, *X, "--method", "smoothgrad", "--base", "gradcam", "--layer", "3")
    result = run(*args, "--samples", "3", "--noise", "0.1", "--seed", "5", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    smooth = hs.SmoothGrad(hs.GradCAM(cli_models.small_cnn(), "3"), samples=3, noise=0.1, seed=5)
    exp = smooth(x)
    picture = hs.overlay(x[0], exp.maps[0], alpha=0.45)
    with Image.open(tmp_path / "smoothgrad_0.png") as png:
        assert torch.equal(
            torch.frombuffer(bytearray(png.tobytes()), dtype=torch.uint8), picture.flatten()
        )
    refused = run("cam", CNN, *X, "--method", "saliency", "--layer", "3")
    assert refused.exit_code == 2 and "explains the input, not a layer" in refused.output


def test_seed_device_and_dtype() -> None:
    def scores(*extra: str) -> list[float]:
        result = run("cam", f"{MODELS}:random_cnn", *X, "--layer", "1", "--json", *extra)
        assert result.exit_code == 0, result.output
        return [r["score"] for r in json.loads(result.stdout)]

    assert scores("--seed", "1") == scores("--seed", "1") != scores("--seed", "2")
    assert scores("--device", "cpu", "--seed", "1") == scores("--seed", "1")
    if not torch.cuda.is_available():
        refused = run("summary", CNN, *X, "--device", "cuda")
        assert refused.exit_code == 2 and "CUDA is not available" in refused.output
    assert run("summary", CNN, *X, "--device", "gpu9").exit_code == 2

    half = run("summary", CNN, "--input-size", "1,3,8,8", "--dtype", "float16", "--json")
    assert half.exit_code == 0, half.output  # the model is cast with its input
    rows = hs.Summary.from_json(half.stdout).rows
    assert {r.dtype for r in rows} == {"float16"}
    want = hs.summary(cli_models.small_cnn(), torch.randn(1, 3, 8, 8))
    assert hs.Summary.from_json(half.stdout).total_flops == want.total_flops


def test_token_ids_for_a_model_whose_first_layer_is_an_embedding() -> None:
    result = run("summary", f"{MODELS}:token_model", "--input-size", "2,6", "--json")
    assert result.exit_code == 0, result.output
    want = hs.summary(cli_models.token_model(), torch.randint(0, 50, (2, 6)))
    assert hs.Summary.from_json(result.stdout).total_flops == want.total_flops
    floats = run("summary", f"{MODELS}:token_model", "--input-size", "2,6", "--dtype", "float32")
    assert floats.exit_code == 1 and "pass --dtype long" in floats.output
    assert "failed in 'embed' (Embedding) called with input=Tensor[2, 6] float32" in floats.output
    clean = run("nan", f"{MODELS}:token_model", "--input-size", "2,6")
    assert clean.exit_code == 0, clean.output
