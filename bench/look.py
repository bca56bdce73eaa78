"""Look capability: ``hs.summary`` (one forward with operator-level FLOPs) against a plain
forward and peers (torchinfo, ``FlopCounterMode``, fvcore, thop).

Cases: HF ResNet-50 and GPT-2 small as in capture.py, and ``LlamaForCausalLM(LlamaConfig())``
(7B) built on ``meta``. Jobs: one timing process per case (same-round ratios, then each tool's
FLOPs against an analytic count, and the Python dispatch calls a summary makes) and one fresh
process that only summarises the meta Llama (its time and peak RSS). Method: bench/README.md.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib
import inspect
import resource
import statistics
import sys
import time
import warnings
from typing import Any

import torch
from torch import nn

import _common as common
import capture
from _common import DASH, SETTINGS, Config, Job, Plan, Ratio, Target, Variant

Result = dict[str, Any]
TITLES = {
    "resnet50": "ResNet-50",
    "gpt2": "GPT-2",
    "llama": "Llama-7B (meta)",
    "resnet50_host": "ResNet-50, 1x64² (host-bound)",
    "gpt2_host": "GPT-2, 1x16 (host-bound)",
}
# On a GPU the forward's kernels run while Python launches the next ones: what a summary adds
# is host time. These cases keep the models and shrink the inputs so that, on the CPU too,
# the forward costs little beside its Python: the nearest this machine gets to a GPU's host.
HOST_BOUND = ("resnet50_host", "gpt2_host")
PEERS = ("torchinfo", "fvcore", "thop")
BUDGETS = {"resnet50": 60, "gpt2": 90, "llama": 20, "resnet50_host": 30, "gpt2_host": 30}
LABELS = {
    "plain": "model(x) under no_grad",
    "hs": "hs.summary(model, x): shapes, params, FLOPs per call",
    "torchinfo": "torchinfo.summary(model, input_data=x, verbose=0)",
    "flopcounter": "with no_grad(), FlopCounterMode(display=False): model(x)",
    "bl": "the baseline revision's hs.summary (--baseline)",
}


# -- cases -------------------------------------------------------------------------------------


def build_case(name: str, quick: bool) -> capture.Case:
    if name in HOST_BOUND:
        return _host_bound(name)
    if name != "llama":
        return capture.build_case(name, quick)
    from transformers import LlamaConfig, LlamaForCausalLM

    small = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    small.update(num_attention_heads=2, num_key_value_heads=2, vocab_size=1000)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**small) if quick else LlamaConfig()).eval()
    tokens = 16 if quick else 128
    # Default use_cache: with use_cache=False and no cache, transformers looks for packed
    # sequences with .item(), which no tool can run on meta.
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    what = f"LlamaForCausalLM({'small' if quick else 'LlamaConfig()'}) on meta, ids 1x{tokens}"
    return capture.Case("llama", model, (ids,), {}, [], "", "", 0, what)


def _host_bound(name: str) -> capture.Case:
    if name == "resnet50_host":
        case = capture.build_case("resnet50", True, full_width=True)  # input 1x3x64x64
        return dataclasses.replace(case, name=name)
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).eval()
    ids = torch.randint(0, model.config.vocab_size, (1, 16))
    what = "GPT2LMHeadModel(GPT-2 small), ids 1x16"
    return capture.Case(name, model, (ids,), {"use_cache": False}, [], "", "", 0, what)


def analytic_flops(config: Any, batch: int, tokens: int) -> tuple[int, int]:
    """(FLOPs, of which attention): 2 x every matmul weight (LM head included) x tokens, plus
    Q·Kᵀ and A·V over the full T x T, 4·B·T²·d·L. GPT-2 or Llama configs."""
    h, layers = config.hidden_size, config.num_hidden_layers
    if config.model_type == "gpt2":
        q = kv = h
        mlp = 2 * h * (config.n_inner or 4 * h)
    else:
        heads = config.num_attention_heads
        q = heads * (getattr(config, "head_dim", None) or h // heads)
        kv = config.num_key_value_heads * q // heads
        mlp = 3 * h * config.intermediate_size
    weights = layers * (2 * h * q + 2 * h * kv + mlp) + h * config.vocab_size
    attention = 4 * batch * tokens**2 * q * layers
    return 2 * weights * batch * tokens + attention, attention


# -- the tools ---------------------------------------------------------------------------------


class _Positional(nn.Module):
    """The model's first output tensor: fvcore's JIT trace and thop take positional tensors
    only, and HF models return dicts."""

    def __init__(self, model: nn.Module, kwargs: dict[str, Any]) -> None:
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, *args: Any) -> torch.Tensor:
        return common.tensors(self.model(*args, **self.kwargs))[0]


def _hs(case: capture.Case) -> Any:
    import hookscope as hs

    return hs.summary(case.model, case.args, forward_kwargs=case.kwargs)


def _torchinfo(case: capture.Case) -> Any:
    import torchinfo

    return torchinfo.summary(case.model, input_data=case.args[0], verbose=0, **case.kwargs)


def _flopcounter(case: capture.Case) -> Any:
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        case.forward()
    return counter


def _fvcore(case: capture.Case) -> tuple[int, str]:
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(_Positional(case.model, case.kwargs), case.args)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    total = analysis.total()  # before unsupported_ops(), which needs the analysis run
    skipped = analysis.unsupported_ops()
    sdpa = skipped.get("aten::scaled_dot_product_attention", 0)
    return 2 * total, f"{len(skipped)} op kinds unsupported (0), SDPA x{sdpa} among them"


def _thop(case: capture.Case) -> tuple[int, str]:
    import thop

    # thop leaves total_ops / total_params buffers on every module: count a copy
    macs, _ = thop.profile(
        _Positional(copy.deepcopy(case.model), case.kwargs), case.args, verbose=False
    )
    return 2 * int(macs), "per-module rules, on a deep copy"


def count_flops(case: capture.Case) -> dict[str, Result]:
    """Each tool's FLOPs (2 per multiply-add) and how it got them; a failure is a result."""
    hs_sum, counter = _hs(case), _flopcounter(case).get_flop_counts()["Global"]
    top = ", ".join(f"{k} x{n}" for k, n in list(hs_sum.uncounted.items())[:3])
    tools = {
        "hookscope": lambda: (hs_sum.total_flops, f"total_flops; uncounted: {top}, ..."),
        "torchinfo": lambda: (2 * _torchinfo(case).total_mult_adds, "2 x total_mult_adds"),
        "fvcore": lambda: _fvcore(case),
        "thop": lambda: _thop(case),
        "flopcounter": lambda: (
            sum(counter.values()),
            f"ops counted: {', '.join(map(str, counter))}",
        ),
    }
    out = {}
    for tool, fn in tools.items():
        try:
            flops, note = fn()
            out[tool] = {"flops": int(flops), "note": note}
        except Exception as e:
            out[tool] = {"flops": None, "note": f"fails: {type(e).__name__}: {str(e)[:140]}"}
    return out


def checks(case: capture.Case, flops: dict[str, Result], analytic: int | None) -> list[Result]:
    """Untimed: parameters deduplicated, FLOPs near the analytic count, no hook left behind."""
    params, unique = _hs(case).total_params, sum(p.numel() for p in case.model.parameters())
    rows = [("hs total_params = unique parameters", params, params == unique)]
    if analytic and flops["hookscope"]["flops"]:
        dev = flops["hookscope"]["flops"] / analytic - 1
        rows.append(("hs FLOPs within 1% of analytic", f"{dev:+.4%}", abs(dev) <= 0.01))
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in case.model.modules())
    rows.append(("hooks left on the model", hooks, hooks == 0))
    return [{"what": w, "value": str(v), "ok": ok} for w, v, ok in rows]


def dispatch_calls(case: capture.Case) -> Result:
    """Python calls per summary (untimed, CPU): the operators of one plain forward (what a
    dispatch mode watching every operator calls Python for), and the ``__torch_dispatch__``
    calls of any mode during ``hs.summary`` (first and second call in this process)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            Ops.n += 1
            return func(*args, **(kw or {}))

    with torch.no_grad(), Ops():
        case.forward()
    seen = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "__torch_dispatch__":
            seen[0] += 1

    calls, rows = [], 0
    for _ in range(2):
        seen[0] = 0
        sys.setprofile(profile)
        try:
            rows = len(_hs(case).rows)
        finally:
            sys.setprofile(None)
        calls.append(seen[0])
    return {"ops": Ops.n, "hs_calls": calls, "module_calls": rows}


# -- workers -----------------------------------------------------------------------------------


def _baseline(path: str | None) -> Any:
    """``hs.summary`` of the revision under ``--baseline``, called as that revision takes it
    (before ``forward_kwargs=``: the forward's keywords as its own)."""
    if not path:
        return None
    if path not in sys.path:
        sys.path.insert(0, path)
    bl = importlib.import_module("hookscope_baseline")
    new = "forward_kwargs" in inspect.signature(bl.summary).parameters

    def run(case: capture.Case) -> Any:
        if new:
            return bl.summary(case.model, case.args, forward_kwargs=case.kwargs)
        return bl.summary(case.model, *case.args, **case.kwargs)

    return run


def _timing(spec: Result) -> Result:
    case, skipped = build_case(spec["model"], spec["quick"]), {}
    variants = [Variant("plain", LABELS["plain"], case.plain)]
    tools = {"hs": _hs, "torchinfo": _torchinfo, "flopcounter": _flopcounter}
    try:
        if (baseline := _baseline(spec.get("baseline"))) is not None:
            tools["bl"] = baseline
    except Exception as e:
        skipped["bl"] = f"{type(e).__name__}: {str(e)[:140]}"
    for key, fn in tools.items():
        try:
            fn(case)  # a peer that is not installed or cannot run here is left out
            variants.append(Variant(key, LABELS[key], functools.partial(fn, case)))
        except Exception as e:
            skipped[key] = f"{type(e).__name__}: {str(e)[:140]}"
    samples, noise = common.run_rounds(variants, Plan(**spec["plan"]), {})
    analytic = attention = None
    if not spec["model"].startswith("resnet50"):
        analytic, attention = analytic_flops(case.model.config, *case.args[0].shape)
    flops, params = count_flops(case), sum(p.numel() for p in case.model.parameters())
    dispatch = dispatch_calls(case)
    return {
        **spec,
        "case": f"{case.description}; {params / 1e6:.1f} M parameters",
        **{"samples": samples, "noise": noise, "skipped": skipped, "flops": flops},
        **{"analytic": analytic, "attention": attention},
        "checks": checks(case, flops, analytic),
        "dispatch": dispatch,
        "peer_versions": {p: common._version(p) for p in PEERS},
    }


def _rss(spec: Result) -> Result:
    """Build the meta Llama and summarise it, nothing else: the process's peak RSS."""
    import hookscope as hs

    case = build_case("llama", spec["quick"])
    shape, before, times = list(case.args[0].shape), common._rss_kib()["VmRSS"] / 1024, []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        hs.summary(case.model, input_size=shape, dtypes=[torch.long])
        times.append(time.perf_counter() - t0)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {**spec, "before_mib": before, "peak_mib": peak, "times_s": times, "shape": shape}


def work(spec: Result) -> Result:
    common.set_threads()
    warnings.simplefilter("ignore")  # transformers' and fvcore's warnings are not results
    return {"timing": _timing, "rss": _rss}[spec["kind"]](spec)


def jobs(cfg: Config) -> list[Job]:
    cases = [m for m in TITLES if not (cfg.quick and m in HOST_BOUND)]  # quick: small already
    out = common.timing_jobs("look", cfg, {m: BUDGETS[m] for m in cases})
    for job in out:
        job.spec["baseline"] = cfg.baseline
    spec = {"kind": "rss", "quick": cfg.quick, "repeats": 2 if cfg.quick else 5}
    return [*out, Job("look", "rss_llama", spec, "defaults")]


# -- report ------------------------------------------------------------------------------------


def _targets(timing: dict[str, Result], rss: Result | None) -> list[Target]:
    out, what = [], "summary with FLOPs: hs.summary ÷ plain forward"
    for model in ("resnet50", "gpt2", *HOST_BOUND):
        if model in timing:
            cell = common.paired(timing[model]["samples"], "hs", "plain")
            out.append(Target(what, TITLES[model], {SETTINGS["tuned"]: cell}, 1.15))
            peer = common.paired(timing[model]["samples"], "hs", "torchinfo")
            if peer is not None:  # the GPU issue's other bound: no slower than torchinfo
                cells = {SETTINGS["tuned"]: peer}
                out.append(Target("hs.summary ÷ torchinfo.summary", TITLES[model], cells, 1.0))
            before = common.paired(timing[model]["samples"], "hs", "bl")
            if before is not None:
                cells = {SETTINGS["tuned"]: before}
                out.append(Target("hs.summary ÷ the baseline's", TITLES[model], cells, 1.0))
    values = {}  # DESIGN.md: a 7B Llama on meta in under 5 s and 1 GB, FLOPs within 1%
    if rss:
        values["hs.summary, first call in a fresh process, s"] = (rss["times_s"][0], 5.0)
        values["that process's peak RSS (ru_maxrss), GB"] = (rss["peak_mib"] * 2**20 / 1e9, 1.0)
    run = timing.get("llama", {})
    if run.get("analytic") and (got := run["flops"]["hookscope"]["flops"]):
        values["hs FLOPs, |÷ analytic - 1| in %"] = (abs(got / run["analytic"] - 1) * 100, 1.0)
    for what, (x, limit) in values.items():
        cell = {"other": Ratio(x, x, x, 1)}
        out.append(Target(f"meta Llama: {what}", "Llama-7B, 1x128", cell, limit))
    return out


def _timing_section(timing: dict[str, Result], rss: Result | None) -> list[str]:
    lines = [
        "## Look: summary",
        "",
        "One malloc-tuned process per model runs every variant once per round, shuffled; ÷ plain "
        f"= median [q1{DASH}q3] of same-round ratios. hs.summary runs one forward under no_grad "
        "in eval mode with module hooks and a dispatch-mode FLOP counter, which is off during "
        "leaf calls whose operators it already learned.",
        "",
    ]
    rows = []
    for model, run in timing.items():
        for key, label in LABELS.items():
            ms, r = common.median(run["samples"], key), common.paired(run["samples"], key, "plain")
            if ms is None and key not in run["skipped"]:
                continue  # the baseline, without --baseline
            label = label if ms else f"not run: {run['skipped'].get(key, '?')}"
            ms_cell = f"{ms * 1e3:.0f}" if ms else DASH
            rows.append([f"{TITLES[model]}: `{key}`", label, ms_cell, r.cell() if r else DASH])
    lines += common.table(["variant", "what is timed", "median ms", "÷ plain"], rows)
    for model, run in timing.items():
        n, (lo, hi) = len(common.per_round(run["samples"], "plain")), run["noise"]["loadavg"]
        lines.append(
            f"* {TITLES[model]}: {run['case']}; {n} measured rounds (+1 warm-up) in "
            f"{run['noise']['rounds_s']:.0f} s, load average {lo:.1f}{DASH}{hi:.1f}."
        )
    lines += _dispatch_lines(timing)
    if rss:
        t, call = rss["times_s"], f"input_size={tuple(rss['shape'])}, dtypes=[torch.long]"
        lines.append(
            "* Meta Llama alone in a fresh process (glibc defaults): builds the model under "
            f"`torch.device('meta')`, then `hs.summary(model, {call})` {len(t)} times: first "
            f"{t[0]:.2f} s, then median {statistics.median(t[1:] or t):.2f} s. RSS "
            f"{rss['before_mib']:.0f} MiB before the first summary (torch, transformers, the "
            f"meta model), peak {rss['peak_mib']:.0f} MiB."
        )
    return [*lines, ""]


def _dispatch_lines(timing: dict[str, Result]) -> list[str]:
    """Python dispatch calls per summary against the operators of one forward (CPU)."""
    rows = []
    for model, run in timing.items():
        if "dispatch" in run:
            d = run["dispatch"]
            first, second = d["hs_calls"]
            share = f"{first / d['ops']:.2f}" if d["ops"] else DASH
            modules = str(d.get("module_calls", DASH))
            rows.append([TITLES[model], modules, str(d["ops"]), str(first), str(second), share])
    if not rows:
        return []
    head = ["model", "module calls", "operators", "hs.summary: 1st call", "2nd call", "1st ÷ ops"]
    return [
        "",
        "Python calls made per operator (untimed, CPU): the module calls of one forward, the "
        "operators it runs (a TorchDispatchMode counting them: what a counter watching every "
        "operator calls Python for), and the `__torch_dispatch__` calls of every dispatch mode "
        "during `hs.summary` (`sys.setprofile`), in its first and second call in the process.",
        "",
        *common.table(head, rows),
        "* Why the host-bound cases miss: a summary runs Python at every module call (the "
        "core session's pre- and post-hook, the row, the input and output shapes) and, for "
        "the operators of calls it has not learned (parents' own code, leaf kinds seen once or "
        "running one operator), one dispatch-mode call per operator. Where the forward itself "
        "is cheap (small inputs here; on a GPU, any forward whose kernels run while Python "
        "launches the next) that Python is the cost, as torchinfo's hooks are; where the "
        "forward computes, it disappears in it.",
    ]


def _flops_section(timing: dict[str, Result]) -> list[str]:
    versions = next(iter(timing.values()), {}).get("peer_versions", {})
    lines = [
        "## Look: FLOPs against an analytic count",
        "",
        "Analytic: 2 x (every matmul weight, LM head included) x tokens + 4·B·T²·d·L (Q·Kᵀ and "
        "A·V over the full T x T). Every tool as FLOPs = 2 x multiply-adds: torchinfo's "
        "mult-adds and fvcore's and thop's MACs are doubled. fvcore and thop get the model "
        "through a wrapper that takes the ids positionally and returns the logits. torchinfo "
        "derives mult-adds from parameter counts x output sizes; thop has rules for torch "
        "layers only (not HF's Conv1D in GPT-2, nor attention); FlopCounterMode has no formula "
        "for CPU's fused SDPA kernel (0), while on meta SDPA runs as its math decomposition "
        "(bmm), which it counts. Untimed, after the timing rounds. Versions: "
        + ", ".join(f"{k} {v}" for k, v in versions.items()),
        "",
    ]
    rows = []
    for model, run in timing.items():
        analytic, attention = run["analytic"], run["attention"]
        if analytic:
            attn = f"of which attention products {attention / 1e9:.2f} G"
            rows.append([f"{TITLES[model]}: analytic", attn, f"{analytic / 1e9:.2f}", "1.000"])
        for tool, got in run["flops"].items():
            n, note = got["flops"], got["note"]
            if n is not None and analytic and abs(n - analytic + attention) < 0.002 * analytic:
                note += "; = analytic without attention"
            ratio = f"{n / analytic:.3f}" if n is not None and analytic else DASH
            rows.append(
                [f"{TITLES[model]}: {tool}", note, DASH if n is None else f"{n / 1e9:.2f}", ratio]
            )
    lines += common.table(["model: tool", "how / note", "GFLOPs", "÷ analytic"], rows)
    for model, run in timing.items():
        bad = [f"**FAILED** {c['what']}: {c['value']}" for c in run["checks"] if not c["ok"]]
        lines.append(f"* checks, {TITLES[model]}: {'; '.join(bad) or 'all ok'}.")
    return [*lines, ""]


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    """The targets and this capability's sections of RESULTS.md."""
    runs = {r["model"]: r for r in results if r["kind"] == "timing"}
    timing = {m: runs[m] for m in TITLES if m in runs}
    rss = next((r for r in results if r["kind"] == "rss"), None)
    return _targets(timing, rss), _timing_section(timing, rss) + _flops_section(timing)
