"""Look: ``hs.summary`` beside a plain forward, torchinfo and ``FlopCounterMode``; every tool's
FLOPs (fvcore and thop too) against an analytic count; the meta Llama alone. README.md."""

from __future__ import annotations

import copy
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

import _harness as h
import capture
import explain
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Look: hs.summary beside a plain forward, torchinfo, FlopCounterMode, fvcore and thop"
TITLES = {"resnet50": "ResNet-50", "gpt2": "GPT-2", "llama": "Llama-7B (meta)"}
TITLES["resnet50_host"] = "ResNet-50, 1x64² (host-bound)"
TITLES["gpt2_host"] = "GPT-2, 1x16 (host-bound)"
HOST_BOUND = ("resnet50_host", "gpt2_host")
BUDGETS = {"resnet50": 60, "gpt2": 90, "llama": 20, "resnet50_host": 30, "gpt2_host": 30}
LABELS = {
    "plain": "model(x) under no_grad",
    "hs": "hs.summary(model, x): shapes, params, FLOPs per call",
    "torchinfo": "torchinfo.summary(model, input_data=x, verbose=0)",
    "flopcounter": "with no_grad(), FlopCounterMode(display=False): model(x)",
    "bl": "the baseline revision's hs.summary (--baseline)",
}
LLAMA_FLOPS, FIRST, PEAK = "hs FLOPs: |÷ analytic - 1|, %", "first call, s", "peak RSS, GB"
TARGETS = [
    *(
        Target(f"look/{m}", "hs", den, limit, what)
        for m in ("resnet50", "gpt2", *HOST_BOUND)
        for den, limit, what in (
            ("plain", 1.15, "summary with FLOPs: hs.summary ÷ plain forward"),
            ("torchinfo", 1.0, "hs.summary ÷ torchinfo.summary"),
            ("bl", 1.0, "hs.summary ÷ the baseline's (--baseline)"),
        )
    ),
    # DESIGN.md: a 7B Llama on meta in under 5 s and 1 GB, FLOPs within 1%
    *(
        Target(f"look/{case}", value, None, limit, f"meta Llama: {what}")
        for case, value, limit, what in (
            ("llama_rss", FIRST, 5.0, "hs.summary, first call in a fresh process, seconds"),
            ("llama_rss", PEAK, 1.0, "that process's peak RSS (ru_maxrss), GB"),
            ("llama", LLAMA_FLOPS, 1.0, "hs FLOPs against the analytic count, % off"),
        )
    ),
]


def build_case(name: str, quick: bool) -> capture.Case:
    """Capture's case, its host-bound version (README.md, "Look"), or the meta Llama."""
    if name in HOST_BOUND:
        case = capture.build_case(name.removesuffix("_host"), False)
        x = case.args[0][:1, :16] if name == "gpt2_host" else case.args[0][:1, :, :64, :64]
        what = case.description.split(", i")[0] + f", input {'x'.join(map(str, x.shape))}"
        return dataclasses.replace(case, name=name, args=(x,), description=what)
    if name != "llama":
        return capture.build_case(name, quick)
    with torch.device("meta"):
        model, _ = capture.hf_model("llama", quick)  # LlamaConfig(): Llama-7B
    tokens = 16 if quick else 128
    # the default use_cache, as on meta use_cache=False cannot run (README.md, "Look")
    ids = torch.zeros(1, tokens, dtype=torch.long, device="meta")
    what = f"LlamaForCausalLM({'small' if quick else 'LlamaConfig()'}) on meta, ids 1x{tokens}"
    return capture.Case("llama", model, (ids,), {}, [], "", "", what)


def analytic_flops(config: Any, batch: int, tokens: int) -> tuple[int, int]:
    """(FLOPs, of which attention) of a GPT-2 or Llama config, counted as README.md says."""
    h_, layers = config.hidden_size, config.num_hidden_layers
    if config.model_type == "gpt2":
        q = kv = h_
        mlp = 2 * h_ * (config.n_inner or 4 * h_)
    else:
        heads = config.num_attention_heads
        q = heads * (getattr(config, "head_dim", None) or h_ // heads)
        kv = config.num_key_value_heads * q // heads
        mlp = 3 * h_ * config.intermediate_size
    weights = layers * (2 * h_ * q + 2 * h_ * kv + mlp) + h_ * config.vocab_size
    attention = 4 * batch * tokens**2 * q * layers
    return 2 * weights * batch * tokens + attention, attention


def _hs(case: capture.Case) -> Any:
    return hs.summary(case.model, case.args, forward_kwargs=case.kwargs)


def _torchinfo(case: capture.Case) -> Any:
    import torchinfo

    return torchinfo.summary(case.model, input_data=case.args[0], verbose=0, **case.kwargs)


def _flopcounter(case: capture.Case) -> Any:
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        case.forward()
    return counter


def _fvcore(case: capture.Case) -> tuple[int, str]:
    from fvcore.nn import FlopCountAnalysis

    analysis = FlopCountAnalysis(explain.Logits(case.model, **case.kwargs), case.args)
    analysis.unsupported_ops_warnings(False).uncalled_modules_warnings(False)
    total = analysis.total()  # before unsupported_ops(), which needs the analysis run
    skipped = analysis.unsupported_ops()
    sdpa = skipped.get("aten::scaled_dot_product_attention", 0)
    return 2 * total, f"{len(skipped)} op kinds unsupported (0), SDPA x{sdpa} among them"


def _thop(case: capture.Case) -> tuple[int, str]:
    import thop

    # thop leaves total_ops / total_params buffers on every module: count a copy
    model = explain.Logits(copy.deepcopy(case.model), **case.kwargs)
    return 2 * int(thop.profile(model, case.args, verbose=False)[0]), "on a deep copy"


def _flops(case: capture.Case) -> Result:
    """Each tool's GFLOPs (2 per multiply-add) against the analytic count, or why it fails."""
    analytic, attention = None, 0
    if not case.name.startswith("resnet50"):
        analytic, attention = analytic_flops(case.model.config, *case.args[0].shape)
    summary, counter = _hs(case), _flopcounter(case).get_flop_counts()["Global"]
    top = ", ".join(f"{k} x{n}" for k, n in list(summary.uncounted.items())[:3])
    tools: dict[str, Callable[[], tuple[int, str]]] = {
        "hookscope": lambda: (summary.total_flops, f"uncounted: {top}, ..."),
        "torchinfo": lambda: (2 * _torchinfo(case).total_mult_adds, "2 x total_mult_adds"),
        "fvcore": lambda: _fvcore(case),
        "thop": lambda: _thop(case),
        "flopcounter": lambda: (sum(counter.values()), f"counted: {', '.join(map(str, counter))}"),
    }
    out: Result = {}
    if analytic:
        share = f"of which attention products {attention / 1e9:.2f}"
        out["GFLOPs: analytic"] = f"{analytic / 1e9:.2f}, {share}"
    for tool, fn in tools.items():
        try:
            flops, note = fn()
        except Exception as e:
            out[f"GFLOPs: {tool}"] = f"fails: {h.error_text(e)}"
            continue
        if analytic:
            note = f"{flops / analytic:.3f} of analytic; {note}"
            if abs(flops - analytic + attention) < 0.002 * analytic:
                note += "; = analytic without attention"
        out[f"GFLOPs: {tool}"] = f"{flops / 1e9:.2f} ({note})"
    if analytic:
        out[LLAMA_FLOPS] = abs(summary.total_flops / analytic - 1) * 100
    return out


def _timing(spec: Result) -> Result:
    case = build_case(spec["model"], spec["quick"])
    bl, error = capture.import_baseline(spec.get("baseline"))
    tools: dict[str, Any] = {"hs": _hs, "torchinfo": _torchinfo, "flopcounter": _flopcounter}
    if bl:  # the --baseline revision's hs.summary
        tools["bl"] = lambda c: bl.summary(c.model, c.args, forward_kwargs=c.kwargs)
    skipped = {"bl": error} if error else {}
    variants = [Variant("plain", LABELS["plain"], case.plain)]
    for key, fn in tools.items():
        try:
            fn(case)  # a peer that is not installed or cannot run here is left out
            variants.append(Variant(key, LABELS[key], functools.partial(fn, case)))
        except Exception as e:
            skipped[key] = h.error_text(e)
    result = h.timing(variants, Plan(**spec["plan"]))
    title, more = TITLES[spec["model"]], {"values": _flops(case), "skipped": skipped}
    return h.named(result, f"look/{spec['model']}", title, capture.about(case), **more)


def _rss(spec: Result) -> Result:
    """Build the meta Llama and summarise it, nothing else: the process's peak RSS."""
    case = build_case("llama", spec["quick"])
    shape, before, times = list(case.args[0].shape), h.rss_kib()["VmRSS"] / 1024, []
    for _ in range(spec["repeats"]):
        t0 = time.perf_counter()
        hs.summary(case.model, input_size=shape, dtypes=[torch.long])
        times.append(time.perf_counter() - t0)
    values = {
        FIRST: times[0],
        "later, median s": statistics.median(times[1:] or times),
        "RSS before the first summary (torch, transformers, the meta model), MiB": before,
        PEAK: h.peak_rss_mib() * 2**20 / 1e9,
    }
    about = f"a fresh process (glibc defaults) builds {case.description} and calls hs.summary"
    about += f"(model, input_size={tuple(shape)}, dtypes=[torch.long]) {len(times)} times"
    return h.named({}, "look/llama_rss", "Llama-7B (meta) alone", about, values=values)


def work(spec: Result) -> Result:
    return {"timing": _timing, "rss": _rss}[spec["kind"]](spec)


def jobs(cfg: Config) -> list[Job]:
    cases = [m for m in TITLES if not (cfg.quick and m in HOST_BOUND)]  # quick: small already
    out = h.timing_jobs("look", cfg, {m: BUDGETS[m] for m in cases})
    spec = {"kind": "rss", "quick": cfg.quick, "repeats": 2 if cfg.quick else 5}
    return [*out, Job("look", "rss_llama", spec, "defaults")]
