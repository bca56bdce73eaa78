"""The W&B and MLflow sinks: a Monitor's records read back with each tool's own reader (W&B's
``wandb leet inspect`` of an offline run's transaction log, MLflow's client on a local file
store) equal the records, step for step, NaN included; one call per logged step; histograms
whose counts are the finite values of the tensor, counted here with NumPy."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs
import wandb_reader
from hookscope.diagnose import MLflowSink, WandbSink

STEPS = 3


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 6), nn.ReLU(), nn.Linear(6, 2))


def _train(net: nn.Module, sinks: list[Any], *, every: int = 1) -> list[dict[str, Any]]:
    """STEPS optimizer steps; the last one's input holds a NaN, so NaN reaches the records
    (its gradients, then the weights it updates)."""
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    with hs.Monitor(net, every=every, sinks=sinks, optimizer=opt) as mon:
        for i in range(STEPS):
            x = torch.randn(8, 3, generator=torch.Generator().manual_seed(i))
            if i == STEPS - 1:
                x[0, 0] = math.nan
            loss = net(x).pow(2).mean()
            loss.backward()
            mon.log(loss=loss.detach())
            opt.step()
            opt.zero_grad()
    return mon.records


def _weights_after(steps: int) -> list[torch.Tensor]:
    """The first layer's weights after ``steps`` steps of :func:`_train`, trained here."""
    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    for i in range(steps):
        x = torch.randn(8, 3, generator=torch.Generator().manual_seed(i))
        net(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return [p.detach() for p in net[0].parameters()]


def _metrics(records: list[dict[str, Any]], prefix: str) -> dict[tuple[int, str], float]:
    """Each record's numbers by (step, name), named here as the sinks document it."""
    out: dict[tuple[int, str], float] = {}
    for r in records:
        if r["kind"] == "scalar":
            out[r["step"], f"{prefix}{r['layer']}"] = r["value"]
            continue
        for key, value in r.items():
            if key not in ("step", "layer", "kind"):
                out[r["step"], f"{prefix}{r['layer']}/{r['kind']}/{key}"] = value
    return out


def _same(got: float, want: float) -> bool:
    return (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6)


# -- W&B ----------------------------------------------------------------------------------------


def _histogram(row: dict[str, Any], name: str) -> dict[str, Any] | None:
    """A histogram of a history row (the reader writes its fields as ``name.field``)."""
    fields = {k.split(".")[-1]: v for k, v in row.items() if k.startswith(f"{name}.")}
    return fields or row.get(name)


@pytest.fixture
def offline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """W&B in offline mode in a folder of the test's: nothing leaves the machine, and W&B's
    service process is stopped after the test."""
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    try:
        yield tmp_path
    finally:
        wandb.teardown()


@pytest.mark.slow
@pytest.mark.mutates_model  # the optimizer trains the model
def test_wandb_offline_run_holds_every_record_one_row_per_step(offline: Path) -> None:
    np = pytest.importorskip("numpy")
    net = _net()
    sink = WandbSink(project="hookscope-test", dir=str(offline), bins=16)
    records = _train(net, [sink])
    rows = wandb_reader.history(wandb_reader.run_dir(offline))
    assert [row["hookscope/step"] for row in rows] == list(range(STEPS))  # one log per step
    want = _metrics(records, "hookscope/")
    for (step, name), value in want.items():
        got = rows[step][name]
        assert _same(float(got), value), (step, name, got, value)
    # histograms: W&B's own type, at most `bins` bins, every finite value counted
    hist = _histogram(rows[1], "hookscope/0/parameter")
    assert hist is not None and hist["_type"] == "histogram"
    assert len(hist["values"]) <= 16 and len(hist["bins"]) == len(hist["values"]) + 1
    weights = np.concatenate([p.detach().numpy().ravel() for p in _weights_after(2)])
    assert sum(hist["values"]) == weights.size
    assert hist["bins"][0] == pytest.approx(float(weights.min()))
    assert hist["bins"][-1] == pytest.approx(float(weights.max()))
    inside = np.histogram(weights, bins=np.array(hist["bins"]))[0]  # NumPy's own counts
    assert inside.sum() == weights.size
    assert _histogram(rows[2], "hookscope/0/parameter_gradient") is None  # all NaN: no bins
    assert _histogram(rows[0], "hookscope/0/activation") is None  # parameters only, by default


@pytest.mark.slow
@pytest.mark.mutates_model
def test_wandb_sink_shares_a_run_it_does_not_finish(offline: Path) -> None:
    """A run given to the sink gets the records against the sink's step metric, though the
    run's own step runs ahead (a trainer logs more often); the sink leaves it open."""
    wandb = pytest.importorskip("wandb")
    run = wandb.init(project="hookscope-test", dir=str(offline))
    try:
        for i in range(5):
            run.log({"trainer/loss": float(i)})  # the run's own step is now 5
        records = _train(_net(), [WandbSink(run, prefix="hs/", histograms=False)], every=2)
        run.log({"trainer/loss": 9.0})  # still open
    finally:
        run.finish()
    rows = [r for r in wandb_reader.history(wandb_reader.run_dir(offline)) if "hs/step" in r]
    assert [r["hs/step"] for r in rows] == [0, 2]
    assert rows[1]["hs/0/activation/mean"] == pytest.approx(
        next(r["mean"] for r in records if r["step"] == 2 and r["layer"] == "0")
    )
    assert not any(key.endswith("parameter") for row in rows for key in row)


def test_wandb_sink_usage_errors(offline: Path) -> None:
    with pytest.raises(hs.UsageError, match="bins must be"):
        WandbSink(bins=1000)
    with pytest.raises(hs.UsageError, match="histograms must be"):
        WandbSink(histograms="some")
    with pytest.raises(hs.UsageError, match="not both"):
        WandbSink(object(), project="x")


# -- MLflow -------------------------------------------------------------------------------------


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local MLflow file store (MLflow 3 asks for an opt-in to use one)."""
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    return (tmp_path / "mlruns").as_uri()


@pytest.mark.slow
@pytest.mark.mutates_model
def test_mlflow_file_store_holds_every_record_at_its_step(store: str) -> None:
    from mlflow import MlflowClient
    from mlflow.artifacts import load_dict

    net = _net()
    sink = MLflowSink(store, histograms=True)
    records = _train(net, [sink])
    client = MlflowClient(tracking_uri=store)
    run = client.get_run(sink.run_id)
    assert run.info.status == "FINISHED"  # the sink started it, and ended it at close
    want = _metrics(records, "hookscope/")
    names = {name for _, name in want}
    for name in names:
        history = {m.step: m.value for m in client.get_metric_history(sink.run_id, name)}
        expected = {step: v for (step, n), v in want.items() if n == name}
        assert history.keys() == expected.keys(), name
        assert all(_same(history[s], v) for s, v in expected.items()), name
    assert set(run.data.metrics) == names  # nothing else, nothing renamed
    base = run.info.artifact_uri
    hists = load_dict(f"{base}/hookscope/histograms/step_{STEPS - 2:08d}.json")
    weights = torch.cat([p.reshape(-1) for p in _weights_after(STEPS - 1)])
    h = hists["0/parameter"]
    assert sum(h["counts"]) == h["num"] == weights.numel()
    assert h["min"] == pytest.approx(float(weights.min()))
    assert h["max"] == pytest.approx(float(weights.max())) and h["max"] <= h["limits"][-1]
    assert h["sum"] == pytest.approx(float(weights.sum()), rel=1e-5)


@pytest.mark.slow
@pytest.mark.mutates_model
def test_mlflow_sink_logs_to_a_given_run_one_batch_per_step(
    store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=store)
    exp = client.create_experiment("mine")
    run_id = client.create_run(exp).info.run_id
    calls: list[int] = []
    real = client.log_batch
    monkeypatch.setattr(
        client, "log_batch", lambda *a, **k: (calls.append(len(k["metrics"])), real(*a, **k))
    )
    single = nn.Linear(3, 2)  # the model itself is the layer: "_root" in the names
    opt = torch.optim.SGD(single.parameters(), lr=0.1)
    with hs.Monitor(single, every=1, optimizer=opt, sinks=[MLflowSink(client, run_id)]) as mon:
        for _ in range(2):
            single(torch.randn(4, 3)).sum().backward()
            opt.step()
            opt.zero_grad()
    assert len(calls) == 2  # one call per logged step
    assert client.get_run(run_id).info.status == "RUNNING"  # not the sink's to end
    norms = client.get_metric_history(run_id, "hookscope/_root/parameter/norm")
    assert [m.step for m in norms] == [0, 1]
    assert norms[1].value == pytest.approx(
        next(r["norm"] for r in mon.records if r["step"] == 1 and r["kind"] == "parameter")
    )


@pytest.mark.mutates_model
def test_tracker_sinks_add_no_host_read(
    offline: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sinks take host values: a logged step is still read once, and steps between
    logged ones read nothing."""
    from syncs import host_reads

    net = _net()
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(4, 3)
    sinks = [WandbSink(project="p", dir=str(offline), histograms=False), MLflowSink(store)]

    def step() -> None:
        net(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with hs.Monitor(net, every=3, optimizer=opt, sinks=sinks) as mon:
        with host_reads() as logged:
            step()
            net(x)  # the next forward reads the logged step
        with host_reads() as between:
            step()
            step()
        with host_reads() as closing:
            mon.close()  # the sinks write and close
    assert len(logged) == 1 and between == [] and closing == [], (logged, between, closing)


def test_buckets_merge_with_exact_counts() -> None:
    from hookscope.diagnose._trackers import merged_buckets

    edges = [-1.0, 0.0, 1.0, 2.0, 3.0]  # buckets (-inf,-1], (-1,0], ..., (3, inf)
    counts = [0.0, 2.0, 0.0, 3.0, 1.0, 4.0]
    stats = {"min": -0.5, "max": 7.0}
    assert merged_buckets(stats, counts, edges, 8) == (
        [2.0, 0.0, 3.0, 1.0, 4.0],
        [-0.5, 0.0, 1.0, 2.0, 3.0, 7.0],
    )
    assert merged_buckets(stats, counts, edges, 2) == ([5.0, 5.0], [-0.5, 2.0, 7.0])
    assert merged_buckets(stats, [0.0] * 6, edges, 2) == ([], [])
