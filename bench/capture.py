"""Capture: ``hs.capture`` beside a plain forward, hand-written hooks, nnsight and TorchLens; its
memory; per-site cost. Every module builds its models here too. Method: bench/README.md."""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import itertools
import operator
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

import _harness as h
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Capture: hs.capture beside a plain forward, hand-written hooks, nnsight and TorchLens"
MODELS = {"resnet50": "ResNet-50", "gpt2": "GPT-2"}
SETTINGS = {"tuned": "malloc tuned", "defaults": "glibc defaults"}
HS_KINDS = ("sel", "leaves_clone", "leaves_ref", "leaves_reduce", "stop")
HAND = ("hand_sel_clone", "hand_leaves_detach", "hand_leaves_clone", "hand_leaves_reduce")
CORE = ("plain", *HAND, "hand_stop", *(f"hs_{k}" for k in HS_KINDS))
PEERS = {"none": (), "nnsight": ("nnsight_sel", "nnsight_leaves")}
PEERS["all"] = (*PEERS["nnsight"], "torchlens_sel", "torchlens_all")
#: Variants measured for memory, each in a fresh process.
MEMORY = ("plain", *HAND[::2], "hs_sel", "hs_leaves_clone", "hs_leaves_ref", "hs_leaves_reduce")
#: Seconds for each full-run timing process's rounds (it stops early once past min_rounds).
BUDGETS = {"resnet50/tuned": 220, "gpt2/tuned": 280, "resnet50/defaults": 110, "gpt2/defaults": 170}
#: DESIGN.md "Performance": (target, variant, divided by, limit).
TIMED = (
    ("few layers: hs.capture of the selection ÷ plain forward", "hs_sel", "plain", 1.02),
    ("every leaf, clone ÷ hand clone floor", "hs_leaves_clone", "hand_leaves_clone", 1.1),
    ("every leaf, copy='reference' ÷ hand clone floor", "hs_leaves_ref", "hand_leaves_clone", 1.1),
    ("every leaf, reduce= ÷ hand reduce floor", "hs_leaves_reduce", "hand_leaves_reduce", 1.1),
    ("early stop (stop=True) ÷ full plain forward", "hs_stop", "plain", 0.75),
    ("early stop ÷ hand early-stop floor (same layer)", "hs_stop", "hand_stop", 1.05),
    *((f"new ÷ baseline (--baseline): hs_{k}", f"hs_{k}", f"bl_{k}", 1.02) for k in HS_KINDS),
)
PEAK = "memory: every leaf, reduce= — peak RSS ÷ plain forward's peak"
SITE = "per-site cost over plain, tiny MLP: {} ÷ a raw hook that {}"
TARGETS = [
    *(
        Target(f"capture/{m}/{s}", a, b, limit, what)
        for m, s in itertools.product(MODELS, SETTINGS)
        for what, a, b, limit in TIMED
    ),
    Target("capture/resnet50/memory", "hs_leaves_reduce", "plain", 1.1, PEAK, "peak_mib"),
    Target("capture/gpt2/memory", "hs_leaves_reduce", "plain", 1.1, PEAK, "peak_mib"),
    # DESIGN.md: clone mode <= 1.1x a raw hook that clones; reference mode <= 2x a no-op hook
    *(
        Target("capture/latency", a, b, limit, SITE.format(what, raw), "site_us")
        for a, b, limit, what, raw in (
            ("hs_clone", "raw_clone", 1.1, "capture", "clones"),
            ("hs_ref", "raw_noop", 2.0, "reference", "does nothing"),
        )
    ),
]


def leaf_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if n and not list(m.children())]


@dataclass
class Case:
    name: str
    model: nn.Module
    args: tuple[Tensor, ...]
    kwargs: dict[str, Any]
    selection: list[str]
    stop_layer: str
    reduce: str
    description: str

    @functools.cached_property
    def leaves(self) -> list[str]:
        return leaf_names(self.model)

    def forward(self) -> Any:
        return self.model(*self.args, **self.kwargs)

    def plain(self) -> Any:
        with torch.no_grad():
            return self.forward()


#: ``ResNetConfig`` arguments of --quick's small ResNet-50: its four stages and their names,
#: one bottleneck each, fewer channels
NARROW_RESNET = {"embedding_size": 16, "hidden_sizes": [32, 64, 128, 256], "depths": [1, 1, 1, 1]}
LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
LLAMA_KEYS += ("num_key_value_heads", "vocab_size")
#: ``LlamaConfig`` arguments of --quick's small Llama (2 layers, grouped-query attention)
SMALL_LLAMA = dict(zip(LLAMA_KEYS, (64, 256, 2, 4, 1, 1000), strict=True))


def hf_model(name: str, quick: bool, llama: dict[str, int] | None = None) -> tuple[Any, list[str]]:
    """A model every module times (random weights, seed 0, eval mode) and its blocks' names:
    ResNet-50, GPT-2 small, or a Llama (``llama``: its ``LlamaConfig`` arguments, none: 7B);
    ``quick`` keeps the blocks' names, with fewer channels and blocks."""
    import transformers as tf

    torch.manual_seed(0)
    if name == "resnet50":
        config = tf.ResNetConfig(num_labels=1000, **(NARROW_RESNET if quick else {}))
        blocks = [f"resnet.encoder.stages.{i}" for i in range(4)]
        return tf.ResNetForImageClassification(config).eval(), blocks
    if name == "gpt2":
        small = {"n_embd": 64, "n_head": 2, "n_layer": 10, "vocab_size": 1000}
        config = tf.GPT2Config(**(small if quick else {}))
        blocks = [f"transformer.h.{i}" for i in range(config.n_layer)]
        return tf.GPT2LMHeadModel(config).eval(), blocks
    config = tf.LlamaConfig(**(SMALL_LLAMA if quick else llama or {}))
    blocks = [f"model.layers.{i}" for i in range(config.num_hidden_layers)]
    return tf.LlamaForCausalLM(config).eval(), blocks


def build_case(name: str, quick: bool) -> Case:
    """ResNet-50 (batch 8, 3x224x224) or GPT-2 small (4 x 128 tokens); ``quick``: the small
    models (:func:`hf_model`) on a small input."""
    model, blocks = hf_model(name, quick)
    seeded = torch.Generator().manual_seed(1)
    if name == "resnet50":
        batch, side = (1, 64) if quick else (8, 224)
        x = torch.randn(batch, 3, side, side, generator=seeded)
        what = f"ResNetForImageClassification(ResNetConfig({'narrow' * quick})), input "
        what += f"{batch}x3x{side}x{side}"
        return Case(name, model, (x,), {}, blocks, blocks[1], "spatial_mean", what)
    batch, tokens = (1, 16) if quick else (4, 128)
    ids = torch.randint(0, model.config.vocab_size, (batch, tokens), generator=seeded)
    what = f"GPT2LMHeadModel({'small' if quick else 'GPT-2 small'}), ids {batch}x{tokens}"
    return Case(name, model, (ids,), {"use_cache": False}, blocks, blocks[5], "token_mean", what)


def about(case: Case) -> str:
    params = sum(p.numel() for p in case.model.parameters()) / 1e6
    return f"{case.description}; {params:.1f} M parameters, {len(case.leaves)} leaves"


class StopHere(Exception):
    """Raised by hand-written early-stop hooks."""


def hooked(
    model: nn.Module, names: list[str], make: Callable[[str], Any], fn: Callable[[], Any]
) -> Any:
    """``fn()`` with the forward hook ``make(name)`` on each of ``names``, for this call only."""
    modules = dict(model.named_modules())
    with contextlib.ExitStack() as stack:
        for n in names:
            stack.callback(modules[n].register_forward_hook(make(n)).remove)
        return fn()


def hand_capture(
    case: Case, names: list[str], store: Callable[[Tensor], Any], stop_after: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """The floor: hooks that keep ``store(output)``; ``stop_after``'s ends the forward."""
    kept: dict[str, Any] = {}

    def make(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            kept[name] = h.map_tensors(store, output)
            if name == stop_after:
                raise StopHere

        return hook

    try:
        return hooked(case.model, names, make, case.plain), kept
    except StopHere:
        return None, kept


def clone(t: Tensor) -> Tensor:
    return t.detach().clone()


def _reducer(kind: str) -> Callable[[Tensor], Tensor]:
    """Hand-written equivalent of hookscope's named ``reduce=`` (it copies 2-D outputs too)."""
    dims = lambda t: tuple(range(2, t.ndim)) if kind == "spatial_mean" else 1  # noqa: E731
    return lambda t: t.detach().clone() if t.ndim <= 2 else t.detach().mean(dim=dims(t))


def lib_capture(lib: ModuleType, case: Case, names: list[str], **options: Any) -> Any:
    out = None
    with torch.no_grad(), lib.capture(case.model, names, **options) as cap:
        out = case.forward()
    return out, cap


def _own_variants(c: Case, lib: ModuleType | None) -> list[Variant]:
    """The plain forward, the hand-written floors, and hookscope's five variants for the
    library under test (``hs_*``) and the ``--baseline`` revision (``bl_*``, with ``lib``)."""
    every, copied, sel = f"all {len(c.leaves)} leaves", "out.detach().clone()", c.selection
    out = [Variant("plain", "model(x) under no_grad", c.plain)]
    for key, names, where, what, store in (
        ("hand_sel_clone", sel, f"the {len(sel)} selected", copied, clone),
        ("hand_leaves_detach", c.leaves, every, "out.detach() (speed only)", Tensor.detach),
        ("hand_leaves_clone", c.leaves, every, copied, clone),
        ("hand_leaves_reduce", c.leaves, every, f"the {c.reduce}", _reducer(c.reduce)),
        ("hand_stop", [c.stop_layer], c.stop_layer, f"{copied}, raise to stop", clone),
    ):
        stop = c.stop_layer if key == "hand_stop" else None
        fn = functools.partial(hand_capture, c, names, store, stop)
        out.append(Variant(key, f"hand hooks on {where}, store {what}", fn))
    for prefix, module in (("hs", hs), ("bl", lib)) if lib else (("hs", hs),):
        for kind, names, opts, floor in (
            ("sel", sel, {}, "hand_sel_clone"),
            ("leaves_clone", c.leaves, {}, "hand_leaves_clone"),
            ("leaves_ref", c.leaves, {"copy": "reference"}, "hand_leaves_clone"),
            ("leaves_reduce", c.leaves, {"reduce": c.reduce}, "hand_leaves_reduce"),
            ("stop", [c.stop_layer], {"stop": True}, "hand_stop"),
        ):
            shown = f"[{len(sel)} selected]" if kind == "sel" else f"[{every}]"
            shown = f"['{c.stop_layer}']" if kind == "stop" else shown
            shown += "".join(f", {k}={v!r}" for k, v in opts.items())
            fn = functools.partial(lib_capture, module, c, names, **opts)
            out.append(Variant(f"{prefix}_{kind}", f"{prefix}.capture(model, {shown})", fn, floor))
    return out


def _nnsight(case: Case, wrapped: Any, names: list[str]) -> Callable[[], dict[str, Any]]:
    """``with NNsight(copy).trace(x): m.output.save()`` per module (saves alias live tensors)."""
    part = lambda e, p: e[int(p)] if p.isdigit() else getattr(e, p)  # noqa: E731
    envoys = [functools.reduce(part, name.split("."), wrapped) for name in names]

    def call() -> dict[str, Any]:
        saved = []  # filled inside the block: nnsight runs the block's code on its own
        with torch.no_grad(), wrapped.trace(*case.args, **case.kwargs):
            for envoy in envoys:
                saved.append(envoy.output.save())
        return dict(zip(names, saved, strict=True))

    return call


def torchlens(
    key: str, label: str, case: Case, save: Callable[[Any], Any] | None, floor: str
) -> Variant:
    """``torchlens.trace(copy, x, save=save(tl))`` on a deep copy (``None``: its default, all);
    seconds a call (heavy), in the ``torchlens`` block (:func:`torchlens_wrapped`)."""
    import torchlens as tl

    model, what = copy.deepcopy(case.model), save and save(tl)

    def call() -> Any:
        with torch.no_grad():
            return tl.trace(model, list(case.args), input_kwargs=case.kwargs, save=what)

    return Variant(key, label, call, floor, "torchlens", heavy=True)


@contextlib.contextmanager
def torchlens_wrapped() -> Iterator[None]:
    """torchlens wraps all of torch on its first trace; everything else must run unwrapped."""
    from torchlens.backends.torch.wrappers import unwrap_torch, wrap_torch

    wrap_torch()
    try:
        yield
    finally:
        unwrap_torch()


def _peer_variants(c: Case, keys: tuple[str, ...]) -> list[Variant]:
    """Each peer on its own deep copy: nnsight replaces ``forward`` on every module it wraps."""
    out: list[Variant] = []
    sel = f"the {len(c.selection)} selected modules"
    if "nnsight_sel" in keys:
        from nnsight import NNsight

        wrapped = NNsight(copy.deepcopy(c.model))
        label = "NNsight(copy).trace(x), .output.save() of"
        ran = list(hand_capture(c, c.leaves, id)[1])  # nnsight needs the leaves that run, in order
        fn = _nnsight(c, wrapped, c.selection)
        out.append(Variant("nnsight_sel", f"{label} {sel}", fn, "hs_sel"))
        label += f" the {len(ran)} leaves that run (aliases, no copy)"
        out.append(Variant("nnsight_leaves", label, _nnsight(c, wrapped, ran), "hs_leaves_ref"))
    if "torchlens_sel" in keys:
        label, modules = "torchlens.trace(copy, x", lambda tl: map(tl.module, c.selection)
        label_sel = f"{label}, save=tl.module(a) | ...), {sel}"
        save = lambda tl: functools.reduce(operator.or_, modules(tl))  # noqa: E731
        out.append(torchlens("torchlens_sel", label_sel, c, save, "hs_sel"))
        label += "): every op's output (its default)"
        out.append(torchlens("torchlens_all", label, c, None, "hs_leaves_clone"))
    return out


def _peer_checks(case: Case, variants: dict[str, Variant]) -> list[Result]:
    """The peers kept what hookscope kept on the selection (README.md, "Correctness")."""
    cap, got = variants["hs_sel"].fn()[1], {}
    if "nnsight_sel" in variants:
        got["nnsight_sel"] = variants["nnsight_sel"].fn()
    if "torchlens_sel" in variants:
        with torchlens_wrapped():
            trace = variants["torchlens_sel"].fn()
            got["torchlens_sel"] = {n: trace.modules[n].out for n in case.selection}
    same = {k: all(h.trees_equal(v[n], cap[n].output) for n in v) for k, v in got.items()}
    return [{"what": f"`{k}` equals `hs_sel`", "ok": ok} for k, ok in same.items()]


def import_baseline(path: str | None) -> tuple[ModuleType | None, str | None]:
    """The ``--baseline`` revision's package, or why it cannot be imported."""
    if not path:
        return None, None
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        return importlib.import_module("hookscope_baseline"), None
    except Exception as e:  # the report says so instead of losing the run
        return None, h.error_text(e)


def _timing(spec: Result) -> Result:
    model, setting = spec["model"].split("/")
    case = build_case(model, spec["quick"])
    baseline, error = import_baseline(spec.get("baseline"))
    keys = CORE + tuple(f"bl_{k}" for k in HS_KINDS if baseline) + PEERS[spec["peers"]]
    variants = [v for v in _own_variants(case, baseline) if v.key in keys]
    variants += _peer_variants(case, keys)
    result = h.timing(variants, Plan(**spec["plan"]), {"torchlens": torchlens_wrapped})
    more = {"checks": _peer_checks(case, {v.key: v for v in variants})}
    more["skipped"] = {f"bl_{k}": error for k in HS_KINDS if error}
    title = f"{MODELS[model]}, {SETTINGS[setting]}"
    return h.named(result, f"capture/{spec['model']}", title, about(case), **more)


def _memory(spec: Result) -> Result:
    """Peak and retained RSS of one variant, alone in a fresh process (its repeats: rounds)."""
    case = build_case(spec["model"], spec["quick"])
    v = next(v for v in _own_variants(case, None) if v.key == spec["variant"])
    for warm in (case.plain, case.plain, v.fn):  # lazy initialisation stays out of the figures
        warm()
    rss = [h.measure_rss(v.fn) for _ in range(spec["repeats"])]
    samples = [{"key": v.key, "round": i, "warmup": False, **got} for i, got in enumerate(rss)]
    title = f"{MODELS[spec['model']]}, memory: one fresh process per variant"
    result = {"samples": samples, "variants": {v.key: {"label": v.label, "floor": None}}}
    return h.named(result, f"capture/{spec['model']}/memory", title, about(case))


#: Each latency variant's label and the raw hook it is compared with (per-site cost over plain).
LATENCY = {
    "plain": ("model(x), no hooks", None),
    "raw_noop": ("raw forward hook on every site that does nothing", None),
    "raw_clone": ("raw forward hook on every site that stores out.detach().clone()", None),
    "hs_clone": ("hs.capture(model, sites)", "raw_clone"),
    "hs_ref": ("hs.capture(model, sites, copy='reference')", "raw_noop"),
}


def _block(model: nn.Module, x: Tensor, sites: list[str], key: str, n: int) -> Any:
    """``n`` forwards, with the hooks or one capture around the block (steady state)."""
    store: dict[str, Tensor] = {}
    keep = lambda name: lambda m, a, o: store.__setitem__(name, o.detach().clone())  # noqa: E731
    make = keep if key == "raw_clone" else lambda name: lambda m, a, o: None
    if key.startswith("raw_"):
        return hooked(model, sites, make, lambda: [model(x) for _ in range(n)]), store
    copy = "clone" if key == "hs_clone" else "reference"
    session = hs.capture(model, sites, copy=copy) if key != "plain" else None
    with session or contextlib.nullcontext():
        return [model(x) for _ in range(n)], session  # freed after the timed call


def _latency(spec: Result) -> Result:
    """Per-site cost on a tiny MLP (README.md, "Latency"): a sample is a block of forwards."""
    torch.manual_seed(0)
    model = nn.Sequential(*(m for _ in range(25) for m in (nn.Linear(32, 32), nn.ReLU()))).eval()
    x, sites, n = torch.randn(1, 32), leaf_names(model), spec["calls"]
    variants = [
        Variant(k, label, functools.partial(_block, model, x, sites, k, n), floor)
        for k, (label, floor) in LATENCY.items()
    ]
    with torch.no_grad():
        result = h.timing(variants, Plan(spec["warmup"], spec["rounds"]))
    plain = h.per_round(result["samples"], "plain")
    for s in result["samples"]:
        if s["round"] in plain and s["key"] != "plain":
            s["site_us"] = (s["seconds"] - plain[s["round"]]) * 1e6 / (n * len(sites))
    about = f"25 x (Linear(32, 32), ReLU): {len(sites)} sites, batch 1; a sample is {n} forwards"
    return h.named(result, "capture/latency", "tiny MLP", about)


def work(spec: Result) -> Result:
    """Worker entry (one process): ``spec["kind"]`` is timing, memory or latency."""
    return {"timing": _timing, "memory": _memory, "latency": _latency}[spec["kind"]](spec)


def jobs(cfg: Config) -> list[Job]:
    out, quick, scale = [], cfg.quick, 1.5 if cfg.baseline else 1
    for model, setting in itertools.product(MODELS, cfg.settings):
        # peers only malloc tuned, torchlens only in 5 rounds (README.md, "Capture")
        peers = "none" if setting != "tuned" else "nnsight" if quick else "all"
        budget = {f"{model}/{setting}": BUDGETS[f"{model}/{setting}"] * scale}
        out += h.timing_jobs("capture", cfg, budget, heavy_rounds=5, env=setting, peers=peers)
    rounds, warmup, calls = (1, 0, 5) if quick else (30, 3, 100)
    spec = {"kind": "latency", "rounds": rounds, "warmup": warmup, "calls": calls}
    out.append(Job("capture", "latency", spec))
    reps = 1 if quick else 2
    for model, key in itertools.product(MODELS, ("plain", "hs_leaves_reduce") if quick else MEMORY):
        spec = {"kind": "memory", "model": model, "variant": key, "quick": quick, "repeats": reps}
        out.append(Job("capture", f"memory_{model}_{key}", spec, "memory", alone=False))
    return out
