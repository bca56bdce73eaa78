"""On CUDA, the diagnose tools read from the device as seldom as they promise: hs.nonfinite at
most once per forward and once per backward, hs.Monitor once per logging step (when the next
step's forward starts), and hs.clip_grad_norm once. Counted with
torch.cuda.set_sync_debug_mode, which warns at every synchronising call (the oracle is CUDA's
own accounting, not ours). Needs a CUDA device: CI has
none, so these run on the GPU machine when one is lent (``pytest tests/test_cuda_syncs.py``)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from syncs import syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.BatchNorm2d(16),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).cuda()


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> Callable[[], None]:
    x = torch.randn(8, 3, 32, 32, device="cuda")
    y = torch.randint(0, 10, (8,), device="cuda")

    def step() -> None:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()

    return step


@pytest.mark.mutates_model  # training steps change the weights on purpose
def test_plain_step_has_no_sync() -> None:
    model = _model()
    step = _step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step()
    with syncs() as seen:
        step()
    assert seen == []  # the baseline the counts below are measured against


@pytest.mark.mutates_model
def test_nonfinite_reads_once_per_forward_and_once_per_backward() -> None:
    model = _model()
    step = _step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step()
    with hs.nonfinite(model):
        with syncs() as seen:
            for _ in range(3):
                step()
    assert len(seen) <= 2 * 3, seen


@pytest.mark.mutates_model
@pytest.mark.parametrize("histograms", [False, True])
def test_monitor_reads_once_per_logging_step_only(histograms: bool, tmp_path: Path) -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    step = _step(model, opt)
    step()
    sinks = [("tensorboard", tmp_path)] if histograms else []  # TensorBoard draws histograms
    with hs.Monitor(model, every=5, optimizer=opt, sinks=sinks) as mon:
        assert mon.histograms == histograms
        step()  # step 0 is logged, and read when step 1's forward starts
        step()
        with syncs() as quiet:
            for _ in range(3):  # steps 2..4: not logged
                step()
        with syncs() as logged:
            step()  # step 5: logged...
            step()  # ...and read when step 6's forward starts
    assert quiet == [] and 1 <= len(logged) <= 1, (quiet, logged)


@pytest.mark.mutates_model
def test_clip_grad_norm_reads_once() -> None:
    model = _model()
    step = _step(model, torch.optim.SGD(model.parameters(), lr=0.01))
    step()
    with syncs() as seen:
        report = hs.clip_grad_norm(model, 0.1)
    assert len(seen) == 1 and report.total_norm > 0, seen
