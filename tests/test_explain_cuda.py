"""On CUDA, no attribution method waits for the device when its targets are host data (ints,
lists, None, a callable): counted with torch.cuda.set_sync_debug_mode, which warns at every
synchronising call (CUDA's own accounting, not ours). A tensor of targets already on the GPU
costs one synchronisation (its range is read), and Eigen-CAM's SVD checks its result (one).
Needs a CUDA device: CI has none, so these run where a GPU is lent
(``pytest tests/test_explain_cuda.py``); the host-read count in test_explain_contract.py is the
CPU-side check of the same promise."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.explain import METHODS
from syncs import syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

#: synchronisations a method makes itself, whatever its targets
OWN = {"eigencam": 1}  # torch.linalg.svd reads its error code back


def _model() -> nn.Module:
    torch.manual_seed(0)
    return (
        nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Conv2d(8, 6, 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(6, 5),
        )
        .cuda()
        .eval()
    )


def _build(name: str, model: nn.Module) -> Any:
    info = METHODS[name]
    kwargs: dict[str, Any] = {"fc": "7"} if "fc" in info.requires else {}
    if "sliding_window_shapes" in info.requires:
        kwargs["sliding_window_shapes"] = (3, 4, 4)
    if info.kind == "layer":
        return info.cls(model, "3", **kwargs)
    if info.kind == "input":
        return info.cls(model, **kwargs)
    return info.cls(hs.Saliency(model), samples=2, seed=0)


#: the attention methods need a transformer: on CPU, test_explain_contract.py counts their
#: host reads
@pytest.mark.parametrize("name", sorted(n for n, i in METHODS.items() if i.kind != "attention"))
def test_host_targets_cost_no_synchronisation(name: str) -> None:
    model, x = _model(), torch.randn(4, 3, 16, 16, device="cuda")
    method = _build(name, model)
    method(x, targets=[0, 1, 2, 3])  # warm-up: cuDNN and allocator set-up
    for targets in ([0, 1, 2, 3], 2, None):
        with syncs() as seen:
            method(x, targets=targets)
        assert len(seen) <= OWN.get(name, 0), (targets, seen)


def test_targets_on_the_gpu_cost_one_synchronisation() -> None:
    model, x = _model(), torch.randn(4, 3, 16, 16, device="cuda")
    method = hs.GradCAM(model, "3")
    targets = torch.tensor([0, 1, 2, 3], device="cuda")
    method(x, targets=targets)
    with syncs() as seen:
        method(x, targets=targets)
    assert len(seen) == 1, seen
