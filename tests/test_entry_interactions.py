"""hs.extract, hs.report and the clip_grad report the way users break things: another capture
open on the same model, under no_grad and inference_mode, a deepcopy of the model made inside
them, and an exception or KeyboardInterrupt mid-forward; the residue fixture checks that the
model is left as found every time."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

pytest.importorskip("zarr")


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


X = torch.randn(12, 3, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("mode", ["capture open", "no_grad", "inference_mode"])
def test_extract_and_report_inside_other_sessions_and_grad_modes(tmp_path: Path, mode: str) -> None:
    pytest.importorskip("matplotlib")
    model = _cnn()
    with torch.no_grad():
        want = model[1](model[0](X)).mean((2, 3))
    context = {
        "capture open": lambda: hs.capture(model, "4"),
        "no_grad": torch.no_grad,
        "inference_mode": torch.inference_mode,
    }[mode]
    with context() as outer:
        store = hs.extract(model, X, ["1"], out=tmp_path / "f", reduce="spatial_mean")
        path = hs.report(model, X[:2], tmp_path / "r.html")
        if mode == "capture open":
            model(X)  # the outer capture still records after both returned
    np.testing.assert_allclose(store.to_numpy("1"), want.numpy(), rtol=1e-6, atol=1e-6)
    text = path.read_text()
    if mode == "inference_mode":  # no autograd at all: the report says so instead of a map
        assert "No Grad-CAM: layer &#x27;1&#x27;&#x27;s output has no gradient" in text
        assert "inference_mode" in text
    else:
        assert "Grad-CAM at <code>1</code>" in text  # gradients even under no_grad
    if mode == "capture open":
        assert outer["4"].output.shape == (12, 3)


class _Interrupting(nn.Module):
    """Raises ``error`` on its ``at``-th call; otherwise the identity."""

    def __init__(self, error: BaseException, at: int) -> None:
        super().__init__()
        self.error, self.at, self.calls = error, at, 0

    def forward(self, x: Tensor) -> Tensor:
        self.calls += 1
        if self.calls == self.at:
            raise self.error
        return x


@pytest.mark.mutates_model  # the interrupting module counts its calls
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_interrupted_extract_leaves_the_model_and_a_resumable_store(
    tmp_path: Path, error: BaseException
) -> None:
    model = _cnn()
    model.insert(1, _Interrupting(error, at=3))  # before the ReLU ("2"): the third batch raises
    with pytest.raises(type(error)):
        hs.extract(model, X, ["2"], out=tmp_path / "f", batch_size=2, chunk=4)
    with pytest.raises(hs.UsageError, match="unfinished"):
        hs.open_features(tmp_path / "f")
    store = hs.extract(model, X, ["2"], out=tmp_path / "f", batch_size=2, chunk=4, resume=True)
    whole = hs.extract(model, X, ["2"], out=tmp_path / "g", batch_size=2, chunk=4)
    assert np.array_equal(store.to_numpy("2"), whole.to_numpy("2")) and store.ids == whole.ids


def test_deepcopy_inside_extract_and_report(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    model = _cnn()
    copies: list[nn.Module] = []

    class Copier(nn.Module):  # the user's forward deep-copies the whole model
        def forward(self, x: Tensor) -> Tensor:
            copies.append(copy.deepcopy(model))
            return x

    model.insert(4, Copier())
    hs.extract(model, X, ["1"], out=tmp_path / "f", stop=False)
    hs.report(model, X[:2], tmp_path / "r.html")
    assert len(copies) >= 3
    for c in copies:  # a copy made inside carries none of hookscope's hooks
        assert not any(m._forward_hooks or m._forward_pre_hooks for m in c.modules())


@pytest.mark.mutates_model  # the backward writes .grad on purpose
def test_clip_grad_report_with_a_capture_open_and_checkpointing() -> None:
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))
    clip = hs.clip_grad(norm=1e-3)
    x = torch.randn(5, 4)
    with hs.capture(block, "0", grads=True) as cap, hs.edit(block, {"0": clip}):
        checkpoint(block, x, use_reentrant=False).pow(2).sum().backward()
    assert cap["0"].grad is not None
    report = clip.report()
    assert set(report.layers) == {"0.weight", "0.bias"} and report.clipped
    assert block[0].weight.grad.norm() <= 1e-3 + 1e-6  # clipped once, not per recompute


def test_hookscopes_own_forwards_are_invisible_to_the_users_sessions(tmp_path: Path) -> None:
    """extract's forwards (its probe of sample 0 included), summary's (on random inputs too)
    and the report's are hookscope's own: an open Monitor does not count them and an open
    capture does not record them; the user's own forward is still seen."""
    pytest.importorskip("matplotlib")
    model = _cnn()
    x = X[:2]
    with hs.capture(model, ["0", "4"], keep="all") as cap, hs.Monitor(model, every=1) as mon:
        hs.extract(model, X, ["1"], out=tmp_path / "f", reduce="spatial_mean")
        hs.summary(model, input_size=(1, 3, 8, 8))
        hs.summary(model, x)
        hs.report(model, x, tmp_path / "r.html")
        assert cap["0"].count == cap["4"].count == 0
        model(x).sum().backward()  # the user's forward
        mon.step()
    assert cap["0"].count == cap["4"].count == 1
    steps = {r["step"] for r in mon.records if r["kind"] == "activation"}
    norms = [r["norm"] for r in mon.records if r["kind"] == "activation" and r["layer"] == "4"]
    assert steps == {0}
    with torch.no_grad():
        assert norms == [pytest.approx(float(model(x).norm()), rel=1e-5)]
