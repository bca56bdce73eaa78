"""``hookscope extract`` as a real subprocess: Ctrl-C (SIGINT) in the middle of a run keeps every
finished block and exits 130, ``--resume`` then finishes it with the same bits as an
uninterrupted run; the progress bar moves per batch; messages name the command's flags; usage
problems exit 2. Commands read for their statuses and messages run several to a process
(``cli_batch``). Oracles: hand-written forward hooks, an uninterrupted run of the command."""

from __future__ import annotations

import importlib.util
import os
import pty
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import hookscope as hs

pytest.importorskip("click")
zarr = pytest.importorskip("zarr")
import cli_batch  # noqa: E402

_MODELS = textwrap.dedent(
    """
    import time, torch, torch.nn as nn

    class Slow(nn.Module):  # a forward that takes a while, so a signal lands inside the run
        def forward(self, x):
            time.sleep(0.1)
            return x

    def slow():
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), Slow(), nn.ReLU())
    """
)


@pytest.fixture
def files(tmp_path: Path) -> tuple[str, Path]:
    (tmp_path / "models.py").write_text(_MODELS)
    x = np.random.default_rng(0).standard_normal((96, 3, 8, 8)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    return f"{tmp_path / 'models.py'}:slow", tmp_path / "x.npy"


def _command(model: str, data: Path, out: Path, *more: str) -> list[str]:
    layers = ["--layer", "0", "--layer", "2"]
    sizes = ["--batch-size", "8", "--chunk", "16"]
    return [
        sys.executable,
        "-m",
        "hookscope",
        "extract",
        model,
        str(data),
        *layers,
        "--out",
        str(out),
        *sizes,
        *more,
    ]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "CI"}


def _runs(*commands: list[str]) -> list[subprocess.CompletedProcess[str]]:
    """``_command`` s, in order, in one process (``cli_batch``)."""
    return cli_batch.run(*(c[3:] for c in commands), env=_env())


def _done(out: Path) -> int:
    try:
        return int(zarr.open_group(str(out), mode="r")["done"][:].sum())
    except Exception:  # not created yet
        return 0


@pytest.mark.slow
def test_ctrl_c_keeps_finished_blocks_and_resume_finishes_them(
    tmp_path: Path, files: tuple[str, Path]
) -> None:
    model, data = files
    out = tmp_path / "s"
    # the console script's entry, with Python's own SIGINT handler even where the shell that
    # runs the tests ignores SIGINT (a background job does, and children inherit it)
    entry = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from hookscope.show import main; main(sys.argv[1:])"
    )
    args = [sys.executable, "-c", entry, *_command(model, data, out)[3:]]
    child = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        deadline = time.monotonic() + 120
        while _done(out) < 2 and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert child.poll() is None, child.communicate()
        child.send_signal(signal.SIGINT)  # what Ctrl-C sends
        _, stderr = child.communicate(timeout=120)
    finally:
        if child.poll() is None:
            child.kill()
    assert child.returncode == 130, stderr
    kept = re.search(
        r"interrupted: (\d+) of 96 samples are stored in .* --resume to finish", stderr
    )
    assert kept and "Aborted" not in stderr and "Traceback" not in stderr, stderr
    blocks = [bool(v) for v in zarr.open_group(str(out), mode="r")["done"][:]]
    assert 2 <= sum(blocks) < 6 and int(kept.group(1)) == 16 * sum(blocks)
    assert blocks == sorted(blocks, reverse=True)  # the finished ones are the first ones
    again, clean = _runs(
        _command(model, data, out, "--resume"), _command(model, data, tmp_path / "clean")
    )
    assert again.returncode == 0, again.stderr
    assert clean.returncode == 0, clean.stderr
    resumed, uninterrupted = hs.open_features(out), hs.open_features(tmp_path / "clean")
    for layer in ("0", "2"):
        assert np.array_equal(resumed.to_numpy(layer), uninterrupted.to_numpy(layer))
    spec = importlib.util.spec_from_file_location("cli_slow_models", model.split(":")[0])
    assert spec is not None and spec.loader is not None
    factory = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(factory)
    with torch.no_grad():  # the oracle: the factory's first layer applied by hand
        want = factory.slow()[0](torch.from_numpy(np.load(data)))
    np.testing.assert_allclose(resumed.to_numpy("0"), want.numpy(), atol=1e-6)
    np.testing.assert_allclose(resumed.to_numpy("2"), want.clamp(min=0).numpy(), atol=1e-6)


@pytest.mark.slow
def test_the_progress_bar_moves_per_batch(tmp_path: Path, files: tuple[str, Path]) -> None:
    """On a terminal (a pseudo-terminal here) the bar counts samples batch by batch (8 at a
    time), not stored blocks (16)."""
    model, data = files
    leader, follower = pty.openpty()
    env = {**_env(), "COLUMNS": "120"}
    child = subprocess.Popen(
        _command(model, data, tmp_path / "s"), stdout=subprocess.DEVNULL, stderr=follower, env=env
    )
    os.close(follower)
    shown = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        shown += chunk
    assert child.wait(timeout=120) == 0
    os.close(leader)
    counts = {int(c) for c in re.findall(rb"(\d+)/96", shown)}
    assert len({c for c in counts if c % 16}) >= 2, counts  # counts between two blocks


@pytest.mark.slow
def test_messages_use_the_flags_and_usage_problems_exit_2(
    tmp_path: Path, files: tuple[str, Path]
) -> None:
    model, data = files
    x = tmp_path / "small.npy"
    np.save(x, np.load(data)[:10])
    out = tmp_path / "s"
    first, missing, bad, again, other = _runs(
        _command(model, x, out, "--json"),
        _command(model, tmp_path / "nope.npy", tmp_path / "t"),
        _command(model, x, tmp_path / "u", "--batch-size", "0"),
        _command(model, x, out),  # this and the next find the store the first made
        _command(model, x, out, "--resume", "--reduce", "spatial_mean"),
    )
    assert first.returncode == 0, first.stderr
    assert '"chunk": 16' in first.stdout  # --chunk reached the store
    assert again.returncode == 2
    assert "a finished feature store" in again.stderr and "Pass --overwrite" in again.stderr
    assert "resume=True" not in again.stderr and "Traceback" not in again.stderr
    assert other.returncode == 2 and "or --overwrite to start again" in other.stderr
    assert missing.returncode == 2 and "no such file" in missing.stderr
    assert "FileNotFoundError" not in missing.stderr
    assert bad.returncode == 2 and "--batch-size must be an int >= 1" in bad.stderr
