"""``Capture.nbytes`` equals the bytes the capture actually holds, at every moment: calls
evicted before their gradients arrive, and gradients replaced by a second backward, are not
counted; ``max_bytes`` therefore never fires on memory that is not held.

Oracle: the bytes of every tensor reachable through the public API of the kept calls
(outputs, inputs, gradients), summed independently of hookscope's own counter."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from zoo import tree_leaves


def held(cap: hs.Capture) -> int:
    total = 0
    for name in cap:
        for call in cap[name].calls:
            values: list[Any] = [call.output]
            for read in ("inputs", "grad", "grad_inputs"):
                with contextlib.suppress(hs.CaptureError):  # not captured, or no gradient
                    values.append(getattr(call, read))
            for value in values:
                total += sum(t.numel() * t.element_size() for _, t in tree_leaves(value))
    return total


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 8))


X = torch.randn(4, 16, requires_grad=True)


@pytest.mark.parametrize("keep", [1, 2, "last", "pass", "all"])
@pytest.mark.parametrize("grads", [True, False], ids=["grads", "outputs-only"])
def test_ring_and_passes(keep: Any, grads: bool) -> None:
    model = mlp()
    with hs.capture(model, ["0", "2"], inputs=grads, grads=grads, keep=keep) as cap:
        for step in range(5):
            model(X).pow(2).sum().backward()
            assert cap.nbytes == held(cap)
            if step == 2:  # reading in between must not change what is kept or counted
                assert [c.index for c in cap["2"].calls][-1] == 2
    assert cap.nbytes == held(cap) > 0
    kept = {1: 1, 2: 2, "last": 1, "pass": 1, "all": 5}[keep]
    assert [c.index for c in cap["2"].calls] == list(range(5 - kept, 5))
    assert cap["2"].count == 5
    model.zero_grad(set_to_none=True)
    X.grad = None


@pytest.mark.parametrize("keep", ["pass", "last", 1])
def test_calls_evicted_before_their_backward_are_not_charged(keep: Any) -> None:
    """Gradient accumulation: two forwards, then one backward over both losses; the first
    forward's calls are gone before their gradients arrive."""
    model = mlp()
    with hs.capture(model, ["0", "2"], grads=True, keep=keep) as cap:
        for _ in range(3):
            first = model(X).pow(2).sum()
            second = model(X).pow(2).sum()
            (first + second).backward()
            assert cap.nbytes == held(cap)
        assert len(cap["2"].calls) == 1 and cap["2"].grad.shape == (4, 8)
    model.zero_grad(set_to_none=True)
    X.grad = None


class Reused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.fc = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        for _ in range(4):
            x = torch.tanh(self.fc(x))
        return x


@pytest.mark.parametrize("keep", [1, 2])
def test_ring_evicting_calls_of_the_same_forward(keep: int) -> None:
    model, x = Reused(), torch.randn(3, 8, requires_grad=True)
    with hs.capture(model, "fc", grads=True, inputs=True, keep=keep) as cap:
        for _ in range(3):
            model(x).sum().backward()
            assert cap.nbytes == held(cap)
    assert [c.index for c in cap["fc"].calls] == list(range(12 - keep, 12))
    model.zero_grad(set_to_none=True)


def test_second_backward_replaces_gradients() -> None:
    model = mlp()
    with hs.capture(model, ["0", "2"], grads=True) as cap:
        out = model(X)
        out.pow(2).sum().backward(retain_graph=True)
        once, first = cap.nbytes, cap["2"].grad.clone()
        (3 * out.pow(2).sum()).backward()
        assert cap.nbytes == once == held(cap)
        torch.testing.assert_close(cap["2"].grad, 3 * first)  # replaced, not summed
    model.zero_grad(set_to_none=True)
    X.grad = None


def test_budget_is_checked_against_what_is_held() -> None:
    """One call's output and gradients fit; a ring of one call must run for ever."""
    model = mlp()
    with hs.capture(model, "2", grads=True, keep=1) as probe:
        model(X).sum().backward()
    one_call = probe.nbytes
    with hs.capture(model, "2", grads=True, keep=1, max_bytes=one_call) as cap:
        for _ in range(10):
            model(X).sum().backward()
    assert cap.nbytes == one_call == held(cap)
    model.zero_grad(set_to_none=True)
    X.grad = None


def test_reduced_and_moved_values_are_counted_as_stored() -> None:
    model = mlp()
    options = {"reduce": "batch_mean", "capture_device": "cpu", "grads": True}
    with hs.capture(model, ["0", "2"], **options) as cap:  # type: ignore[arg-type]
        model(X).sum().backward()
    assert cap["0"].output.shape == (32,) and cap["0"].grad.shape == (32,)
    assert cap.nbytes == held(cap)
    model.zero_grad(set_to_none=True)
    X.grad = None


def test_interrupted_call_refunds_its_inputs() -> None:
    class Fails(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            raise ValueError("boom")

    model = nn.Sequential(nn.Linear(16, 16), Fails())
    with hs.capture(model, ["0", "1"], inputs=True) as cap:
        with pytest.raises(ValueError, match="boom"):
            model(X.detach())
    assert cap.nbytes == held(cap)
    assert cap["1"].count == 0
