"""torch.compile: hooks before compile work; a compiled model that already ran is refused
loudly (default) or recompiled on request, never silently ignored."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


@pytest.fixture(autouse=True)
def fresh_dynamo() -> None:
    torch._dynamo.reset()


X = torch.randn(3, 4)


def compile_(model: nn.Module, how: str) -> nn.Module:
    """``torch.compile(model)`` (a wrapper) or ``model.compile()`` (in place, same names)."""
    if how == "torch.compile":
        return torch.compile(model, backend="eager")  # type: ignore[return-value]
    model.compile(backend="eager")
    return model


def test_compiled_after_hooks_were_added() -> None:
    model = Net()
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), hs.capture(compiled, ["a", "_orig_mod.b"]) as cap:
        out = compiled(X)
    assert torch.equal(cap["a"].output, model.a(X).detach())
    assert torch.equal(cap["b"].output, out)


# dynamo itself warns while tracing a hook on a non-leaf tensor with grad enabled
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_model_compile_in_place_keeps_names() -> None:
    model = Net()
    model.compile(backend="eager")
    with hs.edit(model, {"a": hs.ablate()}):
        out = model(X)
    assert torch.allclose(out, model.b(torch.zeros(3, 4)))


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_already_compiled_and_run_raises_with_the_fix(how: str) -> None:
    model = Net()
    compiled = compile_(model, how)
    compiled(X)
    with pytest.raises(hs.CompiledModelError, match="recompile=True"):
        hs.capture(compiled, "a").open()
    with pytest.raises(hs.CompiledModelError, match="silently ignored"):
        hs.edit(compiled, {"a": hs.ablate()}).open()


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_recompile_makes_hooks_take_effect_and_go_away(how: str) -> None:
    model = Net()
    compiled = compile_(model, how)
    with torch.no_grad():
        plain = compiled(X)
        with hs.capture(compiled, "a", recompile=True) as cap:
            compiled(X)
        assert torch.equal(cap["a"].output, model.a(X))
        with hs.edit(compiled, {"a": hs.ablate()}, recompile=True):
            edited = compiled(X)
        assert torch.allclose(edited, model.b(torch.zeros(3, 4)))
        assert torch.equal(compiled(X), plain)  # the edit is gone after the block
