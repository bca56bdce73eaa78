"""Device benchmark (``bench/run.py --device cuda``): hookscope beside hand-written floors and
peers on a GPU, and the host synchronisations each entry point makes.

One timing process per case (model and dtype) runs its variants once per round, shuffled:
per-iteration wall time between synchronisations, a variant's time in a round is the median
of its iterations, ratios are taken per round, then median and q1-q3 over rounds. One process
counts synchronisations with ``torch.cuda.set_sync_debug_mode("warn")``. ``--device cpu
--quick`` runs every row once on tiny models (the smoke test: no CUDA, so no counts).
Method and rows: bench/README.md, "Device".
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib.util
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import _common as common
import capture
from _common import DASH, Config, Job, Plan

Result = dict[str, Any]
Fn = Callable[[], Any]

BASE = ("capture", "edit", "features", "summary", "grads", "nonfinite")
#: Cases in the table's order, each with its row groups.
CASES: dict[str, tuple[str, ...]] = {
    "resnet50/fp32": (*BASE, "anomaly", "monitor", "gradcam", "extract"),
    "gpt2/fp32": (*BASE, "anomaly", "monitor"),
    "llama1b/bf16": BASE,
    "resnet50/bf16": (*BASE, "anomaly", "monitor"),
    "gpt2/bf16": (*BASE, "anomaly", "monitor"),
}
GROUPS = (*BASE, "anomaly", "monitor", "gradcam", "extract", "syncs")
SYNC_MODELS = ("cnn", "gpt2")
MODELS = ("resnet50", "gpt2", "llama1b", "cnn")
#: Seconds of rounds per case in a full run: no round starts past it after the third.
BUDGETS = {"resnet50/fp32": 90, "gpt2/fp32": 80, "llama1b/bf16": 40, "resnet50/bf16": 45,
           "gpt2/bf16": 40}  # fmt: skip
ITERS, ROUNDS = 3, 7
#: (group, numerator, denominator), in the table's order.
ROWS = (
    ("capture", "few", "plain"), ("capture", "hand_few", "plain"),
    ("capture", "every", "hand_every"), ("capture", "ref_every", "hand_noop"),
    ("capture", "offload", "hand_offload"), ("capture", "offload", "plain"),
    ("edit", "edit", "hand_edit"), ("features", "features", "plain"),
    ("summary", "summary", "plain"), ("summary", "torchinfo", "plain"),
    ("grads", "grads", "hand_grads"), ("grads", "grads", "plain_step"),
    ("grads", "hand_grads", "plain_step"), ("nonfinite", "nonfinite", "plain_step"),
    ("anomaly", "anomaly", "plain_step"), ("monitor", "monitor10", "plain10"),
    ("monitor", "monitor10_tb", "plain10"), ("gradcam", "gradcam", "hand_floor"),
    ("gradcam", "pgc", "gradcam"), ("gradcam", "captum", "gradcam"),
    ("extract", "extract", "hand_loop"),
)  # fmt: skip
TRAIN = {"plain_step", "grads", "hand_grads", "nonfinite", "anomaly", "plain10", "monitor10",
         "monitor10_tb"}  # fmt: skip
SLOW = {"plain10", "monitor10", "monitor10_tb", "extract", "hand_loop"}  # one iteration a round
#: Variants that need a package the GPU machine may lack: skipped with a note.
NEEDS = {"torchinfo": "torchinfo", "pgc": "pytorch_grad_cam", "captum": "captum",
         "extract": "zarr", "monitor10_tb": "tensorboard"}  # fmt: skip
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
PEERS = ("transformers", "torchvision", "captum", "torchinfo", "grad-cam", "zarr", "tensorboard")
SYNC = "called a synchronizing"


def _missing(key: str) -> str | None:
    need = NEEDS.get(key)
    return f"{need} not installed" if need and importlib.util.find_spec(need) is None else None


def _logits(out: Any) -> Tensor:
    return out if isinstance(out, Tensor) else out.logits


# -- cases -------------------------------------------------------------------------------------


def _resnet(quick: bool) -> tuple[nn.Module, list[str], str]:
    """torchvision's ResNet-50 where it works, else HF's; with ``quick``, HF's with the same
    16 bottleneck blocks narrowed (a smoke run)."""
    if not quick:
        try:
            import torchvision

            model: nn.Module = torchvision.models.resnet50()
            return model, [f"layer{i}" for i in range(1, 5)], "torchvision resnet50"
        except Exception:  # missing, or a build whose operators do not load
            pass
    from transformers import ResNetConfig, ResNetForImageClassification

    stages = [f"resnet.encoder.stages.{i}" for i in range(4)]
    widths = capture.NARROW_RESNET if quick else {}
    config = ResNetConfig(num_labels=1000, **widths)
    what = f"HF ResNetForImageClassification(ResNetConfig({'narrow' if quick else ''}))"
    return ResNetForImageClassification(config), stages, what


def _lm(name: str, quick: bool) -> tuple[nn.Module, list[str], int, str]:
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    if name == "gpt2":
        cfg = GPT2Config(n_embd=64, n_head=2, vocab_size=1000) if quick else GPT2Config()
        cfg.use_cache = False
        blocks = [f"transformer.h.{i}" for i in range(cfg.n_layer)]
        what = f"GPT2LMHeadModel(GPT2Config({'n_embd=64' if quick else ''}))"
        return GPT2LMHeadModel(cfg), blocks, cfg.vocab_size, what
    size = (64, 256, 2, 4, 1, 1000) if quick else (2048, 8192, 16, 16, 4, 32000)
    keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "vocab_size")  # fmt: skip
    cfg = LlamaConfig(**dict(zip(keys, size, strict=True)), use_cache=False)
    blocks = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
    what = "LlamaForCausalLM(hidden {}, MLP {}, {} layers, {} heads, {} KV heads)".format(*size)
    return LlamaForCausalLM(cfg), blocks, cfg.vocab_size, what


def build(case: str, device: torch.device, quick: bool) -> tuple[capture.Case, Tensor]:
    """The case on ``device`` in its dtype (selection: the blocks; stop_layer: the middle one)
    and labels for its training step."""
    name, dtype = case.split("/")
    torch.manual_seed(0)
    with torch.device(device):
        if name == "resnet50":
            model, blocks, what = _resnet(quick)
            classes, reduce, middle = 1000, "spatial_mean", blocks[2]
        else:
            model, blocks, classes, what = _lm(name, quick)
            reduce, middle = "token_mean", blocks[len(blocks) // 2 - 1]
    model = model.to(DTYPES[dtype]).eval()
    if name == "resnet50":
        b, side = (2, 32) if quick else (64, 224)
        shape: tuple[int, ...] = (b, 3, side, side)
        x = torch.randn(shape).to(device, DTYPES[dtype])
        labels = torch.randint(0, classes, (b,))
    else:
        shape = (2, 16) if quick else (8, 512) if name == "gpt2" else (4, 1024)
        x = torch.randint(0, classes, shape).to(device)
        labels = torch.randint(0, classes, shape)
    params = sum(p.numel() for p in model.parameters()) / 1e6
    what += f", {params:.1f} M parameters, input {'x'.join(map(str, shape))}, {dtype}"
    c = capture.Case(case, model, (x,), {}, blocks, middle, reduce, 0, what)
    return c, labels.to(device)


# -- variants ----------------------------------------------------------------------------------


def _to_host(t: Tensor) -> Tensor:
    """The hand offload: a pinned buffer, a non-blocking copy (what hookscope promises)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _hooked(model: nn.Module, names: list[str], hook: Any, fn: Fn) -> Any:
    """``fn()`` with ``hook(name)`` as a forward hook on each of ``names``, for this call."""
    modules = dict(model.named_modules())
    handles = [modules[n].register_forward_hook(hook(n)) for n in names]
    try:
        return fn()
    finally:
        for handle in handles:
            handle.remove()


def _keep_grad(kept: dict[Any, Any], key: Any, grad: Tensor) -> None:
    kept[key] = grad.clone()


def _hand_grads(case: capture.Case, step: Fn) -> dict[Any, Any]:
    """Hooks cloning the outputs, tensor hooks on them cloning their gradients."""
    kept: dict[Any, Any] = {}

    def hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def keep(module: nn.Module, args: Any, out: Any) -> None:
            kept[name] = common.map_tensors(capture._clone, out)
            for i, t in enumerate(common.tensors(out)):
                if t.requires_grad:
                    t.register_hook(functools.partial(_keep_grad, kept, (name, i)))

        return keep

    _hooked(case.model, case.selection, hook, step)
    return kept


def _inference(case: capture.Case, groups: tuple[str, ...]) -> dict[str, Fn]:
    import hookscope as hs

    model, x, few, leaves = case.model, case.args[0], case.selection, case.leaves

    def lib(names: list[str], **options: Any) -> Fn:
        return functools.partial(capture._lib_capture, hs, case, names, **options)

    def hand(names: list[str], store: Callable[[Tensor], Any]) -> Fn:
        return functools.partial(capture.hand_capture, case, names, store)

    def half(name: str) -> Callable[[nn.Module, Any, Any], Any]:
        return lambda module, args, out: common.map_tensors(lambda t: t * 0.5, out)

    def edited() -> Any:
        with torch.no_grad(), hs.edit(model, dict.fromkeys(few, hs.scale(0.5))):
            return model(x)

    fns: dict[str, Fn] = {"plain": case.plain}
    if "capture" in groups:
        fns.update(few=lib(few), hand_few=hand(few, capture._clone), every=lib(leaves),
                   hand_every=hand(leaves, capture._clone), hand_noop=hand(leaves, Tensor.detach),
                   ref_every=lib(leaves, copy="reference"), offload=lib(few, device="cpu"),
                   hand_offload=hand(few, _to_host))  # fmt: skip
    if "edit" in groups:
        fns["edit"] = edited
        fns["hand_edit"] = lambda: _hooked(model, few, half, case.plain)
    if "features" in groups:
        fns["features"] = lambda: hs.features(model, x, [case.stop_layer])
    if "summary" in groups:
        fns["summary"] = lambda: hs.summary(model, x)
        fns["torchinfo"] = lambda: __import__("torchinfo").summary(model, input_data=x, verbose=0)
    return fns


def _training(
    case: capture.Case, labels: Tensor, groups: tuple[str, ...], tmp: Path
) -> dict[str, Fn]:
    import hookscope as hs

    model, x = case.model, case.args[0]
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def step() -> None:
        F.cross_entropy(_logits(model(x)).flatten(0, -2).float(), labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def inside(ctx: Callable[[], contextlib.AbstractContextManager[Any]]) -> Fn:
        def run() -> Any:
            with ctx() as got:
                step()
            return got

        return run

    def monitored(sinks: list[Any]) -> Fn:
        def run() -> Any:
            with hs.Monitor(model, every=10, sinks=sinks) as mon:
                for _ in range(10):
                    step()
                    mon.step()
            return mon

        return run

    fns: dict[str, Fn] = {"plain_step": step}
    if "grads" in groups:
        fns["grads"] = inside(lambda: hs.capture(model, case.selection, grads=True))
        fns["hand_grads"] = lambda: _hand_grads(case, step)
    if "nonfinite" in groups:
        fns["nonfinite"] = inside(lambda: hs.nonfinite(model))
    if "anomaly" in groups:
        fns["anomaly"] = inside(torch.autograd.detect_anomaly)
    if "monitor" in groups:
        fns.update(plain10=lambda: [step() for _ in range(10)], monitor10=monitored([]),
                   monitor10_tb=monitored([("tensorboard", str(tmp / "tb"))]))  # fmt: skip
    return fns


def cam_floor(model: nn.Module, layer: nn.Module, x: Tensor, targets: Tensor) -> Tensor:
    """Grad-CAM's floor: keep the layer's output, autograd.grad of the target logits to it."""
    kept: list[Tensor] = []
    handle = layer.register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        logits = _logits(model(x))
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), kept[0])
    cam = F.relu((grad.mean((2, 3), keepdim=True) * kept[0]).sum(1)).detach()
    return F.interpolate(cam[:, None], size=x.shape[-2:], mode="bilinear")[:, 0]


class _Logits(nn.Module):
    """The logits tensor, for peers that want one (HF models return dicts)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return _logits(self.model(x))


def _set_up(key: str, make: Callable[[], Fn], fns: dict[str, Fn], skipped: dict[str, str]) -> None:
    """``fns[key] = make()``, or the reason it failed in ``skipped`` (a peer whose own
    dependencies are missing: its rows say so, the others go on)."""
    if why := _missing(key):
        skipped[key] = why
        return
    try:
        fns[key] = make()
    except Exception as e:
        skipped[key] = f"could not be set up: {_error(e)}"


def _pgc(model: nn.Module, layer: nn.Module, x: Tensor, targets: Tensor) -> Fn:
    import _peers

    pgc, model_targets = _peers.pytorch_grad_cam()
    theirs = pgc.GradCAM(_Logits(model), [layer])
    wanted = [model_targets.ClassifierOutputTarget(int(k)) for k in targets]

    def run() -> Any:
        maps = theirs(input_tensor=x, targets=wanted)
        model.zero_grad(set_to_none=True)  # it ran a full backward into the parameters
        return maps

    return run


def _captum(model: nn.Module, layer: nn.Module, x: Tensor, targets: Tensor) -> Fn:
    from captum.attr import LayerGradCam

    return functools.partial(LayerGradCam(_Logits(model), layer).attribute, x, target=targets)


def _gradcam(case: capture.Case, skipped: dict[str, str]) -> dict[str, Fn]:
    """Grad-CAM of each image's top class, batch 32, at the last stage."""
    import hookscope as hs

    model, name, x = case.model, case.selection[3], case.args[0][:32]
    layer = dict(model.named_modules())[name]
    with torch.no_grad():
        targets = _logits(model(x)).argmax(1)
    fns: dict[str, Fn] = {
        "hand_floor": lambda: cam_floor(model, layer, x, targets),
        "gradcam": lambda: hs.GradCAM(model, name)(x, targets=targets).maps,
    }
    _set_up("pgc", lambda: _pgc(model, layer, x, targets), fns, skipped)
    _set_up("captum", lambda: _captum(model, layer, x, targets), fns, skipped)
    return fns


def _extract(case: capture.Case, tmp: Path, quick: bool) -> dict[str, Fn]:
    """2,048 random images from a CPU tensor, the middle stage's spatial mean, batch 64."""
    import hookscope as hs

    model, name, x = case.model, case.stop_layer, case.args[0]
    layer = dict(model.named_modules())[name]
    torch.manual_seed(2)  # drawn on the device (fast), kept on the host as a dataset is
    data = torch.randn(128 if quick else 2048, *x.shape[1:], device=x.device).cpu()

    def ours() -> Any:
        return hs.extract(model, data, [name], out=tmp / "hs", batch_size=64,
                          reduce="spatial_mean", overwrite=True, progress=False)  # fmt: skip

    def stop(module: nn.Module, args: Any, out: Tensor) -> None:
        kept.append(out)
        raise capture._StopHere

    kept: list[Tensor] = []

    def hand() -> None:
        shutil.rmtree(tmp / "hand", ignore_errors=True)
        (tmp / "hand").mkdir()
        for i in range(0, len(data), 64):
            kept.clear()
            handle = layer.register_forward_hook(stop)
            try:
                with torch.no_grad(), contextlib.suppress(capture._StopHere):
                    model(data[i : i + 64].to(x.device))
            finally:
                handle.remove()
            np.save(tmp / "hand" / f"{i // 64:05d}.npy", kept[0].mean((2, 3)).float().cpu())

    return {"extract": ours, "hand_loop": hand}


def variants(
    case: capture.Case, labels: Tensor, groups: tuple[str, ...], tmp: Path, quick: bool
) -> tuple[dict[str, Fn], dict[str, str]]:
    """The timed calls of ``groups``, and why any is skipped (a peer not installed)."""
    fns, skipped = _inference(case, groups), {}
    fns.update(_training(case, labels, groups, tmp))
    if "gradcam" in groups:
        fns.update(_gradcam(case, skipped))
    if "extract" in groups and not _missing("extract"):
        fns.update(_extract(case, tmp, quick))
    wanted = {k for g, a, b in ROWS if g in groups for k in (a, b)}
    skipped |= {k: why for k in sorted(wanted) if (why := _missing(k))}
    return {k: fn for k, fn in fns.items() if k in wanted and k not in skipped}, skipped


# -- timing ------------------------------------------------------------------------------------


def _iterations(fn: Fn, n: int, sync: Fn) -> list[float]:
    gc.collect()
    sync()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
        del out  # freed untimed
    return times


def run_rounds(
    fns: dict[str, Fn], model: nn.Module, plan: Plan, iters: int, sync: Fn
) -> tuple[list[Result], dict[str, str], Result]:
    """Every variant once per round, shuffled; a variant that raises is dropped with its error."""
    rng, samples, errors = random.Random(0), [], {}
    start = time.perf_counter()
    for rnd, measured in common.rounds(plan):
        keys = [k for k in fns if k not in errors]
        rng.shuffle(keys)
        for key in keys:
            model.train(key in TRAIN)
            try:
                times = _iterations(fns[key], 1 if key in SLOW else iters, sync)
            except Exception as e:  # a row says so; the other rows go on
                errors[key] = _error(e)
                model.zero_grad(set_to_none=True)
                continue
            seconds = statistics.median(times)
            samples.append({"key": key, "round": rnd, "warmup": measured < 0, "seconds": seconds})
    model.eval()
    return samples, errors, {"rounds_s": time.perf_counter() - start}


def _close(a: Any, b: Any, rtol: float) -> bool:
    ta, tb = common.tensors(a), common.tensors(b)
    return len(ta) == len(tb) > 0 and all(
        torch.allclose(x.float(), y.float(), rtol=rtol, atol=rtol * float(y.abs().max()))
        for x, y in zip(ta, tb, strict=True)
    )


def checks(fns: dict[str, Fn], case: capture.Case, tmp: Path) -> list[Result]:
    """Untimed: each hookscope variant computes what its floor computes."""
    rtol = 1e-3 if case.args[0].dtype != torch.bfloat16 else 3e-2
    layer = case.stop_layer

    def capture_same() -> bool:
        ours, theirs = fns["few"]()[1], fns["hand_few"]()[1]
        return len(theirs) == len(case.selection) and all(
            _close(ours[n].output, t, rtol) for n, t in theirs.items()
        )

    def store_same() -> bool:
        got, _ = fns["extract"]().to_numpy(layer), fns["hand_loop"]()
        want = np.concatenate([np.load(p) for p in sorted((tmp / "hand").glob("*.npy"))])
        return bool(np.allclose(got.reshape(want.shape), want, rtol=rtol, atol=1e-5))

    steps = {
        "hs.capture(few) equals the hand clone floor": (("few", "hand_few"), capture_same),
        "hs.edit(scale(0.5)) output equals the hand hooks'": (
            ("edit", "hand_edit"), lambda: _close(fns["edit"](), fns["hand_edit"](), rtol)),
        "hs.GradCAM maps equal the hand floor's": (
            ("gradcam", "hand_floor"), lambda: _close(fns["gradcam"](), fns["hand_floor"](), rtol)),
        "the hs.extract store equals the hand loop's .npy files": (
            ("extract", "hand_loop"), store_same),
    }  # fmt: skip
    out = []
    for what, (keys, check) in steps.items():
        if set(keys) <= fns.keys():
            try:
                out.append({"what": what, "ok": bool(check())})
            except Exception as e:
                out.append({"what": f"{what} (raised {type(e).__name__}: {e})", "ok": False})
    return out


def _timing(spec: Result, device: torch.device) -> Result:
    case, labels = build(spec["case"], device, spec["quick"])
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with tempfile.TemporaryDirectory() as tmp:
        fns, skipped = variants(case, labels, tuple(spec["groups"]), Path(tmp), spec["quick"])
        plan = Plan(**spec["plan"])
        samples, errors, noise = run_rounds(fns, case.model, plan, spec["iters"], sync)
        verdicts = checks({k: f for k, f in fns.items() if k not in errors}, case, Path(tmp))
    return {**spec, "what": case.description, "samples": samples, "errors": errors,
            "skipped": skipped, "noise": noise, "checks": verdicts}  # fmt: skip


# -- host synchronisations ---------------------------------------------------------------------


def _hookscope_frame() -> str:
    """The innermost hookscope frame on the stack ("" if the model itself synchronised)."""
    import hookscope

    root = Path(hookscope.__file__).parent
    frame = sys._getframe(1)
    while frame is not None:
        path = Path(frame.f_code.co_filename)
        if path.is_relative_to(root):
            where = Path("hookscope") / path.relative_to(root)
            return f"{where}:{frame.f_lineno} in {frame.f_code.co_name}"
        frame = frame.f_back  # type: ignore[assignment]
    return ""


def count(fn: Fn, cuda: bool) -> tuple[list[str] | None, Any]:
    """(the hookscope frame of each synchronisation ``fn()`` made, its result); on a CPU
    there is nothing to count (None)."""
    if not cuda:
        return None, fn()
    frames: list[str] = []

    def seen(message: Any, *args: Any, **kwargs: Any) -> None:
        if SYNC in str(message):
            frames.append(_hookscope_frame())

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = seen  # runs inside the synchronising call: its stack is there
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return frames, result


def _sync_model(name: str, device: torch.device, quick: bool) -> tuple[Any, ...]:
    """(model, input, labels, few layers, middle layer, reduce) for the synchronisation table."""
    torch.manual_seed(0)
    with torch.device(device):
        if name == "cnn":
            model: nn.Module = nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(),
                nn.Conv2d(16, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                nn.Flatten(), nn.Linear(16, 10),
            )  # fmt: skip
            x, labels = torch.randn(8, 3, 32, 32), torch.randint(0, 10, (8,))
            return model.eval(), x, labels, ["0", "3"], "3", "spatial_mean"
        model, blocks, vocab, _ = _lm("gpt2", quick)
        ids = torch.randint(0, vocab, (2, 16 if quick else 64))
        return model.eval(), ids, ids, blocks, blocks[len(blocks) // 2 - 1], "token_mean"


def _read(cap: Any) -> list[Any]:
    """Everything a capture kept: outputs, and inputs and gradients where recorded."""
    got = []
    for name in cap:
        for call in cap[name].calls:
            got.append(call.output)
            for side in ("inputs", "grad"):
                with contextlib.suppress(Exception):  # not recorded: not there to read
                    got.append(getattr(call, side))
    return got


def _entries(hs: Any, m: tuple[Any, ...], cam: bool) -> list[tuple[Any, ...]]:
    """(entry point, its call[, how its results are read[, an untimed setup]])."""
    model, x, labels, few, middle, reduce = m
    every = capture.leaf_names(model)
    loss = lambda: F.cross_entropy(_logits(model(x)).flatten(0, -2).float(), labels.flatten())  # noqa: E731
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def plain() -> Any:
        with torch.no_grad():
            return model(x)

    def step() -> None:
        loss().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def cap(names: list[str], forwards: int = 1, backward: bool = False, **o: Any) -> Fn:
        def run() -> Any:
            with torch.set_grad_enabled(backward), hs.capture(model, names, **o) as c:
                for _ in range(forwards):
                    loss().backward() if backward else model(x)
            model.zero_grad(set_to_none=True)
            return c

        return run

    def edit(make: Fn, backward: bool = False) -> Fn:
        def run() -> Any:
            edits = dict.fromkeys(few, make())
            with torch.set_grad_enabled(backward), hs.edit(model, edits):
                loss().backward() if backward else model(x)
            model.zero_grad(set_to_none=True)
            return edits[few[0]]

        return run

    with torch.no_grad(), hs.capture(model, few) as source:
        model(x)
    extractor, clip = hs.FeatureExtractor(model, [middle]), hs.clip_grad(norm=1.0)
    targets = torch.arange(len(x), device=x.device) % 10
    rows = [
        ("plain forward (no_grad)", plain),
        ("plain train step", step),
        ("capture(few)", cap(few), _read),
        ("capture(every leaf)", cap(every), _read),
        ('capture(few, copy="reference")', cap(few, copy="reference"), _read),
        ('capture(every leaf, copy="reference")', cap(every, copy="reference"), _read),
        ("capture(few, grads=True) + backward", cap(few, 1, True, grads=True), _read),
        ("capture(every leaf, grads=True) + backward", cap(every, 1, True, grads=True), _read),
        ('capture(few, device="cpu") [offload]', cap(few, device="cpu"), _read),
        ('capture(few, grads=True, device="cpu") + backward',
         cap(few, 1, True, grads=True, device="cpu"), _read),
        (f'capture(every leaf, reduce="{reduce}")', cap(every, reduce=reduce), _read),
        ("capture(few, keep=2) x3 forwards", cap(few, 3, keep=2), _read),
        ('capture(few, keep="all") x2 forwards', cap(few, 2, keep="all"), _read),
        ("capture(few, max_bytes=2**34)", cap(few, max_bytes=2**34), _read),
        ("capture(few, inputs=True)", cap(few, inputs=True), _read),
        ("capture(few, stop=True)", cap(few, stop=True), _read),
        ("features([middle])", lambda: hs.features(model, x, [middle])),
        ("FeatureExtractor([middle])(x)", lambda: extractor(x)),
        ("edit(few: scale(0.5))", edit(lambda: hs.scale(0.5))),
        ("edit(few: ablate())", edit(hs.ablate)),
        ("edit(few: patch(capture))", edit(lambda: hs.patch(source))),
        ('edit(few: scale(0.5, on="grad")) + backward',
         edit(lambda: hs.scale(0.5, on="grad"), True)),
        ("edit(few: clip_grad(norm=1.0)) + backward", edit(lambda: clip, True),
         lambda c: c.report()),
        ("summary(model, x)", lambda: hs.summary(model, x)),
        ("nonfinite: 3 training steps", lambda: _nonfinite(hs, model, step)),
        ("clip_grad_norm(model, 1.0) [after a step]", lambda: hs.clip_grad_norm(model, 1.0),
         lambda r: r.total_norm, lambda _: loss().backward()),
    ]  # fmt: skip
    if cam:  # image models: targets on the device
        rows[-3:-3] = [
            ("GradCAM(model, middle)(x, targets)",
             lambda: hs.GradCAM(model, middle)(x, targets=targets).maps),
            ("Saliency(model)(x, targets)", lambda: hs.Saliency(model)(x, targets=targets).maps),
        ]  # fmt: skip
    return rows


def _nonfinite(hs: Any, model: nn.Module, step: Fn) -> None:
    with hs.nonfinite(model):
        for _ in range(3):
            step()


def _monitor_rows(hs: Any, m: tuple[Any, ...], cuda: bool, tmp: str) -> list[Result]:
    """Monitor(every=5, optimizer=opt): step 0 logs (warm-up), 1-4 are quiet, 5 logs."""
    model, x, labels = m[:3]
    rows = []
    for title, sinks in (("Monitor", []), ("Monitor+TensorBoard", [("tensorboard", tmp)])):
        opt = torch.optim.SGD(model.parameters(), lr=1e-5)

        def step(opt: Any = opt) -> None:
            F.cross_entropy(_logits(model(x)).flatten(0, -2).float(), labels.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        with hs.Monitor(model, every=5, optimizer=opt, sinks=sinks):
            step()
            quiet, _ = count(lambda: [step() for _ in range(4)], cuda)
            logged, _ = count(step, cuda)
        rows += [(f"{title}: 4 quiet steps", quiet), (f"{title}: 1 logging step", logged)]
    return [{"entry": e, "call": f} for e, f in rows]


def no_read(result: Any) -> None:
    """Nothing to read (the row shows a dash), or no setup."""


def _syncs(spec: Result, device: torch.device) -> Result:
    import hookscope as hs

    cuda, rows = device.type == "cuda", []
    for name in spec["models"]:
        m = _sync_model(name, device, spec["quick"])
        for entry, run, *more in _entries(hs, m, cam=name == "cnn"):
            read, setup = (*more, no_read, no_read)[:2]
            row: Result = {"model": name, "entry": entry}
            try:
                for counted in (False, True):  # a warm-up call first: lazy state stays out
                    setup(None)
                    frames, result = count(run, cuda and counted)
                    read_frames = count(functools.partial(read, result), cuda and counted)[0]
                row["call"] = frames
                if read is not no_read:
                    row["read"] = read_frames
            except Exception as e:
                row["error"] = _error(e)
            rows.append(row)
        with tempfile.TemporaryDirectory() as tmp:
            try:
                rows += [{"model": name, **r} for r in _monitor_rows(hs, m, cuda, tmp)]
            except Exception as e:
                rows.append({"model": name, "entry": "Monitor", "error": _error(e)})
    return {**spec, "rows": rows}


def _error(e: Exception) -> str:
    return f"{type(e).__name__}: {str(e).strip().splitlines()[0][:200]}"


# -- jobs and workers --------------------------------------------------------------------------


def _machine(device: torch.device) -> Result:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    versions = {p: common._version(p) for p in PEERS}
    return {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda, **versions}


def work(spec: Result) -> Result:
    """Worker entry (one process): a case's timing rounds, or the synchronisation counts."""
    if os.environ.get(common.THREADS_ENV):
        common.set_threads()
    warnings.simplefilter("ignore")  # transformers' and peers' warnings are not results
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    device = torch.device(spec["device"])
    result = (_timing if spec["kind"] == "timing" else _syncs)(spec, device)
    return {**result, "device_info": _machine(device)}


def _picked(case: str, models: tuple[str, ...]) -> bool:
    return not models or case in models or case.split("/")[0] in models


def jobs(cfg: Config) -> list[Job]:
    """One process per case (in the table's order), then the synchronisation counts."""
    out, quick = [], cfg.quick
    for case, all_groups in CASES.items():
        groups = [g for g in all_groups if not cfg.rows or g in cfg.rows]
        if not groups or not _picked(case, cfg.models):
            continue
        plan = {"warmup": 0 if quick else 1, "rounds": 1 if quick else ROUNDS, "min_rounds": 3,
                "budget_s": 0 if quick else BUDGETS[case]}  # fmt: skip
        spec = {"kind": "timing", "case": case, "groups": groups, "device": cfg.device,
                "quick": quick, "iters": 1 if quick else ITERS, "plan": plan}  # fmt: skip
        out.append(Job("gpu", f"timing_{case.replace('/', '_')}", spec, "defaults"))
    models = [m for m in SYNC_MODELS if _picked(m, cfg.models)]
    if models and (not cfg.rows or "syncs" in cfg.rows):
        spec = {"kind": "syncs", "models": models, "device": cfg.device, "quick": quick}
        out.append(Job("gpu", "syncs", spec, "defaults"))
    return out


# -- report ------------------------------------------------------------------------------------


def _ratio_rows(run: Result) -> list[Result]:
    """The case's rows: median [q1-q3] of same-round ratios and the medians in ms, or why not."""
    s, rows = run["samples"], []
    for group, num, den in ROWS:
        if group not in run["groups"]:
            continue
        row: Result = {"case": run["case"], "ratio": f"{num}/{den}"}
        why = [run["skipped"].get(k) or run["errors"].get(k) for k in (num, den)]
        r = common.paired(s, num, den)
        if any(why) or r is None:
            skipped = any(k in run["skipped"] for k in (num, den))
            row["note"] = ("skipped: " if skipped else "error: ") + next(w for w in why if w)
        else:
            row.update(median=r.median, q1=r.q1, q3=r.q3, rounds=r.n)
            row.update(num_ms=common.median(s, num) * 1e3, den_ms=common.median(s, den) * 1e3)  # type: ignore[operator]
        rows.append(row)
    return rows


def _ratio_cells(row: Result) -> list[str]:
    if "note" in row:
        return [row["case"], row["ratio"], row["note"], ""]
    spread = f"{row['median']:.3f} [{row['q1']:.3f}-{row['q3']:.3f}]"
    return [row["case"], row["ratio"], spread, f"{row['num_ms']:.2f} ms / {row['den_ms']:.2f} ms"]


def _sync_cell(frames: list[str] | None, error: str | None = None) -> str:
    return error or ("n/a (no CUDA)" if frames is None else str(len(frames)))


def _sync_lines(runs: list[Result]) -> list[str]:
    rows = [r for run in runs for r in run["rows"]]
    if not rows:
        return []
    lines = [
        "## GPU: host synchronisations per call (torch.cuda.set_sync_debug_mode)",
        "",
        "Counted after one warm-up call (models in eval mode; Monitor(every=5, optimizer=opt): "
        "step 0 logs, then 4 quiet steps, then a logging step). The frame is the innermost "
        "hookscope frame on the stack at each synchronisation (blank: the model's own code).",
        "",
    ]
    for r in rows:  # the model's own synchronisations ride along in every row
        if r["entry"].startswith("plain forward") and r.get("call"):
            lines += [f"{r['model']}'s plain forward synchronises {len(r['call'])} time(s) "
                      "itself: every row of that model carries it.", ""]  # fmt: skip
    header = ["model", "entry point", "syncs in the call", "syncs when reading results",
              "first hookscope frame"]  # fmt: skip
    body = []
    for r in rows:
        frames = [f for f in dict.fromkeys((r.get("call") or []) + (r.get("read") or [])) if f]
        read = _sync_cell(r["read"]) if "read" in r else DASH
        body.append([r["model"], r["entry"], _sync_cell(r.get("call"), r.get("error")), read,
                     "; ".join(frames)])  # fmt: skip
    return [*lines, *common.table(header, body)]


def _method(timing: list[Result]) -> list[str]:
    plan, iters = (timing[0]["plan"], timing[0]["iters"]) if timing else ({}, ITERS)
    rounds = ", ".join(
        f"{r['case']} {len({s['round'] for s in r['samples'] if not s['warmup']})}" for r in timing
    )
    return [
        "Method: per-iteration wall time between synchronisations; a variant's time per round "
        f"is the median of its iterations ({iters}; 1 for the 10-step and extraction variants), "
        "ratios per round, then median and q1-q3 over rounds "
        f"({plan.get('rounds')} after {plan.get('warmup')} warm-up round, fewer where a case's "
        f"time budget ran out: {rounds}); TF32 matmul off, cudnn.benchmark off. Rows and "
        'variants: bench/README.md, "Device".',
        "",
    ]


def summarize(results: list[Result], meta: Result) -> tuple[Result, list[str]]:
    """(the JSON summary, the markdown section) of a device run's worker results."""
    order = list(CASES)
    timing = sorted((r for r in results if r.get("kind") == "timing"),
                    key=lambda r: order.index(r["case"]))  # fmt: skip
    syncs = [r for r in results if r.get("kind") == "syncs"]
    info = next((r["device_info"] for r in results if "device_info" in r), {})
    rows = [row for run in timing for row in _ratio_rows(run)]
    failures = [f"{r['job']}: {r['stderr'][-800:]}" for r in results if r.get("kind") == "error"]
    versions = ", ".join(f"{k} {v}" for k, v in info.items() if k not in ("gpu", "cuda"))
    sha = next((r["machine"]["hookscope_sha1"] for r in results if "machine" in r), "?")
    lines = [
        f"## GPU: hookscope on {info.get('gpu', '?')} (measured {meta.get('started', '?')})",
        "",
        f"Machine: {info.get('gpu', '?')}, CUDA {info.get('cuda')}; {versions}; hookscope "
        f"source sha1 {sha}. Command: `{meta.get('command', '?')}`, "
        f"{meta.get('total_s', 0) / 60:.1f} min.",
        "",
        *_method(timing),
    ]
    lines += [
        *common.table(
            ["case", "ratio", "median [q1-q3]", "numerator / denominator"],
            [_ratio_cells(r) for r in rows],
        ),
    ]
    for run in timing:
        bad = [c["what"] for c in run["checks"] if not c["ok"]]
        verdict = f"**FAILED**: {'; '.join(bad)}" if bad else f"{len(run['checks'])} ok"
        lines.append(f"* {run['case']}: {run['what']}; rounds {run['noise']['rounds_s']:.0f} s; "
                     f"checks {verdict}.")  # fmt: skip
    lines += [f"* **worker failed** {f}" for f in failures] + [""] + _sync_lines(syncs)
    checks = {run["case"]: run["checks"] for run in timing}
    summary = {"meta": meta, "device": info, "hookscope_sha1": sha, "rows": rows,
               "checks": checks, "syncs": [r for s in syncs for r in s["rows"]],
               "failures": failures}  # fmt: skip
    return summary, lines
