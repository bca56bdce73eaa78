"""edit(): every edit kind against a hand-written reference; structure, shape, errors."""

from __future__ import annotations

import re
from collections import namedtuple
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs


def net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def by_hand(model: nn.Sequential, x: torch.Tensor, fn) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Reference: the same change written directly as model code."""
    return model[2](fn(model[1](model[0](x))))


X = torch.randn(6, 4)


@pytest.mark.parametrize(
    ("edit", "fn"),
    [
        (hs.ablate(), torch.zeros_like),
        (hs.scale(0.5), lambda t: t * 0.5),
        (hs.add(torch.arange(5.0)), lambda t: t + torch.arange(5.0)),
        (hs.replace(torch.ones(5)), lambda t: torch.ones_like(t)),
        (hs.mean_ablate(), lambda t: t.mean(dim=0, keepdim=True).expand_as(t)),
        (hs.mean_ablate(torch.full((5,), 0.25)), lambda t: torch.full_like(t, 0.25)),
        (hs.transform(lambda t: t.flip(0)), lambda t: t.flip(0)),
        (lambda t: t**2, lambda t: t**2),
    ],
    ids=["ablate", "scale", "add", "replace", "mean_ablate", "mean_given", "transform", "callable"],
)
def test_output_edits_match_hand_reference(edit: object, fn: object) -> None:
    model = net()
    with hs.edit(model, {"1": edit}) as editor:
        got = model(X)
    assert torch.allclose(got, by_hand(model, X, fn), atol=1e-6)  # type: ignore[arg-type]
    assert editor.applied == {"1": 1}
    assert torch.equal(model(X), by_hand(model, X, lambda t: t))  # gone after the block


def test_patch_from_previous_capture() -> None:
    model = net()
    other = torch.randn(6, 4)
    with hs.capture(model, "1") as src:
        clean = model(other)
    with hs.edit(model, {"1": hs.patch(src)}):
        patched = model(X)
    assert torch.equal(patched, clean)


@pytest.mark.parametrize("on", ["output", "grad"])
@pytest.mark.mutates_model  # backward writes .grad
def test_patch_of_one_clean_run_into_a_batch_broadcasts_it(on: str) -> None:
    """The usual set-up: one clean prompt, a batch of corrupted ones."""
    model, clean_x = net(), torch.randn(1, 4)
    with hs.capture(model, "1", grads=on == "grad") as src:
        model(clean_x).sum().backward()
    with hs.edit(model, {"1": hs.patch(src, on=on)}):  # type: ignore[arg-type]
        patched = model(X)
        patched.sum().backward()
    if on == "output":
        want = model[2](src["1"].output.expand(6, 5))
        torch.testing.assert_close(patched, want, rtol=0, atol=0)


def test_patch_of_another_shape_says_what_to_do() -> None:
    model = net()
    with hs.capture(model, "1") as src:
        model(torch.randn(2, 4))
    with (
        pytest.raises(hs.EditError, match=r"recorded \(2, 5\).*has \(6, 5\).*batch 1") as info,
        hs.edit(model, {"1": hs.patch(src)}),
    ):
        model(X)
    assert "allow_shape_change" not in str(info.value)  # patch takes no such option


@pytest.mark.parametrize(
    ("edit", "value"),
    [(hs.replace, torch.ones(3)), (hs.add, torch.ones(2, 1, 5)), (hs.scale, torch.ones(7, 5))],
)
def test_a_value_that_does_not_broadcast_is_refused_naming_both_shapes(
    edit: Any, value: torch.Tensor
) -> None:
    model = net()
    shapes = (
        re.escape(f"{edit.__name__} on '1' output: ")
        + ".*"
        + re.escape(f"{tuple(value.shape)} does not broadcast to the (6, 5)")
    )
    with pytest.raises(hs.EditError, match=shapes), hs.edit(model, {"1": edit(value)}):
        model(X)


def test_patch_per_call_of_reused_module() -> None:
    shared = nn.Linear(3, 3)
    model = nn.Sequential(shared, nn.Tanh(), shared)
    a, b = torch.randn(2, 3), torch.randn(2, 3)
    with hs.capture(model, "0") as src:
        model(a)
    with hs.edit(model, {"0": hs.patch(src)}):
        out = model(b)
    assert torch.equal(out, src["0"].calls[1].output)


Pair = namedtuple("Pair", ["hidden", "aux"])


@dataclass
class Out:
    last_hidden_state: torch.Tensor
    pooled: torch.Tensor


class Structured(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> object:
        h = self.lin(x)
        if self.kind == "tuple":
            return (h, h.sum(-1))
        if self.kind == "namedtuple":
            return Pair(h, h.sum(-1))
        if self.kind == "dict":
            return {"hidden": h, "aux": h.sum(-1)}
        return Out(h, h.sum(-1))


@pytest.mark.parametrize(
    ("kind", "at"),
    [("tuple", 0), ("namedtuple", 0), ("dict", "hidden"), ("dataclass", "last_hidden_state")],
)
def test_edit_one_leaf_keeps_structure(kind: str, at: object) -> None:
    model = nn.Sequential(Structured(kind))
    with torch.no_grad():
        plain = model(X)
        with hs.edit(model, {"0": hs.scale(2.0, at=at)}):
            edited = model(X)
    assert type(edited) is type(plain)
    leaves = (
        list(plain.values())
        if isinstance(plain, dict)
        else ([plain.last_hidden_state, plain.pooled] if isinstance(plain, Out) else list(plain))
    )
    new = (
        list(edited.values())
        if isinstance(edited, dict)
        else (
            [edited.last_hidden_state, edited.pooled] if isinstance(edited, Out) else list(edited)
        )
    )
    assert torch.equal(new[0], leaves[0] * 2)
    assert torch.equal(new[1], leaves[1])  # the rest untouched


def test_ambiguous_edit_is_refused_with_the_fix() -> None:
    model = nn.Sequential(Structured("tuple"))
    with pytest.raises(hs.EditError, match=r"2 tensors; say which one with at= \(e.g. at=0\)"):
        with hs.edit(model, {"0": hs.ablate()}):
            model(X)


def test_at_star_edits_every_leaf() -> None:
    model = nn.Sequential(Structured("dict"))
    with torch.no_grad(), hs.edit(model, {"0": hs.ablate(at="*")}):
        out = model(X)
    assert not out["hidden"].any() and not out["aux"].any()


def test_shape_and_dtype_changes_are_refused_unless_allowed() -> None:
    model = net()
    advice = r"give the function as hs\.transform\(fn, allow_shape_change=True\)"
    with pytest.raises(hs.EditError, match=advice):  # advice that can be followed
        with hs.edit(model, {"0": lambda t: t[:, :2]}):
            model(X)
    with pytest.raises(hs.EditError, match="float64"):
        with hs.edit(model, {"1": lambda t: t.double()}):
            model(X)
    wide = nn.Sequential(nn.Linear(4, 5), nn.Identity())
    with hs.edit(wide, {"0": hs.transform(lambda t: t[:, :2], allow_shape_change=True)}):
        assert wide(X).shape == (6, 2)


def test_in_place_edit_function_is_refused() -> None:
    model = net()
    with pytest.raises(hs.EditError, match="in place"):
        with torch.no_grad(), hs.edit(model, {"1": lambda t: t.mul_(2)}):
            model(X)


def test_user_callback_error_propagates_unchanged() -> None:
    model = net()

    def boom(t: torch.Tensor) -> torch.Tensor:
        raise ZeroDivisionError("user bug")

    with pytest.raises(ZeroDivisionError, match="user bug"), hs.edit(model, {"1": boom}):
        model(X)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, hidden_states: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.lin(hidden_states) * mask


class Host(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Block()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(hidden_states=x, mask=torch.ones(x.shape[0], 1))


def test_input_edit_by_parameter_name_passed_as_keyword() -> None:
    model = Host()
    with torch.no_grad():
        with hs.edit(model, {"block": hs.replace(torch.zeros(2, 1), on="input", at="mask")}):
            out = model(torch.randn(2, 4))
        assert not out.any()
        with hs.edit(model, {"block": hs.scale(0.0, on="input")}):  # first argument
            out = model(torch.randn(2, 4))
        assert torch.allclose(out, model.block.lin.bias.expand(2, 4))


def test_gradient_edit_matches_autograd_reference() -> None:
    model = net()
    x = torch.randn(6, 4, requires_grad=True)
    with hs.edit(model, {"1": hs.scale(3.0, on="grad")}):
        model(x).pow(2).sum().backward()
    got = x.grad.clone()
    # reference: d loss/d x with the gradient at the Tanh output tripled, by hand
    h = model[1](model[0](x))
    (g_h,) = torch.autograd.grad(model[2](h).pow(2).sum(), h)
    (ref,) = torch.autograd.grad(h, x, grad_outputs=3 * g_h)
    assert torch.allclose(got, ref, atol=1e-6)


def test_input_grad_edit_only_changes_the_branch_through_the_layer() -> None:
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.f = nn.Linear(3, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.f(x) + x

    model = Residual()
    x = torch.randn(2, 3, requires_grad=True)
    with hs.edit(model, {"f": hs.ablate(on="input_grad")}):
        model(x).sum().backward()
    assert torch.equal(x.grad, torch.ones(2, 3))  # only the skip connection's gradient


def test_gradient_edit_under_no_grad_says_why() -> None:
    model = net()
    with pytest.raises(hs.EditError, match="no_grad"):
        with torch.no_grad(), hs.edit(model, {"1": hs.scale(2.0, on="grad")}):
            model(X)


def test_clip_grad_by_norm_per_parameter() -> None:
    model, ref = net(), net()
    x = torch.randn(6, 4) * 10
    with hs.edit(model, {"0": hs.clip_grad(norm=0.1)}):
        model(x).pow(2).sum().backward()
    ref(x).pow(2).sum().backward()
    for p, q in zip(model[0].parameters(), ref[0].parameters()):
        want = q.grad * min(1.0, 0.1 / (q.grad.norm().item() + 1e-6))
        assert torch.allclose(p.grad, want, atol=1e-6)
        assert p.grad.norm() <= 0.1 + 1e-5
    assert torch.equal(model[2].weight.grad, ref[2].weight.grad)


def test_edit_bad_values() -> None:
    model = net()
    with pytest.raises(TypeError, match="cannot edit with 3"):
        hs.edit(model, {"1": 3})
    with pytest.raises(ValueError, match="on='outputs'"):
        hs.ablate(on="outputs")
    with pytest.raises(hs.LayerNotFoundError, match="'2x'"):
        hs.edit(model, {"2x": hs.ablate()})


def test_on_grad_result_must_keep_the_gradients_shape() -> None:
    x = torch.randn(3, requires_grad=True)
    z = x * 2
    with hs.on_grad(z, lambda g: g.sum()), pytest.raises(hs.EditError, match="keep their shape"):
        z.sum().backward()


@pytest.mark.parametrize(
    "entry_name", ["acts_on_parents_tensor", "inplace_relu", "inplace_custom", "densenet"]
)
def test_noop_input_grad_edits_keep_in_place_layers_working(entry_name: str) -> None:
    """An ``input_grad`` edit gives the layer a stand-in input; a layer that changes its input
    in place must still change the caller's tensor (the parent may go on with it), so the
    output stays bit-identical and the gradients stay those of the model."""
    from zoo import ZOO, layer_modules, make_loss, tree_map

    entry = ZOO[entry_name]
    model, args, kwargs = entry.build()
    leaf = tree_map(lambda t: t.detach().requires_grad_() if t.is_floating_point() else t, args)
    expected = model(*leaf, **kwargs)
    make_loss(expected).backward()
    want = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    layers = [n for n in layer_modules(model) if n in entry.layers]
    with hs.edit(model, {n: hs.transform(torch.clone, on="input_grad") for n in layers}) as ed:
        actual = model(*leaf, **kwargs)
        make_loss(actual).backward()
    assert torch.equal(actual, expected)
    for got, ref in zip([p.grad for p in model.parameters()], want, strict=True):
        torch.testing.assert_close(got, ref)
    assert all(ed.applied[n] >= 1 for n in layers)
    model.zero_grad(set_to_none=True)
