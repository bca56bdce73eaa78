"""Diagnose: a training step in ``hs.nonfinite`` beside ``detect_anomaly``, ``hs.Monitor`` beside
hand-written histograms, and the operators each adds. Method: bench/README.md."""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import _harness as h
import capture
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Diagnose: hs.nonfinite and hs.Monitor in training, beside detect_anomaly and histograms"
LABELS = {
    "plain": "one training step",
    "nonfinite": "the step inside `with hs.nonfinite(model)`",
    "anomaly": "the step inside `torch.autograd.detect_anomaly()`",
    "monitor_log": "hs.Monitor(every=10, a SummaryWriter as sink): a logging step",
    "monitor_quiet": "hs.Monitor(every=10): a step between logs (hooks on)",
    "hand_log": "plain step + add_histogram of every parameter and gradient",
    "fsdp_plain": "an FSDP2 step, 2 gloo ranks: 4 x (Linear(512, 512), ReLU), batch 64 a rank",
    "fsdp_log": "hs.Monitor(every=10, optimizer=): a logging step (its all-reduce not waited)",
    "fsdp_quiet": "hs.Monitor(every=10, optimizer=): a step between logs",
}
#: Per 10 steps: (1 logging + 9 other) / 10, per round, from these variants' samples.
PER10 = {"monitor_per10": ("monitor_log", "monitor_quiet", "hs.Monitor, per 10 steps")}
PER10["hand_per10"] = ("hand_log", "plain", "hand-written histograms, per 10 steps")
PER10["fsdp_per10"] = ("fsdp_log", "fsdp_quiet", "hs.Monitor under FSDP2, per 10 steps")
SHARDED = "diagnose/fsdp2_mlp"  # the 2 CPU ranks; DESIGN.md's 1.1x per 10 steps
NONFINITE_OPS, MONITOR_OPS = "hs.nonfinite: added ÷ budget", "Monitor: per watched layer ÷ 10"
TARGETS = [
    Target(f"diagnose/{m}{ops}", a, b, limit, what)
    for m in capture.MODELS
    for ops, a, b, limit, what in (
        ("", "nonfinite", "plain", 1.05, "training step in hs.nonfinite ÷ without"),
        ("", "monitor_per10", "plain", 1.10, "training with hs.Monitor every 10 steps ÷ without"),
        ("/ops", NONFINITE_OPS, None, 1.0, "operators hs.nonfinite adds ÷ (10 + calls / 10)"),
        ("/ops", MONITOR_OPS, None, 1.0, "operators a Monitor logging step adds per layer ÷ 10"),
    )
] + [
    Target(SHARDED, "fsdp_per10", "fsdp_plain", 1.10, "FSDP2 with hs.Monitor every 10 ÷ without"),
    Target(SHARDED, "fsdp_quiet", "fsdp_plain", 1.05, "FSDP2 step between logs ÷ without"),
]


def _trainer(case: capture.Case) -> tuple[Any, Any, Callable[[], None]]:
    """(model in training mode, an SGD optimizer, one training step)."""
    model, x = case.model.train(), case.args[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    labels = torch.randint(0, 1000, (len(x),), generator=torch.Generator().manual_seed(0))

    def step(between: Callable[[], None] | None = None) -> None:
        if case.name == "resnet50":
            F.cross_entropy(model(x).logits, labels).backward()
        else:
            model(x, labels=x, **case.kwargs).loss.backward()
        if between is not None:
            between()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return model, opt, step


def _variants(case: capture.Case, logdir: str) -> list[Variant]:
    from torch.utils.tensorboard import SummaryWriter

    model, _, step = _trainer(case)
    writer, ours = SummaryWriter(log_dir=f"{logdir}/hand"), SummaryWriter(log_dir=f"{logdir}/hs")

    def monitor(count: int) -> None:  # step 0 of every=10 logs, step 1 does not
        with hs.Monitor(model, every=10, sinks=[ours]) as mon:
            mon.count = count
            step()
            mon.step()

    def histograms() -> None:
        for name, p in model.named_parameters():
            writer.add_histogram(f"{name}/value", p, 0)
            if p.grad is not None:
                writer.add_histogram(f"{name}/grad", p.grad, 0)
        writer.flush()

    fns = {
        "plain": step,
        "nonfinite": h.inside(lambda: hs.nonfinite(model), step),
        "anomaly": h.inside(torch.autograd.detect_anomaly, step),
        "monitor_log": lambda: monitor(0),
        "monitor_quiet": lambda: monitor(1),
        "hand_log": lambda: step(histograms),
    }
    return [Variant(k, LABELS[k], fn) for k, fn in fns.items()]


def _count(case: capture.Case, hs: Any) -> Result:
    """Operators dispatched by one training step, plain and inside each tool (exact). The
    Monitor's are those it dispatches on a GPU: on the CPU it takes six more a tensor, each
    cheaper than the GPU's one (``few_operators`` in ``diagnose/_stats.py``)."""
    stats = importlib.import_module(f"{hs.__name__}.diagnose._stats")
    with contextlib.ExitStack() as stack:
        if hasattr(stats, "few_operators"):  # a baseline from before it has the one path
            stack.enter_context(mock.patch.object(stats, "few_operators", return_value=True))
        model, _, step = _trainer(case)
        step()  # warm-up: lazy state (optimizer buffers) out of the counts
        c = {"plain": h.count_ops(step), "calls": sum(1 for _ in model.modules())}
        with hs.nonfinite(model):
            step()
            c["nonfinite"] = h.count_ops(step)
        with hs.Monitor(model, every=2) as mon:
            chosen = list(getattr(mon, "layers_watched", None) or mon.layers)
            # a logged step's values are read when its span ends (the next forward, or reading
            # records): read them within the logged step's count
            c["log"] = h.count_ops(lambda: (step(), mon.step(), mon.records))
            c["quiet"] = h.count_ops(lambda: (step(), mon.step()))
        with hs.Monitor(model, chosen[: len(chosen) // 2], every=2) as mon:
            c["half"] = h.count_ops(lambda: (step(), mon.step(), mon.records))  # the slope
        with torch.autograd.detect_anomaly():
            c["anomaly"] = h.count_ops(step)
    per_layer = (c["log"] - c["half"]) / (len(chosen) - len(chosen) // 2)
    extra = {k: c[k] - c["plain"] for k in ("nonfinite", "log", "quiet", "anomaly")}
    return {
        "plain step": c["plain"],
        "hs.nonfinite adds": extra["nonfinite"],
        NONFINITE_OPS: extra["nonfinite"] / (10 + c["calls"] / 10),
        "Monitor logging step adds": f"{extra['log']:+,} = {per_layer:.1f} a layer x "
        f"{len(chosen)} + {extra['log'] - per_layer * len(chosen):.0f}",
        MONITOR_OPS: per_layer / 10,
        "Monitor other step adds": extra["quiet"],
        "detect_anomaly adds": extra["anomaly"],
    }


def _counts(spec: Result) -> Result:
    case = capture.build_case(spec["model"], spec["quick"])
    values = _count(case, hs)
    baseline, error = capture.import_baseline(spec.get("baseline"))
    if baseline is not None:
        counts = _count(capture.build_case(spec["model"], spec["quick"]), baseline)
        values.update({f"the baseline: {k}": v for k, v in counts.items()})
    about = f"{case.description}: operators dispatched by one training step, counted with a "
    about += "TorchDispatchMode on the CPU (the Monitor's statistics as a GPU computes them)"
    title, skipped = f"{capture.MODELS[spec['model']]}, operators", {"the baseline": error}
    case_ = f"diagnose/{spec['model']}/ops"
    return h.named({}, case_, title, about, values=values, skipped=skipped if error else {})


def _fsdp_rank(rank: int, plan: Result, folder: str) -> None:
    """One of two gloo ranks: an FSDP2 MLP alone and one watched, in the same fixed rounds on
    both ranks (they must make the same collectives); rank 0 writes the result."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    timeout = datetime.timedelta(seconds=120)  # (a rank that failed: the other errs, no hang)
    dist.init_process_group("gloo", f"file://{folder}/init", timeout, world_size=2, rank=rank)
    torch.set_num_threads(1)
    x, models = torch.randn(64, 512, generator=torch.Generator().manual_seed(rank)), []
    for _ in range(2):
        torch.manual_seed(0)
        model = nn.Sequential(*(m for _ in range(4) for m in (nn.Linear(512, 512), nn.ReLU())))
        for m in [*model[::2], model]:
            fully_shard(m)
        models.append((model, torch.optim.SGD(model.parameters(), lr=1e-4)))

    def step(model: nn.Module, opt: Any) -> None:
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    with hs.Monitor(models[1][0], every=10, optimizer=models[1][1]) as mon:
        count = lambda n: lambda: setattr(mon, "count", n)  # noqa: E731 (0: logged, 1: not)
        variants = [Variant("fsdp_plain", LABELS["fsdp_plain"], lambda: step(*models[0]))]
        for key, n in (("fsdp_log", 0), ("fsdp_quiet", 1)):
            variants.append(Variant(key, LABELS[key], lambda: step(*models[1]), before=count(n)))
        result = h.timing(variants, Plan(**{**plan, "budget_s": 0.0}), unit="fsdp_plain")
    if rank == 0:
        Path(folder, "rank0.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def work(spec: Result) -> Result:
    if spec["kind"] == "ops":
        return _counts(spec)
    if spec["kind"] == "fsdp":
        with tempfile.TemporaryDirectory() as folder:
            torch.multiprocessing.start_processes(_fsdp_rank, (spec["plan"], folder), 2)
            result = json.loads(Path(folder, "rank0.json").read_text())
        what = "fully_shard on each Linear, then the root; training mode"
        result = h.named(result, SHARDED, "FSDP2 MLP, 2 CPU ranks (gloo)", what)
    else:
        case = capture.build_case(spec["model"], spec["quick"])
        with tempfile.TemporaryDirectory() as logdir:
            result = h.timing(_variants(case, logdir), Plan(**spec["plan"]))
        title, what = capture.MODELS[spec["model"]], f"{case.description}, training mode"
        result = h.named(result, f"diagnose/{spec['model']}", title, what)
    samples = result["samples"]
    for key, (log, quiet, label) in PER10.items():
        a, b = h.per_round(samples, log), h.per_round(samples, quiet)
        if not a or not b:
            continue
        samples += [
            {"key": key, "round": r, "warmup": False, "seconds": (a[r] + 9 * b[r]) / 10}
            for r in sorted(set(a) & set(b))
        ]
        result["variants"][key] = {"label": f"{label}: (1 logging + 9 other) ÷ 10", "floor": None}
    return result


def jobs(cfg: Config) -> list[Job]:
    spec = {"kind": "ops", "quick": cfg.quick, "baseline": cfg.baseline}
    counts = [Job("diagnose", f"ops_{m}", {**spec, "model": m}) for m in capture.MODELS]
    sharded = h.timing_jobs("diagnose", cfg, {"fsdp2_mlp": 60.0}, kind="fsdp")
    return counts + h.timing_jobs("diagnose", cfg, dict.fromkeys(capture.MODELS, 120.0)) + sharded
