"""hookscope.integrations.transformers: real ``transformers.Trainer.train`` runs on the CPU
(a small GPT-2 with random weights), each against a plain ``hs.Monitor`` around the
equivalent hand-written loop on the same data and seed (the oracle, which does what the
Trainer does: accumulation over two micro-batches with the loss normalised by the window's
token count, the Trainer's gradient clipping, an AdamW step): the records are equal, the
steps logged are the optimizer steps, the clipping is reported as ``hs.clip_grad_norm``
reports it, evaluation between steps is not counted, and the trackers of ``report_to``
(W&B offline, MLflow on a file store, TensorBoard) hold the records and the attention maps
when read back with their own readers."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

import hookscope as hs
import wandb_reader

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from hookscope.integrations.transformers import HookscopeCallback, Maps  # noqa: E402

pytestmark = [pytest.mark.hf, pytest.mark.slow, pytest.mark.mutates_model]

SAMPLES, BATCH, ACCUMULATE, LENGTH = 16, 2, 2, 8
STEPS = SAMPLES // BATCH // ACCUMULATE
MAX_NORM = 0.5  # small enough that some steps are clipped


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=64,
        n_positions=LENGTH,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return transformers.GPT2LMHeadModel(config)


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    def __init__(self, seed: int = 1, n: int = SAMPLES) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, 64, (n, LENGTH), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    @staticmethod
    def labels(ids: torch.Tensor) -> torch.Tensor:
        """The ids, the first position not a target (-100): the Trainer's count of a window's
        labels is then the same whether it counts shifted labels or not, and equals the
        count of the model's (shifted) targets."""
        labels = ids.clone()
        labels[..., 0] = -100
        return labels

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels(self.ids[i])}


def _optimizer(model: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-2)


def _train(tmp: Path, callback: HookscopeCallback, **kwargs: Any) -> Any:
    settings: dict[str, Any] = {
        "output_dir": str(tmp / "out"),
        "per_device_train_batch_size": BATCH,
        "gradient_accumulation_steps": ACCUMULATE,
        "num_train_epochs": 1,
        "lr_scheduler_type": "constant",
        "max_grad_norm": MAX_NORM,
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "disable_tqdm": True,
        "dataloader_num_workers": 0,
        "train_sampling_strategy": "sequential",
        "seed": 0,
    }
    model = _gpt2()
    extra = {"eval_dataset": kwargs.pop("eval_dataset")} if "eval_dataset" in kwargs else {}
    args = transformers.TrainingArguments(**(settings | kwargs))
    trainer = transformers.Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(),
        callbacks=[callback],
        optimizers=(_optimizer(model), None),
        **extra,
    )
    trainer.train()
    return trainer


def _by_hand(every: int = 1) -> tuple[list[dict[str, Any]], list[hs.ClipReport]]:
    """The oracle: the Trainer's step, written out. Per window of ACCUMULATE micro-batches,
    each micro-batch's loss is its summed token loss over the window's count of targets
    (GPT-2 takes ``num_items_in_batch``; with equal counts per micro-batch this is also the
    mean loss divided by ACCUMULATE), then the gradients are clipped to MAX_NORM and AdamW
    steps."""
    model = _gpt2()
    model.train()
    opt = _optimizer(model)
    data = Tokens()
    reports = []
    with hs.Monitor(model, every=every, optimizer=opt) as mon:
        for start in range(0, SAMPLES, BATCH * ACCUMULATE):
            window = [
                data.ids[s : s + BATCH] for s in range(start, start + BATCH * ACCUMULATE, BATCH)
            ]
            targets = torch.tensor(sum(int((Tokens.labels(ids) != -100).sum()) for ids in window))
            for ids in window:
                out = model(input_ids=ids, labels=Tokens.labels(ids), num_items_in_batch=targets)
                out.loss.backward()
            if mon.logging:
                report = hs.clip_grad_norm(model, MAX_NORM)
                reports.append(report)
                mon.log(
                    grad_norm=report.total_norm,
                    grad_norm_clipped=report.total_norm_after,
                    clip_coef=min(report.clipped.values(), default=1.0),
                )
            else:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
    return mon.records, reports


def _steps(records: list[dict[str, Any]]) -> list[int]:
    return sorted({r["step"] for r in records})


def test_train_with_accumulation_and_clipping_equals_the_loop_by_hand(tmp_path: Path) -> None:
    callback = HookscopeCallback(every=1, sinks=[tmp_path / "hs.jsonl"])
    trainer = _train(
        tmp_path, callback, eval_dataset=Tokens(seed=5, n=4), eval_strategy="steps", eval_steps=1
    )
    want, reports = _by_hand()
    trainer.model.train()  # the Trainer's last evaluation left it in eval mode: not ours
    assert trainer.state.global_step == STEPS
    assert _steps(callback.records) == list(range(STEPS))
    assert callback.records == want
    lines = (tmp_path / "hs.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == json.loads(json.dumps(want))
    # the clipping: the Trainer's setting back, and what was clipped reported
    assert trainer.args.max_grad_norm == MAX_NORM
    assert [s for s, _ in callback.clip_reports] == list(range(STEPS))
    assert [r for _, r in callback.clip_reports] == reports
    assert any(r.was_clipped for r in reports) and all(r.max_norm == MAX_NORM for r in reports)
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert logged == pytest.approx([r.total_norm for r in reports], rel=1e-5)  # the Trainer's
    model = trainer.model
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_every_other_step(tmp_path: Path) -> None:
    callback = HookscopeCallback(every=2)
    _train(tmp_path, callback)
    want, reports = _by_hand(every=2)
    assert _steps(callback.records) == [0, 2]
    assert callback.records == want
    assert [r for _, r in callback.clip_reports] == reports


def test_after_a_failure_close_takes_the_hooks_off(tmp_path: Path) -> None:
    """The Trainer tells callbacks nothing when training fails: the callback as a context
    manager (or ``close()``) takes the hooks off and gives the clipping back."""

    class Broken(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            if i == 7:
                raise RuntimeError("a broken sample")
            return Tokens()[i]

    model = _gpt2()
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path),
        per_device_train_batch_size=BATCH,
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        train_sampling_strategy="sequential",
        save_strategy="no",
    )
    with HookscopeCallback(every=1, nonfinite=True) as callback:
        trainer = transformers.Trainer(
            model=model, args=args, train_dataset=Broken(), callbacks=[callback]
        )
        with pytest.raises(RuntimeError, match="a broken sample"):
            trainer.train()
        assert args.max_grad_norm == 0.0  # the callback's while training runs
    assert args.max_grad_norm == 1.0
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    done = trainer.state.global_step  # the steps before the loader raised
    assert done >= 1 and _steps(callback.records) == list(range(done))


def test_report_to_trackers_hold_the_records_and_the_attention_maps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    wandb = pytest.importorskip("wandb")
    wandb.teardown()  # a W&B setup an earlier test left would ignore this test's WANDB_* below
    request.addfinalizer(wandb.teardown)  # W&B's service process: none left behind
    pytest.importorskip("mlflow")
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    store = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store)
    monkeypatch.setenv("TENSORBOARD_LOGGING_DIR", str(tmp_path / "tb"))
    prompt = Tokens(seed=7, n=2).ids
    maps = Maps(prompt, layer="transformer.h.1.attn", method="attention", cmap="viridis")
    callback = HookscopeCallback(every=2, histograms=True, maps=maps)
    trainer = _train(
        tmp_path, callback, report_to=["wandb", "mlflow", "tensorboard"], num_train_epochs=2
    )
    import mlflow

    wandb.finish()
    records = callback.records
    steps = list(range(0, 2 * STEPS, 2))
    assert _steps(records) == steps
    want = {r["step"]: r["value"] for r in records if r["layer"] == "grad_norm"}
    assert sorted(want) == steps
    # W&B: the run the Trainer's WandbCallback started
    rows = [
        r for r in wandb_reader.history(wandb_reader.run_dir(tmp_path)) if "hookscope/step" in r
    ]
    got = {
        r["hookscope/step"]: r["hookscope/grad_norm"] for r in rows if "hookscope/grad_norm" in r
    }
    assert got == pytest.approx(want)
    assert any(k.startswith("hookscope/transformer.h.0.mlp.c_fc/parameter.") for k in rows[0])
    pictures = [r for r in rows if any(k.startswith("hookscope/maps/") for k in r)]
    assert [r["hookscope/step"] for r in pictures] == [STEPS, 2 * STEPS]
    # MLflow: the run the Trainer's MLflowCallback started (and ended)
    client = MlflowClient(tracking_uri=store)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()])
    history = client.get_metric_history(run.info.run_id, "hookscope/grad_norm")
    assert {m.step: m.value for m in history} == pytest.approx(want)
    assert "train_loss" in run.data.metrics  # the Trainer's own numbers are there too
    assert mlflow.active_run() is None
    # TensorBoard: a writer of the callback's in the Trainer's log folder
    events = EventAccumulator(str(tmp_path / "tb" / "hookscope"), size_guidance={"images": 0})
    events.Reload()
    assert [s.step for s in events.Scalars("hookscope/grad_norm")] == steps
    assert events.Tags()["images"] == ["hookscope/maps/attention/transformer.h.1.attn"]
    # the maps: the heads' mean of the trained model's attention, as transformers' eager
    # attention computes it (output_attentions), drawn with hs.overlay
    drawn = callback.images["maps/attention/transformer.h.1.attn"]
    scale = math.ceil(96 / LENGTH)
    assert drawn.shape == (LENGTH * scale, 2 * LENGTH * scale + 2, 3)
    eager = transformers.AutoModelForCausalLM.from_config(
        trainer.model.config, attn_implementation="eager"
    )
    eager.load_state_dict(trainer.model.state_dict())
    with torch.no_grad():
        attention = eager.eval()(prompt, output_attentions=True).attentions[1].mean(1)
    black = torch.zeros(LENGTH, LENGTH, 3, dtype=torch.uint8)
    for i, left in enumerate((0, LENGTH * scale + 2)):
        tile = hs.overlay(black, attention[i], cmap="viridis", alpha=1.0)
        tile = tile.repeat_interleave(scale, 0).repeat_interleave(scale, 1).int()
        got_tile = torch.from_numpy(drawn[:, left : left + LENGTH * scale]).int()
        assert (got_tile - tile).abs().max() <= 1
