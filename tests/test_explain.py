"""The CAM family against references written here: activations from a plain forward hook,
gradients from one full backward per sample on a copy of the model, each method's formula
spelled out per sample; CAM against the classifier's explicit weights."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.explain import METHODS


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 5, 3, padding=1),
        nn.ReLU(inplace=True),  # "2": the explained layer
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(5, 4),
    )


def _reference(model: nn.Module, x: Tensor, targets: list[int]) -> tuple[Tensor, Tensor]:
    """Activations of layer "2" and d score_i / d A_i, one full backward per sample."""
    acts: list[Tensor] = []
    grads: list[Tensor] = []

    def keep(mod: nn.Module, args: object, out: Tensor) -> None:
        acts.append(out.detach().clone()[0])  # before the in-place ReLU that follows
        out.register_hook(lambda g: grads.append(g[0]))

    for i, t in enumerate(targets):
        m = copy.deepcopy(model).eval()
        m[2].register_forward_hook(keep)
        m(x[i : i + 1])[0, t].backward()
    return torch.stack(acts), torch.stack(grads)


def _by_hand(name: str, a: Tensor, g: Tensor) -> Tensor:
    """Each method's map for one sample: a, g of shape (C, h, w)."""
    if name == "gradcam":
        cam = (g.mean((1, 2))[:, None, None] * a).sum(0)
    elif name == "hirescam":
        cam = (g * a).sum(0)
    elif name == "layercam":
        cam = (torch.relu(g) * a).sum(0)
    elif name == "xgradcam":
        w = (g * a / (a.sum((1, 2), keepdim=True) + 1e-7)).sum((1, 2))
        cam = (w[:, None, None] * a).sum(0)
    elif name == "gradcam++":
        alpha = g**2 / (2 * g**2 + a.sum((1, 2), keepdim=True) * g**3 + 1e-6)
        alpha[g == 0] = 0
        w = (alpha * torch.relu(g)).sum((1, 2))
        cam = (w[:, None, None] * a).sum(0)
    else:
        raise AssertionError(name)
    return torch.relu(cam)


@pytest.mark.parametrize("name", ["gradcam", "gradcam++", "xgradcam", "layercam", "hirescam"])
def test_gradient_methods_match_hand_references(name: str) -> None:
    model, x, targets = _net(), torch.randn(3, 3, 8, 8), [0, 3, 1]
    a, g = _reference(model, x, targets)
    exp = METHODS[name].cls(model, "2")(x, targets=targets)
    expected = torch.stack([_by_hand(name, a[i], g[i]) for i in range(3)])
    assert exp.raw.shape == (3, 8, 8) and exp.maps.shape == (3, 8, 8)
    torch.testing.assert_close(exp.raw, expected, rtol=1e-4, atol=1e-6)
    assert exp.targets.tolist() == targets and exp.method == name and exp.layer == "2"
    assert all(p.grad is None for p in model.parameters())  # autograd.grad to the layer only


def test_cam_equals_classifier_weights_and_gradcam_times_area() -> None:
    model, x = _net(), torch.randn(2, 3, 8, 8)
    a, _ = _reference(model, x, [2, 2])
    a = torch.relu(a)  # layer "3" (the in-place ReLU) feeds the pooling and the classifier
    cam = hs.CAM(model, "3", fc="6")(x, targets=2)
    w = model[6].weight.detach()[2]
    torch.testing.assert_close(cam.raw, torch.relu((w[None, :, None, None] * a).sum(1)))
    # with global average pooling then a linear layer, Grad-CAM is CAM / (h * w)
    grad = hs.GradCAM(model, "3")(x, targets=2)
    torch.testing.assert_close(grad.raw * 64, cam.raw, rtol=1e-4, atol=1e-6)


def test_eigencam_is_the_first_principal_component() -> None:
    model, x = _net(), torch.randn(2, 3, 8, 8)
    a, _ = _reference(model, x, [0, 0])
    exp = hs.EigenCAM(model, "2")(x)
    for i in range(2):
        m = a[i].reshape(5, 64).T.double().numpy()
        m = m - m.mean(0)
        _, _, vt = np.linalg.svd(m, full_matrices=False)
        proj = (m @ vt[0]).reshape(8, 8)
        ours = exp.raw[i].double().numpy()
        assert np.allclose(np.abs(ours), np.abs(proj), atol=1e-5)  # equal up to the sign
        summed = a[i].sum(0).double().numpy()
        assert (ours * (summed - summed.mean())).sum() >= 0  # the sign we document


def test_batch_equals_single_images_and_targets_are_validated() -> None:
    model, x = _net(), torch.randn(4, 3, 8, 8)
    batch = hs.GradCAM(model, "2")(x, targets=[1, 0, 3, 2])
    for i, t in enumerate([1, 0, 3, 2]):
        one = hs.GradCAM(model, "2")(x[i : i + 1], targets=t)
        torch.testing.assert_close(batch.raw[i], one.raw[0], rtol=1e-4, atol=1e-6)
    broadcast = hs.GradCAM(model, "2")(x, targets=3)  # one class for every sample
    assert broadcast.targets.tolist() == [3, 3, 3, 3] and broadcast.raw[1:].abs().sum() > 0
    assert hs.GradCAM(model, "2")(x, targets=[3]).targets.tolist() == [3, 3, 3, 3]
    top = hs.GradCAM(model, "2")(x)
    with torch.no_grad():
        assert top.targets.tolist() == model.eval()(x).argmax(1).tolist()
    with pytest.raises(hs.UsageError, match="got 2 targets for a batch of 4"):
        hs.GradCAM(model, "2")(x, targets=[1, 2])
    with pytest.raises(hs.UsageError, match=r"0\.\.3"):
        hs.GradCAM(model, "2")(x, targets=4)
    scores = hs.GradCAM(model, "2")(x, targets=lambda out: out[:, 0] - out[:, 1])
    assert scores.targets is None and scores.scores.shape == (4,)


def test_under_no_grad_frozen_parameters_and_in_place_after_the_layer() -> None:
    model, x = _net(), torch.randn(2, 3, 8, 8)
    expected = hs.GradCAM(model, "2")(x, targets=[0, 1]).raw
    frozen = copy.deepcopy(model).requires_grad_(False)
    with torch.no_grad():
        got = hs.GradCAM(frozen, "2")(x, targets=[0, 1]).raw
    torch.testing.assert_close(got, expected)
    with torch.inference_mode():
        xi = torch.randn(1, 3, 8, 8)
    assert hs.GradCAM(model, "2")(xi, targets=0).raw.shape == (1, 8, 8)
    with torch.inference_mode(), pytest.raises(hs.UsageError, match="inference_mode"):
        hs.GradCAM(model, "2")(x, targets=0)


class TokenModel(nn.Module):
    """A toy vision transformer: 4x4 patches, CLS and register tokens in front."""

    def __init__(self, registers: int) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.prefix = nn.Parameter(torch.randn(1, 1 + registers, 8))
        self.block = nn.Linear(8, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        t = self.patch(x).flatten(2).transpose(1, 2)
        t = torch.cat([self.prefix.expand(len(x), -1, -1), t], 1)
        return self.head(torch.tanh(self.block(t)).mean(1))


@pytest.mark.parametrize(("registers", "size"), [(0, (16, 16)), (4, (8, 24))])
def test_token_grid_inferred(registers: int, size: tuple[int, int]) -> None:
    torch.manual_seed(0)
    model = TokenModel(registers)
    x = torch.randn(2, 3, *size)
    exp = hs.GradCAM(model, "block")(x, targets=[0, 2])
    h, w = size[0] // 4, size[1] // 4
    assert exp.raw.shape == (2, h, w) and exp.maps.shape == (2, *size)
    # reference: drop the prefix tokens by hand, on the known grid
    kept: list[Tensor] = []
    grads: list[Tensor] = []

    def keep(mod: nn.Module, args: object, out: Tensor) -> None:
        kept.append(out)
        out.register_hook(grads.append)

    m = copy.deepcopy(model)
    m.block.register_forward_hook(keep)
    out = m(x)
    (out[0, 0] + out[1, 2]).backward()
    a = kept[0].detach()[:, 1 + registers :].reshape(2, h, w, 8).permute(0, 3, 1, 2)
    g = grads[0][:, 1 + registers :].reshape(2, h, w, 8).permute(0, 3, 1, 2)
    expected = torch.stack([_by_hand("gradcam", a[i], g[i]) for i in range(2)])
    torch.testing.assert_close(exp.raw, expected, rtol=1e-4, atol=1e-6)


def test_normalize_never_nan() -> None:
    maps = torch.stack([torch.zeros(3, 3), torch.arange(9.0).view(3, 3)])
    per_image = hs.explain.normalize(maps)
    assert per_image[0].eq(0).all() and per_image[1].max() == 1 and per_image[1].min() == 0
    batch = hs.explain.normalize(maps, per="batch")
    torch.testing.assert_close(batch[1], maps[1] / 8)


def test_layer_selection_errors() -> None:
    model = _net()
    with pytest.raises(hs.UsageError, match="explains one layer"):
        hs.GradCAM(model, nn.Conv2d)
    with pytest.raises(hs.LayerNotFoundError):
        hs.GradCAM(model, "nope")
    with pytest.raises(hs.UsageError, match=r"CAM needs the nn\.Linear head"):
        hs.CAM(model, "2", fc="0")


class TwoLayer(nn.Module):
    """x -> W1 x + b1 -> relu (functional, optionally in place) -> W2 . + b2."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.fc1, self.fc2, self.how = nn.Linear(6, 5), nn.Linear(5, 3), how

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc1(x.flatten(1))
        if self.how == "F.relu":
            r = torch.nn.functional.relu(h)
        elif self.how == "F.relu inplace":
            r = torch.nn.functional.relu(h, inplace=True)
        elif self.how == "relu_":
            r = h.relu_()
        else:
            r = torch.relu(h)
        return self.fc2(r)


@pytest.mark.parametrize("how", ["F.relu", "F.relu inplace", "relu_", "torch.relu"])
def test_guided_backprop_covers_functional_relus(how: str) -> None:
    torch.manual_seed(0)
    model, x = TwoLayer(how), torch.randn(4, 1, 2, 3)
    t = [0, 1, 2, 0]
    guided = hs.GuidedBackprop(model)(x, targets=t).raw
    plain = hs.Saliency(model)(x, targets=t)
    # by hand: g_r = W2[t]; guided: relu(g_r) where h > 0; then W1^T
    w1, w2 = model.fc1.weight.detach(), model.fc2.weight.detach()
    h = x.flatten(1) @ w1.T + model.fc1.bias.detach()
    g_r = w2[t]
    expected = ((torch.relu(g_r) * (h > 0)) @ w1).reshape(x.shape)
    plain_expected = ((g_r * (h > 0)) @ w1).reshape(x.shape)
    torch.testing.assert_close(guided, expected)
    torch.testing.assert_close(plain.raw, plain_expected.abs())
    assert not torch.allclose(guided, plain_expected)  # really guided
    assert all(p.grad is None for p in model.parameters())


def test_guided_backprop_with_relu_modules_and_refusal_without_relu() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.ReLU(inplace=True), nn.Linear(5, 3))
    x = torch.randn(2, 1, 2, 3)
    ref = TwoLayer("torch.relu")
    ref.fc1, ref.fc2 = model[1], model[3]
    torch.testing.assert_close(
        hs.GuidedBackprop(model)(x, targets=1).raw, hs.GuidedBackprop(ref)(x, targets=1).raw
    )
    gelu = nn.Sequential(nn.Flatten(), nn.Linear(6, 5), nn.GELU(), nn.Linear(5, 3))
    with pytest.raises(hs.UsageError, match="no ReLU ran"):
        hs.GuidedBackprop(gelu)(x, targets=0)


def _scorecam_by_hand(
    model: nn.Module, x: Tensor, targets: list[int], k: int | None, rank: str
) -> Tensor:
    a, g = _reference(model, x, targets)
    cams = []
    for n, t in enumerate(targets):
        weight = a[n].mean((1, 2)) * (g[n].mean((1, 2)) if rank == "gradient" else 1)
        order = weight.argsort(descending=True)[: k or a.shape[1]]
        s = []
        for c in order.tolist():
            up = torch.nn.functional.interpolate(
                a[n, c][None, None], size=x.shape[-2:], mode="bilinear", align_corners=True
            )[0, 0]
            span = up.max() - up.min()
            mask = (up - up.min()) / span if span > 0 else torch.zeros_like(up)
            with torch.no_grad():
                s.append(model.eval()(x[n : n + 1] * mask)[0, t])
        w = torch.softmax(torch.stack(s), 0)
        cams.append(torch.relu((w[:, None, None] * a[n, order]).sum(0)))
    return torch.stack(cams)


@pytest.mark.parametrize(
    ("top_k", "rank"), [(None, "gradient"), (2, "gradient"), (2, "activation")]
)
def test_scorecam_matches_hand_reference_and_states_its_cost(top_k: int | None, rank: str) -> None:
    model, x, targets = _net(), torch.randn(3, 3, 8, 8), [0, 3, 1]
    method = hs.ScoreCAM(model, "2", batch_size=4, top_k=top_k, rank=rank)
    k = top_k or 5
    assert method.cost(x) == {"forwards": 3 * k, "calls": -(-3 * k // 4)}
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[0]))
    try:
        exp = method(x, targets=targets)
    finally:
        handle.remove()
    assert calls[1:] == [min(4, 3 * k - i) for i in range(0, 3 * k, 4)]  # after the first
    torch.testing.assert_close(exp.raw, _scorecam_by_hand(model, x, targets, top_k, rank))


def test_ablationcam_matches_hand_reference() -> None:
    model, x, targets = _net(), torch.randn(2, 3, 8, 8), [2, 0]
    a, _ = _reference(model, x, targets)
    expected = []
    for n, t in enumerate(targets):
        with torch.no_grad():
            s0 = model.eval()(x[n : n + 1])[0, t]
        w = []
        for c in range(5):

            def zero(m: nn.Module, args: object, out: Tensor, c: int = c) -> Tensor:
                out = out.clone()
                out[:, c] = 0
                return out

            h = model[2].register_forward_hook(zero)
            with torch.no_grad():
                w.append((s0 - model(x[n : n + 1])[0, t]) / (s0 + 1e-7))
            h.remove()
        expected.append(torch.relu((torch.stack(w)[:, None, None] * a[n]).sum(0)))
    exp = hs.AblationCAM(model, "2", batch_size=3)(x, targets=targets)
    torch.testing.assert_close(exp.raw, torch.stack(expected), rtol=1e-4, atol=1e-6)
    assert hs.AblationCAM(model, "2").cost(x) == {"forwards": 10, "calls": 1}


def test_overlay_pixels_png_and_missing_matplotlib(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys
    from pathlib import Path

    import matplotlib
    from PIL import Image

    image = torch.zeros(3, 2, 2)
    heat = torch.tensor([[0.0, 1.0], [0.5, 0.0]])
    gray = hs.overlay(image, heat, cmap="gray", alpha=0.5)
    assert gray.shape == (2, 2, 3) and gray.dtype == torch.uint8
    assert gray[..., 0].tolist() == [[0, 128], [64, 0]]  # half of gray(v) * 255, black image
    jet = hs.overlay(torch.full((2, 2, 3), 255, dtype=torch.uint8), heat, alpha=1.0)
    expected = np.round(np.array(matplotlib.colormaps["jet"](0.0)[:3]) * 255)
    assert jet[0, 0].tolist() == expected.tolist()
    path = Path(str(tmp_path)) / "over.png"
    out = hs.overlay(image, heat * 7, save=path)  # any scale: the map is scaled to 0..1
    with Image.open(path) as png:
        assert png.mode == "RGB" and np.array_equal(np.asarray(png), out.numpy())
    with pytest.raises(hs.UsageError, match="heatmap must be"):
        hs.overlay(image, torch.zeros(2, 3, 3))
    with pytest.raises(hs.UsageError, match="unknown matplotlib colormap"):
        hs.overlay(image, heat, cmap="nope")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ImportError, match=r'pip install "hookscope\[plots\]"'):
        hs.overlay(image, heat)


class Region(nn.Module):
    """logit 0 = sum of the top-left 2x2 pixels, logit 1 = 0: the right map is known."""

    def forward(self, x: Tensor) -> Tensor:
        s = x[:, :, :2, :2].sum((1, 2, 3))
        return torch.stack([s, torch.zeros_like(s)], 1)


def test_deletion_insertion_average_drop_by_hand() -> None:
    from hookscope.explain import metrics

    x = torch.ones(2, 1, 4, 4)
    right = torch.zeros(4, 4)
    right[:2, :2] = 1
    ramp = torch.arange(16.0).view(4, 4) / 100  # breaks ties: order within a region is fixed
    maps = torch.stack([right + ramp, 1 - right + ramp])  # image 0 right, image 1 inverted
    d = metrics.deletion(Region(), x, maps, 0, steps=4, prob=False)
    assert d.forwards == 2 * 5 and d.fractions.tolist() == [0, 0.25, 0.5, 0.75, 1]
    assert d.curve.tolist() == [[4, 0, 0, 0, 0], [4, 4, 4, 4, 0]]
    assert d.auc.tolist() == [0.5, 3.5]  # trapezoid rule over the fractions, by hand
    i = metrics.insertion(Region(), x, maps, [0, 0], steps=4, prob=False)
    assert i.curve.tolist() == [[0, 4, 4, 4, 4], [0, 0, 0, 0, 4]] and i.auc.tolist() == [3.5, 0.5]
    drop = metrics.average_drop(Region(), x, torch.stack([right, 1 - right]), 0, prob=False)
    assert drop == {"average_drop": 50.0, "increase": 0.0, "forwards": 4}  # 0% and 100%
    with pytest.raises(hs.UsageError, match="maps must be"):
        metrics.deletion(Region(), x, maps[0], 0)


def test_pointing_game() -> None:
    from hookscope.explain import metrics

    maps = torch.zeros(3, 4, 4)
    maps[0, 0, 0] = 1  # inside
    maps[1, 3, 3] = 1  # outside
    masks = torch.zeros(3, 4, 4, dtype=torch.bool)
    masks[:, :2, :2] = True
    assert metrics.pointing_game(maps, masks).tolist() == [True, False, True]  # a flat map ties


def test_smoothgrad_over_saliency_of_a_linear_model_is_its_weights() -> None:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    x = torch.randn(2, 3, 2, 2)
    calls: list[int] = []
    net.register_forward_pre_hook(lambda m, a: calls.append(len(a[0])))
    try:
        exp = hs.SmoothGrad(hs.Saliency(net), samples=5, seed=0)(x, targets=[0, 2])
    finally:
        net._forward_pre_hooks.clear()
    w = net[1].weight.detach()
    torch.testing.assert_close(exp.raw, w[[0, 2]].abs().reshape(2, 3, 2, 2))  # noise-free
    assert len(calls) == 6 and exp.method == "smoothgrad(saliency)"
    model, x = _net(), torch.randn(2, 3, 8, 8)
    a = hs.SmoothGrad(hs.GradCAM(model, "2"), samples=3, seed=1)(x)
    b = hs.SmoothGrad(hs.GradCAM(model, "2"), samples=3, seed=1)(x)
    c = hs.SmoothGrad(hs.GradCAM(model, "2"), samples=3, seed=2)(x)
    assert a.raw.shape == (2, 8, 8) and torch.equal(a.raw, b.raw)  # seeded: repeatable
    assert not torch.equal(a.raw, c.raw)  # the noise matters for a non-linear model


def test_guided_gradcam_is_the_product() -> None:
    model, x = _net(), torch.randn(2, 3, 8, 8)
    exp = hs.GuidedGradCAM(model, "2")(x, targets=[1, 2])
    guided = hs.GuidedBackprop(model)(x, targets=[1, 2]).raw
    cam = hs.GradCAM(model, "2")(x, targets=[1, 2]).maps
    torch.testing.assert_close(exp.raw, guided * cam[:, None])
    assert exp.raw.shape == (2, 3, 8, 8)


def test_metrics_in_small_batches_and_validated_targets() -> None:
    """Chunks smaller than the batch use each image's own target; bad targets are refused."""
    from hookscope.explain import metrics

    x = torch.ones(3, 1, 4, 4)
    maps = torch.rand(3, 4, 4, generator=torch.Generator().manual_seed(0))
    whole = metrics.deletion(Region(), x, maps, 0, steps=4, prob=False)
    chunked = metrics.deletion(Region(), x, maps, 0, steps=4, prob=False, batch_size=2)
    assert torch.equal(whole.curve, chunked.curve) and chunked.forwards == 15
    per_image = metrics.insertion(Region(), x, maps, [0, 1, 0], steps=4, prob=False, batch_size=2)
    assert per_image.curve[1].tolist() == [0, 0, 0, 0, 0]  # class 1's logit is always 0
    with pytest.raises(hs.UsageError, match="got 2 targets for a batch of 3"):
        metrics.deletion(Region(), x, maps, [0, 1], steps=4)
    with pytest.raises(hs.UsageError, match=r"0\.\.1"):
        metrics.average_drop(Region(), x, maps, 5)


def test_pointing_game_tolerance_is_a_distance_to_the_object() -> None:
    from hookscope.explain import metrics

    masks = torch.zeros(4, 9, 9, dtype=torch.bool)
    masks[:, 4, 4] = True  # a one-pixel object in the middle
    maps = torch.zeros(4, 9, 9)
    for i, (y, x) in enumerate([(4, 6), (6, 6), (4, 7), (1, 4)]):  # distances 2, 2.83, 3, 3
        maps[i, y, x] = 1
    assert metrics.pointing_game(maps, masks, tolerance=3).tolist() == [True, True, False, False]
    assert metrics.pointing_game(maps, masks, tolerance=2).tolist() == [False] * 4  # strict <
    assert metrics.pointing_game(maps, masks, tolerance=2.1).tolist() == [True, False, False, False]
    with pytest.raises(hs.UsageError, match="tolerance"):
        metrics.pointing_game(maps, masks, tolerance=-1)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_metrics_refuse_maps_with_nan_or_inf(bad: float) -> None:
    """A NaN sorts first or last silently: deletion used to return an AUC computed from an
    arbitrary order."""
    from hookscope.explain import metrics

    x = torch.ones(2, 1, 4, 4)
    maps = torch.rand(2, 4, 4, generator=torch.Generator().manual_seed(0))
    maps[1, 2, 3] = bad
    for metric in (metrics.deletion, metrics.insertion, metrics.average_drop):
        with pytest.raises(hs.UsageError, match=r"maps hold NaN or Inf \(images \[1\]\)"):
            metric(Region(), x, maps, 0)
    with pytest.raises(hs.UsageError, match=r"maps hold NaN or Inf \(images \[1\]\)"):
        metrics.pointing_game(maps, torch.ones(2, 4, 4, dtype=torch.bool))
    assert metrics.deletion(Region(), x, maps.nan_to_num(0.0, 0.0, 0.0), 0, steps=2).forwards == 6
