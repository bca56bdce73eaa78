"""Device benchmark (``bench/run.py --device cuda``, smoke run ``--device cpu --quick``):
hookscope beside hand-written floors and peers on a GPU. Rows, cases: README.md, "Device"."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import _harness as h
import _peers
import capture
import explain
import extract
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

Fn = Callable[[], Any]
TITLE = "GPU: hookscope beside hand-written floors and peers"
#: Each row group's rows (numerator, denominator), in the table's order.
ROWS: dict[str, tuple[tuple[str, str], ...]] = {
    "capture": (
        ("few", "plain"),
        ("hand_few", "plain"),
        ("every", "hand_every"),
        ("ref_every", "hand_noop"),
        ("offload", "hand_offload"),
        ("offload", "plain"),
    ),
    "edit": (("edit", "hand_edit"),),
    "features": (("features", "plain"),),
    "summary": (("summary", "plain"), ("torchinfo", "plain")),
    "grads": (("grads", "hand_grads"), ("grads", "plain_step"), ("hand_grads", "plain_step")),
    "nonfinite": (("nonfinite", "plain_step"),),
    "anomaly": (("anomaly", "plain_step"),),
    "monitor": (("monitor10", "plain10"), ("monitor10_tb", "plain10")),
    "gradcam": (("gradcam", "hand_floor"), ("pgc", "gradcam"), ("captum", "gradcam")),
    "extract": (("extract", "hand_loop"),),
}
GROUPS = tuple(ROWS)
BASE = GROUPS[:6]  # every case's: inference rows, grads, nonfinite
#: Cases in the table's order: seconds of rounds in a full run (no round starts past it after
#: the third), row groups.
CASES: dict[str, tuple[float, tuple[str, ...]]] = {
    "resnet50/fp32": (90, GROUPS),
    "gpt2/fp32": (80, GROUPS[:-2]),
    "llama1b/bf16": (40, BASE),
    "resnet50/bf16": (45, GROUPS[:-2]),
    "gpt2/bf16": (40, GROUPS[:-2]),
}
MODELS = ("resnet50", "gpt2", "llama1b")
ITERS, ROUNDS = 3, 7
TARGETS = [
    Target(f"gpu/{case}", a, b, None, group)
    for case, (_, groups) in CASES.items()
    for group in groups
    for a, b in ROWS[group]
]
#: The variants of a training step (the model in train mode).
TRAIN = {k for g in ("grads", "nonfinite", "anomaly", "monitor") for row in ROWS[g] for k in row}
SLOW = {"plain10", "monitor10", "monitor10_tb", "extract", "hand_loop"}  # one iteration a round
#: Variants that need a package the GPU machine may lack: skipped with a note.
NEEDS = {"torchinfo": "torchinfo", "pgc": "pytorch_grad_cam", "captum": "captum", "extract": "zarr"}
NEEDS["monitor10_tb"] = "tensorboard"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _missing(key: str) -> str | None:
    need = NEEDS.get(key)
    return f"{need} not installed" if need and importlib.util.find_spec(need) is None else None


#: ``LlamaConfig`` arguments of the 1B Llama
LLAMA_1B = dict(zip(capture.LLAMA_KEYS, (2048, 8192, 16, 16, 4, 32000), strict=True))


def _model(name: str, quick: bool) -> tuple[nn.Module, list[str], str]:
    """torchvision's ResNet-50 where it works (a full run), else the transformers model of
    :func:`capture.hf_model` (--quick: the small one), without a KV cache."""
    if name == "resnet50" and not quick:
        with contextlib.suppress(Exception):  # missing, or a build whose operators do not load
            import torchvision

            torch.manual_seed(0)
            model: nn.Module = torchvision.models.resnet50()
            return model, [f"layer{i}" for i in range(1, 5)], "torchvision resnet50"
    model, blocks = capture.hf_model(name, quick, LLAMA_1B)
    model.config.use_cache = False
    what = f"HF {type(model).__name__}({type(model.config).__name__}({'small' * quick}))"
    if name == "llama1b":
        what = "LlamaForCausalLM(hidden {}, MLP {}, {} layers, {} heads, {} KV heads)"
        what = what.format(*(getattr(model.config, k) for k in capture.LLAMA_KEYS))
    return model, blocks, what


def build(case: str, device: torch.device, quick: bool) -> tuple[capture.Case, Tensor]:
    """The case on ``device`` in its dtype (selection: the blocks; stop_layer: the middle one)
    and labels for its training step."""
    name, dtype = case.split("/")
    with torch.device(device):
        model, blocks, what = _model(name, quick)
    model = model.to(DTYPES[dtype]).eval()
    if name == "resnet50":
        b, side = (2, 32) if quick else (64, 224)
        shape: tuple[int, ...] = (b, 3, side, side)
        x = torch.randn(shape).to(device, DTYPES[dtype])
        labels = torch.randint(0, 1000, (b,))
        reduce, middle = "spatial_mean", blocks[2]
    else:
        shape = (2, 16) if quick else (8, 512) if name == "gpt2" else (4, 1024)
        x = torch.randint(0, model.config.vocab_size, shape).to(device)
        labels = torch.randint(0, model.config.vocab_size, shape)
        reduce, middle = "token_mean", blocks[len(blocks) // 2 - 1]
    params = sum(p.numel() for p in model.parameters()) / 1e6
    what += f", {params:.1f} M parameters, input {'x'.join(map(str, shape))}, {dtype}"
    return capture.Case(case, model, (x,), {}, blocks, middle, reduce, what), labels.to(device)


def _to_host(t: Tensor) -> Tensor:
    """The hand offload: a pinned buffer, a non-blocking copy (what hookscope promises)."""
    t = t.detach()
    if t.device.type == "cpu":
        return t.clone()
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)


def _hand_grads(case: capture.Case, step: Fn) -> dict[Any, Any]:
    """Hooks cloning the outputs, tensor hooks on them cloning their gradients."""
    kept: dict[Any, Any] = {}

    def hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def keep(module: nn.Module, args: Any, out: Any) -> None:
            kept[name] = h.map_tensors(capture.clone, out)
            for i, t in enumerate(h.tensors(out)):
                if t.requires_grad:
                    t.register_hook(lambda g, key=(name, i): kept.__setitem__(key, g.clone()))

        return keep

    capture.hooked(case.model, case.selection, hook, step)
    return kept


def _inference(case: capture.Case) -> dict[str, Fn]:
    """Every inference row's calls (building one costs nothing; variants() keeps the rows')."""
    model, x, few, leaves = case.model, case.args[0], case.selection, case.leaves

    def lib(names: list[str], **options: Any) -> Fn:
        return functools.partial(capture.lib_capture, hs, case, names, **options)

    def hand(names: list[str], store: Callable[[Tensor], Any]) -> Fn:
        return functools.partial(capture.hand_capture, case, names, store)

    def half(name: str) -> Callable[[nn.Module, Any, Any], Any]:
        return lambda module, args, out: h.map_tensors(lambda t: t * 0.5, out)

    def edited() -> Any:
        with torch.no_grad(), hs.edit(model, dict.fromkeys(few, hs.scale(0.5))):
            return model(x)

    return {
        "plain": case.plain,
        "few": lib(few),
        "hand_few": hand(few, capture.clone),
        "every": lib(leaves),
        "hand_every": hand(leaves, capture.clone),
        "hand_noop": hand(leaves, Tensor.detach),
        "ref_every": lib(leaves, copy="reference"),
        "offload": lib(few, capture_device="cpu"),
        "hand_offload": hand(few, _to_host),
        "edit": edited,
        "hand_edit": lambda: capture.hooked(model, few, half, case.plain),
        "features": lambda: hs.features(model, x, [case.stop_layer]),
        "summary": lambda: hs.summary(model, x),
        "torchinfo": lambda: __import__("torchinfo").summary(model, input_data=x, verbose=0),
    }


def _training(case: capture.Case, labels: Tensor, tmp: Path, quick: bool) -> dict[str, Fn]:
    """A training step, alone and inside each tool; 10 steps for the Monitor (--quick: 2)."""
    model, x, steps = case.model, case.args[0], 2 if quick else 10
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)

    def step() -> None:
        logits = explain.Logits(model)(x).flatten(0, -2).float()
        F.cross_entropy(logits, labels.flatten()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def monitored(sinks: list[Any]) -> Any:
        with hs.Monitor(model, every=steps, sinks=sinks) as mon:
            for _ in range(steps):
                step()
                mon.step()
        return mon

    return {
        "plain_step": step,
        "grads": h.inside(lambda: hs.capture(model, case.selection, grads=True), step),
        "hand_grads": lambda: _hand_grads(case, step),
        "nonfinite": h.inside(lambda: hs.nonfinite(model), step),
        "anomaly": h.inside(torch.autograd.detect_anomaly, step),
        "plain10": lambda: [step() for _ in range(steps)],
        "monitor10": functools.partial(monitored, []),
        "monitor10_tb": functools.partial(monitored, [("tensorboard", str(tmp / "tb"))]),
    }


def _gradcam(case: capture.Case, skipped: dict[str, str]) -> dict[str, Fn]:
    """Grad-CAM of each image's top class, batch 32, at the last stage; a peer whose own
    dependencies are missing is skipped with its error, the other rows go on."""
    model, name, x = case.model, case.selection[3], case.args[0][:32]
    layer, logits = dict(model.named_modules())[name], explain.Logits(model)
    with torch.no_grad():
        targets = logits(x).argmax(1)
    fns: dict[str, Fn] = {
        "hand_floor": lambda: explain.cam_floor(model, layer, x, targets),
        "gradcam": lambda: hs.GradCAM(model, name)(x, targets=targets).maps,
    }
    try:
        cam = _peers.pytorch_grad_cam()[0].GradCAM(logits, [layer])
        fns["pgc"] = explain.pgc_run(cam, model, x, targets)
    except Exception as e:
        skipped["pgc"] = f"could not be set up: {h.error_text(e)}"
    try:
        from captum.attr import LayerGradCam

        fns["captum"] = functools.partial(LayerGradCam(logits, layer).attribute, x, target=targets)
    except Exception as e:
        skipped["captum"] = f"could not be set up: {h.error_text(e)}"
    return fns


def _extract(case: capture.Case, tmp: Path, quick: bool) -> dict[str, Fn]:
    """2,048 random images from a CPU tensor, the middle stage's spatial mean, batch 64."""
    model, name, x = case.model, case.stop_layer, case.args[0]
    torch.manual_seed(2)  # drawn on the device (fast), kept on the host as a dataset is
    data = torch.randn(128 if quick else 2048, *x.shape[1:], device=x.device).cpu()
    batches = [lambda i=i: data[i : i + 64].to(x.device) for i in range(0, len(data), 64)]
    opts = {"batch_size": 64, "reduce": "spatial_mean", "overwrite": True, "progress": False}
    ours = functools.partial(hs.extract, model, data, [name], out=tmp / "hs", **opts)
    hand = functools.partial(extract.hand_loop, model, name, "spatial_mean", batches, tmp / "h")
    return {"extract": ours, "hand_loop": hand}


def variants(
    case: capture.Case, labels: Tensor, groups: tuple[str, ...], tmp: Path, quick: bool
) -> tuple[list[Variant], dict[str, str]]:
    """The timed calls of ``groups``, and why any is skipped (a peer not installed)."""
    fns, skipped = {**_inference(case), **_training(case, labels, tmp, quick)}, {}
    if "gradcam" in groups:
        fns.update(_gradcam(case, skipped))
    if "extract" in groups and not _missing("extract"):
        fns.update(_extract(case, tmp, quick))
    wanted = {k for g in groups for row in ROWS[g] for k in row}
    skipped |= {k: why for k in sorted(wanted) if (why := _missing(k))}

    def variant(key: str, fn: Fn) -> Variant:
        train = functools.partial(case.model.train, key in TRAIN)
        return Variant(key, "", fn, before=train, iters=1 if key in SLOW else None)

    return [variant(k, fn) for k, fn in fns.items() if k in wanted and k not in skipped], skipped


def work(spec: Result) -> Result:
    """Worker entry (one process): a case's timing rounds."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.benchmark = False
    name, device = spec["model"], torch.device(spec["device"])
    case, labels = build(name, device, spec["quick"])
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    with tempfile.TemporaryDirectory() as tmp:
        vs, skipped = variants(case, labels, tuple(spec["groups"]), Path(tmp), spec["quick"])
        plan = Plan(**spec["plan"], iters=spec["iters"])
        result = h.timing(vs, plan, sync=sync)
    case.model.eval()
    return h.named(result, f"gpu/{name}", name, case.description, skipped=skipped)


def jobs(cfg: Config) -> list[Job]:
    """One process per case, in the table's order."""
    out, iters = [], 1 if cfg.quick else ITERS
    opts = {"rounds": ROUNDS, "min_rounds": 3, "env": "defaults", "device": cfg.device}
    for case, (budget, all_groups) in CASES.items():
        groups = [g for g in all_groups if not cfg.rows or g in cfg.rows]
        picked = not cfg.models or case in cfg.models or case.split("/")[0] in cfg.models
        if groups and picked:
            out += h.timing_jobs("gpu", cfg, {case: budget}, groups=groups, iters=iters, **opts)
    return out
