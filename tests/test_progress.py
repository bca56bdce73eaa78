"""Progress bars: automatic only on a terminal outside CI, forced or refused on request, drawn
by rich, tqdm or a plain line, counting the work the caller said it would do."""

from __future__ import annotations

import importlib.util
import io

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope import _progress
from hookscope.errors import UsageError


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2)
    )


def _without(monkeypatch: pytest.MonkeyPatch, *names: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n, *a: None if n in names else real(n, *a)
    )


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_automatic_only_on_a_terminal_outside_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stderr", io.StringIO())
    assert not _progress.wanted(None)
    monkeypatch.setattr("sys.stderr", _Tty())
    monkeypatch.delenv("CI", raising=False)
    assert _progress.wanted(None)
    monkeypatch.setenv("CI", "true")
    assert not _progress.wanted(None)
    assert _progress.wanted(True) and not _progress.wanted(False)
    with pytest.raises(UsageError, match="progress must be True, False or None"):
        _progress.wanted("yes")  # type: ignore[arg-type]


def test_plain_line_counts_the_forwards_cost_announced(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _without(monkeypatch, "rich", "tqdm")
    net, x = _net(), torch.randn(3, 3, 8, 8)
    cam = hs.ScoreCAM(net, "1", batch_size=5, progress=True)
    forwards = cam.cost(x)["forwards"]
    assert forwards == 3 * 4  # 3 images x 4 channels, known from the layer
    cam(x)
    err = capsys.readouterr().err
    assert f"ScoreCAM: {forwards}/{forwards}" in err
    assert err.count("\r") == 3  # one line per extra model call: ceil(12 / 5)


@pytest.mark.parametrize("backend", ["rich", "tqdm"])
def test_rich_and_tqdm_draw_on_stderr(
    backend: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    if backend == "tqdm":
        _without(monkeypatch, "rich")
    hs.AblationCAM(_net(), "1", progress=True)(torch.randn(2, 3, 8, 8))
    assert "AblationCAM" in capsys.readouterr().err


def test_quiet_by_default_off_a_terminal(capsys: pytest.CaptureFixture[str]) -> None:
    hs.ScoreCAM(_net(), "1")(torch.randn(2, 3, 8, 8))
    assert capsys.readouterr().err == ""
    with pytest.raises(UsageError, match="progress"):
        hs.ScoreCAM(_net(), "1", progress=1)  # type: ignore[arg-type]
