"""Operations inside the forward: ``hs.capture`` of ``"layer::op"`` selectors and attention
weights of fused attention, against a plain forward, the module-hook floor, eager attention
and peers (nnsight's ``.source``, TorchLens' ``tl.func``) on the same selections.

Case: HF GPT-2 small (4 x 128 tokens, SDPA attention) as in capture.py. One malloc-tuned
timing process: every variant once per round, shuffled; ratios are same-round medians.
Method: bench/README.md, "Ops".
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import _common as common
import capture
from _common import DASH, SETTINGS, Config, Job, Plan, Target, Variant

Result = dict[str, Any]
BUDGET = 900  # seconds of rounds: many, since other tenants of the VM make single rounds noisy
SDPA = "transformer.h.*.attn::scaled_dot_product_attention"
WEIGHTS = [f"transformer.h.{i}.attn::attention_weights" for i in (3, 9)]
LABELS = {
    "plain": "model(x) under no_grad (SDPA attention)",
    "hand_attn": "hand hooks on the 12 attention modules, store out[0].detach().clone()",
    "hs_sdpa": f"hs.capture(model, {SDPA!r})",
    "hs_weights2": "hs.capture(model, [h.3 and h.9 ::attention_weights]), both .output read",
    "floor_weights2": "model(x), then softmax(QKᵀ·scale + causal mask) of h.3 and h.9 by hand",
    "eager_all": "the same weights with attn_implementation='eager', output_attentions=True",
    "nnsight_sdpa": "NNsight(copy).trace(x): .source... scaled_dot_product_attention_0.output"
    ".save() x12 (aliases)",
    "torchlens_sdpa": "torchlens.trace(copy, x, save=tl.func('scaled_dot_product_attention'))",
}
#: (target, variant, divided by, limit): issue 17's performance section
TARGETS = (
    ("one operation in each of 12 blocks: hs.capture ÷ plain forward", "hs_sdpa", "plain", 1.05),
    ("one operation in each of 12 blocks ÷ hand module hooks, same bytes copied", "hs_sdpa",
     "hand_attn", 1.05),
    ("attention weights of 2 of 12 layers ÷ plain forward + their QKᵀ and softmax by hand",
     "hs_weights2", "floor_weights2", 1.05),
)  # fmt: skip


# -- variants ----------------------------------------------------------------------------------
def _hand_attn(case: capture.Case) -> Callable[[], Any]:
    """The module-hook floor: forward hooks on the 12 attention modules for this call only,
    each keeping a copy of the module's output (as many bytes as the SDPA output)."""
    modules = [m for n, m in case.model.named_modules() if n.endswith(".attn")]

    def run() -> list[Tensor]:
        kept: list[Tensor] = []
        hook = lambda m, a, out: kept.append(out[0].detach().clone())  # noqa: E731
        handles = [m.register_forward_hook(hook) for m in modules]
        try:
            case.plain()
        finally:
            for handle in handles:
                handle.remove()
        return kept

    return run


def _qk(case: capture.Case, layers: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
    """Q and K of ``layers`` as GPT-2 computes them (c_attn's output, split into heads),
    from hand-written hooks, untimed."""
    config, kept = case.model.config, {}
    blocks = case.model.transformer.h
    hooks = [
        blocks[i].attn.c_attn.register_forward_hook(lambda m, a, o, i=i: kept.__setitem__(i, o))
        for i in layers
    ]
    try:
        case.plain()
    finally:
        for hook in hooks:
            hook.remove()
    out = []
    for i in layers:
        q, k, _ = kept[i].split(config.n_embd, dim=2)
        heads = lambda t: t.view(*t.shape[:2], config.n_head, -1).transpose(1, 2)  # noqa: E731
        out.append((heads(q), heads(k)))
    return out


def _explicit(qk: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """softmax(QKᵀ/√d + causal mask), written out: the extra work attention weights need."""
    out = []
    for q, k in qk:
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out.append(scores.masked_fill(~causal, -math.inf).softmax(-1))
    return out


def _eager_copy(case: capture.Case) -> nn.Module:
    """The same weights with eager attention, what users switch to for the weights."""
    eager = copy.deepcopy(case.model)
    eager.set_attn_implementation("eager")
    return eager


def _nnsight(case: capture.Case) -> Callable[[], list[Any]]:
    from nnsight import NNsight

    wrapped = NNsight(copy.deepcopy(case.model))

    def run() -> list[Any]:
        saved = []
        with torch.no_grad(), wrapped.trace(*case.args, **case.kwargs):
            for block in wrapped.transformer.h:
                fn = block.attn.source.attention_interface_1.source
                saved.append(fn.torch_nn_functional_scaled_dot_product_attention_0.output.save())
        return saved

    return run


def _torchlens(case: capture.Case) -> Callable[[], Any]:
    import torchlens as tl

    model = copy.deepcopy(case.model)

    def run() -> Any:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            save = tl.func("scaled_dot_product_attention")
            return tl.trace(model, list(case.args), input_kwargs=case.kwargs, save=save)

    return run


def _torchlens_outputs(trace: Any) -> list[Tensor]:
    layers = [x for x in trace.layers if x.func_name == "scaled_dot_product_attention"]
    return [x.out for x in layers]


def build_variants(case: capture.Case, peers: bool) -> dict[str, Variant]:
    import hookscope as hs

    qk = _qk(case, (3, 9))
    eager = _eager_copy(case)

    def hs_sdpa() -> Any:
        with torch.no_grad(), hs.capture(case.model, SDPA) as cap:
            case.forward()
        return cap

    def hs_weights2() -> Any:
        with torch.no_grad(), hs.capture(case.model, WEIGHTS) as cap:
            case.forward()
        return [cap[w].output for w in WEIGHTS]

    def floor_weights2() -> Any:
        return case.plain(), _explicit(qk)

    def eager_all() -> Any:
        with torch.no_grad():
            return eager(*case.args, **case.kwargs, output_attentions=True)

    fns: dict[str, Callable[[], Any]] = {
        "plain": case.plain, "hand_attn": _hand_attn(case), "hs_sdpa": hs_sdpa,
        "hs_weights2": hs_weights2, "floor_weights2": floor_weights2, "eager_all": eager_all,
    }  # fmt: skip
    out = {k: Variant(k, LABELS[k], fn) for k, fn in fns.items()}
    if peers:
        out["nnsight_sdpa"] = Variant("nnsight_sdpa", LABELS["nnsight_sdpa"], _nnsight(case))
        tl_fn = _torchlens(case)
        out["torchlens_sdpa"] = Variant(
            "torchlens_sdpa", LABELS["torchlens_sdpa"], tl_fn, None, "torchlens", heavy=True
        )
    return out


# -- checks ----------------------------------------------------------------------------------
def run_checks(case: capture.Case, variants: dict[str, Variant]) -> list[Result]:
    """Untimed: hookscope's values against the hand floors, eager attention and peers."""
    import hookscope as hs

    rows: list[Result] = []

    def add(what: str, value: Any, ok: bool | None) -> None:
        rows.append({"what": what, "value": str(value), "ok": ok})

    steps: list[tuple[str, Callable[[], tuple[Any, bool | None]]]] = []
    cap = variants["hs_sdpa"].fn()
    got = [cap[n].output for n in cap]

    def against_eager() -> tuple[Any, bool]:
        eager = _eager_copy(case)
        with torch.no_grad():
            ref = eager(*case.args, **case.kwargs, output_attentions=True).attentions
        weights = variants["hs_weights2"].fn()
        diff = max(float((w - ref[i]).abs().max()) for w, i in zip(weights, (3, 9), strict=True))
        return f"max |diff| {diff:.1e}", diff <= 1e-6

    def fused_untouched() -> tuple[Any, bool]:
        plain = case.plain()
        with torch.no_grad(), hs.capture(case.model, [SDPA, *WEIGHTS]):
            out = case.forward()
        same = common.trees_equal(out, plain)
        return "torch.equal" if same else "differs", same

    def floor_equal() -> tuple[Any, bool]:
        ours = variants["hs_weights2"].fn()
        hand = _explicit(_qk(case, (3, 9)))
        diff = max(float((a - b).abs().max()) for a, b in zip(ours, hand, strict=True))
        return f"max |diff| {diff:.1e}", diff <= 1e-6

    def intercepted() -> tuple[Any, None]:
        listed = hs.names(case.model, ops=True, inputs=case.args[0])
        own = [n for n in listed if ".attn::" in n and n.startswith("transformer.h.0.")]
        return f"{len(own)} returning tensors, listed by hs.names(ops=True) for h.0.attn", None

    steps.append(("attention weights (h.3, h.9) equal eager output_attentions", against_eager))
    steps.append(("attention weights equal the floor's hand-written softmax", floor_equal))
    steps.append(("model output with ops captured = plain output (SDPA still fused)",
                  fused_untouched))  # fmt: skip
    steps.append(("operations of one attention module's own code per call", intercepted))
    if "nnsight_sdpa" in variants:
        steps.append(("`nnsight_sdpa` equals `hs_sdpa` (torch.equal)", lambda: _same(
            [t for t in variants["nnsight_sdpa"].fn()], got)))  # fmt: skip
    if "torchlens_sdpa" in variants:

        def torchlens_equal() -> tuple[Any, bool]:
            with capture.torchlens_wrapped():
                trace = variants["torchlens_sdpa"].fn()
                return _same(_torchlens_outputs(trace), got)

        steps.append(("`torchlens_sdpa` equals `hs_sdpa` (torch.equal)", torchlens_equal))
    for what, step in steps:
        try:
            value, ok = step()
        except Exception as e:  # one broken check must not lose the run's other results
            value, ok = f"{type(e).__name__}: {str(e)[:200]}", False
        add(what, value, ok)
    hooks = sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in case.model.modules())
    modes = len(torch.overrides._get_current_function_mode_stack())
    add("hooks and torch function modes left after everything", hooks + modes, hooks + modes == 0)
    return rows


def _same(a: list[Any], b: list[Tensor]) -> tuple[str, bool]:
    ok = len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    return f"{sum(torch.equal(x, y) for x, y in zip(a, b, strict=False))} of {len(b)}", ok


# -- worker, jobs, report --------------------------------------------------------------------
def work(spec: Result) -> Result:
    common.set_threads()
    warnings.simplefilter("ignore")  # transformers' warnings are not results
    case = capture.build_case("gpt2", spec["quick"])
    variants = build_variants(case, peers=True)
    blocks = {"torchlens": capture.torchlens_wrapped}
    samples, noise = common.run_rounds(list(variants.values()), Plan(**spec["plan"]), blocks)
    params = sum(p.numel() for p in case.model.parameters()) / 1e6
    return {
        **spec,
        "case": f"{case.description}; {params:.1f} M parameters",
        "variants": {k: v.label for k, v in variants.items()},
        "samples": samples,
        "noise": noise,
        "checks": run_checks(case, variants),
    }


def jobs(cfg: Config) -> list[Job]:
    plan = {"warmup": 1, "rounds": 2 if cfg.quick else 40, "min_rounds": 5}
    plan.update(budget_s=0 if cfg.quick else BUDGET, heavy_rounds=0 if cfg.quick else 3)
    spec = {"kind": "timing", "model": "gpt2", "quick": cfg.quick, "plan": plan}
    return [Job("ops", "timing_gpt2", spec, "tuned")]


CPU = "malloc tuned, CPU time"


def _cpu(samples: list[Result], key: str, base: str) -> Any:
    """Same-round ratio of the process's CPU time (both torch threads)."""
    return common.ratio(
        common.per_round(samples, key, "cpu"), common.per_round(samples, base, "cpu")
    )


def _targets(run: Result) -> list[Target]:
    out = []
    for what, key, base, limit in TARGETS:
        cells = {SETTINGS["tuned"]: common.paired(run["samples"], key, base)}
        cells[CPU] = _cpu(run["samples"], key, base)
        out.append(Target(what, "GPT-2", cells, limit))
    return out


def _section(run: Result) -> list[str]:
    samples = run["samples"]
    lines = [
        "## Ops: operations inside the forward, GPT-2",
        "",
        f"{run['case']}. One malloc-tuned process, every variant once per round, shuffled "
        f"(torchlens only in the first {run['plan']['heavy_rounds'] or 'all'} rounds); ratios "
        "are medians of same-round ratios, of wall time / of the process's CPU time (both "
        "torch threads; other tenants of this shared VM disturb it less).",
        "",
    ]
    rows = []
    for key, label in run["variants"].items():
        ms = common.median(samples, key)
        vs_plain, vs_hs = (
            common.paired(samples, key, "plain"),
            common.paired(samples, key, "hs_sdpa"),
        )
        rows.append([
            f"`{key}`", label, f"{ms * 1e3:.0f}" if ms else DASH,
            vs_plain.cell() if vs_plain else DASH, vs_hs.cell() if vs_hs else DASH,
        ])  # fmt: skip
    lines += common.table(["variant", "what is timed", "median ms", "÷ plain", "÷ hs_sdpa"], rows)
    n, (lo, hi) = len(common.per_round(samples, "plain")), run["noise"]["loadavg"]
    lines.append(
        f"* {n} measured rounds (+1 warm-up) in {run['noise']['rounds_s']:.0f} s; load average "
        f"{lo:.1f}{DASH}{hi:.1f}; steal {run['noise']['steal_ticks']} ticks."
    )
    marks = {True: "ok", False: "**FAILED**", None: "info"}
    lines += ["", "Checks (untimed, after the rounds):", ""]
    lines += [f"* [{marks[c['ok']]}] {c['what']}: {c['value']}" for c in run["checks"]]
    return [*lines, ""]


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    """The targets and this capability's section of RESULTS.md."""
    run = next((r for r in results if r["kind"] == "timing"), None)
    if run is None:
        return [], []
    return _targets(run), _section(run)
