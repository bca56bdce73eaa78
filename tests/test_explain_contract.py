"""The contract every attribution method keeps, one test per property, parametrised over the
registry (``hookscope.explain.METHODS``): a method registered tomorrow is tested here without
a line changed, except ``REQUIRED`` if its constructor needs a keyword no method needed before.

Oracles come from outside the code under test: the same method on an image alone, on the same
model whose layer returns a tensor instead of a tuple, on the eager model instead of the
compiled one, pytorch-grad-cam and Captum, and counts taken by the test itself (model calls,
``torch.autograd.grad`` calls, host reads of tensors).
"""

from __future__ import annotations

import copy
import gc
import importlib.util
import inspect
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs
from hookscope.explain import METHODS, MethodInfo

#: how to build each constructor keyword without a default that some method requires
REQUIRED: dict[str, Callable[[nn.Module], Any]] = {
    "fc": lambda model: "head",
    "method": lambda model: hs.Saliency(model),
    "sliding_window_shapes": lambda model: (3, 4, 4),
}

#: the model's calls, counted by the models themselves (not by a hook hookscope could see)
CALLS: list[int] = []
#: a tensor of each forward that only the autograd graph keeps (ReLU saves its result)
SAVED: list[weakref.ref[Tensor]] = []


class Block(nn.Module):
    """The explained layer: a convolution whose output is returned alone or in a tuple."""

    def __init__(self, as_tuple: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(6, 5, 3, padding=1)
        self.as_tuple = as_tuple

    def forward(self, x: Tensor) -> Any:
        h = self.conv(x)
        return (h, {"mean": h.mean()}) if self.as_tuple else h


class Net(nn.Module):
    """stem (stride 2) -> ReLU -> block -> ReLU -> global mean -> head (4 classes)."""

    def __init__(self, as_tuple: bool = False, counted: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.counted = counted  # counting is a graph break: compiled tests turn it off
        self.stem = nn.Conv2d(3, 6, 3, stride=2, padding=1)
        self.relu = nn.ReLU()
        self.block = Block(as_tuple)
        self.act = nn.ReLU()
        self.head = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        if self.counted:
            CALLS.append(len(x))
        r = self.relu(self.stem(x))
        if self.counted:
            SAVED.append(weakref.ref(r))
        h = self.block(r)
        if isinstance(h, tuple):
            h = h[0]
        return self.head(self.act(h).mean((2, 3)))


def _x(n: int = 3, seed: int = 1) -> Tensor:
    return torch.randn(n, 3, 12, 12, generator=torch.Generator().manual_seed(seed))


def build(info: MethodInfo, model: nn.Module, layer: str = "block", **options: Any) -> Any:
    """``info.cls`` built as the registry says: its required keywords from ``REQUIRED``."""
    missing = [k for k in info.requires if k not in REQUIRED]
    assert not missing, f"{info.name} requires {missing}: say how to build them in REQUIRED"
    kwargs = {k: REQUIRED[k](model) for k in info.requires}
    if info.kind == "layer":
        return info.cls(model, layer, **kwargs, **options)
    if info.kind == "input":
        return info.cls(model, **kwargs, **options)
    return info.cls(**kwargs, **options)


def options(info: MethodInfo) -> dict[str, Any]:
    """Deterministic, small settings: SmoothGrad seeded, perturbations in chunks of 4 (so a
    chunk mixes images)."""
    if info.kind == "wrapper":
        return {"samples": 3, "seed": 0}
    if info.perturbation:
        return {"batch_size": 4}
    return {}


def per_channel(info: MethodInfo, method: Any) -> bool:
    """Whether ``maps`` are ``(N, C, H, W)``: the registry's word (a wrapper's inner one's)."""
    if info.kind != "wrapper":
        return info.per_channel
    inner = next(i for i in METHODS.values() if type(method.method) is i.cls)
    return inner.per_channel


#: every method a CNN can be explained with; the attention methods have their own model below
NAMES = sorted(n for n, i in METHODS.items() if i.kind != "attention")
ATTENTION = sorted(n for n, i in METHODS.items() if i.kind == "attention")


@pytest.fixture(autouse=True)
def _count() -> Iterator[None]:
    CALLS.clear()
    yield
    CALLS.clear()
    SAVED.clear()


@pytest.mark.parametrize("name", NAMES)
def test_the_registry_says_what_the_method_is(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    info = METHODS[name]
    assert info.name == name and info.kind in ("layer", "input", "wrapper")
    fixed = {"self", "model", "layers"} if info.kind != "wrapper" else {"self"}
    no_default = [
        p.name
        for p in inspect.signature(info.cls.__init__).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert tuple(p for p in no_default if p not in fixed) == info.requires
    grads: list[int] = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grads.append(1) or real(*a, **k))
    model, x = Net(), _x()
    method = build(info, model, **options(info))
    exp = method(x, targets=[1, 2, 3])
    assert bool(grads) == info.gradients  # it runs a backward pass exactly when it says so
    if info.perturbation:  # cost() announced the extra calls it then made
        CALLS.clear()
        calls = method.cost(x)["calls"]
        # cost() itself runs one forward at most (the CAMs count the layer's channels;
        # occlusion and feature ablation know their features from the shapes)
        assert CALLS in ([3], [])
        CALLS.clear()
        method(x, targets=[1, 2, 3])
        assert len(CALLS) == 1 + calls
    assert exp.method == name or exp.method.startswith(f"{name}(")


@pytest.mark.parametrize("name", NAMES)
def test_shapes_targets_and_scores(name: str) -> None:
    info = METHODS[name]
    model, x = Net(), _x()
    method = build(info, model, **options(info))
    exp = method(x, targets=[1, 2, 3])
    if per_channel(info, method):
        assert exp.raw.shape == exp.maps.shape == x.shape
    else:
        assert exp.raw.shape == (3, 6, 6) and exp.maps.shape == (3, 12, 12)  # stem stride 2
        assert exp.layer == "block"
    assert exp.targets.tolist() == [1, 2, 3] and exp.scores.shape == (3,)
    torch.testing.assert_close(exp.scores, model(x).detach()[[0, 1, 2], [1, 2, 3]])
    top = method(x)  # no targets: each image's top class
    assert top.targets.tolist() == model(x).argmax(1).tolist()


@pytest.mark.parametrize("name", NAMES)
def test_a_batch_gives_each_image_its_own_map(name: str) -> None:
    info = METHODS[name]
    model, x, targets = Net(), _x(), [2, 0, 3]
    extra = {"noise": 0.0} if info.kind == "wrapper" else {}  # the same noise for all
    method = build(info, model, **options(info), **extra)
    batch = method(x, targets=targets)
    for i, t in enumerate(targets):
        one = method(x[i : i + 1], targets=t)
        torch.testing.assert_close(batch.raw[i], one.raw[0], rtol=1e-4, atol=1e-6)
        torch.testing.assert_close(batch.maps[i], one.maps[0], rtol=1e-4, atol=1e-6)
    broadcast = method(x, targets=3)
    assert broadcast.targets.tolist() == [3, 3, 3]
    assert method(x, targets=[3]).targets.tolist() == [3, 3, 3]
    torch.testing.assert_close(method(x, targets=np.array([2, 0, 3])).raw, batch.raw)
    torch.testing.assert_close(method(x, targets=torch.tensor(targets)).raw, batch.raw)


BAD_TARGETS = [
    ([1, 2], "got 2 targets for a batch of 3"),
    ([1.0, 0.0, 2.0], r"class indices \(ints\), got 1\.0 \(float\)"),
    (1.7, r"got 1\.7 \(float\)"),
    (torch.tensor([1.0, 0.0, 2.0]), "dtype torch.float32"),
    (np.array([1.5, 0.0, 2.0]), "dtype float64"),
    ([True, False, True], r"True \(bool\)"),
    (torch.tensor([1, 0, 1]).bool(), "dtype torch.bool"),
]


@pytest.mark.parametrize("name", NAMES)
def test_an_empty_batch_is_refused_before_any_forward(name: str) -> None:
    """It used to fail deep inside (``min() arg is an empty sequence``)."""
    info = METHODS[name]
    method = build(info, Net(), **options(info))
    with pytest.raises(hs.UsageError, match=r"the batch is empty \(shape \(0, 3, 12, 12\)\)"):
        method(_x()[:0], targets=None)
    assert CALLS == []


@pytest.mark.parametrize("name", [n for n in NAMES if METHODS[n].kind == "layer"])
def test_every_layer_method_takes_reshape(name: str) -> None:
    """A layout neither the type nor the shapes decide is refused asking for ``reshape=``, so
    every method that explains a layer must take it (Guided Grad-CAM did not). The oracle:
    a reshape= giving the layout the method infers gives the same maps, and is used."""
    info = METHODS[name]
    model, x = Net(), _x()
    seen: list[tuple[int, ...]] = []

    def channels_first(t: Tensor) -> Tensor:
        seen.append(tuple(t.shape))
        return t

    given = build(info, model, reshape=channels_first, **options(info))(x, targets=[1, 2, 3])
    inferred = build(info, model, **options(info))(x, targets=[1, 2, 3])
    assert seen and seen[0] == (3, 5, 6, 6)
    torch.testing.assert_close(given.raw, inferred.raw)


@pytest.mark.parametrize("name", NAMES)
def test_targets_are_checked_before_any_forward(name: str) -> None:
    info = METHODS[name]
    method = build(info, Net(), **options(info))
    x = _x()
    for bad, message in BAD_TARGETS:
        CALLS.clear()
        with pytest.raises(hs.UsageError, match=message):
            method(x, targets=bad)
        assert CALLS == [], bad  # refused on the host, before the model ran
    with pytest.raises(hs.UsageError, match=r"target classes must be in 0\.\.3, got 4"):
        method(x, targets=4)
    with pytest.raises(hs.UsageError, match=r"0\.\.3, got \[0, -1, 2\]"):
        method(x, targets=[0, -1, 2])


@pytest.mark.parametrize("name", NAMES)
def test_parameter_gradients_are_left_as_found(name: str) -> None:
    info = METHODS[name]
    model = Net()
    model.head.weight.grad = torch.full_like(model.head.weight, 7.0)
    model.block.conv.requires_grad_(False)  # frozen layers still get maps
    method = build(info, model, **options(info))
    exp = method(_x(), targets=[0, 1, 2])
    assert torch.equal(model.head.weight.grad, torch.full_like(model.head.weight, 7.0))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "head.weight")
    assert torch.isfinite(exp.raw).all() and exp.raw.abs().sum() > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_layer_returning_a_tuple_explains_its_tensor(name: str) -> None:
    info = METHODS[name]
    x, targets = _x(), [1, 3, 0]
    plain = build(info, Net(as_tuple=False), **options(info))(x, targets=targets)
    tupled = build(info, Net(as_tuple=True), **options(info))(x, targets=targets)
    assert plain.raw.abs().sum() > 0
    torch.testing.assert_close(tupled.raw, plain.raw, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(tupled.maps, plain.maps, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_nothing_of_the_forward_outlives_the_call(name: str) -> None:
    """The forward's autograd graph (and what it saved) is freed when the call returns."""
    info = METHODS[name]
    method = build(info, Net(), **options(info))
    exp = method(_x(), targets=[1, 2, 3])
    gc.collect()
    assert SAVED and all(ref() is None for ref in SAVED)
    assert exp.raw.grad_fn is None and not exp.scores.requires_grad


READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy")


@pytest.mark.parametrize("name", NAMES)
def test_no_tensor_is_read_back_to_the_host(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of a tensor's values by Python (what synchronises with a GPU) is counted:
    none, for int, list, callable or top-class targets."""
    info = METHODS[name]
    model, x = Net(), _x()
    method = build(info, model, **options(info))
    reads: list[str] = []
    for attr in READS:
        real = getattr(torch.Tensor, attr)

        def counted(*a: Any, _real: Any = real, _attr: str = attr, **k: Any) -> Any:
            reads.append(_attr)
            return _real(*a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    callable_ok = not getattr(info.cls, "class_targets", False)  # CAM needs classes
    score = [lambda out: out[:, 0] - out[:, 1]] if callable_ok else []
    for targets in ([1, 2, 3], 2, None, *score):
        method(x, targets=targets)
        assert reads == [], (targets, reads)


@pytest.fixture(scope="module")
def compiled_nets() -> Iterator[dict[str, nn.Module]]:
    """A compiled ``Net`` for each way of compiling, shared by the methods' tests: a method
    compiles nothing new (each test checks), so each test finds the cache as the warm-up
    forwards left it, and the ~0.6 s of compiling is paid once per way, not per method."""
    torch._dynamo.reset()
    model = Net(counted=False).eval()  # as explained: cached code matches our forwards
    other = Net(counted=False).eval()
    other.compile(backend="eager")
    yield {"torch.compile": torch.compile(model, backend="eager"), "Module.compile": other}  # type: ignore[dict-item]
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_compiled_model_that_already_ran_gives_the_eager_maps(
    name: str, how: str, compiled_nets: dict[str, nn.Module]
) -> None:
    info = METHODS[name]
    x, targets = _x(), [1, 2, 3]
    expected = build(info, Net().eval(), **options(info))(x, targets=targets)
    compiled = compiled_nets[how]
    with torch.no_grad():  # cached code for the sizes of the extra forwards, no grad...
        for n in (1, 3, 4, 5):  # (compiled by the first test; cached after)
            compiled(_x(n))
    compiled(x.clone().requires_grad_(True))  # ...and for a forward with grad
    from torch._dynamo.utils import counters  # (imported here: dynamo takes a second)

    graphs = counters["stats"]["unique_graphs"]
    got = build(info, compiled, **options(info))(x, targets=targets)
    torch.testing.assert_close(got.raw, expected.raw, rtol=1e-4, atol=1e-6)
    assert counters["stats"]["unique_graphs"] == graphs  # (what sharing the model relies on)


class Dead(nn.Module):
    """``side`` runs, but the classifier never reads its output (PiT's last stage)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.stem = nn.Conv2d(3, 5, 3, padding=1)
        self.side = nn.Conv2d(5, 5, 3, padding=1)
        self.head = nn.Linear(5, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(self.stem(x))
        self.side(h)
        return self.head(h.mean((2, 3)))


def _gradient_layer_methods() -> list[tuple[str, dict[str, Any]]]:
    cases = [(n, {}) for n, i in sorted(METHODS.items()) if i.kind == "layer" and i.gradients]
    cases += [  # perturbation methods take a gradient to rank channels for top_k
        (n, {"top_k": 2, "rank": "gradient"})
        for n, i in sorted(METHODS.items())
        if i.kind == "layer" and i.perturbation
    ]
    return cases


@pytest.mark.parametrize(("name", "extra"), _gradient_layer_methods())
def test_a_layer_that_does_not_reach_the_output_is_named(name: str, extra: dict[str, Any]) -> None:
    method = build(METHODS[name], Dead(), "side", **extra)
    with pytest.raises(hs.UsageError, match="layer 'side' does not influence the target"):
        method(_x(), targets=[0, 1, 2])


class Detached(Dead):
    """The model cuts the graph before ``side``, which it then uses."""

    def forward(self, x: Tensor) -> Tensor:
        h = self.side(torch.relu(self.stem(x)).detach())
        return self.head(h.mean((2, 3)))


#: methods that replace the layer's output by a tensor of their own (Captum's layer
#: integrated gradients does too): they need no gradient path from the input to the layer
REPLACES_OUTPUT = {"layer_integrated_gradients"}


@pytest.mark.parametrize(
    ("name", "extra"), [c for c in _gradient_layer_methods() if c[0] not in REPLACES_OUTPUT]
)
def test_a_layer_cut_from_the_graph_says_why(name: str, extra: dict[str, Any]) -> None:
    frozen = Detached().requires_grad_(False)
    method = build(METHODS[name], frozen, "side", **extra)
    with pytest.raises(hs.UsageError, match=r"'side''s output has no gradient: nothing"):
        method(_x(), targets=[0, 1, 2])


# -- peers ---------------------------------------------------------------------------------


def _pytorch_grad_cam() -> Any:
    """pytorch-grad-cam imported as bench/_peers.py does (torchvision stubbed out meanwhile)."""
    path = Path(__file__).resolve().parents[1] / "bench" / "_peers.py"
    spec = importlib.util.spec_from_file_location("bench_peers", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.pytorch_grad_cam()


def _minmax(maps: Tensor) -> Tensor:
    lo = maps.flatten(1).min(1).values[:, None, None]
    hi = maps.flatten(1).max(1).values[:, None, None]
    return (maps - lo) / (1e-7 + hi - lo)


def _scaled(raw: Tensor, size: tuple[int, int]) -> np.ndarray:
    """pytorch-grad-cam's post-processing: min-max per image, bilinear resize, min-max again
    (its ``aggregate_multi_layers``)."""
    up = F.interpolate(_minmax(raw)[:, None], size=size, mode="bilinear", align_corners=False)
    return _minmax(up[:, 0]).numpy()


PGC = {
    "gradcam": "GradCAM",
    "gradcam++": "GradCAMPlusPlus",
    "xgradcam": "XGradCAM",
    "layercam": "LayerCAM",
    "hirescam": "HiResCAM",
    "scorecam": "ScoreCAM",
    "ablationcam": "AblationCAM",
    "eigencam": "EigenCAM",
}
CAPTUM = {
    "gradcam": "LayerGradCam",
    "saliency": "Saliency",
    "guided_backprop": "GuidedBackprop",
    "guided_gradcam": "GuidedGradCam",
    "integrated_gradients": "IntegratedGradients",
    "layer_integrated_gradients": "LayerIntegratedGradients",
    "layer_conductance": "LayerConductance",
    "input_x_gradient": "InputXGradient",
    "occlusion": "Occlusion",
    "feature_ablation": "FeatureAblation",
}
#: checked against references written in tests/test_explain.py instead: no peer has CAM
#: (torchcam is not installed) or SmoothGrad with noise we can reproduce; nor attention
#: rollout or transformer relevance (hand-written on eager attention in
#: tests/test_explain_transformer.py)
NO_PEER = {"cam", "smoothgrad", "attention_rollout", "transformer_relevance"}


def test_every_method_has_a_peer_or_a_written_reference() -> None:
    assert set(METHODS) == set(PGC) | set(CAPTUM) | NO_PEER
    assert not (set(PGC) | set(CAPTUM)) & NO_PEER


@pytest.mark.parametrize("name", sorted(PGC))
def test_maps_match_pytorch_grad_cam(name: str) -> None:
    pgc, model_targets = _pytorch_grad_cam()
    model, x, targets = Net(), _x(), [1, 2, 3]
    ours = build(METHODS[name], model, "act", **options(METHODS[name]))(x, targets=targets)
    theirs_model = copy.deepcopy(model)  # pytorch-grad-cam swaps modules and fills .grad
    cls = getattr(pgc, PGC[name])
    with cls(model=theirs_model, target_layers=[theirs_model.act]) as cam:
        wanted = [model_targets.ClassifierOutputTarget(c) for c in targets]
        theirs = cam(input_tensor=x, targets=wanted)
    if name == "eigencam":  # the SVD's sign is arbitrary: each of theirs has one of the two
        gaps = [
            np.abs(_scaled((s * ours.raw).clamp_min(0), (12, 12)) - theirs).max((1, 2))
            for s in (1, -1)
        ]
        assert np.minimum(*gaps).max() < 1e-4
    else:
        assert np.abs(_scaled(ours.raw, (12, 12)) - theirs).max() < 1e-4


@pytest.mark.parametrize("name", sorted(CAPTUM))
@pytest.mark.filterwarnings("ignore:Setting backward hooks on ReLU")  # Captum's own notices
@pytest.mark.filterwarnings("ignore:Input Tensor 0 did not already require gradients")
def test_maps_match_captum(name: str) -> None:
    import captum.attr as attr

    model, x, targets = Net(), _x(), [1, 2, 3]
    ours = build(METHODS[name], model, "act", **options(METHODS[name]))(x, targets=targets)
    theirs_model = copy.deepcopy(model)
    cls = getattr(attr, CAPTUM[name])
    if name == "gradcam":
        theirs = cls(theirs_model, theirs_model.act).attribute(
            x, target=targets, relu_attributions=True
        )[:, 0]
    elif name == "guided_gradcam":
        theirs = cls(theirs_model, theirs_model.act).attribute(
            x, target=targets, interpolate_mode="bilinear"
        )
    elif name.startswith("layer_"):  # the defaults are Captum's: 50 steps, Gauss-Legendre
        theirs = cls(theirs_model, theirs_model.act).attribute(x, target=targets)
    elif name == "occlusion":
        theirs = cls(theirs_model).attribute(
            x, REQUIRED["sliding_window_shapes"](model), target=targets
        )
    else:
        theirs = cls(theirs_model).attribute(x.clone().requires_grad_(True), target=targets)
    got = ours.attributions if ours.attributions is not None else ours.raw
    torch.testing.assert_close(got, theirs.detach(), rtol=1e-4, atol=1e-6)


# -- attention methods: the same contract on a small vision transformer --------------------


class SelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``."""

    def __init__(self, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.qkv, self.proj, self.heads = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim), heads

    def forward(self, x: Tensor) -> Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(n, t, d))


class Layer(nn.Module):
    """Pre-norm: attention and a one-layer MLP, each with its residual."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.attn, self.mlp = nn.LayerNorm(8), SelfAttention(), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.norm(x))
        return x + torch.relu(self.mlp(x))


class ViT(nn.Module):
    """4x4 patches of a 3x12x12 image (a 3x3 grid) and a CLS token, two blocks, 4 classes."""

    def __init__(self, counted: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.counted = counted
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.pos = nn.Parameter(torch.randn(1, 10, 8))
        self.blocks = nn.Sequential(Layer(), Layer())
        self.head = nn.Linear(8, 4)

    def forward(self, x: Tensor) -> Tensor:
        if self.counted:
            CALLS.append(len(x))
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.relu(torch.cat([self.cls.expand(len(x), -1, -1), tokens], 1) + self.pos)
        if self.counted:
            SAVED.append(weakref.ref(h))
        return self.head(self.blocks(h)[:, 0] * 3)


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_methods_shapes_targets_scores_and_backward(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    info = METHODS[name]
    assert info.requires == () and not info.perturbation
    model, x = ViT(), _x()
    grads: list[int] = []
    real = torch.autograd.grad
    monkeypatch.setattr(torch.autograd, "grad", lambda *a, **k: grads.append(1) or real(*a, **k))
    method = info.cls(model)
    exp = method(x, targets=[1, 2, 3])
    assert bool(grads) == info.gradients
    assert exp.raw.shape == (3, 3, 3) and exp.maps.shape == (3, 12, 12)  # the patch grid
    assert exp.attributions.shape == (3, 10)  # the CLS token's row, every token
    assert exp.targets.tolist() == [1, 2, 3] and exp.method == name
    torch.testing.assert_close(exp.scores, model(x).detach()[[0, 1, 2], [1, 2, 3]])
    assert method(x).targets.tolist() == model(x).argmax(1).tolist()
    assert torch.isfinite(exp.raw).all() and exp.raw.abs().sum() > 0


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_methods_batch_targets_grads_and_what_outlives_the_call(name: str) -> None:
    model, x, targets = ViT(), _x(), [2, 0, 3]
    model.head.weight.grad = torch.full_like(model.head.weight, 7.0)
    model.blocks[0].requires_grad_(False)
    method = METHODS[name].cls(model)
    batch = method(x, targets=targets)
    for i, t in enumerate(targets):
        one = method(x[i : i + 1], targets=t)
        torch.testing.assert_close(batch.raw[i], one.raw[0], rtol=1e-4, atol=1e-6)
    for bad, message in BAD_TARGETS:
        CALLS.clear()
        with pytest.raises(hs.UsageError, match=message):
            method(x, targets=bad)
        assert CALLS == [], bad
    with pytest.raises(hs.UsageError, match=r"the batch is empty"):
        method(x[:0])
    assert torch.equal(model.head.weight.grad, torch.full_like(model.head.weight, 7.0))
    assert all(p.grad is None for n, p in model.named_parameters() if n != "head.weight")
    gc.collect()
    assert SAVED and all(ref() is None for ref in SAVED)
    assert batch.raw.grad_fn is None and not batch.scores.requires_grad


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_methods_read_nothing_back_and_give_a_compiled_models_maps(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    x, targets = _x(), [1, 2, 3]
    method = METHODS[name].cls(ViT())
    method(x, targets=targets)  # the attention layers are found once, by a first forward
    reads: list[str] = []
    for attr in READS:
        real = getattr(torch.Tensor, attr)

        def counted(*a: Any, _real: Any = real, _attr: str = attr, **k: Any) -> Any:
            reads.append(_attr)
            return _real(*a, **k)

        monkeypatch.setattr(torch.Tensor, attr, counted)
    for t in ([1, 2, 3], 2, None, lambda out: out[:, 0] - out[:, 1]):
        method(x, targets=t)
        assert reads == [], (t, reads)
    monkeypatch.undo()
    torch._dynamo.reset()
    expected = METHODS[name].cls(ViT(counted=False).eval())(x, targets=targets)
    compiled: nn.Module = torch.compile(ViT(counted=False).eval(), backend="eager")  # type: ignore[assignment]
    compiled(x.clone().requires_grad_(True))
    got = METHODS[name].cls(compiled)(x, targets=targets)
    torch.testing.assert_close(got.raw, expected.raw, rtol=1e-4, atol=1e-6)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ATTENTION)
def test_attention_methods_refuse_a_model_without_attention(name: str) -> None:
    with pytest.raises(hs.UsageError, match=r"no F.scaled_dot_product_attention call ran in Net"):
        METHODS[name].cls(Net())(_x(), targets=1)
