"""hs.Monitor: statistics against torch reductions on tensors taken by plain hooks in the test,
dead units on a layer built to have them, optimizer-step counting under gradient
accumulation, and the JSONL / CSV / TensorBoard files read back."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


def _net() -> nn.Module:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        net[0].bias[[0, 2]] = -100.0  # channels 0 and 2 never fire: dead
    return net


def _expected(t: Tensor) -> dict[str, float]:
    finite = t[torch.isfinite(t)].double()
    return {
        "norm": float(finite.norm()),
        "mean": float(finite.mean()),
        "std": float(finite.std()),
        "min": float(finite.min()),
        "max": float(finite.max()),
        "zeros": float((t == 0).double().mean()),
        "nonfinite": int((~torch.isfinite(t)).sum()),
    }


@pytest.mark.mutates_model  # an optimizer trains the model
def test_statistics_dead_units_and_accumulation() -> None:
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    seen: dict[str, list[Tensor]] = {"1": [], "2": []}
    grads: list[Tensor] = []
    for name in seen:
        net.get_submodule(name).register_forward_hook(
            lambda m, a, out, name=name: seen[name].append(out.detach().clone())
        )

    def keep_grad(m: nn.Module, a: object, out: Tensor) -> None:
        out.register_hook(grads.append)

    net[1].register_forward_hook(keep_grad)
    batches = [torch.randn(4, 3, generator=torch.Generator().manual_seed(i)) for i in range(9)]
    with hs.Monitor(net, every=2, optimizer=opt) as mon:
        for step in range(3):  # 3 optimizer steps of 3 micro-batches each
            for x in batches[3 * step : 3 * step + 3]:
                net(x).pow(2).mean().backward()
            if step == 0:
                accumulated = torch.cat([p.grad.reshape(-1) for p in net[2].parameters()])
                accumulated = accumulated.double().norm().item()
                first_acts = {k: torch.cat(v) for k, v in seen.items()}
                first_grads = torch.cat(grads)
            opt.step()
            opt.zero_grad()
    records = mon.records()
    assert sorted({r["step"] for r in records}) == [0, 2]  # optimizer steps, every 2
    acts = {r["layer"]: r for r in records if r["step"] == 0 and r["kind"] == "activation"}
    for layer in ("1", "2"):
        for key, value in _expected(first_acts[layer]).items():
            assert acts[layer][key] == pytest.approx(value, rel=1e-6, abs=1e-9), (layer, key)
    assert acts["1"]["dead"] == pytest.approx(2 / 6)  # channels 0 and 2
    grad = next(
        r for r in records if r["step"] == 0 and r["kind"] == "gradient" and r["layer"] == "1"
    )
    assert grad["norm"] == pytest.approx(float(first_grads.double().norm()), rel=1e-6)
    param = next(
        r for r in records if r["step"] == 0 and r["kind"] == "parameter" and r["layer"] == "2"
    )
    assert param["grad_norm"] == pytest.approx(accumulated, rel=1e-6)  # all 3 micro-batches
    assert param["update_norm"] == pytest.approx(0.01 * accumulated, rel=1e-5)
    assert param["update_ratio"] == pytest.approx(param["update_norm"] / param["norm"])


def test_nonfinite_values_are_counted_not_hidden() -> None:
    class Spiky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            y = x.clone()
            y[0, 0], y[1, 1] = float("nan"), float("inf")
            return y

    net = nn.Sequential(nn.Linear(2, 3), Spiky())
    with hs.Monitor(net, layers="1", every=1) as mon:
        with torch.no_grad():
            out = net(torch.ones(2, 2))
        mon.step()
    (record,) = mon.records()
    assert record["nonfinite"] == 2 and record["kind"] == "activation"
    assert record["max"] == pytest.approx(_expected(out)["max"])  # over the finite values
    assert not any(r["kind"] == "gradient" for r in mon.records())  # no_grad: none


@pytest.mark.mutates_model
def test_sinks_read_back(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    sinks = [tmp_path / "m.jsonl", tmp_path / "m.csv", ("tensorboard", tmp_path / "tb")]
    with hs.Monitor(net, every=1, sinks=sinks, optimizer=opt) as mon:
        for _ in range(2):
            net(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    records = mon.records()
    lines = (tmp_path / "m.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(records))
    with open(tmp_path / "m.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == len(records)
    assert all(float(row["norm"]) == pytest.approx(r["norm"]) for row, r in zip(rows, records))
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    scalars = events.Scalars("1/activation/dead")
    assert [(s.step, round(s.value, 6)) for s in scalars] == [
        (0, round(2 / 6, 6)),
        (1, round(2 / 6, 6)),
    ]
    import pandas

    assert len(pandas.read_csv(tmp_path / "m.csv")) == len(records)
    assert len(pandas.read_json(tmp_path / "m.jsonl", lines=True)) == len(records)


def test_usage_errors() -> None:
    with pytest.raises(hs.UsageError, match="every"):
        hs.Monitor(nn.Linear(2, 2), every=0)
    with pytest.raises(hs.UsageError, match="cannot tell the sink"):
        hs.Monitor(nn.Sequential(nn.Linear(2, 2)), sinks=["log.txt"])
    with pytest.raises(hs.UsageError, match="pass layers="):
        hs.Monitor(nn.Identity())
    single = nn.Linear(2, 2)
    with hs.Monitor(single, every=1) as mon:
        with torch.no_grad():
            single(torch.ones(1, 2))
        mon.step()
    assert [r["layer"] for r in mon.records()] == ["", ""]  # activation, parameter
