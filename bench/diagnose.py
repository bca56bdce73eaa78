"""Diagnose capability: a training step (forward, loss, backward, optimizer step) with
``hs.nonfinite`` ÷ the same step without, beside ``torch.autograd.detect_anomaly``; and
``hs.Monitor`` logging every 10 steps ÷ plain training, beside TensorBoard histograms of every
parameter and gradient written by hand every 10 steps.

Monitor's cost per 10 steps is one logging step plus nine quiet ones: both kinds are timed
as variants of their own (a quiet step has the hooks on, returning at once) and combined as
``(logging + 9 quiet) / (10 plain)`` from their medians; likewise the hand-written baseline.
"""

from __future__ import annotations

import contextlib
import importlib
import tempfile
import warnings
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F

import _common as common
import capture
from _common import DASH, SETTINGS, Config, Job, Plan, Ratio, Target, Variant

Result = dict[str, Any]
TITLES = {"resnet50": "ResNet-50", "gpt2": "GPT-2"}
BUDGETS = {"resnet50": 120, "gpt2": 120}  # seconds of rounds per timing process
LABELS = {
    "plain": "one training step",
    "nonfinite": "the step inside `with hs.nonfinite(model)`",
    "anomaly": "the step inside `torch.autograd.detect_anomaly()`",
    "monitor_log": "hs.Monitor(every=10, a SummaryWriter as sink): a logging step",
    "monitor_quiet": "hs.Monitor(every=10): a step between logs (hooks on)",
    "hand_log": "plain step + add_histogram of every parameter and gradient",
}


def _trainer(case: capture.Case) -> tuple[Any, Any, Callable[[], torch.Tensor]]:
    """(model in training mode, an SGD optimizer, the loss of one batch)."""
    model = case.model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    x = case.args[0]
    if case.name == "resnet50":
        labels = torch.randint(0, 1000, (len(x),), generator=torch.Generator().manual_seed(0))
        return model, opt, lambda: F.cross_entropy(model(x).logits, labels)
    return model, opt, lambda: model(x, labels=x, **case.kwargs).loss


def _variants(case: capture.Case, logdir: str) -> tuple[list[Variant], list[Result]]:
    from torch.utils.tensorboard import SummaryWriter

    import hookscope as hs

    model, opt, loss = _trainer(case)
    checks: list[Result] = []
    writer, ours = SummaryWriter(log_dir=f"{logdir}/hand"), SummaryWriter(log_dir=f"{logdir}/hs")

    def step(between: Callable[[], None] | None = None) -> None:
        loss().backward()
        if between is not None:
            between()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def nonfinite() -> None:
        with hs.nonfinite(model) as report:
            step()
        checks.append({"ok": report.ok and report.forwards == report.backwards == 1})

    def anomaly() -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with torch.autograd.detect_anomaly():
                step()

    def monitor(logging: bool) -> Callable[[], None]:
        def run() -> None:
            with hs.Monitor(model, every=10, sinks=[ours]) as mon:
                mon.count = 0 if logging else 1  # step 0 logs, step 1 does not
                step()
                mon.step()
            if logging:
                checks.append({"ok": len(mon.records()) > 0})

        return run

    def histograms() -> None:
        for name, p in model.named_parameters():
            writer.add_histogram(f"{name}/value", p, 0)
            if p.grad is not None:
                writer.add_histogram(f"{name}/grad", p.grad, 0)
        writer.flush()

    fns = {
        "plain": step, "nonfinite": nonfinite, "anomaly": anomaly,
        "monitor_log": monitor(True), "monitor_quiet": monitor(False),
        "hand_log": lambda: step(histograms),
    }  # fmt: skip
    return [Variant(k, LABELS[k], fn) for k, fn in fns.items()], checks


def _count(case: capture.Case, hs: Any) -> Result:
    """Operators dispatched by one training step, plain and inside each tool (exact). The
    Monitor's are those it dispatches on a GPU: on the CPU it takes six more a tensor, each
    cheaper than the GPU's one (``few_operators`` in ``diagnose/_stats.py``)."""
    stats = importlib.import_module(f"{hs.__name__}.diagnose._stats")
    with contextlib.ExitStack() as stack:
        if hasattr(stats, "few_operators"):  # a baseline from before it has the one path
            stack.enter_context(mock.patch.object(stats, "few_operators", return_value=True))
        return _count_steps(case, hs)


def _count_steps(case: capture.Case, hs: Any) -> Result:
    model, opt, loss = _trainer(case)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # warm-up: lazy state (optimizer buffers) out of the counts
    out: Result = {"plain": common.count_ops(step)}
    out["calls"] = sum(1 for m in model.modules())
    with hs.nonfinite(model):
        step()
        out["nonfinite"] = common.count_ops(step)
    with hs.Monitor(model, every=2) as mon:
        chosen = getattr(mon, "layers_watched", None) or mon.layers
        out["layers"] = len(chosen)
        out["monitor_log"] = common.count_ops(lambda: (step(), mon.step()))
        out["monitor_quiet"] = common.count_ops(lambda: (step(), mon.step()))
    half = list(chosen)[: len(chosen) // 2]  # the cost of a layer: the slope between the two
    with hs.Monitor(model, half, every=2) as mon:
        out["half_layers"] = len(half)
        out["monitor_half"] = common.count_ops(lambda: (step(), mon.step()))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with torch.autograd.detect_anomaly():
            out["anomaly"] = common.count_ops(step)
    return out


def _counts(spec: Result) -> Result:
    import hookscope as hs

    case = capture.build_case(spec["model"], spec["quick"])
    result: Result = {**spec, "case": case.description, "hs": _count(case, hs)}
    baseline, error = capture._import_baseline(spec.get("baseline"))
    if baseline is not None:
        result["baseline"] = _count(capture.build_case(spec["model"], spec["quick"]), baseline)
    result["baseline_error"] = error
    return result


def work(spec: Result) -> Result:
    common.set_threads()
    warnings.simplefilter("ignore")  # transformers' warnings are not results
    if spec["kind"] == "ops":
        return _counts(spec)
    case = capture.build_case(spec["model"], spec["quick"])
    with tempfile.TemporaryDirectory() as logdir:
        variants, checks = _variants(case, logdir)
        samples, noise = common.run_rounds(variants, Plan(**spec["plan"]), {})
    return {**spec, "case": case.description, "samples": samples, "noise": noise,
            "checks_ok": all(c["ok"] for c in checks) and bool(checks)}  # fmt: skip


def jobs(cfg: Config) -> list[Job]:
    counts = [
        Job("diagnose", f"ops_{m}", {"kind": "ops", "model": m, "quick": cfg.quick,
                                     "baseline": cfg.baseline}, "tuned")
        for m in TITLES
    ]  # fmt: skip
    return counts + common.timing_jobs("diagnose", cfg, {m: BUDGETS[m] for m in TITLES})


def _per10(samples: list[Result], log: str, quiet: str | None) -> Ratio | None:
    """(1 logging + 9 quiet steps) / 10 plain steps, per round."""
    plain, a = common.per_round(samples, "plain"), common.per_round(samples, log)
    b = common.per_round(samples, quiet) if quiet else plain
    both = {r: (a[r] + 9 * b[r]) / 10 for r in set(a) & set(b)}
    return common.ratio(both, plain)


def _op_rows(counts: dict[str, Result]) -> tuple[list[Target], list[list[str]]]:
    """Operators added per step, against the targets: hs.nonfinite at most 10 plus one per 10
    module calls, a Monitor logging step at most 10 per watched layer, its quiet steps none."""
    targets, rows = [], []
    for model, run in counts.items():
        title = TITLES[model]
        for who in ("hs", "baseline"):
            c = run.get(who)
            if not c:
                continue
            extra = {k: c[k] - c["plain"] for k in ("nonfinite", "monitor_log", "monitor_quiet",
                                                     "anomaly")}  # fmt: skip
            name = "this version" if who == "hs" else "the baseline revision"
            per_layer = (c["monitor_log"] - c["monitor_half"]) / (c["layers"] - c["half_layers"])
            fixed = extra["monitor_log"] - per_layer * c["layers"]
            rows.append([f"{title}: {name}", f"{c['plain']:,}", f"{extra['nonfinite']:+,}",
                         f"{extra['monitor_log']:+,} = {per_layer:.1f} a layer x {c['layers']} "
                         f"+ {fixed:.0f}", f"{extra['monitor_quiet']:+,}",
                         f"{extra['anomaly']:+,}"])  # fmt: skip
            if who == "hs":
                budget = 10 + c["calls"] / 10
                targets.append(
                    Target(
                        f"operators hs.nonfinite adds ÷ (10 + module calls / 10 = {budget:.0f})",
                        title,
                        {"count": _exact(extra["nonfinite"] / budget)},
                        1.0,
                    )
                )
                targets.append(
                    Target(
                        "operators a Monitor logging step adds per watched layer ÷ 10",
                        title,
                        {"count": _exact(per_layer / 10)},
                        1.0,
                    )
                )
    return targets, rows


OP_HEADER = ["model", "plain step", "hs.nonfinite", "Monitor logging step",
             "Monitor other step", "detect_anomaly"]  # fmt: skip


def _exact(value: float) -> Ratio:
    """A count's ratio: no spread (counts are exact)."""
    return Ratio(value, value, value, 1)


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    counts = {r["model"]: r for r in results if r.get("kind") == "ops"}
    results = [r for r in results if r.get("kind") != "ops"]
    runs = {r["model"]: r for r in results}
    targets, op_rows = _op_rows(counts)
    rows = []
    for model, title in TITLES.items():
        if model not in runs:
            continue
        s = runs[model]["samples"]
        cells = {SETTINGS["tuned"]: common.paired(s, "nonfinite", "plain")}
        targets.append(Target("training step with hs.nonfinite ÷ without", title, cells, 1.05))
        cells = {SETTINGS["tuned"]: _per10(s, "monitor_log", "monitor_quiet")}
        targets.append(
            Target("training with hs.Monitor every 10 steps ÷ without", title, cells, 1.10)
        )
        for key, label in LABELS.items():
            ms, r = common.median(s, key), common.paired(s, key, "plain")
            rows.append([f"{title}: `{key}`", label, f"{ms * 1e3:.0f}" if ms else DASH,
                         r.cell() if r else DASH])  # fmt: skip
        for key, quiet, label in (("monitor_log", "monitor_quiet", "hs.Monitor"),
                                  ("hand_log", None, "hand-written histograms")):  # fmt: skip
            r = _per10(s, key, quiet)
            rows.append([f"{title}: {label}, per 10 steps", "(1 logging + 9 other) ÷ 10 plain",
                         DASH, r.cell() if r else DASH])  # fmt: skip
    lines = [
        "## Diagnose: training-step overhead",
        "",
        "Operators dispatched per training step (forward, loss, backward, SGD step; counted "
        "with a TorchDispatchMode on the CPU: exact, and what a GPU pays a launch and a Python "
        "dispatch for). The targets: hs.nonfinite adds at most 10 plus one per 10 module calls; "
        "a Monitor logging step at most 10 per watched layer (the slope between watching every "
        "default layer and half of them; the rest is per step); its other steps none. The "
        "Monitor's statistics are counted as a GPU computes them: on the CPU, where an "
        "operator costs its arithmetic rather than a launch, it takes six more a tensor, "
        "together a third of the time of var_mean and count_nonzero there.",
        "",
        *common.table(OP_HEADER, op_rows),
        "One malloc-tuned process per model runs every variant once per round, shuffled; ÷ plain "
        f"= median [q1{DASH}q3] of same-round ratios. A step is forward, loss (cross-entropy on "
        "random labels / the LM loss), backward and an SGD step, in training mode. "
        "detect_anomaly checks backward only; hs.nonfinite checks forward and backward.",
        "",
        *common.table(["variant", "what is timed", "median ms", "÷ plain"], rows),
    ]
    for model, run in runs.items():
        (lo, hi), n = run["noise"]["loadavg"], len(common.per_round(run["samples"], "plain"))
        ok = "all ok" if run["checks_ok"] else "**FAILED**"
        lines.append(
            f"* {TITLES[model]}: {run['case']}; {n} measured rounds in "
            f"{run['noise']['rounds_s']:.0f} s, load average {lo:.1f}{DASH}{hi:.1f}; checks "
            f"(nonfinite saw 1 forward and 1 backward and found nothing; Monitor logged): {ok}."
        )
    lines.append(
        "* Why the misses (on this CPU): hs.nonfinite takes one L2 norm of every floating "
        "tensor each module call takes and returns and of each output's gradient (ResNet-50 "
        "makes about 300 module calls a step), a pass over each: 10 to 21 % here, against "
        "detect_anomaly's 33 to 49 % (the run before, on a loaded machine, read higher for "
        "both). A Monitor logging step takes statistics of every watched layer's activation "
        "and output gradient and of every parameter and its gradient, and counts TensorBoard "
        "histograms of the parameters and gradients: on the CPU, putting each value in one of "
        "TensorBoard's 1,500 exponential buckets (torch.bucketize) is the largest part (2.9 of "
        "GPT-2's 7.5 s), the statistics next (ResNet-50's: 2.5 s in a profile before the CPU "
        "took its own operators, 1.4 s after). add_histogram by hand draws the histograms "
        "only. On a GPU both tools are the few operators counted above."
    )
    return targets, [*lines, ""]
