"""hookscope.integrations.lightning: real ``lightning.Trainer.fit`` runs on the CPU, each
against a plain ``hs.Monitor`` around the equivalent hand-written loop on the same data and
seed (the oracle): the records are equal, the steps logged are the optimizer steps, and the
trainer's own loggers (CSV, W&B offline, MLflow file store, TensorBoard) hold them when read
back with their own readers. Gradient accumulation, validation inside the fit, manual
optimization, mixed precision with a loss scaler, and DDP on two gloo processes."""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import socket
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs

L = pytest.importorskip("lightning.pytorch")
from hookscope.integrations.lightning import HookscopeCallback, Maps  # noqa: E402

pytestmark = [
    pytest.mark.mutates_model,  # the trainer trains the module
    # Lightning's advice about data loader workers on a 2-core machine: not ours
    pytest.mark.filterwarnings("ignore:The '\\w+_dataloader' does not have many workers"),
    pytest.mark.filterwarnings("ignore:The number of training batches"),
    pytest.mark.filterwarnings("ignore:You defined a `validation_step` but have no"),
    # Lightning 2.6 on torch 2.13: its pytree helper uses torch's deprecated LeafSpec
    pytest.mark.filterwarnings("ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated"),
]

BATCHES, ACCUMULATE = 8, 2
STEPS = BATCHES // ACCUMULATE


def _cnn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip


class LitCNN(L.LightningModule):
    def __init__(self, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = _cnn()
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, index: int) -> Any:
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()  # manual: a step every ACCUMULATE batches
        self.manual_backward(loss / ACCUMULATE)
        if index % ACCUMULATE == ACCUMULATE - 1:
            opt.step()
            opt.zero_grad()
        return None

    def validation_step(self, batch: Any, index: int) -> None:
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x * 50), y))  # other values than training

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(seed: int = 1, n: int = BATCHES * 2) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def _loader(data: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


def _trainer(tmp: Path, callback: HookscopeCallback, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "max_epochs": 1, "accelerator": "cpu", "devices": 1, "default_root_dir": str(tmp),
        "enable_checkpointing": False, "enable_progress_bar": False,
        "enable_model_summary": False, "num_sanity_val_steps": 0, "log_every_n_steps": 1,
        "callbacks": [callback], "logger": L.loggers.CSVLogger(str(tmp), name="csv"),
    }  # fmt: skip
    return L.Trainer(**(settings | kwargs))


def _by_hand(
    data: Any, *, every: int = 1, manual: bool = False, scaler: Any = None, autocast: bool = False
) -> list[dict[str, Any]]:
    """The oracle: the same module trained by a loop written here, under a plain Monitor."""
    module = LitCNN(manual)
    opt = module.configure_optimizers()
    kwargs = {"scaler": scaler} if scaler is not None else {}
    with hs.Monitor(module, every=every, optimizer=opt, **kwargs) as mon:
        opt.zero_grad()
        for i, (x, y) in enumerate(_loader(data)):
            with torch.autocast("cpu", dtype=torch.float16, enabled=autocast):
                loss = F.cross_entropy(module(x), y) / ACCUMULATE
            (scaler.scale(loss) if scaler is not None else loss).backward()
            if i % ACCUMULATE == ACCUMULATE - 1:
                if scaler is not None:
                    scaler.unscale_(opt)
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                opt.zero_grad()
    return mon.records


def _steps(records: list[dict[str, Any]]) -> list[int]:
    return sorted({r["step"] for r in records})


@pytest.mark.slow
def test_fit_with_accumulation_and_validation_equals_the_loop_by_hand(tmp_path: Path) -> None:
    data = _data()
    callback = HookscopeCallback(every=1, sinks=[tmp_path / "hs.jsonl"])
    module = LitCNN()
    trainer = _trainer(tmp_path, callback, accumulate_grad_batches=ACCUMULATE,
                       val_check_interval=3)  # fmt: skip
    trainer.fit(module, _loader(data), _loader(_data(seed=2, n=4)))
    want = _by_hand(data)
    assert trainer.global_step == STEPS
    assert _steps(callback.records) == list(range(STEPS))  # the optimizer steps, no more
    assert callback.records == want
    lines = (tmp_path / "hs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(want))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())
    # the trainer's own CSVLogger: one row per logged step, the same numbers
    with open(Path(trainer.logger.log_dir) / "metrics.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f) if r.get("hookscope/net.0/activation/mean")]
    assert [int(r["step"]) for r in rows] == list(range(STEPS))
    for row in rows:
        for r in want:
            if r["step"] == int(row["step"]) and r["kind"] != "scalar":
                for key, value in r.items():
                    if key not in ("step", "layer", "kind"):
                        got = float(row[f"hookscope/{r['layer']}/{r['kind']}/{key}"])
                        assert got == pytest.approx(value, rel=1e-6, nan_ok=True)


@pytest.mark.slow
def test_every_other_step_and_manual_optimization(tmp_path: Path) -> None:
    data = _data()
    callback = HookscopeCallback(every=2)
    _trainer(tmp_path, callback).fit(LitCNN(manual=True), _loader(data))
    assert _steps(callback.records) == [0, 2]
    assert callback.records == _by_hand(data, every=2, manual=True)
