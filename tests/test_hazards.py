"""The hazard matrix: every entry point that hooks a model, in every situation users found
entry points breaking in. Each cell either works, checked against a reference computed
without hookscope on a plain copy of the model, or refuses with the error named by the policy
table of docs/guarantees.md, and the residue fixture checks the model is left as found.

Situations: a compiled model that already ran; reentrant and non-reentrant activation
checkpointing; an exception raised and caught inside the model; a KeyboardInterrupt in an
earlier forward; another session open on the model; no_grad and inference_mode; a deepcopy
of the model made inside its own forward; a second-order backward; nested tensors;
torch.func transforms around the model or inside its forward, and functional_call;
torch.export, strict and not, and an export on another thread. Capture and edit appear
twice: with a layer and with an operation selector (``"layer::op"``).
"""

from __future__ import annotations

import contextlib
import copy
import threading
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs

# -- the model, and its situations ---------------------------------------------------------------


class Fragile(nn.Module):
    """Raises when told to; the model catches it (fallback code does this)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        raise RuntimeError("a layer that fails, caught by its caller")


class Net(nn.Module):
    """conv -> ReLU -> block (conv -> ReLU) -> pool -> linear, with a hazard switched on."""

    def __init__(self, hazard: str = "plain") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.act = nn.ReLU()
        self.block = nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.ReLU())
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
        self.fragile = Fragile()
        self.hazard = hazard
        self.copies: list[nn.Module] = []

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.conv(x))
        if self.hazard == "caught":
            with contextlib.suppress(RuntimeError):
                self.fragile(h)
        if self.hazard == "deepcopy":
            self.copies.append(copy.deepcopy(self))
        if self.hazard in ("reentrant", "non-reentrant") and torch.is_grad_enabled():
            h = checkpoint(self.block, h, use_reentrant=self.hazard == "reentrant")
        elif self.hazard == "functional_call":  # parameters given for the call (equal values)
            given = {name: p * 1.0 for name, p in self.block.named_parameters()}
            h = torch.func.functional_call(self.block, given, (h,))
        elif self.hazard == "vmap":  # the block runs per sample, inside a torch.func transform
            h = torch.func.vmap(self.block)(h.unsqueeze(1)).squeeze(1)
        else:
            h = self.block(h)
        return self.head(h)


LAYER = "block.1"  # the layer every entry point looks at
X = torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _reference(fn: Callable[[nn.Module, Tensor], Any]) -> Any:
    """``fn`` on a plain copy of the model, no hookscope anywhere."""
    return fn(Net("plain"), X.clone())


@contextlib.contextmanager
def _eval(model: nn.Module) -> Iterator[nn.Module]:
    """The model in eval mode for the block, every module's flag restored after."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield model
    finally:
        for m, flag in flags:
            m.training = flag


def _layer_output(model: nn.Module, x: Tensor) -> Tensor:
    seen: list[Tensor] = []
    handle = model.get_submodule(LAYER).register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone())
    )
    try:
        with torch.no_grad(), _eval(model):
            model(x)
    finally:
        handle.remove()
    return seen[0]


# -- entry points ------------------------------------------------------------------------------
# Each takes (model, x) and returns what its reference returns on a plain model.


OP = f"{LAYER}::relu"  # the operation that layer runs: an operation selector


def _capture(model: nn.Module, x: Tensor, selector: str = LAYER) -> Tensor:
    with hs.capture(model, selector) as cap, _eval(model):
        model(x)
    return cap[selector].output


def _edit(model: nn.Module, x: Tensor, selector: str = LAYER) -> Tensor:
    with hs.edit(model, {selector: hs.scale(0.5)}), torch.no_grad(), _eval(model):
        return model(x).detach()


def _edit_reference(model: nn.Module, x: Tensor) -> Tensor:
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, out: out * 0.5)
    try:
        with torch.no_grad(), _eval(model):
            return model(x)
    finally:
        handle.remove()


def _features(model: nn.Module, x: Tensor) -> Tensor:
    out: Tensor = hs.features(model, x, [LAYER])[LAYER]
    return out


def _summary(model: nn.Module, x: Tensor) -> tuple[int, int]:
    s = hs.summary(model, x)
    return s.total_flops, s.total_params


def _summary_reference(model: nn.Module, x: Tensor) -> tuple[int, int]:
    params = sum(p.numel() for p in model.parameters())
    convs = 2 * (4 * 3 * 9 * 64 + 4 * 4 * 9 * 64) * x.shape[0]  # 2 per multiply-add
    return convs + 2 * 4 * 3 * x.shape[0], params


def _nonfinite(model: nn.Module, x: Tensor) -> tuple[bool, int]:
    with hs.nonfinite(model) as report:
        model(x).sum().backward()
    model.zero_grad(set_to_none=True)
    return report.ok, report.forwards


def _monitor(model: nn.Module, x: Tensor) -> float:
    with hs.Monitor(model, LAYER, every=1) as mon:
        with torch.no_grad(), _eval(model):
            model(x)
        mon.step()
    return next(r["norm"] for r in mon.records if r["kind"] == "activation")


def _gradcam(model: nn.Module, x: Tensor) -> Tensor:
    return hs.GradCAM(model, LAYER)(x, targets=[0, 1, 2, 0]).raw


def _gradcam_reference(model: nn.Module, x: Tensor) -> Tensor:
    kept: list[Tensor] = []
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        with torch.enable_grad(), _eval(model):
            scores = model(x).gather(1, torch.tensor([[0], [1], [2], [0]]))
            (grad,) = torch.autograd.grad(scores.sum(), kept[0])
    finally:
        handle.remove()
    weights = grad.mean((2, 3), keepdim=True)
    return (weights * kept[0]).sum(1).clamp_min(0).detach()


def _extract(model: nn.Module, x: Tensor, *, tmp: Path) -> Tensor:
    store = hs.extract(model, x, [LAYER], out=tmp / "store", overwrite=True)
    return torch.from_numpy(store.to_numpy(LAYER))


def _report(model: nn.Module, x: Tensor, *, tmp: Path) -> bool:
    pytest.importorskip("matplotlib")
    text = hs.report(model, x, tmp / "r.html").read_text()
    return "Grad-CAM at <code>" in text


# Patching and the logit lens on the image model: its channels stand for positions (axis 1),
# the corrupted input is the batch in another order.
POSITIONS = [0, 2]


def _metric(out: Tensor) -> Tensor:
    return out[:, 0].sum()


def _patching(model: nn.Module, x: Tensor) -> Tensor:
    return hs.patching(model, x, x.flip(0), _metric, [LAYER], positions=POSITIONS).values


def _patching_reference(model: nn.Module, x: Tensor) -> Tensor:
    clean, cells = _layer_output(model, x), []
    for p in POSITIONS:

        def patch(m: nn.Module, a: Any, out: Tensor, p: int = p) -> Tensor:
            out = out.clone()
            out[:, p] = clean[:, p]
            return out

        handle = model.get_submodule(LAYER).register_forward_hook(patch)
        try:
            with torch.no_grad(), _eval(model):
                cells.append(_metric(model(x.flip(0))))
        finally:
            handle.remove()
    return torch.stack(cells)[None]


def _attribution(model: nn.Module, x: Tensor) -> Tensor:
    return hs.attribution_patching(
        model, x, x.flip(0), _metric, [LAYER], positions=POSITIONS
    ).values


def _attribution_reference(model: nn.Module, x: Tensor) -> Tensor:
    """The metric at the corrupted run plus its gradient there times (clean - corrupted)."""
    clean, kept = _layer_output(model, x), []
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, out: kept.append(out))
    try:
        with torch.enable_grad(), _eval(model):
            score = _metric(model(x.flip(0)))
            (grad,) = torch.autograd.grad(score, kept[0])
    finally:
        handle.remove()
    change = grad * (clean - kept[0].detach())
    return (score.detach() + torch.stack([change[:, p].sum() for p in POSITIONS]))[None]


def _lens(model: nn.Module, x: Tensor) -> Tensor:
    """The layer read through the pool (as the norm) and the whole head (as the unembedding):
    pooling twice is pooling once, so its one row is the model's logits."""
    return hs.logit_lens(model, x, [LAYER], norm="head.0", unembed="head").logits


def _lens_reference(model: nn.Module, x: Tensor) -> Tensor:
    with torch.no_grad(), _eval(model):
        return model(x)[None]


@dataclass(frozen=True)
class Entry:
    run: Callable[..., Any]
    reference: Callable[[nn.Module, Tensor], Any]
    wraps: bool  # a session around the user's code (else: it runs the model itself)
    needs_tmp: bool = False


ENTRIES: dict[str, Entry] = {
    "capture": Entry(_capture, _layer_output, wraps=True),
    "edit": Entry(_edit, _edit_reference, wraps=True),
    "capture op": Entry(lambda m, x: _capture(m, x, OP), _layer_output, wraps=True),
    "edit op": Entry(lambda m, x: _edit(m, x, OP), _edit_reference, wraps=True),
    "features": Entry(_features, _layer_output, wraps=False),
    "summary": Entry(_summary, _summary_reference, wraps=False),
    "nonfinite": Entry(_nonfinite, lambda m, x: (True, 1), wraps=True),
    "Monitor": Entry(_monitor, lambda m, x: float(_layer_output(m, x).norm()), wraps=True),
    "GradCAM": Entry(_gradcam, _gradcam_reference, wraps=False),
    "extract": Entry(_extract, _layer_output, wraps=False, needs_tmp=True),
    "report": Entry(_report, lambda m, x: True, wraps=False, needs_tmp=True),
    "patching": Entry(_patching, _patching_reference, wraps=False),
    "attribution_patching": Entry(_attribution, _attribution_reference, wraps=False),
    "logit_lens": Entry(_lens, _lens_reference, wraps=False),
}


def _run(name: str, model: nn.Module, tmp: Path) -> Any:
    entry = ENTRIES[name]
    kwargs = {"tmp": tmp} if entry.needs_tmp else {}
    return entry.run(model, X.clone(), **kwargs)


def _same(got: Any, want: Any) -> None:
    if isinstance(want, Tensor):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    elif isinstance(want, float):
        assert got == pytest.approx(want, rel=1e-5)
    else:
        assert got == want


# -- the matrix ----------------------------------------------------------------------------------


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize(
    "hazard", ["plain", "reentrant", "non-reentrant", "caught", "deepcopy", "functional_call"]
)
def test_model_situations(entry: str, hazard: str, tmp_path: Path) -> None:
    """Checkpointing, a caught exception, a deepcopy and torch.func.functional_call (not a
    transform: its calls are ordinary calls) inside the forward change nothing, except that a
    layer inside a reentrant checkpoint has no gradient to explain: its forward runs under
    no_grad, and its gradient exists only in a .backward() that would write every parameter's
    .grad (and run their hooks), so gradient maps refuse and say what to do."""
    model = Net(hazard)
    if (entry, hazard) == ("GradCAM", "reentrant"):
        with pytest.raises(
            hs.UsageError, match=r"reentrant activation checkpoint.*use_reentrant=False"
        ):
            _run(entry, model, tmp_path)
        return
    if (entry, hazard) == ("report", "reentrant"):
        text = hs.report(model, X.clone(), tmp_path / "r.html").read_text()
        assert "Grad-CAM at <code>" not in text and "use_reentrant=False" in text
        return
    got = _run(entry, model, tmp_path)
    _same(got, _reference(ENTRIES[entry].reference))
    if hazard == "deepcopy":  # the copies made inside carry none of hookscope's hooks
        assert model.copies and not any(
            m._forward_hooks or m._forward_pre_hooks for c in model.copies for m in c.modules()
        )


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_compiled_model_that_already_ran(entry: str, tmp_path: Path) -> None:
    """Sessions around the user's code refuse (CompiledModelError: hooks would be ignored)
    unless recompile=True; entry points that run the model themselves run it eagerly."""
    model = Net()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(X)
    want = _reference(ENTRIES[entry].reference)
    if ENTRIES[entry].wraps:
        with pytest.raises(hs.CompiledModelError, match="recompile=True"):
            _run(entry, compiled, tmp_path)
        return
    _same(_run(entry, compiled, tmp_path), want)


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_after_a_keyboard_interrupt_in_a_forward(entry: str, tmp_path: Path) -> None:
    """An earlier forward ended by KeyboardInterrupt (no hook sees it end) leaves nothing
    behind that confuses the next call."""
    model = Net()
    seen = {"calls": 0}

    def interrupt(m: nn.Module, a: Any) -> None:
        seen["calls"] += 1
        if seen["calls"] == 1:
            raise KeyboardInterrupt

    with hs.capture(model, "act") as other:  # a session open while it happens
        handle = model.block.register_forward_pre_hook(interrupt)
        with pytest.raises(KeyboardInterrupt):
            model(X)
        handle.remove()
        got = _run(entry, model, tmp_path)
    _same(got, _reference(ENTRIES[entry].reference))
    assert other["act"].count >= 1


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_with_another_session_open(entry: str, tmp_path: Path) -> None:
    model = Net()
    with hs.capture(model, LAYER) as outer, hs.edit(model, {"conv": hs.transform(lambda t: t)}):
        got = _run(entry, model, tmp_path)
        with _eval(model):
            model(X)
    _same(got, _reference(ENTRIES[entry].reference))
    torch.testing.assert_close(outer[LAYER].output, _reference(_layer_output))


# What each entry point does under torch.no_grad() and torch.inference_mode(): "works" or the
# error it raises (README's policy table says the same).
GRAD_MODES: dict[str, dict[str, type[Exception] | str]] = {
    "capture": {"no_grad": "works", "inference_mode": "works"},
    "edit": {"no_grad": "works", "inference_mode": "works"},
    "capture op": {"no_grad": "works", "inference_mode": "works"},
    "edit op": {"no_grad": "works", "inference_mode": "works"},
    "features": {"no_grad": "works", "inference_mode": "works"},
    "summary": {"no_grad": "works", "inference_mode": "works"},
    "nonfinite": {"no_grad": "forward only", "inference_mode": "forward only"},
    "Monitor": {"no_grad": "works", "inference_mode": "works"},
    "GradCAM": {"no_grad": "works", "inference_mode": hs.UsageError},
    "extract": {"no_grad": "works", "inference_mode": "works"},
    "report": {"no_grad": "works", "inference_mode": "no cam"},
    "patching": {"no_grad": "works", "inference_mode": "works"},
    "attribution_patching": {"no_grad": "works", "inference_mode": hs.UsageError},
    "logit_lens": {"no_grad": "works", "inference_mode": "works"},
}


@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_under_no_grad_and_inference_mode(entry: str, mode: str, tmp_path: Path) -> None:
    model = Net()
    want = _reference(ENTRIES[entry].reference)
    context = torch.no_grad if mode == "no_grad" else torch.inference_mode
    expected = GRAD_MODES[entry][mode]
    if entry == "nonfinite":  # no backward can run: the forward is checked
        with context(), hs.nonfinite(model) as report:
            model(X)
        assert report.ok and report.forwards == 1 and report.backwards == 0
        return
    if isinstance(expected, type):
        with context(), pytest.raises(expected, match="inference_mode"):
            _run(entry, model, tmp_path)
        return
    with context():
        got = _run(entry, model, tmp_path)
    if expected == "no cam":
        assert got is False  # the report says why there is no Grad-CAM instead
        return
    _same(got, want)


# -- second-order backward -------------------------------------------------------------------


def _penalty_step(model: nn.Module) -> list[Tensor]:
    x = X.clone().requires_grad_()
    out = model(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.sum() + gx.pow(2).sum()).backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return grads


@contextlib.contextmanager
def _session(entry: str, model: nn.Module) -> Iterator[None]:
    sessions: dict[str, Callable[[], Any]] = {
        "capture": lambda: hs.capture(model, list(hs.names(model)), grads=True),
        "edit": lambda: hs.edit(model, {LAYER: hs.scale(1.0, on="grad")}),
        "capture op": lambda: hs.capture(model, OP, grads=True),
        "edit op": lambda: hs.edit(model, {OP: hs.scale(1.0, on="grad")}),
        "nonfinite": lambda: hs.nonfinite(model),
        "Monitor": lambda: hs.Monitor(model, every=1),
    }
    with sessions[entry]():
        yield


@pytest.mark.parametrize(
    "entry", ["capture", "edit", "capture op", "edit op", "nonfinite", "Monitor"]
)
def test_second_order_backward_changes_no_gradient(entry: str) -> None:
    """A gradient penalty (create_graph=True, then backward) under each session around the
    user's code: parameter gradients bit-identical to the plain step's."""
    want = _penalty_step(Net())
    model = Net()
    with _session(entry, model):
        got = _penalty_step(model)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)


# -- nested tensors ------------------------------------------------------------------------------


def _encoder() -> tuple[nn.Module, Tensor, Tensor]:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    return model, x, pad


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_of_a_padded_transformer_encoder(tmp_path: Path) -> None:
    """In eval, TransformerEncoder turns a padded batch into nested tensors between its layers:
    every entry point works on them or says plainly what it cannot do."""
    model, x, pad = _encoder()
    with torch.no_grad():
        want = model(x, src_key_padding_mask=pad)
    inputs = {"src": x, "src_key_padding_mask": pad}
    with torch.no_grad(), hs.capture(model, "layers.0") as cap:
        got = model(**inputs)
    assert torch.equal(got, want)
    nested = cap["layers.0"].output
    assert nested.is_nested and [t.shape for t in nested.unbind()] == [(5, 8), (3, 8)]
    with torch.no_grad(), hs.nonfinite(model) as report:
        model(**inputs)
    assert report.ok
    with torch.no_grad(), hs.Monitor(model, "layers.0", every=1) as mon:
        model(**inputs)
        mon.step()
    (record,) = [r for r in mon.records if r["kind"] == "activation"]
    assert record["norm"] == pytest.approx(float(nested.values().norm()), rel=1e-5)
    s = hs.summary(model, inputs)
    assert s.total_params == sum(p.numel() for p in model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        store = hs.extract(
            model, x, ["layers.0"], out=tmp_path / "f", reduce="token_mean", batch_size=2
        )
    assert store["layers.0"].shape == (2, 8)


# -- torch.func ----------------------------------------------------------------------------------
# Transforms as users write them around a function of x built on the model (each runs it on
# a whole batch: vmap over a stack of two, jacobians of the per-class sums).
Fn = Callable[[Tensor], Tensor]
TRANSFORMS: dict[str, Callable[[Fn, Tensor], Tensor]] = {
    "vmap": lambda f, x: torch.func.vmap(f)(torch.stack([x, x]))[0],
    "grad": lambda f, x: torch.func.grad(lambda x: f(x).pow(2).sum())(x),
    "jacrev": lambda f, x: torch.func.jacrev(lambda x: f(x).sum(0))(x),
    "jacfwd": lambda f, x: torch.func.jacfwd(lambda x: f(x).sum(0))(x),
}
#: what a refusal names (jacrev's forward runs under grad; jacfwd's under jvp inside vmap)
NAMED = {
    "vmap": r"torch\.func\.vmap",
    "grad": r"torch\.func\.grad",
    "jacrev": r"torch\.func\.grad",
    "jacfwd": r"torch\.func\.jvp inside torch\.func\.vmap",
}
#: the sessions of the matrix, opened around the user's code
SESSIONS: dict[str, Callable[[nn.Module], Any]] = {
    "capture": lambda m: hs.capture(m, LAYER),
    "edit": lambda m: hs.edit(m, {LAYER: hs.scale(0.5)}),
    "capture op": lambda m: hs.capture(m, OP),
    "edit op": lambda m: hs.edit(m, {OP: hs.scale(0.5)}),
    "nonfinite": lambda m: hs.nonfinite(m),
    "Monitor": lambda m: hs.Monitor(m, LAYER, every=1),
}


@contextlib.contextmanager
def _hand_edit(model: nn.Module) -> Iterator[None]:
    """The edit of SESSIONS, as a forward hook of the user's."""
    handle = model.get_submodule(LAYER).register_forward_hook(lambda m, a, out: out * 0.5)
    try:
        yield
    finally:
        handle.remove()


def _hand_output(model: nn.Module, run: Callable[[], Any]) -> Tensor:
    """The layer's output in ``run()``, kept by a forward hook of the user's."""
    seen: list[Tensor] = []
    handle = model.get_submodule(LAYER).register_forward_hook(
        lambda m, a, out: seen.append(out.detach().clone())
    )
    try:
        run()
    finally:
        handle.remove()
    (out,) = seen
    return out


def _saw(entry: str, session: Any) -> Any:
    """What a session holds: the capture's calls and latest output, the checker's forwards,
    the Monitor's activation norms, the edit's count of applied edits."""
    if entry.startswith("capture"):
        name = OP if entry == "capture op" else LAYER
        record = session[name]
        return record.count, record.output if record.count else None
    if entry == "nonfinite":
        return session.forwards, session.ok
    if entry == "Monitor":
        session.step()
        return [r["norm"] for r in session.records if r["kind"] == "activation"]
    return sum(session.applied.values())


def _saw_one_plain_forward(entry: str, session: Any) -> None:
    """The session holds exactly one plain forward of the model on X (and nothing else)."""
    got = _saw(entry, session)
    output = _reference(_layer_output)
    if entry.startswith("capture"):
        assert got[0] == 1
        _same(got[1], output)
    elif entry == "nonfinite":
        assert got == (1, True)
    elif entry == "Monitor":
        assert got == [pytest.approx(float(output.norm()), rel=1e-5)]
    else:
        assert got == 1


# jacfwd's first use scripts a helper of torch's (torch.jit.script is deprecated: not ours)
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("transform", list(TRANSFORMS))
def test_inside_a_torch_func_transform(entry: str, transform: str, tmp_path: Path) -> None:
    """Edits are part of the function a transform computes, as a forward hook of the user's
    would be: they work, equal to that hook. The other sessions read values, which inside a
    transform are its wrappers: they refuse, naming the transform and the fix, and record
    nothing of it. Entry points that run the model themselves, called inside a transform,
    refuse likewise (vmap: summary mixed per-sample shapes with whole-batch FLOPs)."""
    model, run = Net(), TRANSFORMS[transform]
    if entry.startswith("edit"):
        with _hand_edit(model):
            want = run(model, X)
        with SESSIONS[entry](model) as edit:
            got = run(model, X)
        torch.testing.assert_close(got, want)
        assert edit.applied[OP if entry == "edit op" else LAYER] >= 1
        assert not torch.allclose(got, run(model, X))  # the edit changed what it computes
        return
    refusal = rf"ran inside {NAMED[transform]} \(a torch\.func transform\).*Fix: "
    if ENTRIES[entry].wraps:
        with SESSIONS[entry](model) as session:
            with pytest.raises(hs.UnsupportedModelError, match=refusal):
                run(model, X)
            with torch.no_grad():
                model(X)  # outside the transform, the same session works
        _saw_one_plain_forward(entry, session)
        return
    kwargs = {"tmp": tmp_path} if ENTRIES[entry].needs_tmp else {}

    def inside(x: Tensor) -> Tensor:
        ENTRIES[entry].run(model, x, **kwargs)
        out: Tensor = model(x)
        return out

    with pytest.raises(hs.UnsupportedModelError, match=rf"inside {NAMED[transform]} \(a "):
        run(inside, X)
    assert not list(tmp_path.iterdir())  # nothing written (extract, report)


@contextlib.contextmanager
def _hand_grad_edit(model: nn.Module) -> Iterator[None]:
    """A gradient edit (half the layer's output gradient), as a tensor hook of the user's."""

    def hook(m: nn.Module, a: Any, out: Tensor) -> None:
        out.register_hook(lambda g: g * 0.5)

    handle = model.get_submodule(LAYER).register_forward_hook(hook)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("transform", ["grad", "jacrev", "vmap of grad", "jacfwd"])
def test_gradient_edits_inside_a_transform(transform: str) -> None:
    """Gradient edits apply to the backward a reverse-mode transform runs (equal to a tensor
    hook of the user's); forward-mode transforms run no backward, and the refusal says so."""
    model = Net()
    runs: dict[str, Callable[[], Tensor]] = {
        "grad": lambda: TRANSFORMS["grad"](model, X),
        "jacrev": lambda: TRANSFORMS["jacrev"](model, X),
        "vmap of grad": lambda: torch.func.vmap(torch.func.grad(lambda x: model(x).pow(2).sum()))(
            torch.stack([X, X])
        )[0],
        "jacfwd": lambda: TRANSFORMS["jacfwd"](model, X),
    }
    edit = hs.edit(model, {LAYER: hs.scale(0.5, on="grad")})
    if transform == "jacfwd":
        with edit, pytest.raises(hs.EditError, match=r"inside torch\.func\.jvp.*no backward"):
            runs[transform]()
        return
    with _hand_grad_edit(model):
        want = runs[transform]()
    with edit:
        got = runs[transform]()
    torch.testing.assert_close(got, want)
    assert not torch.allclose(got, runs[transform]())  # the edit changed the gradients


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_a_transform_inside_the_forward(entry: str, tmp_path: Path) -> None:
    """A model whose forward runs a layer inside vmap: edits there work (equal to a hook of
    the user's); every other entry point refuses, naming vmap and the fix."""
    model = Net("vmap")
    if entry.startswith("edit"):
        with _hand_edit(model), torch.no_grad():
            want = model(X)
        with SESSIONS[entry](model), torch.no_grad():
            got = model(X)
        torch.testing.assert_close(got, want)
        return
    with pytest.raises(hs.UnsupportedModelError, match=r"inside torch\.func\.vmap.*Fix: "):
        _run(entry, model, tmp_path)


@pytest.mark.parametrize("entry", list(SESSIONS))
def test_functional_call_is_an_ordinary_call(entry: str) -> None:
    """torch.func.functional_call runs the model with the parameters it is given: sessions
    see that call as any other, computed with those parameters."""
    model = Net()
    given = {name: p.detach() * 2.0 for name, p in model.named_parameters()}

    def call() -> Tensor:
        with torch.no_grad():
            out: Tensor = torch.func.functional_call(model, given, (X,))
        return out

    if entry.startswith("edit"):
        with _hand_edit(model):
            want = call()
        with SESSIONS[entry](model):
            torch.testing.assert_close(call(), want)
        return
    output = _hand_output(model, call)
    assert not torch.allclose(output, _reference(_layer_output))  # the given parameters
    with SESSIONS[entry](model) as session:
        call()
    got = _saw(entry, session)
    if entry.startswith("capture"):
        assert got[0] == 1
        _same(got[1], output)
    elif entry == "nonfinite":
        assert got == (1, True)
    else:
        assert got == [pytest.approx(float(output.norm()), rel=1e-5)]


# -- torch.export --------------------------------------------------------------------------------


def _program(ep: Any) -> list[tuple[str, str]]:
    """An exported program's graph: each node's kind and target."""
    return [(node.op, str(node.target)) for node in ep.graph.nodes]


class _Calls(nn.Module):
    """A model whose forward calls an entry point that runs ``net`` itself."""

    def __init__(self, entry: str, tmp: Path) -> None:
        super().__init__()
        self.entry, self.tmp = entry, tmp
        # not a submodule: an export does not swap its parameters for fake ones meanwhile
        self.__dict__["net"] = Net()

    def forward(self, x: Tensor) -> Tensor:
        run = ENTRIES[self.entry]
        run.run(self.net, x, **({"tmp": self.tmp} if run.needs_tmp else {}))
        out: Tensor = self.net(x)
        return out


# a non-strict export rebinds module attributes (conv.kernel_size...) to equal new objects:
# torch's doing; hooks, training flags and parameter lists are still checked
@pytest.mark.mutates_model
@pytest.mark.parametrize("entry", list(ENTRIES))
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_torch_export(entry: str, strict: bool, tmp_path: Path) -> None:
    """An export's trace is not one of the model's forwards: sessions open meanwhile record,
    count and edit nothing of it, and the program is the one exported without hookscope
    (it used to record a FakeTensor, fail on value reads, or die in Dynamo). Entry points
    that run the model themselves refuse to run inside code that export traces (strict:
    Dynamo refuses hookscope's Python first, with its own error)."""
    plain = torch.export.export(Net(), (X,), strict=strict)
    model = Net()
    if ENTRIES[entry].wraps:
        with SESSIONS[entry](model) as session:
            ep = torch.export.export(model, (X,), strict=strict)
            assert _saw(entry, session) in ((0, None), (0, True), [], 0)
            with torch.no_grad():
                model(X)  # a forward of the model's own: seen as always
        assert _program(ep) == _program(plain)
        torch.testing.assert_close(ep.module()(X), plain.module()(X))
        _saw_one_plain_forward(entry, session)
        return
    calls = _Calls(entry, tmp_path)
    if strict:  # Dynamo stops at the first line of Python it cannot trace
        with pytest.raises(Exception):  # noqa: B017, PT011 - Dynamo's own error
            torch.export.export(calls, (X,), strict=True)
    else:
        with pytest.raises(hs.UnsupportedModelError, match=r"inside code that torch\.export"):
            torch.export.export(calls, (X,), strict=False)
    assert not list(tmp_path.iterdir())


@pytest.mark.mutates_model  # (see test_torch_export)
@pytest.mark.parametrize("strict", [False, True], ids=["non-strict", "strict"])
def test_torch_export_skips_every_kind_of_hook(strict: bool) -> None:
    """Inputs and gradients (capture's pre-hooks and per-call hooks), operation sites and
    several sessions at once: none of them sees the trace or leaves anything in the
    program."""
    plain = torch.export.export(Net(), (X,), strict=strict)
    model = Net()
    sessions = (
        hs.capture(model, [LAYER, "block", "conv"], inputs=True, grads=True),
        hs.capture(model, ["head.2", OP]),
        hs.edit(model, {"conv": hs.ablate(), OP: hs.scale(2.0, on="input")}),
        hs.Monitor(model, every=1),
    )
    with contextlib.ExitStack() as stack:
        for session in sessions:
            stack.enter_context(session)
        ep = torch.export.export(model, (X,), strict=strict)
    assert _program(ep) == _program(plain)
    assert all(record.count == 0 for cap in sessions[:2] for record in cap.records.values())
    assert sum(sessions[2].applied.values()) == 0 and not sessions[3].records


@pytest.mark.parametrize("entry", list(ENTRIES))
def test_an_export_on_another_thread_changes_nothing_here(entry: str, tmp_path: Path) -> None:
    """torch.compiler.is_exporting() is one flag for the whole process: while another thread
    exports a model, every entry point here sees its own forwards as usual."""
    other = Net()
    inside, go = threading.Event(), threading.Event()
    failed: list[BaseException] = []

    def pause(m: nn.Module, a: Any) -> None:
        if torch.compiler.is_exporting():
            inside.set()
            go.wait(120)

    def export() -> None:
        try:
            torch.export.export(other, (X,), strict=False)
        except BaseException as e:
            failed.append(e)

    handle = other.register_forward_pre_hook(pause)
    thread = threading.Thread(target=export)
    thread.start()
    try:
        assert inside.wait(120) and torch.compiler.is_exporting()
        got = _run(entry, Net(), tmp_path)
    finally:
        go.set()
        thread.join()
        handle.remove()
    assert not failed
    _same(got, _reference(ENTRIES[entry].reference))
