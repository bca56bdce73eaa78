"""Explain: Grad-CAM(++) on ResNet-50 beside the autograd floor, pytorch-grad-cam and Captum; on
the shapes CNN, Score-CAM, IG and occlusion beside pytorch-grad-cam's and Captum's; patching on
GPT-2 beside TransformerLens' helper; capture during GPT-2's generate(). README.md, "Explain"."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import _harness as h
import _peers
import capture
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Explain: CAM, attribution and patching beside the autograd floor and peers"
LAYER = "resnet.encoder.stages.3"
#: Each variant's label and floor (the variant it is compared with besides the unit).
VARIANTS = {
    "plain": ("forward, no_grad (the unit)", None),
    "floor": ("hand-written: forward hook, autograd.grad to the layer, weighted sum", None),
    "hs_gradcam": ("hs.GradCAM built once, called on (x, targets list)", "floor"),
    "pgc_gradcam": ("pytorch-grad-cam GradCAM (full backward)", "hs_gradcam"),
    "captum_gradcam": ("Captum LayerGradCam.attribute", "hs_gradcam"),
    "hs_gradcampp": ("hs.GradCAMPlusPlus, built once", "floor"),
    "pgc_gradcampp": ("pytorch-grad-cam GradCAMPlusPlus", "hs_gradcampp"),
    "score_plain": ("forward, no_grad (the unit)", None),
    "hs_scorecam": ("hs.ScoreCAM, every channel", None),
    "hs_scorecam_topk": ("hs.ScoreCAM(top_k=3): 3 of 32 channels", "hs_scorecam"),
    "pgc_scorecam": ("pytorch-grad-cam ScoreCAM (every channel)", "hs_scorecam"),
    "hs_ig": ("hs.IntegratedGradients: 50 steps, Gauss-Legendre, 10 steps a forward", None),
    "captum_ig": ("Captum IntegratedGradients, the same (internal_batch_size=80)", "hs_ig"),
    "hs_occlusion": ("hs.Occlusion: 8x8 windows, stride 4, 64 images a forward", None),
    "captum_occlusion": ("Captum Occlusion, the same (perturbations_per_eval=8)", "hs_occlusion"),
    "tl": ("TransformerLens: run_with_cache(clean) + get_act_patch_resid_pre", None),
    "hs": ("hs.patching(clean, corrupted), 16 cells a forward", "hs_1"),
    "hs_1": ("hs.patching, cells_per_forward=1 (a forward per cell, as TL)", None),
    "gen": ("model.generate(ids): greedy, 32 new tokens (the unit)", None),
    "hs_gen": ("the same in hs.capture(model, its 12 blocks, keep='all')", None),
}
TARGETS = [
    Target("explain/resnet50", "hs_gradcam", "floor", 1.05, "Grad-CAM ÷ forward + autograd floor"),
    Target("explain/resnet50", "hs_gradcam", "captum_gradcam", 1.0, "Grad-CAM ÷ Captum's"),
    Target("explain/shapes", "hs_scorecam", "pgc_scorecam", 1.0, "Score-CAM ÷ pytorch-grad-cam's"),
    Target("explain/shapes", "hs_ig", "captum_ig", 1.0, "integrated gradients ÷ Captum's"),
    Target("explain/shapes", "hs_occlusion", "captum_occlusion", 1.0, "occlusion ÷ Captum's"),
    Target("patching/gpt2", "hs", "tl", 1 / 3, "hs.patching ÷ get_act_patch_resid_pre"),
    Target("patching/gpt2", "hs_1", "tl", None, "one cell a forward ÷ TransformerLens"),
    Target("generate/gpt2", "hs_gen", "gen", 1.05, "capture of 12 blocks during generate()"),
]


class Logits(nn.Module):
    """The model's logits as a tensor (HF models return dicts), from positional tensors only
    (``kwargs``: fixed keyword arguments), for peers, floors and fvcore's and thop's traces."""

    def __init__(self, model: nn.Module, **kwargs: Any) -> None:
        super().__init__()
        self.model, self.kwargs = model, kwargs

    def forward(self, *args: Tensor) -> Tensor:
        out = self.model(*args, **self.kwargs)
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
        maps = cam(input_tensor=x, targets=wanted)
        model.zero_grad(set_to_none=True)
        return maps

    return run


def _gradcam(quick: bool) -> tuple[dict[str, Any], Result]:
    from captum.attr import LayerGradCam

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
    ranks = torch.stack([x.flatten(1).argsort(1).argsort(1).float() for x in (a, b)], 1)
    return float(torch.stack([torch.corrcoef(r)[0, 1] for r in ranks]).mean())


def _scorecam(quick: bool) -> tuple[dict[str, Any], Result]:
    from captum.attr import IntegratedGradients, Occlusion

    from hookscope.show import shapes, train

    pgc, _ = _peers.pytorch_grad_cam()
    model = train(5 if quick else 300, size=32, progress_bar=False)
    x, y, _ = shapes(2 if quick else 8, torch.Generator().manual_seed(5), size=32)
    full = hs.ScoreCAM(model, "7", batch_size=64)
    budget = hs.ScoreCAM(model, "7", batch_size=64, top_k=3)
    theirs = pgc.ScoreCAM(model, [model[7]])
    theirs.batch_size = 64  # as ours
    ig, cig = hs.IntegratedGradients(model, internal_batch_size=80), IntegratedGradients(model)
    occ, cocc = hs.Occlusion(model, (1, 8, 8), strides=4, batch_size=64), Occlusion(model)
    labels, ppe = y.tolist(), {"perturbations_per_eval": 8}  # Captum's: 8 windows x 8 images
    fns = {
        "score_plain": lambda: model(x).detach(),
        "hs_scorecam": lambda: full(x, targets=y),
        "hs_scorecam_topk": lambda: budget(x, targets=y),
        "pgc_scorecam": pgc_run(theirs, model, x, y),
        "hs_ig": lambda: ig(x, targets=labels).raw,
        "captum_ig": lambda: cig.attribute(x, target=labels, internal_batch_size=80),
        "hs_occlusion": lambda: occ(x, targets=labels).raw,
        "captum_occlusion": lambda: cocc.attribute(x, (1, 8, 8), 4, target=labels, **ppe),
    }
    rho = _spearman(full(x, targets=y).raw, budget(x, targets=y).raw)
    values = {
        "extra image forwards, every channel": full.cost(x)["forwards"],
        "extra image forwards, top_k=3": budget.cost(x)["forwards"],
        "rank correlation of the top-k map with the full one (Spearman, mean over images)": rho,
    }
    about = f"the demo's shapes CNN (trained here), {len(x)}x1x32x32, layer `7` (32 channels)"
    title = "Score-CAM, IG, occlusion: shapes CNN"
    return fns, h.named({}, "explain/shapes", title, about, values=values, unit="score_plain")


def _lens_models(width: int) -> tuple[Any, Any]:
    """A Hugging Face GPT-2 (4 blocks, random weights) and the same weights converted into a
    TransformerLens ``HookedTransformer``, as tests/test_units_transformer_lens.py does."""
    import transformer_lens as tl
    import transformers
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=4, n_embd=width, n_head=4, vocab_size=1000)
    ).eval()
    shape = {"d_model": width, "d_head": width // 4, "n_heads": 4, "d_mlp": 4 * width}
    shape |= {"n_layers": 4, "n_ctx": 1024, "d_vocab": 1000, "eps": hf.config.layer_norm_epsilon}
    kind = {"act_fn": "gelu_new", "normalization_type": "LN", "default_prepend_bos": False}
    cfg = tl.HookedTransformerConfig(**shape, **kind, original_architecture="GPT2LMHeadModel")
    lens = tl.HookedTransformer(cfg)
    keep = dict.fromkeys(("fold_ln", "center_writing_weights", "center_unembed"), False)
    lens.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), **keep)
    return hf, lens.eval()


def _patching(quick: bool) -> tuple[dict[str, Any], Result]:
    """A layers x positions sweep of the residual stream: hs.patching on the Hugging Face model
    beside TransformerLens' helper on the same weights, checked equal before the rounds."""
    from transformer_lens import patching

    (width, length), layers = (32, 4) if quick else (256, 16), ["transformer.drop"]
    hf, tl = _lens_models(width)
    layers += [f"transformer.h.{i}" for i in range(3)]  # resid_pre of blocks 0-3
    clean = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(3))
    corrupt = torch.cat([clean[:, :1], clean[:, 1:].flip(1)], 1)
    a, b = int(clean[0, -1]), int(clean[1, -1])
    metric = lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()  # noqa: E731

    def ours(cells: int) -> Any:
        out = lambda o: metric(o.logits)  # noqa: E731
        return lambda: hs.patching(hf, clean, corrupt, out, layers, cells_per_forward=cells).values

    def theirs() -> Any:
        return patching.get_act_patch_resid_pre(tl, corrupt, tl.run_with_cache(clean)[1], metric)

    fns = {"tl": theirs, "hs": ours(16), "hs_1": ours(1)}
    same = torch.allclose(fns["hs"](), theirs().float(), rtol=0, atol=1e-5)
    about = f"GPT-2, 4 blocks {width} wide (random weights), 2 prompts of {length} tokens: "
    about += f"{4 * length} cells (resid_pre of 4 layers x {length} positions), a logit difference"
    checks = [{"what": "`hs` equals `tl` within 1e-5", "ok": same}]
    title = "Patching: residual stream sweep, GPT-2"
    return fns, h.named({}, "patching/gpt2", title, about, unit="tl", checks=checks)


def _generate(quick: bool) -> tuple[dict[str, Any], Result]:
    """GPT-2 small's greedy ``generate`` (32 new tokens every run), alone and keeping its 12
    blocks' outputs at every step: the residual stream, what the lens and patching read."""
    model, blocks = capture.hf_model("gpt2", quick)
    ids = torch.randint(0, 1000, (2, 16), generator=torch.Generator().manual_seed(4))
    fixed = {"max_new_tokens": 32, "min_new_tokens": 32, "eos_token_id": 0, "pad_token_id": 0}
    fixed |= {"attention_mask": torch.ones_like(ids), "do_sample": False}
    run = lambda: model.generate(ids, **fixed)  # noqa: E731
    kept = h.inside(lambda: hs.capture(model, blocks, keep="all"), run)
    ok = {r.count for r in kept().records.values()} == {32}  # the prompt, then a step a token
    check = {"what": f"each of the {len(blocks)} blocks kept its 32 calls", "ok": ok}
    about = f"GPT-2 ({len(blocks)} blocks, random weights), 2 prompts of 16 ids, 32 new tokens"
    info = {"case": "generate/gpt2", "title": "Capture during generate, GPT-2", "unit": "gen"}
    return {"gen": run, "hs_gen": kept}, {**info, "about": about, "checks": [check]}


def work(spec: Result) -> Result:
    build = dict(resnet50=_gradcam, shapes=_scorecam, patching=_patching, generate=_generate)
    # the CAM methods and attributions need gradients; patching runs under no_grad
    with torch.set_grad_enabled(spec["model"] != "patching"):
        fns, info = build[spec["model"]](spec["quick"])
        variants = [Variant(k, VARIANTS[k][0], fn, VARIANTS[k][1]) for k, fn in fns.items()]
        result = h.timing(variants, Plan(**spec["plan"]), unit=info.get("unit", "plain"))
    return {**result, **info}


def jobs(cfg: Config) -> list[Job]:
    budgets = {"resnet50": 150, "shapes": 150, "patching": 240, "generate": 150}
    return h.timing_jobs("explain", cfg, budgets, rounds=15)
