"""Path and perturbation methods (integrated gradients, layer integrated gradients, layer
conductance, gradient x input, occlusion, feature ablation) against Captum on a CNN and a
text model, with the same baselines, steps, integration rule and internal batch size; the
convergence delta as Captum computes it; their options refused with the fix; and properties
that hold whatever the implementation (completeness on a linear model).

Captum runs on a deep copy (it fills the parameters' ``.grad``). Equality is within 1e-5 of
the largest attribution (float32)."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.explain import metrics

attr = pytest.importorskip("captum.attr")

RULES = ["gausslegendre", "riemann_left", "riemann_right", "riemann_middle", "riemann_trapezoid"]


def close(ours: Tensor, theirs: Tensor, tol: float = 1e-5) -> None:
    """Equal within ``tol`` of the largest value (attributions of small nets are ~1e-3)."""
    theirs = theirs.detach()
    assert ours.shape == theirs.shape
    scale = float(theirs.abs().max())
    assert scale > 0
    gap = float((ours - theirs).abs().max())
    assert gap <= tol * scale, (gap, scale)


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.BatchNorm2d(6),
        nn.ReLU(),
        nn.Conv2d(6, 12, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),  # "3": a layer
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(12, 5),
    ).eval()


def images(n: int = 3, seed: int = 1) -> Tensor:
    return torch.randn(n, 3, 16, 16, generator=torch.Generator().manual_seed(seed))


def captum(model: nn.Module) -> Any:
    """A copy for Captum, which runs a full backward into the parameters."""
    return copy.deepcopy(model)


@pytest.fixture(autouse=True)
def _quiet() -> Any:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Input Tensor 0 did not already require")
        yield


@pytest.mark.parametrize("method", RULES)
@pytest.mark.parametrize("internal_batch_size", [None, 7])
def test_integrated_gradients_and_delta_equal_captums(
    method: str, internal_batch_size: Any
) -> None:
    model, x, targets = cnn(), images(), [1, 4, 0]
    base = torch.rand(1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    ig = hs.IntegratedGradients(
        model,
        baselines=base,
        n_steps=9,
        method=method,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    ours = ig(x, targets=targets)
    theirs, delta = attr.IntegratedGradients(captum(model)).attribute(
        x,
        baselines=base,
        target=targets,
        n_steps=9,
        method=method,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    close(ours.raw, theirs)
    assert ours.maps is ours.raw and ours.attributions is ours.raw
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("method", RULES)
@pytest.mark.parametrize("internal_batch_size", [None, 7])
def test_layer_integrated_gradients_equal_captums(method: str, internal_batch_size: Any) -> None:
    model, x, targets = cnn(), images(), [2, 2, 3]
    lig = hs.LayerIntegratedGradients(
        model,
        "3",
        baselines=0.25,
        n_steps=8,
        method=method,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    ours = lig(x, targets=targets)
    theirs_model = captum(model)
    theirs, delta = attr.LayerIntegratedGradients(theirs_model, theirs_model[3]).attribute(
        x,
        baselines=0.25,
        target=targets,
        n_steps=8,
        method=method,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    assert ours.attributions is not None
    close(ours.attributions, theirs)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    torch.testing.assert_close(ours.raw, theirs.detach().sum(1), rtol=1e-5, atol=1e-8)
    assert ours.raw.shape == (3, 8, 8) and ours.maps.shape == (3, 16, 16)


@pytest.mark.parametrize("method", RULES)
@pytest.mark.parametrize("internal_batch_size", [None, 6])
def test_layer_conductance_equals_captums(method: str, internal_batch_size: Any) -> None:
    model, x, targets = cnn(), images(), [0, 1, 2]
    cond = hs.LayerConductance(
        model,
        "4",
        baselines=-0.5,
        n_steps=7,
        method=method,
        internal_batch_size=internal_batch_size,
        return_convergence_delta=True,
    )
    ours = cond(x, targets=targets)
    theirs_model = captum(model)
    theirs, delta = attr.LayerConductance(theirs_model, theirs_model[4]).attribute(
        x,
        baselines=-0.5,
        target=targets,
        n_steps=7,
        method=method,
        internal_batch_size=internal_batch_size and 2 * internal_batch_size,
        return_convergence_delta=True,
    )
    assert ours.attributions is not None
    close(ours.attributions, theirs)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)


def test_gradient_x_input_equals_captums() -> None:
    model, x = cnn(), images()
    ours = hs.InputXGradient(model)(x, targets=[4, 3, 2])
    theirs = attr.InputXGradient(captum(model)).attribute(
        x.clone().requires_grad_(), target=[4, 3, 2]
    )
    close(ours.raw, theirs)


@pytest.mark.parametrize(
    ("window", "strides", "baseline"),
    [
        ((3, 4, 4), 2, 0.0),
        ((3, 5, 5), (1, 4, 3), 0.5),
        ((1, 3, 3), None, -1.0),
        ((3, 16, 16), 1, 0.0),
    ],
)
def test_occlusion_equals_captums(window: tuple[int, ...], strides: Any, baseline: float) -> None:
    model, x, targets = cnn(), images(), [1, 2, 3]
    occlusion = hs.Occlusion(model, window, strides=strides, baselines=baseline, batch_size=5)
    ours = occlusion(x, targets=targets)
    theirs = attr.Occlusion(captum(model)).attribute(
        x, sliding_window_shapes=window, strides=strides, baselines=baseline, target=targets
    )
    close(ours.raw, theirs)


def test_feature_ablation_equals_captums_for_shared_per_sample_and_default_masks() -> None:
    model, x, targets = cnn(), images(2), [1, 3]
    quarters = torch.arange(16).view(1, 1, 4, 4).repeat_interleave(4, 2).repeat_interleave(4, 3)
    per_sample = torch.stack([quarters[0], quarters[0].flip(-1) + 3])  # ids 0..18
    channels = torch.arange(3).view(1, 3, 1, 1)  # broadcast over the positions
    for mask in (quarters, per_sample, channels):
        ours = hs.FeatureAblation(model, feature_mask=mask, batch_size=3)(x, targets=targets)
        theirs = attr.FeatureAblation(captum(model)).attribute(x, feature_mask=mask, target=targets)
        close(ours.raw, theirs)
    small = images(1)[:, :, :6, :6]
    ours = hs.FeatureAblation(model, batch_size=64, baselines=0.3)(small, targets=2)
    theirs = attr.FeatureAblation(captum(model)).attribute(small, target=2, baselines=0.3)
    close(ours.raw, theirs)


class Counted(nn.Module):
    """The model, counting the images of each of its calls."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model, self.calls = model, []  # type: ignore[var-annotated]

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append(len(x))
        return self.model(x)  # type: ignore[no-any-return]


def test_perturbation_costs_are_counted_before_they_run() -> None:
    """3 x 4 x 4 windows of stride 2 on 16 x 16 are 7 x 7 = 49 positions per image."""
    model, x = Counted(cnn()), images(3)
    occlusion = hs.Occlusion(model, (3, 4, 4), strides=2, batch_size=50)
    assert occlusion.cost(x) == {"forwards": 147, "calls": 3}
    assert model.calls == []  # no forward to count them
    occlusion(x, targets=0)
    assert model.calls == [3, 50, 50, 47]  # the scores, then the occluded images
    ablation = hs.FeatureAblation(model, feature_mask=torch.arange(3).view(1, 3, 1, 1))
    assert ablation.cost(x) == {"forwards": 9, "calls": 1}


class Text(nn.Module):
    """Token ids -> embeddings -> a 1-D convolution over the tokens -> 3 classes; the padding
    mask multiplies the embeddings (a second batched input)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(50, 16)
        self.conv = nn.Conv1d(16, 8, 3, padding=1)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        h = self.embed(ids) * mask[..., None]
        return self.head(torch.tanh(self.conv(h.transpose(1, 2))).mean(2))


def test_token_ids_through_the_embeddings_and_occluded_tokens_equal_captums() -> None:
    model = Text().eval()
    ids = torch.randint(1, 50, (2, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones(2, 9)
    mask[1, 7:] = 0
    reference = torch.zeros_like(ids)  # the padding id
    theirs_model = captum(model)
    lig = hs.LayerIntegratedGradients(
        model, "embed", baselines=reference, n_steps=12, return_convergence_delta=True
    )
    ours = lig((ids, mask), targets=[0, 2])
    theirs, delta = attr.LayerIntegratedGradients(theirs_model, theirs_model.embed).attribute(
        ids,
        baselines=reference,
        target=[0, 2],
        additional_forward_args=(mask,),
        n_steps=12,
        return_convergence_delta=True,
    )
    assert ours.attributions is not None
    close(ours.attributions, theirs)
    torch.testing.assert_close(ours.delta, delta, rtol=0, atol=1e-6)
    assert ours.raw.shape == ours.maps.shape == (2, 9)  # one value per token
    torch.testing.assert_close(ours.raw, theirs.detach().sum(2), rtol=1e-5, atol=1e-8)
    occluded = hs.Occlusion(model, (2,), baselines=0, batch_size=4)((ids, mask), targets=[1, 1])
    theirs = attr.Occlusion(theirs_model).attribute(
        ids, sliding_window_shapes=(2,), baselines=0, target=[1, 1], additional_forward_args=(mask,)
    )
    close(occluded.raw, theirs)


def test_integrated_gradients_is_complete_on_a_linear_model() -> None:
    """For a linear score the path integral is exact: attributions are w * (x - x') times the
    sum of the rule's step sizes, which is 1 but for Captum's trapezoid rule, whose end points
    get half of 1/n (the sizes sum to (n - 1) / n); the delta is what the sizes miss."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
    x, base = torch.randn(4, 3, 2, 2), torch.randn(4, 3, 2, 2)
    weights = net[1].weight[2].detach().view(3, 2, 2)
    with torch.no_grad():
        gain = net(x)[:, 2] - net(base)[:, 2]
    for method in RULES:
        exp = hs.IntegratedGradients(
            net, baselines=base, n_steps=3, method=method, return_convergence_delta=True
        )(x, targets=2)
        total = 2 / 3 if method == "riemann_trapezoid" else 1.0
        torch.testing.assert_close(exp.raw, total * weights * (x - base), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(exp.delta, (total - 1) * gain, rtol=0, atol=1e-5)


def test_memory_steps_and_options_are_checked_with_the_fix() -> None:
    model = cnn()
    bad: list[tuple[dict[str, Any], str]] = [
        ({"n_steps": 0}, r"n_steps must be >= 1 for gausslegendre, got 0"),
        ({"n_steps": 1, "method": "riemann_left"}, r"n_steps must be >= 2 for riemann_left"),
        (
            {"method": "simpson"},
            r"method must be one of riemann_left, .*gausslegendre; got 'simpson'",
        ),
        ({"internal_batch_size": 0}, r"internal_batch_size must be an int >= 1 or None, got 0"),
        (
            {"baselines": "zeros"},
            r"baselines must be a number, a tensor or None \(zeros\), got str",
        ),
    ]
    for kwargs, message in bad:
        with pytest.raises(hs.UsageError, match=message):
            hs.IntegratedGradients(model, **kwargs)
        with pytest.raises(hs.UsageError, match=message):
            hs.LayerConductance(model, "3", **kwargs)
    ig = hs.IntegratedGradients(model, baselines=torch.zeros(2, 3, 16, 16))
    with pytest.raises(hs.UsageError, match=r"baselines has shape \(2, 3, 16, 16\); the explained"):
        ig(images(3), targets=0)
    with pytest.raises(hs.UsageError, match=r"sliding_window_shapes must be a tuple of ints >= 1"):
        hs.Occlusion(model, [3, 4, 4])  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match=r"one value per dimension of a sample, \(3, 16, 16\)"):
        hs.Occlusion(model, (4, 4))(images(), targets=0)
    with pytest.raises(hs.UsageError, match=r"each stride <= its window side"):
        hs.Occlusion(model, (3, 4, 4), strides=5)(images(), targets=0)
    with pytest.raises(hs.UsageError, match=r"feature_mask has shape \(2, 16, 16\)"):
        hs.FeatureAblation(model, feature_mask=torch.zeros(2, 16, 16, dtype=torch.long))(
            images(), targets=0
        )
    with pytest.raises(hs.UsageError, match=r"feature_mask must be an integer tensor"):
        hs.FeatureAblation(model, feature_mask=torch.zeros(1, 1, 16, 16))
    for method in (hs.IntegratedGradients(model), hs.LayerIntegratedGradients(model, "3")):
        with torch.inference_mode(), pytest.raises(hs.UsageError, match=r"takes gradients, which"):
            method(images(), targets=0)
    ids = torch.zeros(2, 5, dtype=torch.long)
    for method in (hs.IntegratedGradients(Words()), hs.LayerConductance(Words(), "embed")):
        with pytest.raises(hs.UsageError, match=r"token ids cannot be scaled and have no gradient"):
            method(ids, targets=0)
    with pytest.raises(hs.UsageError, match=r"layer 'head' returns shape \(1, 3\) for 5 input"):
        hs.LayerIntegratedGradients(Text(), "head")(
            (torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5)), targets=0
        )


def test_layer_integrated_gradients_with_an_in_place_relu_after_the_layer() -> None:
    """The model changes the layer's output in place further on: the replaced output is a
    copy, so the in-place ReLU neither fails on a leaf nor changes the path's points."""
    model, x = cnn(), images(2)
    plain = hs.LayerIntegratedGradients(model, "3", n_steps=6)(x, targets=[0, 1])
    inplace = copy.deepcopy(model)
    inplace[4] = nn.ReLU(inplace=True)
    got = hs.LayerIntegratedGradients(inplace, "3", n_steps=6)(x, targets=[0, 1])
    assert plain.attributions is not None and got.attributions is not None
    torch.testing.assert_close(got.attributions, plain.attributions)


class Words(nn.Module):
    """Token ids alone -> a bag of embeddings -> 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.head = nn.Embedding(50, 8), nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.embed(ids)).mean(1))


def test_faithfulness_metrics_take_per_channel_and_token_maps() -> None:
    """Per-channel maps rank pixels by their sum over channels; token maps delete tokens
    (they become the baseline id), checked against curves computed here by hand."""
    model, x = cnn(), images(2)
    exp = hs.IntegratedGradients(model, n_steps=8)(x, targets=[1, 3])
    summed = metrics.deletion(model, x, exp.maps.sum(1), [1, 3], steps=4)
    for given in (exp, exp.maps):
        got = metrics.deletion(model, x, given, [1, 3], steps=4)
        torch.testing.assert_close(got.curve, summed.curve)
    assert metrics.pointing_game(exp, torch.ones(2, 16, 16, dtype=torch.bool)).all()
    words = Words().eval()
    ids = torch.randint(1, 50, (2, 5), generator=torch.Generator().manual_seed(4))
    occluded = hs.Occlusion(words, (1,), baselines=0)(ids, targets=[0, 2])
    curve = metrics.deletion(words, ids, occluded, [0, 2], steps=5, baseline=0, prob=False)
    order = occluded.maps.argsort(1, descending=True)
    for k in range(6):
        deleted = ids.clone()
        for i in range(2):
            deleted[i, order[i, :k]] = 0
        with torch.no_grad():
            want = words(deleted)[[0, 1], [0, 2]]
        torch.testing.assert_close(curve.curve[:, k], want)
    with pytest.raises(hs.UsageError, match=r"maps must be \(N, T\) for token ids \(N, T\)"):
        metrics.insertion(words, ids, occluded.maps[:, :3], [0, 2])
    with pytest.raises(hs.UsageError, match=r"average_drop multiplies images"):
        metrics.average_drop(words, ids, occluded, [0, 2])


class Tabular(nn.Module):
    """Captum's Titanic tutorial's shape: 12 features -> 12 -> 8 -> 2, sigmoids and softmax."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.linear1, self.sigmoid1 = nn.Linear(12, 12), nn.Sigmoid()
        self.linear2, self.sigmoid2 = nn.Linear(12, 8), nn.Sigmoid()
        self.linear3 = nn.Linear(8, 2)

    def forward(self, x: Tensor) -> Tensor:
        h = self.sigmoid2(self.linear2(self.sigmoid1(self.linear1(x))))
        return torch.softmax(self.linear3(h), dim=1)


def test_tabular_features_have_attributions_as_maps_equal_to_captums() -> None:
    """Features (N, F) have no positions: every method's maps are its attributions. The
    forwards hold the images Captum's hold (its attributions are ~1e-3 of softmax outputs
    ~0.5, so another batch's float rounding would show at 1e-5 of them)."""
    model, x = Tabular().eval(), torch.rand(4, 12, generator=torch.Generator().manual_seed(5))
    theirs = captum(model)
    ours = hs.IntegratedGradients(model, n_steps=20, internal_batch_size=80)(x, targets=1)
    close(ours.raw, attr.IntegratedGradients(theirs).attribute(x, target=1, n_steps=20))
    ours = hs.LayerConductance(model, "sigmoid1", n_steps=20)(x, targets=1)
    want = attr.LayerConductance(theirs, theirs.sigmoid1).attribute(x, target=1, n_steps=20)
    assert ours.raw.shape == ours.maps.shape == (4, 12)
    close(ours.raw, want)
    ours = hs.FeatureAblation(model, baselines=0.5, batch_size=4)(x, targets=1)
    close(ours.raw, attr.FeatureAblation(theirs).attribute(x, target=1, baselines=0.5))
    ours = hs.Occlusion(model, (3,), strides=3, batch_size=4)(x, targets=0)
    close(ours.raw, attr.Occlusion(theirs).attribute(x, (3,), strides=3, target=0))
    ours = hs.InputXGradient(model)(x, targets=0)
    close(ours.raw, attr.InputXGradient(theirs).attribute(x.clone().requires_grad_(), target=0))
