"""The core session's promises where users found them broken: second-order backward,
arguments that are one tensor, tensors returned twice, LSTMs read through ``h_n``,
PackedSequence, TorchScript, and gradients of a layer whose output existed before the call."""

from __future__ import annotations

import copy
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.nn.utils.rnn import pack_padded_sequence

import hookscope as hs


class ScaleGrad(torch.autograd.Function):
    """The reference for a gradient edit: identity forward, gradient times k backward (its
    backward is differentiable, so second-order backward goes through it)."""

    @staticmethod
    def forward(ctx: object, x: Tensor, k: float) -> Tensor:
        ctx.k = k  # type: ignore[attr-defined]
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, g: Tensor) -> tuple[Tensor, None]:
        return g * ctx.k, None  # type: ignore[attr-defined]


class Scaled(nn.Module):
    def __init__(self, inner: nn.Module, k: float) -> None:
        super().__init__()
        self.inner, self.k = inner, k

    def forward(self, x: Tensor) -> Tensor:
        return ScaleGrad.apply(self.inner(x), self.k)


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))


def _penalty(m: nn.Module, x: Tensor) -> list[Tensor]:
    """A gradient penalty: d out / d x taken with create_graph, then differentiated again."""
    out = m(x)
    (gx,) = torch.autograd.grad(out.sum(), x, create_graph=True)
    (out.sum() + gx.pow(2).sum()).backward()
    return [p.grad.clone() for p in m.parameters()]


def _maml(m: nn.Module, x: Tensor) -> list[Tensor]:
    """Second order through the parameters' own gradients (MAML's outer step)."""
    params = list(m.parameters())
    grads = torch.autograd.grad(m(x).pow(2).sum(), params, create_graph=True)
    sum(g.pow(2).sum() for g in grads).backward()
    return [p.grad.clone() for p in m.parameters()]


@pytest.mark.mutates_model  # backward writes .grad
@pytest.mark.parametrize("second_order", [_penalty, _maml])
def test_double_backward_gradient_edit_equals_an_autograd_function(
    second_order: Callable[[nn.Module, Tensor], list[Tensor]],
) -> None:
    """Tanh's backward uses its own output: in a second-order backward, its formula sends
    gradient to that output too, which is not gradient from downstream."""
    x = torch.randn(5, 3, requires_grad=True)
    reference = _mlp()
    reference[1] = Scaled(reference[1], 0.5)
    want = second_order(reference, x)
    model = _mlp()
    with hs.edit(model, {"1": hs.scale(0.5, on="grad")}):
        got = second_order(model, x)
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


class SelfAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 8)
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.inp(x)
        a, _ = self.attn(h, h, h)  # query is key is value: attention takes its fused path
        return self.out(a + h)


@pytest.mark.mutates_model
@pytest.mark.parametrize("second_order", [None, _penalty, _maml])
def test_capture_of_self_attention_changes_nothing(
    second_order: Callable[[nn.Module, Tensor], list[Tensor]] | None,
) -> None:
    model = SelfAttention().eval()
    x = torch.randn(2, 4, 3, requires_grad=True)

    def step(m: nn.Module) -> tuple[Tensor, list[Tensor]]:
        if second_order is not None:
            return m(x), second_order(m, x)
        out = m(x)
        out.sum().backward()
        return out, [p.grad.clone() for p in m.parameters()]

    want_out, want = step(copy.deepcopy(model))
    seen: list[bool] = []
    with hs.capture(model, ["inp", "attn", "out"], grads=True, inputs=True) as cap:
        probe = model.attn.register_forward_pre_hook(
            lambda m, a, kw: seen.append(a[0] is a[1] is a[2]), with_kwargs=True
        )
        out, got = step(model)
        probe.remove()
    assert seen and all(seen)
    assert torch.equal(out, want_out)
    for a, b in zip(want, got, strict=True):
        assert torch.equal(a, b)
    gi = cap["attn"].grad_inputs  # one tensor: its gradient through the layer, three names
    assert gi["query"] is not None and torch.equal(gi["query"], gi["key"])


class ReturnsTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.lin(x)
        return h, h


@pytest.mark.mutates_model
def test_a_tensor_returned_twice_gets_each_places_gradient() -> None:
    torch.manual_seed(0)
    layer = nn.Sequential(ReturnsTwice())
    x = torch.randn(4, 3)
    with hs.capture(layer, "0", grads=True) as cap:
        a, b = layer(x)
        (a.sum() * 2 + b.pow(2).sum()).backward()
    g0, g1 = cap["0"].grad
    torch.testing.assert_close(g0, torch.full_like(a, 2.0))
    torch.testing.assert_close(g1, 2 * b.detach())


@pytest.mark.mutates_model
@pytest.mark.parametrize("inputs", [False, True])
def test_lstm_read_through_h_n_only(inputs: bool) -> None:
    """The LSTM's node runs for ``h_n``; ``output``'s gradient is then None for its hook."""
    torch.manual_seed(0)

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lstm = nn.LSTM(3, 4, num_layers=2)
            self.fc = nn.Linear(4, 1)

        def forward(self, x: Tensor, state: tuple[Tensor, Tensor]) -> Tensor:
            _, (h, _) = self.lstm(x, state)
            return self.fc(h[-1])

    model = Head()
    x = torch.randn(5, 2, 3, requires_grad=True)
    state = (torch.zeros(2, 2, 4, requires_grad=True), torch.zeros(2, 2, 4, requires_grad=True))
    with hs.capture(model, ["lstm", "fc"], grads=True, inputs=inputs) as cap:
        model(x, state).sum().backward()
    output_grad, (h_grad, c_grad) = cap["lstm"].grad
    assert output_grad is None and c_grad is None  # nothing read them
    want = torch.zeros(2, 2, 4)
    want[-1] = model.fc.weight.detach().expand(2, 4)
    torch.testing.assert_close(h_grad, want)
    with hs.edit(model, {"lstm": hs.scale(0.5, on="grad", at=(1, 0))}):
        model(x, state).sum().backward()


@pytest.mark.mutates_model
@pytest.mark.parametrize("inputs", [False, True])
def test_packed_sequences(inputs: bool) -> None:
    torch.manual_seed(0)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gru = nn.GRU(3, 4, batch_first=True)

        def forward(self, packed: object) -> Tensor:
            out, h = self.gru(packed)
            return h[-1] + out.data.sum()

    model = Encoder()
    data = torch.randn(2, 5, 3, requires_grad=True)
    packed = pack_padded_sequence(data, torch.tensor([5, 3]), batch_first=True)
    with hs.capture(model, "gru", grads=True, inputs=inputs) as cap:
        model(packed).sum().backward()
    out_grad, h_grad = cap["gru"].grad
    torch.testing.assert_close(h_grad, torch.ones(1, 2, 4))
    torch.testing.assert_close(out_grad.data, torch.full((8, 4), 8.0))  # a PackedSequence
    if inputs:
        assert cap["gru"].inputs["input"].data.shape == packed.data.shape
        assert cap["gru"].grad_inputs["input"].data.shape == packed.data.shape


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:DeprecationWarning")
def test_torchscript_is_refused_plainly() -> None:
    scripted = torch.jit.script(nn.Sequential(nn.Linear(2, 2), nn.ReLU()))
    model = nn.Sequential(nn.Linear(2, 2), scripted)
    for make in (
        lambda: hs.capture(model, "1.0"),
        lambda: hs.capture(scripted, "0"),
        lambda: hs.edit(model, {"1": hs.ablate()}),
    ):
        with pytest.raises(hs.UnsupportedModelError, match="TorchScript"):
            make().open()
    with hs.capture(model, "0") as cap:  # the Python part still works
        model(torch.ones(1, 2))
    assert cap["0"].output.shape == (1, 2)


class Tree(nn.Module):
    """x feeds two branches and an identity projection (a DLA tree's root)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.project = nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        r = self.project(x)
        return self.c(torch.tanh(self.a(x)) + torch.tanh(self.b(x)) * r + r)


@pytest.mark.mutates_model
def test_identity_in_a_residual_branch() -> None:
    """The identity's output is its input: telling its gradient (from downstream) from the
    input's other uses needs a stand-in, which adds an autograd node; the sum of the input's
    gradients may then be taken in another order. What holds, as README says: outputs
    bit-identical, the identity's gradient exact, parameter gradients within float rounding,
    and bit-identical where no stand-in is needed."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), Tree(), Tree(), nn.Linear(8, 1))
    x = torch.randn(16, 8)

    def step(m: nn.Module) -> tuple[Tensor, list[Tensor]]:
        out = m(x)
        out.pow(2).sum().backward()
        return out, [p.grad.clone() for p in m.parameters()]

    want_out, want = step(copy.deepcopy(net))
    grads_at: dict[str, Tensor] = {}
    reference = copy.deepcopy(net)
    for name in ("1", "2"):  # the downstream gradient, by an autograd.Function boundary
        tree = reference.get_submodule(name)
        tree.project = Scaled(nn.Identity(), 1.0)
        tree.project.register_full_backward_hook(
            lambda m, gi, go, name=name: grads_at.__setitem__(name, go[0])
        )
    step(reference)
    with hs.capture(net, ["1.project", "2.project"], grads=True) as cap:
        out, got = step(net)
    assert torch.equal(out, want_out)
    for name in ("1", "2"):
        torch.testing.assert_close(cap[f"{name}.project"].grad, grads_at[name])
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    chain = nn.Sequential(nn.Linear(8, 8), nn.Identity(), nn.Tanh(), nn.Linear(8, 1))
    want_out, want = step(copy.deepcopy(chain))
    with hs.capture(chain, ["1", "2"], grads=True):
        out, got = step(chain)  # the identity's input has no other use: no reordering
    assert torch.equal(out, want_out) and all(map(torch.equal, want, got))
