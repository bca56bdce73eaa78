"""Explain: Grad-CAM and Grad-CAM++ on HF ResNet-50 beside the autograd-to-layer floor,
pytorch-grad-cam and Captum; Score-CAM (every channel and top-k) beside pytorch-grad-cam's on
the demo's shapes CNN (ResNet-50's 2,048 channels would take 16k forwards). README.md."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import _harness as h
import _peers
import capture
from _harness import Config, Job, Plan, Result, Variant
from _report import Target

TITLE = "Explain: CAM methods beside the autograd floor, pytorch-grad-cam and Captum"
LAYER = "resnet.encoder.stages.3"
LABELS = {
    "plain": "forward, no_grad (the unit)",
    "floor": "hand-written: forward hook, autograd.grad to the layer, weighted sum",
    "hs_gradcam": "hs.GradCAM built once, called on (x, targets list)",
    "pgc_gradcam": "pytorch-grad-cam GradCAM (full backward)",
    "captum_gradcam": "Captum LayerGradCam.attribute",
    "hs_gradcampp": "hs.GradCAMPlusPlus, built once",
    "pgc_gradcampp": "pytorch-grad-cam GradCAMPlusPlus",
    "score_plain": "forward, no_grad (the unit)",
    "hs_scorecam": "hs.ScoreCAM, every channel",
    "hs_scorecam_topk": "hs.ScoreCAM(top_k=3): 3 of 32 channels",
    "pgc_scorecam": "pytorch-grad-cam ScoreCAM (every channel)",
}
FLOORS = {"hs_gradcam": "floor", "pgc_gradcam": "hs_gradcam", "captum_gradcam": "hs_gradcam",
          "hs_gradcampp": "floor", "pgc_gradcampp": "hs_gradcampp",
          "hs_scorecam_topk": "hs_scorecam", "pgc_scorecam": "hs_scorecam"}  # fmt: skip
TARGETS = [
    Target("explain/resnet50", "hs_gradcam", "floor", 1.05, "Grad-CAM ÷ forward + autograd floor"),
    Target("explain/resnet50", "hs_gradcam", "captum_gradcam", 1.0, "Grad-CAM ÷ Captum's"),
    Target("explain/shapes", "hs_scorecam", "pgc_scorecam", 1.0, "Score-CAM ÷ pytorch-grad-cam's"),
]


class Logits(nn.Module):
    """The model's logits as a tensor (HF models return dicts), for peers and floors."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: Tensor) -> Tensor:
        out = self.model(x)
        return out if isinstance(out, Tensor) else out.logits


def cam_floor(model: nn.Module, layer: nn.Module, x: Tensor, targets: Tensor) -> Tensor:
    """What any Grad-CAM must do at least: keep the layer's output, ``autograd.grad`` of the
    summed target logits to it (no parameter gradient), weight it by its mean gradient."""
    kept: list[Tensor] = []
    handle = layer.register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        logits = Logits(model)(x)
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(logits.gather(1, targets[:, None]).sum(), kept[0])
    cam = F.relu((grad.mean((2, 3), keepdim=True) * kept[0]).sum(1)).detach()
    return F.interpolate(cam[:, None], size=x.shape[-2:], mode="bilinear")[:, 0]


def pgc_run(cam: Any, model: nn.Module, x: Tensor, targets: Any) -> Any:
    """A pytorch-grad-cam call; it runs a full backward into the parameters, which is cleared."""
    _, model_targets = _peers.pytorch_grad_cam()
    wanted = [model_targets.ClassifierOutputTarget(int(k)) for k in targets]

    def run() -> Any:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            maps = cam(input_tensor=x, targets=wanted)
        model.zero_grad(set_to_none=True)
        return maps

    return run


def _gradcam(quick: bool) -> tuple[dict[str, Any], Result]:
    from captum.attr import LayerGradCam

    import hookscope as hs

    pgc, _ = _peers.pytorch_grad_cam()
    case = capture.build_case("resnet50", quick)
    model, x = case.model, case.args[0]
    layer = dict(model.named_modules())[LAYER]
    with torch.no_grad():
        targets = model(x).logits.argmax(1)
    labels = targets.tolist()  # what a user holds: a list of classes (no device read then)
    gradcam, gradcampp = hs.GradCAM(model, LAYER), hs.GradCAMPlusPlus(model, LAYER)
    captum = LayerGradCam(Logits(model), layer)
    fns = {
        "plain": case.plain,
        "floor": lambda: cam_floor(model, layer, x, targets),
        "hs_gradcam": lambda: gradcam(x, targets=labels).maps,
        "pgc_gradcam": pgc_run(pgc.GradCAM(Logits(model), [layer]), model, x, targets),
        "captum_gradcam": lambda: captum.attribute(x, target=targets),
        "hs_gradcampp": lambda: gradcampp(x, targets=labels).maps,
        "pgc_gradcampp": pgc_run(pgc.GradCAMPlusPlus(Logits(model), [layer]), model, x, targets),
    }
    about = f"{case.description}, layer `{LAYER}`, targets = each image's top class"
    return fns, {"case": "explain/resnet50", "title": "Grad-CAM, ResNet-50", "about": about}


def _spearman(a: Tensor, b: Tensor) -> float:
    ra = a.flatten(1).argsort(1).argsort(1).float()
    rb = b.flatten(1).argsort(1).argsort(1).float()
    ra, rb = ra - ra.mean(1, keepdim=True), rb - rb.mean(1, keepdim=True)
    return float(((ra * rb).sum(1) / (ra.norm(dim=1) * rb.norm(dim=1))).mean())


def _scorecam(quick: bool) -> tuple[dict[str, Any], Result]:
    import hookscope as hs
    from hookscope.show import shapes, train

    pgc, _ = _peers.pytorch_grad_cam()
    model = train(5 if quick else 300, size=32, progress_bar=False)
    x, y, _ = shapes(2 if quick else 8, torch.Generator().manual_seed(5), size=32)
    full = hs.ScoreCAM(model, "7", batch_size=64)
    budget = hs.ScoreCAM(model, "7", batch_size=64, top_k=3)
    theirs = pgc.ScoreCAM(model, [model[7]])
    theirs.batch_size = 64  # as ours
    fns = {
        "score_plain": lambda: model(x).detach(),
        "hs_scorecam": lambda: full(x, targets=y),
        "hs_scorecam_topk": lambda: budget(x, targets=y),
        "pgc_scorecam": pgc_run(theirs, model, x, y),
    }
    values = {"extra image forwards, every channel": full.cost(x)["forwards"],
              "extra image forwards, top_k=3": budget.cost(x)["forwards"],
              "rank correlation of the top-k map with the full one (Spearman, mean over images)":
              _spearman(full(x, targets=y).raw, budget(x, targets=y).raw)}  # fmt: skip
    about = f"the demo's shapes CNN (trained in the worker), {len(x)}x1x32x32, layer `7` (32 ch.)"
    return fns, {"case": "explain/shapes", "title": "Score-CAM, shapes CNN", "about": about,
                 "values": values, "unit": "score_plain"}  # fmt: skip


def work(spec: Result) -> Result:
    h.set_threads()
    warnings.simplefilter("ignore")  # transformers' and peers' warnings are not results
    with torch.enable_grad():
        fns, info = (_gradcam if spec["model"] == "resnet50" else _scorecam)(spec["quick"])
        variants = [Variant(k, LABELS[k], fn, FLOORS.get(k)) for k, fn in fns.items()]
        result = h.timing(variants, Plan(**spec["plan"]), unit=info.get("unit", "plain"))
    return {**result, **info}


def jobs(cfg: Config) -> list[Job]:
    return h.timing_jobs("explain", cfg, {"resnet50": 150, "shapes": 60}, rounds=15)
