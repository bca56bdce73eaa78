"""Capture capability: ``hs.capture`` against a plain forward, hand-written hooks and peers.

Cases: HF ResNet-50 (batch 8, 3x224x224) and GPT-2 small (4 x 128 tokens), random weights,
and a latency-bound tiny MLP. Jobs: one timing process per (model, malloc setting), one
memory process per (model, variant), one latency process. Method: bench/README.md.

hookscope is imported only by the worker code, so ``--report-only`` works whatever state the
library is in.
"""

from __future__ import annotations

import contextlib
import copy
import cProfile
import functools
import importlib
import operator
import pstats
import statistics
import sys
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from torch import Tensor, nn

import _common as common
from _common import DASH, SETTINGS, Config, Job, Plan, Ratio, Target, Variant

Result = dict[str, Any]  # one worker's JSON
Runs = dict[tuple[str, str], Result]  # (model, malloc setting or variant) -> result
MODELS = ("resnet50", "gpt2")
TITLES = {"resnet50": "ResNet-50", "gpt2": "GPT-2"}
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
TARGETS = (
    ("few layers: hs.capture of the selection ÷ plain forward", "hs_sel", "plain", 1.02),
    ("every leaf, clone ÷ hand clone floor", "hs_leaves_clone", "hand_leaves_clone", 1.1),
    ("every leaf, copy='reference' ÷ hand clone floor", "hs_leaves_ref", "hand_leaves_clone", 1.1),
    ("every leaf, reduce= ÷ hand reduce floor", "hs_leaves_reduce", "hand_leaves_reduce", 1.1),
    ("early stop (stop=True) ÷ full plain forward", "hs_stop", "plain", 0.75),
    ("early stop ÷ hand early-stop floor (same layer)", "hs_stop", "hand_stop", 1.05),
    *((f"new ÷ baseline: `hs_{k}`", f"hs_{k}", f"bl_{k}", 1.02) for k in HS_KINDS),
)


# -- cases -------------------------------------------------------------------------------------


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
    in_place: int  # leaf outputs a later op overwrites in place: what copy='reference' must flag
    description: str
    leaves: list[str] = field(init=False)

    def __post_init__(self) -> None:
        self.leaves = leaf_names(self.model)

    def forward(self) -> Any:
        return self.model(*self.args, **self.kwargs)

    def plain(self) -> Any:
        with torch.no_grad():
            return self.forward()


#: ``ResNetConfig`` arguments of --quick's narrow ResNet-50: its 16 bottleneck blocks and
#: names, fewer channels (here and in gpu.py)
NARROW_RESNET: dict[str, Any] = {"embedding_size": 16, "hidden_sizes": [32, 64, 128, 256]}


def _resnet50(quick: bool, full_width: bool = False) -> Case:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    # --quick keeps the 16 bottleneck blocks (same names and selections) but narrows them
    # (unless ``full_width``: look's host-bound case, ResNet-50 itself on a small input).
    narrow = quick and not full_width
    widths = NARROW_RESNET if narrow else {}
    model = ResNetForImageClassification(ResNetConfig(num_labels=1000, **widths)).eval()
    batch, side = (1, 64) if quick else (8, 224)
    torch.manual_seed(1)
    x = torch.randn(batch, 3, side, side)
    config = "ResNetConfig(narrow)" if narrow else "ResNetConfig()"
    what = f"ResNetForImageClassification({config}), input {batch}x3x{side}x{side}"
    stages = [f"resnet.encoder.stages.{i}" for i in range(4)]
    return Case("resnet50", model, (x,), {}, stages, stages[1], "spatial_mean", 32, what)


def _gpt2(quick: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # --quick keeps the 12 blocks (same names and selections) but narrows them.
    config = GPT2Config(n_embd=64, n_head=2, vocab_size=1000) if quick else GPT2Config()
    model = GPT2LMHeadModel(config).eval()
    batch, tokens = (1, 16) if quick else (4, 128)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, tokens))
    what = f"GPT2LMHeadModel({'n_embd=64' if quick else 'GPT-2 small'}), ids {batch}x{tokens}"
    blocks = [f"transformer.h.{i}" for i in range(config.n_layer)]
    kw = {"use_cache": False}
    return Case("gpt2", model, (ids,), kw, blocks, blocks[5], "token_mean", 0, what)


def build_case(name: str, quick: bool, full_width: bool = False) -> Case:
    """The case ``name``; ``quick``: a small input and (unless ``full_width``) narrow layers."""
    builders = {"resnet50": lambda: _resnet50(quick, full_width), "gpt2": lambda: _gpt2(quick)}
    return builders[name]()


# -- variants ----------------------------------------------------------------------------------


class _StopHere(Exception):
    """Raised by the hand-written early-stop hook."""


def hand_capture(
    case: Case, names: list[str], store: Callable[[Tensor], Any], stop_after: str | None = None
) -> tuple[Any, dict[str, Any]]:
    """The floor: forward hooks registered for this call only (as a library must) that keep
    ``store(output)``; with ``stop_after`` that layer's hook ends the forward by raising."""
    modules = dict(case.model.named_modules())
    kept: dict[str, Any] = {}

    def make(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            kept[name] = common.map_tensors(store, output)
            if name == stop_after:
                raise _StopHere

        return hook

    handles = [modules[n].register_forward_hook(make(n)) for n in names]
    out = None
    try:
        out = case.plain()
    except _StopHere:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return out, kept


def _clone(t: Tensor) -> Tensor:
    return t.detach().clone()


def _reducer(kind: str) -> Callable[[Tensor], Tensor]:
    """Hand-written equivalent of hookscope's named ``reduce=`` (it copies 2-D outputs too)."""

    def reduce(t: Tensor) -> Tensor:
        t = t.detach()
        if t.ndim <= 2:
            return t.clone()
        return t.mean(dim=tuple(range(2, t.ndim)) if kind == "spatial_mean" else 1)

    return reduce


def _hand_variants(c: Case) -> list[Variant]:
    every, clone = f"all {len(c.leaves)} leaves", "out.detach().clone()"
    specs: dict[str, tuple[list[str], str, str, Callable[[Tensor], Any]]] = {
        "hand_sel_clone": (c.selection, f"the {len(c.selection)} selected", clone, _clone),
        "hand_leaves_detach": (c.leaves, every, "out.detach() (speed only)", Tensor.detach),
        "hand_leaves_clone": (c.leaves, every, clone, _clone),
        "hand_leaves_reduce": (c.leaves, every, f"the {c.reduce}", _reducer(c.reduce)),
        "hand_stop": ([c.stop_layer], c.stop_layer, f"{clone}, raise to stop", _clone),
    }
    out = []
    for key, (names, where, what, store) in specs.items():
        stop = c.stop_layer if key == "hand_stop" else None
        fn = functools.partial(hand_capture, c, names, store, stop)
        out.append(Variant(key, f"hand hooks on {where}, store {what}", fn))
    return out


def _lib_capture(lib: ModuleType, case: Case, names: list[str], **options: Any) -> Any:
    out = None
    with torch.no_grad(), lib.capture(case.model, names, **options) as cap:
        out = case.forward()
    return out, cap


def _hs_variants(c: Case, lib: ModuleType, prefix: str) -> list[Variant]:
    """hookscope's five variants, for the library under test or the extracted baseline."""
    every = f"[all {len(c.leaves)} leaves]"
    specs: dict[str, tuple[list[str], str, dict[str, Any], str]] = {
        "sel": (c.selection, f"[{len(c.selection)} selected]", {}, "hand_sel_clone"),
        "leaves_clone": (c.leaves, every, {}, "hand_leaves_clone"),
        "leaves_ref": (c.leaves, every, {"copy": "reference"}, "hand_leaves_clone"),
        "leaves_reduce": (c.leaves, every, {"reduce": c.reduce}, "hand_leaves_reduce"),
        "stop": ([c.stop_layer], f"['{c.stop_layer}']", {"stop": True}, "hand_stop"),
    }
    out = []
    for kind, (names, shown, opts, floor) in specs.items():
        shown += "".join(f", {k}={v!r}" for k, v in opts.items())
        fn = functools.partial(_lib_capture, lib, c, names, **opts)
        out.append(Variant(f"{prefix}_{kind}", f"{prefix}.capture(model, {shown})", fn, floor))
    return out


def _envoy(root: Any, name: str) -> Any:
    """nnsight's proxy for the module at dotted ``name`` (``ModuleList`` parts by index)."""
    for part in name.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def _nnsight(case: Case, wrapped: Any, names: list[str]) -> Callable[[], dict[str, Any]]:
    """``with NNsight(copy).trace(x): m.output.save()`` per module (saves alias live tensors)."""
    envoys = [_envoy(wrapped, n) for n in names]

    def call() -> dict[str, Any]:
        saved = []
        with torch.no_grad(), wrapped.trace(*case.args, **case.kwargs):
            for envoy in envoys:
                saved.append(envoy.output.save())
        return dict(zip(names, saved, strict=True))

    return call


def _torchlens(case: Case, model: nn.Module, names: list[str] | None) -> Callable[[], Any]:
    """``torchlens.trace(copy, x, save=tl.module(a) | ...)``; ``None`` keeps its default (all)."""
    import torchlens as tl

    save = None if names is None else functools.reduce(operator.or_, map(tl.module, names))

    def call() -> Any:
        # torchlens warns on every GPT-2 trace (transformers' masking code), not about us.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tl.trace(model, list(case.args), input_kwargs=case.kwargs, save=save)

    return call


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
        # nnsight needs the leaves that run, in execution order: the order hand hooks see
        ran = list(hand_capture(c, c.leaves, id)[1])
        label = "NNsight(copy).trace(x), .output.save() of"
        out.append(
            Variant("nnsight_sel", f"{label} {sel}", _nnsight(c, wrapped, c.selection), "hs_sel")
        )
        label += f" the {len(ran)} leaves that run (aliases, no copy)"
        out.append(Variant("nnsight_leaves", label, _nnsight(c, wrapped, ran), "hs_leaves_ref"))
    if "torchlens_sel" in keys:
        model = copy.deepcopy(c.model)
        label = f"torchlens.trace(copy, x, save=tl.module(a) | ...), {sel}"
        fn = _torchlens(c, model, c.selection)
        out.append(Variant("torchlens_sel", label, fn, "hs_sel", "torchlens", heavy=True))
        label = "torchlens.trace(copy, x): every op's output (its default)"
        fn = _torchlens(c, model, None)
        out.append(Variant("torchlens_all", label, fn, "hs_leaves_clone", "torchlens", heavy=True))
    return out


def build_variants(
    case: Case, keys: tuple[str, ...], baseline: ModuleType | None = None
) -> dict[str, Variant]:
    """The variants named by ``keys`` (``bl_*`` need ``baseline``), in a fixed order."""
    import hookscope as hs

    built = [Variant("plain", "model(x) under no_grad", case.plain), *_hand_variants(case)]
    built += _hs_variants(case, hs, "hs") + (_hs_variants(case, baseline, "bl") if baseline else [])
    variants = {v.key: v for v in built if v.key in keys}
    variants.update((v.key, v) for v in _peer_variants(case, keys))
    return variants


# -- untimed correctness checks ----------------------------------------------------------------


class _Checks:
    """Each step compares a variant's values with the hand-written clone floor."""

    def __init__(self, case: Case, variants: dict[str, Variant]) -> None:
        self.case, self.v = case, variants
        self.rows: list[dict[str, Any]] = []
        self.sel: dict[str, Any] = {}
        self.leaves: dict[str, Any] = {}
        self.overwritten: set[str] = set()

    def add(self, what: str, value: Any, ok: bool | None = None) -> None:
        self.rows.append({"what": what, "value": str(value), "ok": ok})

    def captured(self, key: str, names: list[str]) -> dict[str, Any]:
        """Latest output of every layer among ``names`` that ran in one call of ``key``."""
        cap = self.v[key].fn()[1]
        return {n: cap[n].output for n in names if len(cap[n])}

    def equal(self, key: str, got: dict[str, Any], want: dict[str, Any], floor: str) -> None:
        same = [n for n in want if n in got and common.trees_equal(got[n], want[n])]
        ok = len(same) == len(want) == len(got)
        self.add(f"`{key}` equals the {floor} (torch.equal)", f"{len(same)} of {len(want)}", ok)

    def floors(self) -> None:
        self.sel = self.v["hand_sel_clone"].fn()[1]
        self.leaves = self.v["hand_leaves_clone"].fn()[1]
        n, want = len(self.leaves), self.case.in_place
        self.add("leaves that run in one forward", f"{n} of {len(self.case.leaves)}")
        detached = self.v["hand_leaves_detach"].fn()[1]
        self.overwritten = {
            k for k, t in detached.items() if not common.trees_equal(t, self.leaves[k])
        }
        what = f"leaf outputs overwritten in place later in the forward (expected {want})"
        self.add(what, f"{len(self.overwritten)} of {n}", len(self.overwritten) == want)

    def hookscope(self) -> None:
        sel, leaves, clone = self.case.selection, self.case.leaves, "hand clone floor"
        for p in ("hs", "bl") if "bl_sel" in self.v else ("hs",):
            self.equal(f"{p}_sel", self.captured(f"{p}_sel", sel), self.sel, clone)
            got = self.captured(f"{p}_leaves_clone", leaves)
            self.equal(f"{p}_leaves_clone", got, self.leaves, clone)
        hand = self.v["hand_leaves_reduce"].fn()[1]
        got = self.captured("hs_leaves_reduce", leaves)
        self.equal("hs_leaves_reduce", got, hand, f"hand {self.case.reduce} floor")

    def reference(self) -> None:
        import hookscope as hs

        cap, stale, equal = self.v["hs_leaves_ref"].fn()[1], set(), 0
        for name, want in self.leaves.items():
            try:
                equal += common.trees_equal(cap[name].output, want)
            except hs.StaleCaptureError:
                stale.add(name)
        self.add(
            "`hs_leaves_ref` equals the clone floor, or raises StaleCaptureError exactly on "
            "the outputs overwritten in place",
            f"{equal} equal, {len(stale)} stale",
            equal + len(stale) == len(self.leaves) and stale == self.overwritten,
        )

    def early_stop(self) -> None:
        name, ran = self.case.stop_layer, []
        modules = dict(self.case.model.named_modules())
        handles = [
            modules[n].register_forward_pre_hook(lambda m, a, n=n: ran.append(n))
            for n in self.case.leaves
        ]
        try:
            out, cap = self.v["hs_stop"].fn()
        finally:
            for handle in handles:
                handle.remove()
        ok = out is None and common.trees_equal(cap[name].output, self.sel[name])
        self.add(f"`hs_stop`: {name} equals the clone floor, no model output", ok, ok)
        n = len(self.leaves)
        self.add("`hs_stop`: leaves that ran before the stop", f"{len(ran)} of {n}", len(ran) < n)
        ok = common.trees_equal(self.v["hand_stop"].fn()[1][name], self.sel[name])
        self.add(f"`hand_stop`: {name} equals the clone floor", ok, ok)

    def peers(self) -> None:
        if "nnsight_sel" in self.v:
            self.equal("nnsight_sel", self.v["nnsight_sel"].fn(), self.sel, "hand clone floor")
            got = self.v["nnsight_leaves"].fn()
            wrong = {n for n, t in got.items() if not common.trees_equal(t, self.leaves[n])}
            self.add(
                "`nnsight_leaves`: values that differ from the clone floor (allowed only for "
                "outputs overwritten in place: nnsight keeps aliases)",
                f"{len(wrong)} of {len(got)}",
                wrong <= self.overwritten and len(got) == len(self.leaves),
            )
        if "torchlens_sel" in self.v:
            with torchlens_wrapped():
                trace = self.v["torchlens_sel"].fn()
                got = {n: trace.modules[n].out for n in self.case.selection}
                self.equal("torchlens_sel", got, self.sel, "hand clone floor")

    def untouched(self) -> None:
        hooks = sum(
            len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
            for m in self.case.model.modules()
        )
        self.add("hooks left on the benchmarked model after everything", hooks, hooks == 0)


def run_checks(case: Case, variants: dict[str, Variant]) -> list[dict[str, Any]]:
    checks = _Checks(case, variants)
    steps = (checks.floors, checks.hookscope, checks.reference, checks.early_stop, checks.peers)
    for step in (*steps, checks.untouched):
        try:
            step()
        except Exception as e:  # one broken check must not lose the run's other results
            checks.add(f"check {step.__name__} raised", f"{type(e).__name__}: {e}", False)
    return checks.rows


# -- workers -----------------------------------------------------------------------------------


def _import_baseline(path: str | None) -> tuple[ModuleType | None, str | None]:
    if not path:
        return None, None
    sys.path.insert(0, path)
    try:
        return importlib.import_module("hookscope_baseline"), None
    except Exception as e:  # the report says so instead of losing the run
        return None, f"{type(e).__name__}: {e}"


def _timing(spec: Result) -> Result:
    case = build_case(spec["model"], spec["quick"])
    baseline, error = _import_baseline(spec["baseline"])
    keys = CORE + tuple(f"bl_{k}" for k in HS_KINDS if baseline) + PEERS[spec["peers"]]
    variants = build_variants(case, keys, baseline)
    blocks = {"torchlens": torchlens_wrapped}
    samples, noise = common.run_rounds(list(variants.values()), Plan(**spec["plan"]), blocks)
    params = sum(p.numel() for p in case.model.parameters()) / 1e6
    return {
        **spec,
        "case": f"{case.description}; {params:.1f} M parameters, {len(case.leaves)} leaves",
        "variants": {k: {"label": v.label, "floor": v.floor} for k, v in variants.items()},
        "samples": samples,
        "noise": noise,
        "baseline_error": error,
        "checks": run_checks(case, variants),
    }


def _memory(spec: Result) -> Result:
    """Peak and retained RSS of one variant, alone in a fresh process."""
    case = build_case(spec["model"], spec["quick"])
    fn = build_variants(case, (spec["variant"],))[spec["variant"]].fn
    for warm in (case.plain, case.plain, fn):  # lazy initialisation stays out of the figures
        warm()
    runs = [common.measure_rss(fn) for _ in range(spec["repeats"])]
    return {**spec, **{k: statistics.median(r[k] for r in runs) for k in runs[0]}}


LATENCY = {
    "plain": "model(x), no hooks",
    "raw_noop": "raw forward hook on every site that does nothing",
    "raw_clone": "raw forward hook on every site that stores out.detach().clone()",
    "hs_clone": "hs.capture(model, sites)",
    "hs_ref": "hs.capture(model, sites, copy='reference')",
}
_EACH = ", set up and torn down around every forward"
LATENCY.update({f"{k}_percall": v + _EACH for k, v in list(LATENCY.items())[1:]})
#: The raw hook each hookscope latency variant is divided by (per-site cost above plain).
LATENCY_BASES = {"hs_clone": "raw_clone", "hs_ref": "raw_noop"}
LATENCY_BASES.update({f"{k}_percall": f"{b}_percall" for k, b in LATENCY_BASES.items()})
#: DESIGN.md: clone mode <= 1.1x a raw hook that clones; reference mode <= 2x a raw no-op hook.
LATENCY_TARGETS = (("hs_clone", 1.1), ("hs_ref", 2.0))


def tiny_mlp() -> nn.Sequential:
    """25 x (Linear(32, 32), ReLU) = 50 sites at batch 1: Python overhead dominates."""
    torch.manual_seed(0)
    return nn.Sequential(*(m for _ in range(25) for m in (nn.Linear(32, 32), nn.ReLU()))).eval()


@contextlib.contextmanager
def _raw_hooks(model: nn.Module, sites: list[str], clone: bool) -> Iterator[dict[str, Tensor]]:
    modules, store = dict(model.named_modules()), {}

    def keep(name: str) -> Callable[[nn.Module, Any, Tensor], None]:
        def hook(module: nn.Module, args: Any, out: Tensor) -> None:
            store[name] = out.detach().clone()

        return hook

    def noop(module: nn.Module, args: Any, out: Tensor) -> None:
        return None

    handles = [modules[n].register_forward_hook(keep(n) if clone else noop) for n in sites]
    try:
        yield store
    finally:
        for handle in handles:
            handle.remove()


def _session(
    hs: ModuleType, model: nn.Module, sites: list[str], kind: str
) -> contextlib.AbstractContextManager[Any]:
    if kind == "plain":
        return contextlib.nullcontext()
    if kind.startswith("raw_"):
        return _raw_hooks(model, sites, clone=kind == "raw_clone")
    return hs.capture(model, sites, copy="clone" if kind == "hs_clone" else "reference")


def _block(
    hs: ModuleType, model: nn.Module, x: Tensor, sites: list[str], key: str, calls: int
) -> Any:
    """``calls`` forwards, with hooks around the block (steady state) or around every call."""
    kind = key.removesuffix("_percall")
    if kind == key:
        with _session(hs, model, sites, kind) as kept:
            for _ in range(calls):
                model(x)
        return kept
    for _ in range(calls):
        with _session(hs, model, sites, kind) as kept:
            model(x)
    return kept


def _profile(
    hs: ModuleType, model: nn.Module, x: Tensor, sites: list[str], calls: int
) -> list[list[Any]]:
    """hookscope's 10 functions with the most own time, steady state, µs per site-call."""
    profile = cProfile.Profile()
    with hs.capture(model, sites):
        profile.enable()
        for _ in range(calls):
            model(x)
        profile.disable()
    root, per = str(Path(hs.__file__).parent), 1e6 / (calls * len(sites))
    stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
    ours = sorted(
        (kv for kv in stats.items() if kv[0][0].startswith(root)), key=lambda kv: -kv[1][2]
    )
    # [function, calls, own µs, cumulative µs] per row
    return [
        [f"{Path(f).relative_to(root)}:{line} {fn}", n, tt * per, ct * per]
        for (f, line, fn), (_, n, tt, ct, _callers) in ours[:10]
    ]


def _latency(spec: Result) -> Result:
    import hookscope as hs

    model, x = tiny_mlp(), torch.randn(1, 32)
    sites, calls = leaf_names(model), spec["calls"]
    variants = [
        Variant(k, label, functools.partial(_block, hs, model, x, sites, k, calls))
        for k, label in LATENCY.items()
    ]
    with torch.no_grad():
        samples, noise = common.run_rounds(variants, Plan(spec["warmup"], spec["rounds"]), {})
        profile = _profile(hs, model, x, sites, calls * 3)
    return {**spec, "sites": len(sites), "samples": samples, "noise": noise, "profile": profile}


def work(spec: Result) -> Result:
    """Worker entry (one process): ``spec["kind"]`` is timing, memory or latency."""
    common.set_threads()
    return {"timing": _timing, "memory": _memory, "latency": _latency}[spec["kind"]](spec)


def jobs(cfg: Config) -> list[Job]:
    quick, out = cfg.quick, []
    for model in MODELS:
        for setting in cfg.settings:
            # Peers only where the library's own cost is isolated; torchlens (seconds per call)
            # only in the first 5 rounds of a full run, so the fast variants get more rounds.
            peers = "none" if setting != "tuned" else "nnsight" if quick else "all"
            budget = 0 if quick else BUDGETS[f"{model}/{setting}"] * (1.5 if cfg.baseline else 1)
            plan = {"warmup": 1, "rounds": 2 if quick else 20, "min_rounds": 5}
            plan.update(budget_s=budget, heavy_rounds=0 if quick else 5)
            spec = {"kind": "timing", "model": model, "setting": setting, "quick": quick}
            spec.update(peers=peers, baseline=cfg.baseline, plan=plan)
            out.append(Job("capture", f"timing_{model}_{setting}", spec, setting))
    rounds, warmup, calls = (3, 1, 20) if quick else (30, 3, 100)
    lat = {"kind": "latency", "rounds": rounds, "warmup": warmup, "calls": calls}
    out.append(Job("capture", "latency", lat, "tuned"))
    for model in MODELS:
        for key in ("plain", "hs_leaves_reduce") if quick else MEMORY:
            spec = {"kind": "memory", "model": model, "variant": key, "quick": quick}
            spec["repeats"] = 1 if quick else 2
            out.append(Job("capture", f"memory_{model}_{key}", spec, "memory", alone=False))
    return out


# -- report ------------------------------------------------------------------------------------


def _site_costs(lat: Result) -> dict[str, dict[int, float]]:
    """µs per site per forward above the plain forward of the same round, per round."""
    plain, scale = common.per_round(lat["samples"], "plain"), 1e6 / (lat["calls"] * lat["sites"])
    costs = {k: common.per_round(lat["samples"], k) for k in LATENCY}
    return {
        k: {r: (s - plain[r]) * scale for r, s in c.items() if r in plain} for k, c in costs.items()
    }


def _targets(timing: Runs, memory: Runs, lat: Result | None, baseline: bool) -> list[Target]:
    out = []
    for model in MODELS:
        runs = {SETTINGS[s]: r for (m, s), r in timing.items() if m == model}
        for what, key, base, limit in TARGETS if runs else ():
            if baseline or not base.startswith("bl_"):
                cells = {col: common.paired(r["samples"], key, base) for col, r in runs.items()}
                out.append(Target(what, TITLES[model], cells, limit))
        plain, reduced = memory.get((model, "plain")), memory.get((model, "hs_leaves_reduce"))
        if plain and reduced and plain["peak_mib"] > 0:
            m = reduced["peak_mib"] / plain["peak_mib"]
            what = "memory: every leaf, reduce= — peak RSS ÷ plain forward's peak"
            out.append(Target(what, TITLES[model], {"other": Ratio(m, m, m, 1)}, 1.1))
    costs = _site_costs(lat) if lat else {}
    for key, limit in LATENCY_TARGETS if costs else ():
        base = LATENCY_BASES[key]
        what = f"per-site cost, tiny MLP: `{key}` ÷ `{base}` (each over plain)"
        cells = {"other": common.ratio(costs[key], costs[base])}
        out.append(Target(what, "tiny MLP", cells, limit))
    return out


def _cell(samples: list[Result], key: str, what: str, base: str | None) -> str:
    if what == "ratio":
        r = common.paired(samples, key, base)
        return f"{r.median:.2f}" if r else DASH
    x = common.median(samples, key, "minflt" if what == "faults" else "seconds")
    if x is None:
        return DASH
    if what == "ms":
        return f"{x * 1e3:.0f}"
    return f"{x / 1e3:.0f}k" if x >= 1e4 else f"{x:.0f}"


def _cells(runs: list[Result], key: str, what: str, base: str | None = "plain") -> str:
    """``what`` ("ms", "faults" or "ratio" to ``base``) per malloc setting, joined by " / "."""
    return " / ".join(_cell(r["samples"], key, what, base) for r in runs)


def _model_section(model: str, timing: Runs, memory: Runs) -> list[str]:
    runs = [timing[model, s] for s in SETTINGS if (model, s) in timing]
    if not runs:
        return []
    cols = " / ".join(SETTINGS[r["setting"]] for r in runs)
    lines = [f"## Capture: {TITLES[model]}", "", f"{runs[0]['case']}. Cells: {cols}.", ""]
    header = ["variant", "what is timed", "median ms", "÷ plain", "floor", "÷ floor"]
    rows = []
    for key, v in runs[0]["variants"].items():
        mem, floor = memory.get((model, key)), v["floor"]
        vs_floor = [f"`{floor}`", _cells(runs, key, "ratio", floor)] if floor else [DASH, DASH]
        rows.append(
            [f"`{key}`", v["label"], _cells(runs, key, "ms"), _cells(runs, key, "ratio")]
            + [*vs_floor, _cells(runs, key, "faults")]
            + [f"{mem[k]:.0f}" if mem else DASH for k in ("peak_mib", "retained_mib")]
        )
    lines += common.table([*header, "faults/call", "peak MiB", "retained MiB"], rows)
    for r in runs:
        n, noise = len(common.per_round(r["samples"], "plain")), r["noise"]
        (lo, hi), warm = noise["loadavg"], r["plan"]["warmup"]
        lines.append(
            f"* {SETTINGS[r['setting']]}: {n} measured rounds (+{warm} warm-up) in "
            f"{noise['rounds_s']:.0f} s; load average {lo:.1f}{DASH}{hi:.1f}; "
            f"steal {noise['steal_ticks']} ticks (10 ms each)."
        )
        if r.get("baseline_error"):
            lines.append(f"* **The baseline could not be imported**: {r['baseline_error']}")
    return [*lines, ""]


def _latency_section(lat: Result | None) -> list[str]:
    if lat is None:
        return []
    costs = _site_costs(lat)
    lines = [
        f"## Capture: per-site cost, tiny MLP ({lat['sites']} sites, batch 1)",
        "",
        f"Each sample is {lat['calls']} forwards; per-site cost = (variant minus plain of the "
        f"same round) / {lat['sites']}, µs, median [q1{DASH}q3] over {len(costs['plain'])} rounds.",
        "",
    ]
    rows = []
    for key, label in LATENCY.items():
        fwd, base = common.median(lat["samples"], key), LATENCY_BASES.get(key)
        q1, med, q3 = common.quartiles(list(costs[key].values()))
        cost = f"{med:.2f} [{q1:.2f}{DASH}{q3:.2f}]" if key != "plain" else DASH
        r = common.ratio(costs[key], costs[base]) if base else None
        per_fwd = f"{fwd / lat['calls'] * 1e6:.0f}" if fwd else DASH
        rows.append([f"`{key}`", label, per_fwd, cost, f"{r.cell()} `{base}`" if r else DASH])
    lines += common.table(["variant", "what", "µs per forward", "µs per site", "÷ raw hook"], rows)
    lines += [
        "hookscope's own functions, steady state (cProfile inflates Python several-fold):",
        "",
    ]
    rows = [[f"`{f}`", str(n), f"{own:.2f}", f"{cum:.2f}"] for f, n, own, cum in lat["profile"]]
    return lines + common.table(["function", "calls", "own µs/site-call", "cum µs/site-call"], rows)


def _checks_section(timing: Runs) -> list[str]:
    lines = ["## Capture: checks (untimed, after the timed rounds)", ""]
    marks = {True: "ok", False: "**FAILED**", None: "info"}
    order = [(m, s) for m in MODELS for s in SETTINGS if (m, s) in timing]
    for model, setting in order:
        run = timing[model, setting]
        failed = [c for c in run["checks"] if c["ok"] is False]
        title = f"**{TITLES[model]}**, {SETTINGS[setting]} process"
        if setting != "tuned" and not failed:  # the same checks as the tuned process
            lines += [f"{title}: all {sum(c['ok'] is True for c in run['checks'])} checks ok.", ""]
            continue
        lines += [f"{title}:", ""]
        lines += [f"* [{marks[c['ok']]}] {c['what']}: {c['value']}" for c in run["checks"]] + [""]
    return lines


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    """The targets and this capability's sections of RESULTS.md."""
    timing = {(r["model"], r["setting"]): r for r in results if r["kind"] == "timing"}
    memory = {(r["model"], r["variant"]): r for r in results if r["kind"] == "memory"}
    latency = next((r for r in results if r["kind"] == "latency"), None)
    targets = _targets(timing, memory, latency, bool(meta.get("baseline")))
    lines = [line for m in MODELS for line in _model_section(m, timing, memory)]
    return targets, lines + _latency_section(latency) + _checks_section(timing)
