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
from typing import TYPE_CHECKING, Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs
import wandb_reader
import zygote

if TYPE_CHECKING:
    import lightning.pytorch as L

    from hookscope.integrations.lightning import HookscopeCallback, Maps

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
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


LitCNN: Any = None  # set by _import_lightning(), with L, HookscopeCallback and Maps
Exploding: Any = None


def _import_lightning() -> None:
    """Lightning, and the modules built on it, made this module's globals ``L``,
    ``HookscopeCallback``, ``Maps``, ``LitCNN`` and ``Exploding``: imported when a test of this
    file first runs, not when the file is collected (every pytest-xdist worker collects every
    file; importing Lightning takes ~8 s, paid before by the worker that runs none of these)."""
    L = pytest.importorskip("lightning.pytorch")
    from hookscope.integrations.lightning import HookscopeCallback, Maps

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

    class Exploding(LitCNN):
        """Its second convolution makes NaN from the third batch on (a bug in a layer)."""

        def __init__(self) -> None:
            super().__init__()
            self.batches = 0

        def training_step(self, batch: Any, index: int) -> Any:
            self.batches += 1
            if self.batches == 3:
                with torch.no_grad():
                    self.net[2].bias.fill_(math.nan)
            return super().training_step(batch, index)

    globals().update(
        L=L, HookscopeCallback=HookscopeCallback, Maps=Maps, LitCNN=LitCNN, Exploding=Exploding
    )


@pytest.fixture(autouse=True, scope="module")
def _lightning() -> None:
    _import_lightning()


def _data(seed: int = 1, n: int = BATCHES * 2) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(
        torch.randn(n, 3, 8, 8, generator=g), torch.randint(0, 3, (n,), generator=g)
    )


def _loader(data: Any) -> torch.utils.data.DataLoader:
    return torch.utils.data.DataLoader(data, batch_size=2, shuffle=False)


def _trainer(tmp: Path, callback: HookscopeCallback, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "max_epochs": 1,
        "accelerator": "cpu",
        "devices": 1,
        "default_root_dir": str(tmp),
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "log_every_n_steps": 1,
        "callbacks": [callback],
        "logger": L.loggers.CSVLogger(str(tmp), name="csv"),
    }
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
    trainer = _trainer(tmp_path, callback, accumulate_grad_batches=ACCUMULATE, val_check_interval=3)
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


@pytest.mark.slow
def test_mixed_precision_steps_are_the_scalers_and_gradients_unscaled(tmp_path: Path) -> None:
    """16-bit autocast with a GradScaler: Lightning unscales before the optimizer step, and
    the callback gives the Monitor the trainer's scaler, so the records equal a loop by hand
    with the same scaler (its first steps overflow and are skipped: not optimizer steps)."""
    from lightning.pytorch.plugins import MixedPrecision

    data = _data()
    callback = HookscopeCallback(every=1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    trainer = _trainer(
        tmp_path,
        callback,
        accumulate_grad_batches=ACCUMULATE,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
    )
    trainer.fit(LitCNN(), _loader(data))
    mine = torch.amp.GradScaler("cpu", init_scale=2.0**8)
    want = _by_hand(data, scaler=mine, autocast=True)
    assert callback.monitor is not None and callback.monitor.scaler is scaler
    assert callback.records == want
    assert mine.get_scale() == scaler.get_scale()


def _hooks_left(module: nn.Module) -> bool:
    return any(m._forward_hooks or m._forward_pre_hooks for m in module.modules())


@pytest.mark.slow
def test_nonfinite_names_the_layer_and_the_model_is_left_clean(tmp_path: Path) -> None:
    callback = HookscopeCallback(every=1, nonfinite=True, sinks=[tmp_path / "hs.jsonl"])
    module = Exploding()
    with pytest.raises(hs.NonFiniteError) as caught:
        _trainer(tmp_path, callback).fit(module, _loader(_data()))
    assert caught.value.module == "net.2" and caught.value.phase == "forward"
    assert not _hooks_left(module)  # closed on the exception
    assert _steps(callback.records) == [0, 1]  # the steps before the failing batch
    # the NaN tracer alone, warning: the run goes on, the report lists the finding
    callback = HookscopeCallback(monitor=False, nonfinite="warn")
    with pytest.warns(RuntimeWarning, match="NaN/Inf in the forward"):
        _trainer(tmp_path, callback).fit(Exploding(), _loader(_data()))
    assert callback.report is not None and callback.report.findings
    assert callback.records == []


@pytest.mark.slow
def test_the_trainers_loggers_hold_the_records_and_the_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """A TensorBoardLogger, a WandbLogger (offline) and an MLFlowLogger (a local file
    store) at once, read back with TensorBoard's, W&B's and MLflow's own readers: the
    records at the optimizer steps, parameter histograms, and the Grad-CAM maps of a fixed
    batch drawn at each epoch's end."""
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # a W&B setup an earlier test left would ignore this test's WANDB_* below
    request.addfinalizer(wandb.teardown)  # W&B's service process: none left behind
    pytest.importorskip("mlflow")
    import mlflow.tracking._tracking_service.utils as tracking
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    # MLFlowLogger sets MLflow's process-wide tracking URI, which later runs (a Hugging Face
    # Trainer's MLflowCallback) then use instead of MLFLOW_TRACKING_URI: put it back after
    monkeypatch.setattr(tracking, "_tracking_uri", tracking._tracking_uri)
    store = (tmp_path / "mlruns").as_uri()
    loggers = [
        L.loggers.TensorBoardLogger(str(tmp_path), name="tb"),
        L.loggers.WandbLogger(project="lit", save_dir=str(tmp_path), offline=True),
        L.loggers.MLFlowLogger(experiment_name="lit", tracking_uri=store),
    ]
    images = _data(seed=3, n=2).tensors[0]
    maps = Maps(images, layer="net.2", method="gradcam", targets=[0, 1])
    callback = HookscopeCallback(every=1, histograms=True, maps=maps)
    data = _data()
    trainer = _trainer(
        tmp_path, callback, accumulate_grad_batches=ACCUMULATE, logger=loggers, max_epochs=2
    )
    trainer.fit(LitCNN(), _loader(data))
    wandb.finish()
    records = callback.records
    steps = list(range(2 * STEPS))
    assert _steps(records) == steps
    want = {
        r["step"]: r["mean"] for r in records if (r["layer"], r["kind"]) == ("net.0", "activation")
    }
    # TensorBoard
    events = EventAccumulator(loggers[0].log_dir, size_guidance={"histograms": 0, "images": 0})
    events.Reload()
    scalars = events.Scalars("hookscope/net.0/activation/mean")
    assert [(s.step, s.value) for s in scalars] == [(k, pytest.approx(v)) for k, v in want.items()]
    assert [h.step for h in events.Histograms("hookscope/net.0/parameter")] == steps
    assert [i.step for i in events.Images("hookscope/maps/gradcam/net.2")] == [STEPS, 2 * STEPS]
    # W&B: against the hookscope/step metric
    rows = [
        r for r in wandb_reader.history(wandb_reader.run_dir(tmp_path)) if "hookscope/step" in r
    ]
    by_step = {r["hookscope/step"]: r for r in rows if "hookscope/net.0/activation/mean" in r}
    assert {k: v["hookscope/net.0/activation/mean"] for k, v in by_step.items()} == pytest.approx(
        want
    )
    assert any(k.startswith("hookscope/net.0/parameter.") for k in by_step[0])  # a histogram
    pictures = [r for r in rows if any(k.startswith("hookscope/maps/") for k in r)]
    assert [r["hookscope/step"] for r in pictures] == [STEPS, 2 * STEPS]
    # MLflow
    client = MlflowClient(tracking_uri=store)
    history = client.get_metric_history(loggers[2].run_id, "hookscope/net.0/activation/mean")
    assert {m.step: m.value for m in history} == pytest.approx(want)
    # the maps: the image logged is the overlays of a Grad-CAM computed here
    drawn = callback.images["maps/gradcam/net.2"]
    assert drawn.shape == (8, 8 * 2 + 2, 3) and drawn.dtype.name == "uint8"
    module = LitCNN()
    module.load_state_dict(trainer.lightning_module.state_dict())
    exp = hs.GradCAM(module, "net.2")(images, targets=[0, 1])
    tiles = [hs.overlay(images[i], exp.maps[i]).numpy() for i in (0, 1)]
    assert (drawn[:, :8] == tiles[0]).all() and (drawn[:, 10:] == tiles[1]).all()


# -- DDP: two gloo processes ---------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _by_hand_ddp(part: Any, sink: str, ranks: str) -> None:
    """The oracle on one rank: a DDP-wrapped module, no_sync on the micro-batch that does not
    step (as Lightning does), a plain Monitor."""
    module = LitCNN()
    ddp = nn.parallel.DistributedDataParallel(module)
    opt = module.configure_optimizers()
    with hs.Monitor(module, every=1, optimizer=opt, sinks=[sink], ranks=ranks):
        opt.zero_grad()
        for i, (x, y) in enumerate(_loader(part)):
            steps = i % ACCUMULATE == ACCUMULATE - 1
            with contextlib.nullcontext() if steps else ddp.no_sync():
                (F.cross_entropy(ddp(x), y) / ACCUMULATE).backward()
            if steps:
                opt.step()
                opt.zero_grad()


def _ddp_rank(rank: int, port: int, out: str) -> None:
    """Rank ``rank`` of two: Lightning's DDP fit and the by-hand DDP loop with the callback's
    ``ranks="reduce"``, then both again with ``ranks="each"`` (one pair of processes for
    both: each rank mostly imports torch and Lightning)."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE="2",
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        NODE_RANK="0",
    )  # launched here, so Lightning launches nothing (LightningEnvironment)
    warnings.filterwarnings("ignore")  # Lightning's advice, printed by each process
    _import_lightning()
    torch.set_num_threads(1)
    data = _data()
    part = torch.utils.data.Subset(data, list(range(rank, len(data), 2)))  # its own half
    try:
        for ranks in ("reduce", "each"):
            _fit_and_by_hand(rank, part, f"{out}/{ranks}", ranks)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # Done: leave without the interpreter's shutdown (a gloo process sometimes never finishes
    # exiting on a loaded machine, see test_monitoring.py); a failure above still raises.
    os._exit(0)


def _fit_and_by_hand(rank: int, part: Any, out: str, ranks: str) -> None:
    """Lightning's DDP fit with the callback, then the oracle: the by-hand DDP loop."""
    callback = HookscopeCallback(every=1, sinks=[f"{out}/lightning{rank}.jsonl"], ranks=ranks)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        devices=2,
        num_nodes=1,
        strategy="ddp",
        accumulate_grad_batches=ACCUMULATE,
        use_distributed_sampler=False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    module = LitCNN()
    trainer.fit(module, _loader(part))
    assert trainer.global_step == STEPS // 2  # its half: half the optimizer steps
    assert not _hooks_left(module), "hooks left after fit"
    _by_hand_ddp(part, f"{out}/hand{rank}.jsonl", ranks)


@contextlib.contextmanager
def _processes(fn: Any, args: tuple[Any, ...], seconds: float) -> Iterator[None]:
    """Two processes running ``fn(rank, *args)``, forked from the tests' forkserver; killed
    after ``seconds`` (a rank waiting for a peer that died would wait forever), none left
    behind either way."""
    import time

    mp = pytest.importorskip("torch.multiprocessing")
    zygote.context()  # forked from a server that imported torch once (see zygote.py)
    context = mp.start_processes(
        fn, args=args, nprocs=2, join=False, start_method=zygote.START_METHOD
    )
    deadline = time.monotonic() + seconds
    try:
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"the 2 gloo processes did not finish in {seconds:.0f} s")
        yield
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join(timeout=30)
        assert not any(p.is_alive() for p in context.processes), "a process was left behind"


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_ddp_on_two_gloo_processes_equals_ddp_by_hand(tmp_path: Path) -> None:
    """Both ``ranks`` settings from one pair of gloo processes (``_ddp_rank``)."""
    for ranks in ("reduce", "each"):
        (tmp_path / ranks).mkdir()
    with _processes(_ddp_rank, (_free_port(), str(tmp_path)), seconds=600):
        pass
    out = tmp_path / "reduce"  # rank 0 writes every rank's statistics combined
    assert not (out / "lightning1.jsonl").read_text()
    assert not (out / "hand1.jsonl").read_text()
    got, want = _rows(out / "lightning0.jsonl"), _rows(out / "hand0.jsonl")
    assert got == want and _steps(got) == list(range(STEPS // 2))
    assert "rank" not in got[0]
    out = tmp_path / "each"
    for rank in (0, 1):
        got = _rows(out / f"lightning{rank}.jsonl")
        assert got == _rows(out / f"hand{rank}.jsonl")
        assert {r["rank"] for r in got} == {rank} and _steps(got) == list(range(STEPS // 2))
