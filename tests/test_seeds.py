"""The seed tutorials' test vectors (../shared/seeds-digest.md), through hookscope's API.

Modern semantics: since PyTorch 2.0 ``retain_grad`` runs after every tensor hook, so the
article's ``e.grad = 1`` is ``2`` today; these tests assert the modern values.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs


def t(v: float) -> torch.Tensor:
    return torch.tensor(v, requires_grad=True)


def test_hook_doubling_intermediate_gradient() -> None:
    x, y, w = t(2.0), t(3.0), t(4.0)
    z = x + y
    o = w * z
    with hs.on_grad(z, lambda g: 2 * g):
        o.backward()
    assert (x.grad.item(), y.grad.item(), w.grad.item()) == (8.0, 8.0, 5.0)
    assert not z.retains_grad  # hookscope took the gradient without retain_grad()


def test_hooks_run_in_order_and_retain_grad_runs_last() -> None:
    a, b, d = t(2.0), t(3.0), t(4.0)
    c = a * b
    with hs.on_grad(c, lambda g: g + 2), hs.grad_of(c) as seen, hs.on_grad(d, lambda g: g + 100):
        c.retain_grad()
        e = c * d
        e.retain_grad()
        with hs.on_grad(e, lambda g: g * 2):
            e.backward()
    assert seen.grad.item() == 10.0  # the second hook sees the first one's result
    assert (d.grad.item(), c.grad.item(), a.grad.item(), b.grad.item()) == (112, 10, 30, 20)
    assert e.grad.item() == 2.0  # PyTorch >= 2.0; the article printed 1


def test_grad_of_intermediate_without_retain_grad() -> None:
    w, x = t(1.0), t(2.0)
    a = w + x
    b = w + 1
    y = a * b
    with hs.grad_of(a) as ga:
        y.backward()
    assert ga.grad.item() == 2.0
    assert (w.grad.item(), x.grad.item()) == (5.0, 2.0)
    assert not a.retains_grad


def test_in_place_gradient_edit_is_refused() -> None:
    """The article's ``grad *= 2`` leaks through for leaves; hookscope refuses it loudly."""
    w, x = t(1.0), t(2.0)
    y = (w + x) * (w + 1)
    with hs.on_grad(w, lambda g: g.mul_(2)), pytest.raises(hs.EditError, match="in place"):
        y.backward()


def article_001_model() -> nn.Sequential:
    fc1, fc2 = nn.Linear(3, 4), nn.Linear(4, 1)
    with torch.no_grad():
        fc1.weight.copy_(torch.tensor([[1.0, 2, 3], [-4, -5, -6], [7, 8, 9], [-10, -11, -12]]))
        fc1.bias.copy_(torch.tensor([1.0, 2, 3, 4]))
        fc2.weight.copy_(torch.tensor([[1.0, 2, 3, 4]]))
        fc2.bias.fill_(1.0)
    return nn.Sequential(fc1, nn.ReLU(), fc2)


@pytest.mark.parametrize("x", [torch.ones(1, 3), torch.ones(3)], ids=["batched", "1-D"])
def test_article_001_module_values_and_gradients(x: torch.Tensor) -> None:
    model = article_001_model()
    x = x.clone().requires_grad_(True)
    with hs.capture(model, ["0", "1", "2"], grads=True) as cap:
        model(x).sum().backward()
    flat = {name: (cap[name].output.flatten().tolist()) for name in ("0", "1", "2")}
    assert flat == {"0": [7, -13, 27, -29], "1": [7, 0, 27, 0], "2": [89]}
    grads = {
        n: (cap[n].grad.flatten().tolist(), cap[n].grad_input.flatten().tolist()) for n in "012"
    }
    assert grads["2"] == ([1], [1, 2, 3, 4])
    assert grads["1"] == ([1, 2, 3, 4], [1, 0, 3, 0])
    assert grads["0"] == ([1, 0, 3, 0], [22, 26, 30])
    assert model[0].weight.grad.tolist() == [[1, 1, 1], [0, 0, 0], [3, 3, 3], [0, 0, 0]]
    assert model[2].weight.grad.tolist() == [[7, 0, 27, 0]]


def test_article_000_zeroing_input_gradient_zeroes_everything_upstream() -> None:
    model = article_001_model()
    x = torch.ones(1, 3, requires_grad=True)
    with hs.edit(model, {"1": hs.ablate(on="input_grad")}):
        model(x).sum().backward()
    assert torch.equal(x.grad, torch.zeros(1, 3))
    assert torch.equal(model[0].weight.grad, torch.zeros(4, 3))
    assert model[2].weight.grad.tolist() == [[7, 0, 27, 0]]  # downstream untouched


def test_article_004_conv_and_pool() -> None:
    conv = nn.Conv2d(1, 2, 3)
    with torch.no_grad():
        conv.weight[0].fill_(1.0)
        conv.weight[1].fill_(2.0)
        conv.bias.zero_()
    model = nn.Sequential(conv, nn.MaxPool2d(2, 2))
    with hs.capture(model, [nn.Conv2d, nn.MaxPool2d]) as cap:
        model(torch.ones(1, 1, 4, 4))
    out = cap["0"].output
    assert out.shape == (1, 2, 2, 2)
    assert torch.equal(out[0, 0], torch.full((2, 2), 9.0))
    assert torch.equal(out[0, 1], torch.full((2, 2), 18.0))
    pooled = cap["1"].output
    assert pooled.shape == (1, 2, 1, 1)
    assert pooled.flatten().tolist() == [9.0, 18.0]


def test_article_004_pre_hook_replaces_input() -> None:
    model = article_001_model()
    with hs.edit(model, {"0": hs.replace(torch.zeros(1, 3), on="input")}):
        out = model(torch.ones(1, 3))
    # fc1(0) = bias [1,2,3,4]; relu; fc2 = 1+4+9+16+1
    assert out.item() == 31.0


def test_article_003_gradient_clipping_by_value_through_hooks() -> None:
    model = article_001_model()
    reference = article_001_model()
    x = torch.ones(1, 3)
    with hs.edit(model, {"0": hs.clip_grad(value=2.0)}):
        model(x).sum().backward()
    handles = [p.register_hook(lambda g: g.clamp(-2.0, 2.0)) for p in reference[0].parameters()]
    reference(x).sum().backward()
    for h in handles:
        h.remove()
    assert torch.equal(model[0].weight.grad, reference[0].weight.grad)
    assert model[0].weight.grad.max().item() == 2.0  # the unclipped value was 3
    assert torch.equal(model[2].weight.grad, reference[2].weight.grad)  # not clipped
