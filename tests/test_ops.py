"""Operation selectors (``"layer::op"``): capture and edit what a module's own code runs.

Oracles, never hookscope itself: the same computations written by hand in the test (softmax,
matmul, attention with its probabilities materialised), gradients by ``torch.autograd.grad``
on those hand-written replicas, edits written into a replica's code, and the expected
operation lists written out. Transformers' eager attention is the oracle in
``test_ops_hf.py``."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack as mode_stack
from torch.utils.checkpoint import checkpoint

import hookscope as hs

Edit = Callable[[Tensor], Tensor]


class Functional(nn.Module):
    """A hand-written functional model: every operation is in the model's own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = nn.Parameter(torch.randn(4, 6)), nn.Parameter(torch.randn(6, 3))

    def forward(self, x: Tensor) -> Tensor:
        h = torch.relu(x @ self.w1)
        p = F.softmax(h, dim=-1)
        return p @ self.w2


def by_hand(m: Functional, x: Tensor) -> dict[str, Tensor]:
    """The same computation, every intermediate kept (the oracle)."""
    mm1 = x @ m.w1
    relu = mm1.clamp_min(0)
    e = (relu - relu.amax(-1, keepdim=True)).exp()
    soft = e / e.sum(-1, keepdim=True)
    return {"matmul#1": mm1, "relu": relu, "softmax": soft, "matmul#2": soft @ m.w2}


class Attention(nn.Module):
    """Attention written out (two matmuls and a softmax) with projections as children;
    ``edit_probs`` is the oracle's hand-written edit, used by replicas only."""

    def __init__(self, d: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
        self.heads = heads
        self.edit_probs: Edit | None = None
        self.kept: dict[str, Tensor] | None = None  # a replica keeps its intermediates

    def split(self, t: Tensor) -> Tensor:
        b, n, d = t.shape
        return t.view(b, n, self.heads, d // self.heads).transpose(1, 2)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.split(self.q(x)), self.split(self.k(x)), self.split(self.v(x))
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        probs = torch.softmax(scores, dim=-1)
        if self.kept is not None:  # only in the oracle's replicas
            self.kept.update(scores=scores, softmax=probs)
        if self.edit_probs is not None:
            probs = self.edit_probs(probs)
        if self.kept is not None:
            self.kept["edited"] = probs
        ctx = probs @ v
        return self.o(ctx.transpose(1, 2).flatten(2))


def attention_net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Attention(), nn.Tanh(), nn.Linear(8, 2))


def replica(net: nn.Sequential, edit: Edit | None = None) -> nn.Sequential:
    """The same weights, with ``edit`` written into the attention's code."""
    copy = attention_net()
    copy.load_state_dict(net.state_dict())
    copy[0].edit_probs, copy[0].kept = edit, {}
    return copy


X = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))


@pytest.fixture(autouse=True)
def no_mode_left() -> Any:
    yield
    assert mode_stack() == []  # also checked by the residue fixture, named here


# -- capture ----------------------------------------------------------------------------------
def test_functional_model_operations_equal_the_hand_computation() -> None:
    m, x = Functional(), torch.randn(5, 4)
    sel = ["::matmul#1", "::relu", "::softmax", "::matmul#2"]
    with hs.capture(m, sel, inputs=True) as cap:
        out = m(x)
    want = by_hand(m, x)
    for name, value in want.items():
        torch.testing.assert_close(cap[f"::{name}"].output, value, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out, want["matmul#2"], rtol=1e-6, atol=1e-6)
    soft = cap["::softmax"]
    assert soft.inputs["dim"] == -1 and soft.inputs["dtype"] is None  # F.softmax's names
    torch.testing.assert_close(soft.input, want["relu"])
    assert torch.equal(cap["::matmul#1"].input, x)  # a builtin: arg0, arg1
    assert list(cap) == ["::matmul#1", "::relu", "::softmax", "::matmul#2"]


def test_numbers_restart_with_each_call_of_the_module() -> None:
    shared = Attention()
    net = nn.Sequential(shared, shared)
    with hs.capture(net, ["0::matmul#2", "0::matmul"]) as cap:
        net(X)
    assert cap["0::matmul#2"].count == 2  # the second matmul of each of the two calls
    assert cap["0::matmul"].count == 4
    assert torch.equal(cap["0::matmul#2"].calls[0].output, cap["0::matmul"].calls[1].output)
    assert torch.equal(cap["0::matmul#2"].calls[1].output, cap["0::matmul"].calls[3].output)


def test_only_the_modules_own_code_counts() -> None:
    """A child's operations are the child's; a hook's (the user's, another session's copy or
    reduction) are nobody's: numbers do not move when something else is hooked."""
    net = attention_net()
    hs.names(net)  # the residue fixture's snapshot: before the test's own hook
    seen: list[Tensor] = []
    handle = net[0].register_forward_hook(lambda m, a, o: seen.append(torch.softmax(o, -1)))
    try:
        with (
            hs.capture(net, "0", reduce="token_mean"),
            hs.capture(net, ["0::softmax", "0::softmax#1", "0.q::linear"]) as cap,
            hs.capture(net, "0", inputs=True),
        ):
            net(X)
    finally:
        handle.remove()
    assert cap["0::softmax"].count == 1 and seen
    want = replica(net)
    want(X)
    torch.testing.assert_close(cap["0::softmax#1"].output, want[0].kept["softmax"])
    torch.testing.assert_close(cap["0.q::linear"].output, net[0].q(X))
    with pytest.raises(hs.LayerNotFoundError, match=r"no linear ran in '0' \(Attention\)"):
        with hs.capture(net, "0::linear"):
            net(X)


def test_in_place_operations_are_captured_as_they_were() -> None:
    class InPlace(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            h = x.clone()
            h.add_(1)
            torch.relu_(h)
            return h.mul_(2)

    m, x = InPlace(), torch.randn(4, 3)
    with hs.capture(m, ["::add_", "::relu_"]) as cap:
        m(x)
    assert torch.equal(cap["::add_"].output, x + 1)  # before relu_ and mul_ changed it
    assert torch.equal(cap["::relu_"].output, (x + 1).clamp_min(0))
    with hs.capture(m, "::add_", copy="reference") as ref:
        m(x)
    with pytest.raises(hs.StaleCaptureError, match="modified in place"):
        ref["::add_"].output  # noqa: B018


def test_keep_budget_reduce_and_features_apply_to_operations() -> None:
    m, x = Functional(), torch.randn(5, 4)
    with hs.capture(m, "::softmax", keep="all", reduce="batch_mean") as cap:
        m(x)
        m(x)
    assert len(cap["::softmax"].calls) == 2
    torch.testing.assert_close(cap["::softmax"].output, by_hand(m, x)["softmax"].mean(0))
    with pytest.raises(hs.CaptureBudgetError, match="'::softmax' output"):
        with hs.capture(m, "::softmax", max_bytes=16):
            m(x)
    got = hs.features(m, x, ["::relu"])
    torch.testing.assert_close(got["::relu"], by_hand(m, x)["relu"])


def test_gradients_of_operations_equal_autograd() -> None:
    net, x = attention_net(), X.clone().requires_grad_(True)
    with hs.capture(net, ["0::softmax", "0::matmul#2"], grads=True) as cap:
        net(x).pow(2).sum().backward()
    ref = replica(net)
    loss = ref(x).pow(2).sum()
    kept = ref[0].kept
    assert kept is not None
    g_probs, g_scores = torch.autograd.grad(loss, [kept["softmax"], kept["scores"]])
    torch.testing.assert_close(cap["0::softmax"].grad, g_probs, rtol=1e-5, atol=1e-7)
    # what flows into the softmax's input through the softmax
    torch.testing.assert_close(cap["0::softmax"].grad_input, g_scores, rtol=1e-5, atol=1e-7)
    assert cap["0::matmul#2"].grad.shape == (3, 2, 5, 4)


def test_a_capture_that_edits_nothing_changes_nothing() -> None:
    net, x = attention_net(), X.clone().requires_grad_(True)
    want = net(x)
    (gw,) = torch.autograd.grad(want.sum(), net[0].q.weight)
    with hs.capture(net, ["0::softmax", "0::matmul", "0::transpose"], grads=True, inputs=True):
        got = net(x)
        (gg,) = torch.autograd.grad(got.sum(), net[0].q.weight)
    assert torch.equal(got, want) and torch.equal(gg, gw)


# -- edit -------------------------------------------------------------------------------------
EDITS: list[tuple[Any, Edit]] = [
    (hs.ablate(), torch.zeros_like),
    (hs.scale(0.5), lambda t: t * 0.5),
    (hs.add(0.25), lambda t: t + 0.25),
    (hs.transform(lambda t: t.flip(-1)), lambda t: t.flip(-1)),
    (lambda t: t**2, lambda t: t**2),
]


@pytest.mark.parametrize(("edit", "fn"), EDITS, ids=["ablate", "scale", "add", "transform", "fn"])
def test_operation_edits_equal_the_edit_written_into_the_code(edit: Any, fn: Edit) -> None:
    net = attention_net()
    with hs.edit(net, {"0::softmax": edit}) as editor:
        got = net(X)
    torch.testing.assert_close(got, replica(net, fn)(X), rtol=1e-6, atol=1e-6)
    assert editor.applied == {"0::softmax": 1}
    torch.testing.assert_close(net(X), replica(net)(X))  # gone after the block


def test_input_edit_and_patch_of_an_operation() -> None:
    net, other = attention_net(), torch.randn(3, 5, 8)
    with hs.edit(net, {"0::softmax": hs.scale(2.0, on="input")}):
        got = net(X)
    # softmax(2 * scores), written into the replica
    doubled = replica(net, lambda p: torch.softmax(2 * kept["scores"], -1))
    kept = doubled[0].kept
    assert kept is not None
    torch.testing.assert_close(got, doubled(X), rtol=1e-6, atol=1e-6)
    with hs.capture(net, "0::softmax") as clean:
        net(other)
    with hs.edit(net, {"0::softmax": hs.patch(clean)}):
        patched = net(X)
    src = replica(net)
    src(other)
    assert src[0].kept is not None
    torch.testing.assert_close(patched, replica(net, lambda p: src[0].kept["softmax"])(X))


def test_gradient_edit_of_an_operation() -> None:
    net, x = attention_net(), X.clone().requires_grad_(True)
    with hs.edit(net, {"0::softmax": hs.scale(0.0, on="grad")}):
        net(x).sum().backward()
    got = net[0].q.weight.grad
    assert got is not None and torch.equal(got, torch.zeros_like(got))  # q reaches out only
    assert net[0].v.weight.grad is not None and net[0].v.weight.grad.abs().sum() > 0  # via probs


def test_sessions_stack_like_module_hooks() -> None:
    """A capture opened after an edit records the edited value; one opened before, not."""
    net = attention_net()
    with hs.capture(net, "0::softmax") as before, hs.edit(net, {"0::softmax": hs.scale(3.0)}):
        with hs.capture(net, "0::softmax") as after:
            net(X)
    torch.testing.assert_close(after["0::softmax"].output, 3 * before["0::softmax"].output)
    ref = replica(net)
    ref(X)
    assert ref[0].kept is not None
    torch.testing.assert_close(before["0::softmax"].output, ref[0].kept["softmax"])


# -- lifetime ---------------------------------------------------------------------------------
class Interrupting(nn.Module):
    """Raises ``error`` in its first call, between two softmaxes."""

    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error, self.calls = error, 0

    def forward(self, x: Tensor) -> Tensor:
        y = torch.softmax(x, -1)
        self.calls += 1
        if self.calls == 1:
            raise self.error
        return torch.softmax(y, -1)


@pytest.mark.mutates_model  # the interrupting module counts its calls
@pytest.mark.parametrize("error", [KeyboardInterrupt(), RuntimeError("boom")])
def test_an_interrupted_call_leaves_no_mode_and_records_no_stray_call(
    error: BaseException,
) -> None:
    net, x = nn.Sequential(nn.Linear(3, 3), Interrupting(error)), torch.randn(2, 3)
    with hs.capture(net, "1::softmax") as cap:
        with pytest.raises(type(error)):
            net(x)
        torch.softmax(x, -1)  # the user's code after the interruption is nobody's
        if isinstance(error, Exception):  # the always-called hook took the mode off
            assert mode_stack() == []
        out = net(x)
    assert cap["1::softmax"].count == 3 and len(cap["1::softmax"].calls) == 2
    torch.testing.assert_close(cap["1::softmax"].output, out)


def test_early_stop_at_an_operation() -> None:
    ran: list[str] = []
    net = nn.Sequential(Functional(), nn.Linear(3, 3))
    hs.names(net)  # the residue fixture's snapshot: before the test's own hook
    handle = net[1].register_forward_pre_hook(lambda m, a: ran.append("after"))
    x = torch.randn(5, 4)
    with hs.capture(net, "0::softmax", stop=True) as cap:
        net(x)
    handle.remove()
    assert ran == [] and mode_stack() == []
    torch.testing.assert_close(cap["0::softmax"].output, by_hand(net[0], x)["softmax"])


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_checkpoint_replays_get_the_same_edits_and_gradients(reentrant: bool) -> None:
    class Checkpointed(nn.Module):
        def __init__(self, net: nn.Sequential) -> None:
            super().__init__()
            self.net = net

        def forward(self, x: Tensor) -> Tensor:
            return self.net[2](self.net[1](checkpoint(self.net[0], x, use_reentrant=reentrant)))

    net, x = attention_net(), X.clone().requires_grad_(True)
    model = Checkpointed(net)
    with (
        hs.edit(model, {"net.0::softmax": hs.scale(0.5)}),
        hs.capture(model, "net.0::softmax", grads=True) as cap,
    ):
        model(x).pow(2).sum().backward()
    got = [p.grad for p in net.parameters()]
    ref = replica(net, lambda p: p * 0.5)
    out = ref(x)
    assert ref[0].kept is not None
    edited = ref[0].kept["edited"]  # the capture opened after the edit sees it
    want = torch.autograd.grad(out.pow(2).sum(), [*ref.parameters(), edited])
    for a, b in zip(got, want[:-1], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert cap["net.0::softmax"].count == 1
    torch.testing.assert_close(cap["net.0::softmax"].grad, want[-1], rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("ran", [False, True], ids=["not run yet", "already ran"])
def test_compiled_models_run_eagerly_or_are_refused(ran: bool) -> None:
    torch._dynamo.reset()
    m = Functional()
    compiled = torch.compile(m, backend="eager")
    x = torch.randn(5, 4)
    if ran:
        compiled(x)
    with pytest.raises(hs.CompiledModelError, match="operation selectors"):
        with hs.capture(compiled, "::softmax"):
            compiled(x)
    with hs.capture(compiled, "::softmax", recompile=True) as cap:
        compiled(x)
    torch.testing.assert_close(cap["::softmax"].output, by_hand(m, x)["softmax"])


def test_torch_func_transforms_are_refused() -> None:
    m = Functional()
    with hs.capture(m, "::softmax"), pytest.raises(hs.UnsupportedModelError, match="vmap"):
        torch.func.vmap(m)(torch.randn(2, 5, 4))


@pytest.mark.filterwarnings("ignore:`torch.jit.script:DeprecationWarning")
def test_torchscript_is_refused() -> None:
    net = nn.Sequential(torch.jit.script(nn.Linear(2, 2)), nn.ReLU())
    with pytest.raises(hs.UnsupportedModelError, match="TorchScript"):
        hs.capture(net, "0::linear").open()


def test_private_forwards_and_wrappers() -> None:
    net = nn.DataParallel(attention_net())
    with hs.capture(net, "module.0::softmax") as cap:
        listed = hs.names(net, ops=True, inputs=X)  # a private forward: not recorded
        assert cap["0::softmax"].count == 0
        net(X)
    assert "0::softmax" in listed and cap["module.0::softmax"].count == 1


# -- selectors and listings ---------------------------------------------------------------------
def test_listing_names_every_operation_each_layer_runs() -> None:
    net = nn.Sequential(Functional(), nn.ReLU())
    assert hs.names(net, ops=True, inputs=torch.randn(2, 4)) == {
        "0": "Functional",
        "0::matmul#1": "torch.Tensor.matmul",
        "0::matmul#2": "torch.Tensor.matmul",
        "0::relu": "torch.relu",
        "0::softmax": "torch.nn.functional.softmax",
        "1": "ReLU",
        "1::relu": "torch.nn.functional.relu",
    }
    listed = hs.names(attention_net(), "0", ops=True, inputs=X)
    assert [k for k in listed if k.startswith("0::")] == [
        "0::view#1",
        "0::transpose#1",
        "0::view#2",
        "0::transpose#2",
        "0::view#3",
        "0::transpose#3",
        "0::transpose#4",
        "0::matmul#1",
        "0::div",
        "0::softmax",
        "0::matmul#2",
        "0::transpose#5",
        "0::flatten",
    ]
    with pytest.raises(hs.UsageError, match="inputs=x"):
        hs.names(net, ops=True)
    with pytest.raises(hs.UsageError, match="only with ops=True"):
        hs.names(net, inputs=torch.randn(2, 4))


@pytest.mark.parametrize(
    ("selector", "error", "match"),
    [
        ("0::", hs.UsageError, "bad operation selector '0::'"),
        ("0::matmul#0", hs.UsageError, r"'layer::op#k' \(its k-th call, from 1\)"),
        ("0::soft max", hs.UsageError, "bad operation selector"),
        ("9::softmax", hs.LayerNotFoundError, "operation selector '9::softmax': no layer of"),
    ],
)
def test_bad_selectors_fail_before_the_forward(selector: str, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        hs.capture(attention_net(), selector)


@pytest.mark.parametrize(
    ("selector", "match"),
    [
        ("0::sofmax", r"no sofmax ran in '0' \(Attention\).*Closest: 'softmax'"),
        ("0::matmul#3", r"'0::matmul#3' selects nothing: matmul ran 2 time\(s\) in a call"),
        ("0::attention_weights", "attention weights come from F.scaled_dot_product_attention"),
        ("::linear", "no linear ran in the model's own forward"),
    ],
)
def test_an_operation_that_never_ran_is_refused_naming_those_that_did(
    selector: str, match: str
) -> None:
    net = attention_net()
    with pytest.raises(hs.LayerNotFoundError, match=match) as info:
        with hs.capture(net, selector):
            net(X)
    if selector.startswith("0::"):
        assert "view x3, transpose x5, matmul x2, div, softmax, flatten;" in str(info.value)
        assert "child modules' are theirs ('0.q', '0.k', '0.v', ...)" in str(info.value)
    with pytest.raises(hs.LayerNotFoundError, match=match):
        with hs.edit(net, {selector: hs.ablate()}):
            net(X)


def test_edits_an_operation_cannot_take_are_refused() -> None:
    net = attention_net()
    with pytest.raises(hs.UsageError, match="has no parameters"):
        hs.edit(net, {"0::softmax": hs.clip_grad(norm=1.0)})
    with pytest.raises(hs.EditError, match="attention weights have no inputs"):
        hs.edit(net, {"0::attention_weights": hs.ablate(on="input")})


# -- attention weights of F.scaled_dot_product_attention ---------------------------------------
class SDPA(nn.Module):
    """Attention through the fused kernel, every option passed through."""

    def __init__(self, heads: int = 4, kv_heads: int = 4, **options: Any) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 16 + 2 * 16 * kv_heads // heads)
        self.heads, self.kv_heads, self.options = heads, kv_heads, options

    def forward(self, x: Tensor) -> Tensor:
        b, n, _ = x.shape
        kv = 16 * self.kv_heads // self.heads
        q, k, v = self.qkv(x).split([16, kv, kv], dim=-1)
        q = q.view(b, n, self.heads, -1).transpose(1, 2)
        k, v = (t.view(b, n, self.kv_heads, -1).transpose(1, 2) for t in (k, v))
        out = F.scaled_dot_product_attention(q, k, v, **self.options)
        return out.transpose(1, 2).flatten(2)


def explicit_probs(m: SDPA, x: Tensor) -> tuple[Tensor, Tensor]:
    """The oracle: (probabilities, values) of ``m``'s attention, written out."""
    b, n, _ = x.shape
    kv = 16 * m.kv_heads // m.heads
    q, k, v = m.qkv(x).split([16, kv, kv], dim=-1)
    q = q.view(b, n, m.heads, -1).transpose(1, 2)
    k, v = (t.view(b, n, m.kv_heads, -1).transpose(1, 2) for t in (k, v))
    k, v = (t.repeat_interleave(m.heads // m.kv_heads, dim=1) for t in (k, v))
    opts = m.options
    scores = q @ k.transpose(-2, -1) * opts.get("scale", q.shape[-1] ** -0.5)
    if opts.get("is_causal"):
        scores = scores + torch.full((n, n), float("-inf")).triu(1)
    mask = opts.get("attn_mask")
    if mask is not None:
        scores = scores + (mask if mask.is_floating_point() else (~mask) * -1e30)
    return torch.softmax(scores, -1), v


MASK = torch.rand(6, 6, generator=torch.Generator().manual_seed(3)) > 0.3
MASK.fill_diagonal_(True)
OPTIONS = {
    "plain": {},
    "causal": {"is_causal": True},
    "bool mask": {"attn_mask": MASK},
    "float mask": {"attn_mask": torch.randn(1, 1, 6, 6) * 2},
    "scale": {"scale": 0.3},
    "gqa": {"enable_gqa": True, "is_causal": True},
}


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("case", list(OPTIONS))
def test_attention_weights_equal_the_explicit_softmax(case: str) -> None:
    torch.manual_seed(0)
    m = SDPA(kv_heads=2 if case == "gqa" else 4, **OPTIONS[case])
    x = torch.randn(2, 6, 16, requires_grad=True)
    plain = m(x)
    with hs.capture(m, "::attention_weights", grads=True) as cap:
        out = m(x)
        out.pow(2).sum().backward()
    assert torch.equal(out, plain)  # the fused call ran, untouched
    probs, v = explicit_probs(m, x)
    torch.testing.assert_close(cap["::attention_weights"].output, probs, rtol=1e-6, atol=1e-6)
    ctx = probs @ v
    (g,) = torch.autograd.grad(ctx.transpose(1, 2).flatten(2).pow(2).sum(), probs)
    torch.testing.assert_close(cap["::attention_weights"].grad, g, rtol=1e-5, atol=1e-6)
    with pytest.raises(hs.GradientUnavailableError, match="scaled_dot_product_attention"):
        cap["::attention_weights"].grad_input  # noqa: B018


def test_an_attention_weights_record_shows_the_output_it_returns() -> None:
    torch.manual_seed(0)
    m = SDPA()
    with hs.capture(m, "::attention_weights") as cap:
        m(torch.randn(2, 6, 16))
    record = cap["::attention_weights"]
    assert record.output.shape == (2, 4, 6, 6)
    for shown in (repr(record), repr(record.calls[0])):
        assert "output=None" not in shown and "[2, 4, 6, 6]" in shown, shown


KNOCKOUT = torch.ones(6, 6)
KNOCKOUT[3:, 0] = 0.0  # attention knockout: queries 3..5 may not read token 0
EDITED = {
    "head ablation": lambda p: p * torch.tensor([1.0, 0.0, 1.0, 1.0])[:, None, None],
    "knockout": lambda p: p * KNOCKOUT,
}


@pytest.mark.parametrize("edit", list(EDITED))
@pytest.mark.parametrize("case", ["plain", "causal", "gqa"])
def test_edited_attention_weights_replace_that_call_only(case: str, edit: str) -> None:
    torch.manual_seed(0)
    m = SDPA(kv_heads=2 if case == "gqa" else 4, **OPTIONS[case])
    x = torch.randn(2, 6, 16)
    fn = EDITED[edit]
    with (
        hs.capture(m, "::attention_weights") as before,
        hs.edit(m, {"::attention_weights": fn}),
        hs.capture(m, "::attention_weights") as after,
    ):
        got = m(x)
    probs, v = explicit_probs(m, x)
    want = (fn(probs) @ v).transpose(1, 2).flatten(2)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(before["::attention_weights"].output, probs)
    torch.testing.assert_close(after["::attention_weights"].output, fn(probs))


def _fully_masked(kind: str) -> Tensor:
    """A mask whose query 2 may read no key (float: all -inf; bool: all False)."""
    if kind == "float":
        mask = torch.randn(1, 1, 6, 6, generator=torch.Generator().manual_seed(4))
        mask[..., 2, :] = float("-inf")
        return mask
    mask = MASK.clone()
    mask[2, :] = False
    return mask


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("kind", ["float", "bool"])
def test_fully_masked_rows_under_an_edit_have_sdpas_own_gradients(kind: str) -> None:
    """The explicit path of an edit gives a query that may read no key a zero row, as SDPA
    does, and the gradients SDPA's math kernel gives (not NaN for that query and every key)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    m, x = SDPA(attn_mask=_fully_masked(kind)), torch.randn(2, 6, 16, requires_grad=True)
    with sdpa_kernel(SDPBackend.MATH):
        want = m(x)
        want.pow(2).sum().backward()
    want_grads = [x.grad, m.qkv.weight.grad, m.qkv.bias.grad]
    x.grad = m.qkv.weight.grad = m.qkv.bias.grad = None
    with hs.edit(m, {"::attention_weights": lambda p: p * 1.0}) as ed:
        got = m(x)
        got.pow(2).sum().backward()
    assert ed.applied == {"::attention_weights": 1}
    assert torch.equal(got[:, 2], torch.zeros_like(got[:, 2]))
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    for a, b in zip([x.grad, m.qkv.weight.grad, m.qkv.bias.grad], want_grads, strict=True):
        assert a is not None and b is not None and a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class ScaleGrad(torch.autograd.Function):
    """The reference for a gradient edit: identity forward, gradient times k (differentiable
    backward, so second-order backward goes through it)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, k: float) -> Tensor:
        ctx.k = k
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.k, None


class TanhNet(nn.Module):
    def __init__(self, reference: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w1, self.w2 = nn.Parameter(torch.randn(3, 4)), nn.Parameter(torch.randn(4, 1))
        self.reference = reference

    def forward(self, x: Tensor) -> Tensor:
        h = torch.tanh(x @ self.w1)
        if self.reference:
            h = ScaleGrad.apply(h, 0.5)
        return torch.tanh(h @ self.w2)


@pytest.mark.mutates_model  # backward writes .grad
def test_second_order_backward_through_an_operation_gradient_edit() -> None:
    """A gradient penalty: tanh's backward uses its own output, so in a second-order
    backward its formula sends gradient there too, which the edit must not scale."""
    x = torch.randn(5, 3, requires_grad=True)

    def penalty(m: nn.Module) -> list[Tensor]:
        out = m(x)
        (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
        (out.sum() + gx.pow(2).sum()).backward()
        return [p.grad.clone() for p in m.parameters()]

    want = penalty(TanhNet(reference=True))
    model = TanhNet()
    with hs.edit(model, {"::tanh#1": hs.scale(0.5, on="grad")}):
        got = penalty(model)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.mutates_model  # backward writes .grad
def test_gradient_edit_of_attention_weights() -> None:
    torch.manual_seed(0)
    m, x = SDPA(), torch.randn(2, 6, 16, requires_grad=True)
    with hs.edit(m, {"::attention_weights": hs.scale(0.0, on="grad")}):
        m(x).sum().backward()
    grad = m.qkv.weight.grad
    assert grad is not None
    assert torch.equal(grad[:32], torch.zeros_like(grad[:32]))  # q and k reach out via P only
    assert grad[32:].abs().sum() > 0  # v does not


# -- the engine's hazards -------------------------------------------------------------------------
def test_recursive_and_nested_selected_calls_keep_their_own_operations() -> None:
    class Tree(nn.Module):
        """Calls itself ``depth`` times: every level's own softmax is its own."""

        def forward(self, x: Tensor, depth: int = 2) -> Tensor:
            y = torch.softmax(x, -1)
            return y if depth == 0 else self(y * 2, depth - 1) + torch.softmax(y, -1)

    net, x = nn.Sequential(Tree()), torch.randn(2, 3)
    with hs.capture(net, ["0::softmax#1", "0::softmax#2", "0::mul"]) as cap:
        net(x)
    first = [x.softmax(-1)]
    for _ in range(2):
        first.append((first[-1] * 2).softmax(-1))
    # in the order they ran: level 0's first softmax, then level 1's, then level 2's
    got = [c.output for c in cap["0::softmax#1"].calls]
    for a, b in zip(got, first, strict=True):
        torch.testing.assert_close(a, b)
    assert cap["0::softmax#2"].count == 2 and cap["0::mul"].count == 2  # levels 0 and 1


def test_deepcopy_inside_a_selected_call() -> None:
    copies: list[nn.Module] = []

    class Copier(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            copies.append(__import__("copy").deepcopy(net))
            return torch.softmax(x, -1)

    net, x = nn.Sequential(nn.Linear(3, 3), Copier()), torch.randn(2, 3)
    with hs.capture(net, "1::softmax") as cap:
        net(x)
    torch.testing.assert_close(cap["1::softmax"].output, net[0](x).softmax(-1))
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in copies[0].modules())
    with hs.capture(copies[0], "1::softmax") as again:  # the copy works on its own
        copies[0](x)
    torch.testing.assert_close(again["1::softmax"].output, cap["1::softmax"].output)


def test_grad_modes_and_failing_edits() -> None:
    net = attention_net()
    ref = replica(net)
    ref(X)
    assert ref[0].kept is not None
    with torch.inference_mode(), hs.capture(net, "0::softmax") as cap:
        net(X)
    torch.testing.assert_close(cap["0::softmax"].output, ref[0].kept["softmax"])
    with torch.no_grad(), pytest.raises(hs.EditError, match="no_grad"):
        with hs.edit(net, {"0::softmax": hs.scale(2.0, on="grad")}):
            net(X)
    with pytest.raises(hs.EditError, match="changed Tensor"):
        with hs.edit(net, {"0::softmax": lambda p: p[..., :1]}):
            net(X)

    def boom(p: Tensor) -> Tensor:
        raise ValueError("the user's edit failed")

    with pytest.raises(ValueError, match="the user's edit failed"):
        with hs.edit(net, {"0::softmax": boom}):
            net(X)
    assert mode_stack() == []


def test_features_and_feature_extractor_take_operations() -> None:
    torch.manual_seed(0)
    m = SDPA(is_causal=True)
    x = torch.randn(2, 6, 16)
    probs, _ = explicit_probs(m, x)
    got = hs.features(m, x, ["::attention_weights"])["::attention_weights"]
    torch.testing.assert_close(got, probs, rtol=1e-6, atol=1e-6)
    extractor = hs.FeatureExtractor(m, "::attention_weights", stop=False)
    torch.testing.assert_close(extractor(x)["::attention_weights"], probs, rtol=1e-6, atol=1e-6)
    with pytest.raises(hs.UsageError, match=r"selects an operation .* ops=True, inputs="):
        hs.names(m, "::softmax")  # entry points that take layers only say why, and what to do


class _InPlace(nn.Module):
    """Code that throws the in-place calls' return values away, as real code does."""

    def forward(self, x: Tensor) -> Tensor:
        h = x * 1.0
        h.add_(1)
        F.relu(h, inplace=True)
        h += 2
        torch.relu_(h)
        return h * 3


@pytest.mark.parametrize(
    ("selector", "calls", "reference"),
    [
        ("::add_#1", 1, lambda x: ((torch.zeros_like(x)).relu() + 2).relu() * 3),
        ("::add_", 2, lambda x: torch.zeros_like(x)),  # h.add_(1) and h += 2
        ("::relu", 1, lambda x: ((torch.zeros_like(x)) + 2).relu() * 3),
        ("::relu_", 1, lambda x: torch.zeros_like(x) * 3),
    ],
)
def test_an_edit_of_an_in_place_operation_changes_the_tensor_it_changed(
    selector: str, calls: int, reference: Any
) -> None:
    """The edit is written into the tensor the operation changed, so the code that goes on
    using that tensor sees it (ablating ``y.add_(1)`` used to do nothing, silently)."""
    m, x = _InPlace(), torch.randn(2, 5)
    with hs.edit(m, {selector: hs.ablate()}) as ed:
        out = m(x)
    assert ed.applied == {selector: calls}
    torch.testing.assert_close(out, reference(x), rtol=0, atol=0)


def test_an_in_place_operation_has_no_input_or_gradient_to_edit() -> None:
    m, x = _InPlace(), torch.randn(2, 5, requires_grad=True)
    with pytest.raises(hs.EditError, match="in-place operation changes its input"):
        with hs.edit(m, {"::add_": hs.scale(2.0, on="grad")}):
            m(x)
    with pytest.raises(hs.EditError, match="must return a tensor of that shape"):
        with hs.edit(m, {"::add_": hs.transform(lambda t: t[:, :2], allow_shape_change=True)}):
            m(x)


def test_multihead_attention_weights_say_where_they_are() -> None:
    """nn.MultiheadAttention's SDPA runs inside F.multi_head_attention_forward, one operation
    to a function mode: the selector is refused with the way to get its weights, not with
    advice (select its softmax) that cannot apply."""
    mha = nn.TransformerEncoderLayer(8, 2, batch_first=True).eval()
    with pytest.raises(hs.LayerNotFoundError, match=r"need_weights=True.*capture the module"):
        with hs.capture(mha, "self_attn::attention_weights"):
            mha(torch.randn(1, 3, 8))
