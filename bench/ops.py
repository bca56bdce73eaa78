"""Ops: ``hs.capture`` of ``"layer::op"`` selectors and attention weights of fused attention on
GPT-2 beside hooks, eager attention, nnsight and TorchLens. Method: bench/README.md."""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

import _harness as h
import capture
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Ops: operations inside GPT-2's forward, beside hooks, eager attention, nnsight, TorchLens"
SDPA = "transformer.h.*.attn::scaled_dot_product_attention"
OP = SDPA.split("::")[1]
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
FLOORS = {"hs_sdpa": "hand_attn", "hs_weights2": "floor_weights2", "eager_all": "hs_weights2"}
FLOORS |= {"nnsight_sdpa": "hs_sdpa", "torchlens_sdpa": "hs_sdpa"}
ONE = "one operation in each of 12 blocks"
TWO = "attention weights of 2 of 12 layers ÷ plain forward + their QKᵀ and softmax by hand"
#: issue 17's performance section, of wall time and of the process's CPU time
TARGETS = [
    Target("ops/gpt2", num, den, 1.05, what, t)
    for what, num, den in (
        (f"{ONE}: hs.capture ÷ plain forward", "hs_sdpa", "plain"),
        (f"{ONE} ÷ hand module hooks, same bytes copied", "hs_sdpa", "hand_attn"),
        (TWO, "hs_weights2", "floor_weights2"),
    )
    for t in ("seconds", "cpu")
]


def _qk(case: capture.Case, layers: tuple[int, ...]) -> list[tuple[Tensor, Tensor]]:
    """Q and K of ``layers`` as GPT-2 computes them (c_attn's output split into heads), untimed."""
    config, kept = case.model.config, {}
    names = [f"transformer.h.{i}.attn.c_attn" for i in layers]
    capture.hooked(case.model, names, lambda n: lambda m, a, o: kept.__setitem__(n, o), case.plain)
    heads = lambda t: t.view(*t.shape[:2], config.n_head, -1).transpose(1, 2)  # noqa: E731
    qkv = [kept[n].split(config.n_embd, dim=2) for n in names]
    return [(heads(q), heads(k)) for q, k, _ in qkv]


def _explicit(qk: list[tuple[Tensor, Tensor]]) -> list[Tensor]:
    """softmax(QKᵀ/√d + causal mask), written out: the extra work attention weights need."""
    out = []
    for q, k in qk:
        n = q.shape[-2]
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        causal = torch.ones(n, n, dtype=torch.bool).tril()
        out.append(scores.masked_fill(~causal, -math.inf).softmax(-1))
    return out


def _nnsight(case: capture.Case, wrapped: Any) -> list[Any]:
    """Each block's SDPA output, saved by nnsight on its own copy of the model (aliases)."""
    saved = []
    with torch.no_grad(), wrapped.trace(*case.args, **case.kwargs):
        for block in wrapped.transformer.h:
            fn = block.attn.source.attention_interface_1.source
            saved.append(fn.torch_nn_functional_scaled_dot_product_attention_0.output.save())
    return saved


def build_variants(case: capture.Case, quick: bool) -> list[Variant]:
    from nnsight import NNsight

    qk = _qk(case, (3, 9))
    attn = [n for n, _ in case.model.named_modules() if n.endswith(".attn")]
    eager = copy.deepcopy(case.model)  # the same weights, what users switch to for the weights
    eager.set_attn_implementation("eager")

    def captured(sites: str | list[str]) -> list[Tensor]:  # every .output read, timed
        with torch.no_grad(), hs.capture(case.model, sites) as cap:
            case.forward()
        return [cap[n].output for n in cap]

    def eager_all() -> Any:
        with torch.no_grad():
            return eager(*case.args, **case.kwargs, output_attentions=True)

    fns: dict[str, Callable[[], Any]] = {
        "plain": case.plain,
        # the module-hook floor: a copy of each attention output (the SDPA outputs' bytes)
        "hand_attn": functools.partial(capture.hand_capture, case, attn, capture.clone),
        "hs_sdpa": functools.partial(captured, SDPA),
        "hs_weights2": functools.partial(captured, WEIGHTS),
        "floor_weights2": lambda: (case.plain(), _explicit(qk)),
        "eager_all": eager_all,
        "nnsight_sdpa": functools.partial(_nnsight, case, NNsight(copy.deepcopy(case.model))),
    }
    out = [Variant(k, LABELS[k], fn, FLOORS.get(k)) for k, fn in fns.items()]
    save, key = lambda tl: tl.func(OP), "torchlens_sdpa"  # (TorchLens: not in --quick)
    return out if quick else [*out, capture.torchlens(key, LABELS[key], case, save, FLOORS[key])]


def _peer_checks(variants: dict[str, Variant]) -> list[Result]:
    """The peers kept what hookscope kept (tests own hookscope's values, not the peers')."""
    want, theirs = variants["hs_sdpa"].fn(), {"nnsight_sdpa": variants["nnsight_sdpa"].fn()}
    if "torchlens_sdpa" in variants:  # (not in --quick)
        with capture.torchlens_wrapped():
            ops = variants["torchlens_sdpa"].fn().layers
            theirs["torchlens_sdpa"] = [x.out for x in ops if x.func_name == OP]
    same = {k: h.trees_equal(list(v), want) for k, v in theirs.items()}
    return [{"what": f"`{k}` equals `hs_sdpa`", "ok": ok} for k, ok in same.items()]


def work(spec: Result) -> Result:
    case = capture.build_case(spec["model"], spec["quick"])
    variants = build_variants(case, spec["quick"])
    result = h.timing(variants, Plan(**spec["plan"]), {"torchlens": capture.torchlens_wrapped})
    listed = hs.names(case.model, ops=True, inputs=case.args[0])
    own = [n for n in listed if ".attn::" in n and n.startswith("transformer.h.0.")]
    values = {"operations returning tensors in h.0.attn's own code, per call": len(own)}
    checks = _peer_checks({v.key: v for v in variants})
    return h.named(result, "ops/gpt2", "GPT-2", capture.about(case), values=values, checks=checks)


def jobs(cfg: Config) -> list[Job]:
    # many rounds: other tenants of the VM make single rounds noisy
    return h.timing_jobs("ops", cfg, {"gpt2": 900}, rounds=40, heavy_rounds=3)
