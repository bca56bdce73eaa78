"""Explain capability: Grad-CAM and Grad-CAM++ on HF ResNet-50 (batch 8) ÷ a plain forward,
beside the autograd-to-layer floor written by hand, pytorch-grad-cam and Captum's
``LayerGradCam`` in the same process; Score-CAM, full and with a budget of top-k channels,
beside pytorch-grad-cam's, on the demo's shapes CNN (its full map costs one forward per
channel and image: on ResNet-50's 2,048 channels that is 16k forwards, hours on 2 cores).

The floor keeps the layer's output from a forward hook, takes ``torch.autograd.grad`` of the
summed target logits to it (no parameter gradient) and weights the output by its mean
gradient: what any Grad-CAM must do at least.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import _common as common
import _peers
import capture
from _common import DASH, SETTINGS, Config, Job, Plan, Target, Variant

Result = dict[str, Any]
LAYER = "resnet.encoder.stages.3"
LABELS = {
    "plain": "forward, no_grad (the unit)",
    "floor": "hand-written: forward hook, autograd.grad to the layer, weighted sum",
    "hs_gradcam": "hs.GradCAM built once, called on (x, targets list)",
    "pgc_gradcam": "pytorch-grad-cam GradCAM (full backward)",
    "captum_gradcam": "Captum LayerGradCam.attribute",
    "hs_gradcampp": "hs.GradCAMPlusPlus, built once",
    "pgc_gradcampp": "pytorch-grad-cam GradCAMPlusPlus",
}
SCORE_LABELS = {
    "score_plain": "forward, no_grad (the unit)",
    "hs_scorecam": "hs.ScoreCAM, every channel",
    "hs_scorecam_topk": "hs.ScoreCAM(top_k=3): 3 of 32 channels",
    "pgc_scorecam": "pytorch-grad-cam ScoreCAM (every channel)",
}


class _Logits(nn.Module):
    """HF model -> logits tensor, for the peers that want a tensor output."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x).logits


def _floor(model: nn.Module, layer: nn.Module, x: Tensor, targets: Tensor) -> Tensor:
    kept: list[Tensor] = []
    handle = layer.register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        logits = model(x).logits
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), kept[0])
    cam = F.relu((grad.mean((2, 3), keepdim=True) * kept[0]).sum(1)).detach()
    return F.interpolate(cam[:, None], size=x.shape[-2:], mode="bilinear")[:, 0]


def _gradcam_variants(quick: bool) -> tuple[list[Variant], list[Result]]:
    from captum.attr import LayerGradCam

    import hookscope as hs

    pgc, model_targets = _peers.pytorch_grad_cam()
    case = capture.build_case("resnet50", quick)
    model, x = case.model, case.args[0]
    layer = dict(model.named_modules())[LAYER]
    with torch.no_grad():
        targets = model(x).logits.argmax(1)
    labels = targets.tolist()  # what a user holds: a list of classes (no device read then)
    wanted = [model_targets.ClassifierOutputTarget(int(k)) for k in targets]
    gradcam, gradcampp = hs.GradCAM(model, LAYER), hs.GradCAMPlusPlus(model, LAYER)
    logits = _Logits(model)
    captum = LayerGradCam(logits, layer)
    peers = {
        "gradcam": pgc.GradCAM(logits, [layer]),
        "gradcampp": pgc.GradCAMPlusPlus(logits, [layer]),
    }

    def peer(name: str) -> Any:
        def run() -> Any:
            out = peers[name](input_tensor=x, targets=wanted)
            model.zero_grad(set_to_none=True)  # it ran a full backward into the parameters
            return out

        return run

    fns = {
        "plain": case.plain,
        "floor": lambda: _floor(model, layer, x, targets),
        "hs_gradcam": lambda: gradcam(x, targets=labels).maps,
        "pgc_gradcam": peer("gradcam"),
        "captum_gradcam": lambda: captum.attribute(x, target=targets),
        "hs_gradcampp": lambda: gradcampp(x, targets=labels).maps,
        "pgc_gradcampp": peer("gradcampp"),
    }
    ours, floor = fns["hs_gradcam"](), _floor(model, layer, x, targets)
    same = torch.allclose(ours, floor, rtol=1e-4, atol=1e-5 * float(floor.max()))
    checks = [{"what": "hs.GradCAM equals the hand-written floor's map", "ok": bool(same)}]
    return [Variant(k, LABELS[k], fn) for k, fn in fns.items()], checks


def _spearman(a: Tensor, b: Tensor) -> float:
    ra = a.flatten(1).argsort(1).argsort(1).float()
    rb = b.flatten(1).argsort(1).argsort(1).float()
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return float(((ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))).mean())


def _scorecam_variants(quick: bool) -> tuple[list[Variant], list[Result], Result]:
    import hookscope as hs
    from hookscope.show import shapes, train

    pgc, model_targets = _peers.pytorch_grad_cam()
    model = train(100 if quick else 300, size=32, progress_bar=False)
    x, y, _ = shapes(2 if quick else 8, torch.Generator().manual_seed(5), size=32)
    full = hs.ScoreCAM(model, "7", batch_size=64)
    budget = hs.ScoreCAM(model, "7", batch_size=64, top_k=3)
    theirs = pgc.ScoreCAM(model, [model[7]])
    theirs.batch_size = 64  # as ours
    wanted = [model_targets.ClassifierOutputTarget(int(k)) for k in y]

    def pgc_run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return theirs(input_tensor=x, targets=wanted)

    fns = {
        "score_plain": lambda: model(x).detach(),
        "hs_scorecam": lambda: full(x, targets=y),
        "hs_scorecam_topk": lambda: budget(x, targets=y),
        "pgc_scorecam": pgc_run,
    }
    a, b = full(x, targets=y), budget(x, targets=y)
    info = {
        "rho": _spearman(a.raw, b.raw),
        "forwards": full.cost(x)["forwards"],
        "forwards_topk": budget.cost(x)["forwards"],
        "case": f"ShapesCNN, {len(x)}x1x32x32",
    }
    same = torch.from_numpy(pgc_run())
    ours = a.normalized()
    checks = [{"what": "hs.ScoreCAM equals pytorch-grad-cam's map (both min-max scaled)",
               "ok": bool(torch.allclose(ours, same, atol=1e-3))}]  # fmt: skip
    variants = [Variant(k, SCORE_LABELS[k], fn) for k, fn in fns.items()]
    return variants, checks, info


def work(spec: Result) -> Result:
    common.set_threads()
    warnings.simplefilter("ignore")  # transformers' and peers' warnings are not results
    plan = Plan(**spec["plan"])
    with torch.enable_grad():
        if spec["model"] == "resnet50":
            variants, checks = _gradcam_variants(spec["quick"])
            info: Result = {}
        else:
            variants, checks, info = _scorecam_variants(spec["quick"])
        samples, noise = common.run_rounds(variants, plan, {})
    return {**spec, "samples": samples, "noise": noise, "checks": checks, "info": info}


def jobs(cfg: Config) -> list[Job]:
    return common.timing_jobs("explain", cfg, {"resnet50": 150, "shapes": 60}, rounds=15)


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    runs = {r["model"]: r for r in results}
    targets, rows = [], []
    if "resnet50" in runs:
        s = runs["resnet50"]["samples"]
        cell = {SETTINGS["tuned"]: common.paired(s, "hs_gradcam", "floor")}
        targets.append(
            Target("Grad-CAM ÷ (forward + autograd-to-layer floor)", "ResNet-50", cell, 1.05)
        )
        cell = {SETTINGS["tuned"]: common.paired(s, "hs_gradcam", "captum_gradcam")}
        targets.append(Target("Grad-CAM ÷ Captum's LayerGradCam", "ResNet-50", cell, 1.0))
        for key, label in LABELS.items():
            ms = common.median(s, key)
            ratios = [_cell(s, key, base) for base in ("plain", "floor", "hs_gradcam")]
            rows.append([f"ResNet-50: `{key}`", label, f"{ms * 1e3:.0f}" if ms else DASH, *ratios])
    if "shapes" in runs:
        s, info = runs["shapes"]["samples"], runs["shapes"]["info"]
        cell = {SETTINGS["tuned"]: common.paired(s, "hs_scorecam", "pgc_scorecam")}
        targets.append(
            Target("Score-CAM ÷ pytorch-grad-cam's (same maps)", "shapes CNN", cell, 1.0)
        )
        for key, label in SCORE_LABELS.items():
            ms = common.median(s, key)
            ratios = [_cell(s, key, "score_plain"), DASH, _cell(s, key, "hs_scorecam")]
            rows.append([f"shapes: `{key}`", label, f"{ms * 1e3:.1f}" if ms else DASH, *ratios])
    lines = [
        "## Explain: CAM cost",
        "",
        "One malloc-tuned process per case runs every variant once per round, shuffled; ratios "
        f"are medians [q1{DASH}q3] of same-round ratios. Gradient methods run with gradients "
        f"enabled on the eval-mode model, targets = each image's top class, layer `{LAYER}`.",
        "",
        *common.table(
            ["variant", "what is timed", "median ms", "÷ plain", "÷ floor", "÷ hs"], rows
        ),
    ]
    for model, run in runs.items():
        ok = all(c["ok"] for c in run["checks"]) and run["checks"]
        what = "; ".join(c["what"] for c in run["checks"])
        unit = "plain" if model == "resnet50" else "score_plain"
        (lo, hi), n = run["noise"]["loadavg"], len(common.per_round(run["samples"], unit))
        verdict = "all ok" if ok else "**FAILED**"
        lines.append(
            f"* {model}: {n} measured rounds, load average {lo:.1f}{DASH}{hi:.1f}; "
            f"checks ({what}): {verdict}."
        )
    if "shapes" in runs:
        info = runs["shapes"]["info"]
        lines.append(
            f"* Score-CAM case: {info['case']}, layer `7` (32 channels): {info['forwards']} extra "
            f"image forwards for the full map, {info['forwards_topk']} with top_k=3; rank "
            f"correlation of the top-k map with the full one {info['rho']:.2f} (Spearman, mean "
            "over images)."
        )
    lines.append(
        "* Why Score-CAM can miss its <= 1.00 target: both libraries run the same masked "
        "forwards in batches of 64 of a 1.9 ms model, so Python per batch (masks, target "
        f"scores) is all that differs: a few percent, inside a q1{DASH}q3 range that straddles 1 "
        "on this machine."
    )
    return targets, [*lines, ""]


def _cell(samples: list[Result], key: str, base: str) -> str:
    r = common.paired(samples, key, base) if key != base else None
    return r.cell() if r else DASH
