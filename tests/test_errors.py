"""Bad input gets a clear, early error in hookscope's own classes, naming the problem and the
fix; odd but legal input (aliases' children, ``*args`` forwards) just works."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"keep": True}, r"keep=True"),
        ({"keep": 0}, r"keep=0"),
        ({"keep": "every"}, r"keep='every'"),
        ({"max_bytes": "1e6"}, r"max_bytes='1e6'.*not str"),
        ({"max_bytes": True}, r"max_bytes=True"),
        ({"max_bytes": -1}, r"max_bytes=-1"),
        ({"copy": "deep"}, r"copy='deep'"),
        ({"reduce": "median"}, r"reduce='median'"),
        ({"reduce": 3}, r"reduce must be a name or a function"),
        ({"stop": True, "grads": True}, r"stop=True ends the forward early"),
    ],
)
def test_bad_capture_options_are_refused_before_anything_is_hooked(
    options: dict[str, Any], match: str
) -> None:
    model = mlp()
    with pytest.raises(hs.UsageError, match=match):
        hs.capture(model, "0", **options)
    assert not model[0]._forward_hooks


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: hs.scale("2"), r"scale\('2'\): use a number or a tensor"),
        (lambda: hs.add(None), r"add\(None\)"),
        (lambda: hs.replace([1.0]), r"replace\(\[1.0\]\)"),
        (lambda: hs.clip_grad(value=-1), r"clip_grad\(value=-1\): use a positive number"),
        (lambda: hs.clip_grad(norm=-1), r"clip_grad\(norm=-1\)"),
        (lambda: hs.clip_grad(norm=0), r"clip_grad\(norm=0\)"),
        (lambda: hs.clip_grad(), r"needs value= or norm="),
        (lambda: hs.ablate(on="outputs"), r"on='outputs'"),
        (lambda: hs.transform(3), r"transform needs a function"),
        (lambda: hs.patch(torch.ones(2)), r"patch needs a Capture or a LayerRecord"),
    ],
)
def test_bad_edit_arguments_fail_when_the_edit_is_made(make: Any, match: str) -> None:
    with pytest.raises(hs.UsageError, match=match):
        make()


def test_edits_must_be_a_mapping() -> None:
    with pytest.raises(hs.UsageError, match=r"edits must be a dict \{layer selector: edit\}"):
        hs.edit(mlp(), ["0"])  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match="cannot edit with 3"):
        hs.edit(mlp(), {"0": 3})  # type: ignore[dict-item]


def test_the_root_is_not_a_layer() -> None:
    model = mlp()
    for selector in (model, ""):
        with pytest.raises(hs.UsageError, match=r"the model itself \(Sequential.*is not a layer"):
            hs.capture(model, selector)


class Holder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(3, 3), nn.Linear(3, 3)])
        self.heads = nn.ModuleDict({"a": nn.Linear(3, 1)})
        self.enc = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
        self.enc2 = self.enc  # a second name for the same module

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return self.heads["a"](self.enc2(x))


@pytest.mark.parametrize("selector", ["blocks", "heads"])
def test_containers_that_never_run_are_refused_with_their_children(selector: str) -> None:
    model = Holder()
    with pytest.raises(hs.UsageError, match=rf"'{selector}' is a Module(List|Dict).*'{selector}\."):
        hs.capture(model, selector)
    with pytest.raises(hs.UsageError, match="never called"):
        hs.capture(model, getattr(model, selector))
    # patterns skip containers instead of failing on them
    assert list(hs.capture(model, nn.Module).records) == [
        "blocks.0",
        "blocks.1",
        "heads.a",
        "enc",
        "enc.0",
        "enc.1",
    ]


def test_children_of_an_alias_resolve_to_the_canonical_layer() -> None:
    model, x = Holder(), torch.randn(2, 3)
    with torch.no_grad(), hs.capture(model, ["enc2.0", "enc2"]) as cap:
        model(x)
    assert list(cap.records) == ["enc.0", "enc"]
    assert cap["enc2.0"] is cap["enc.0"]
    assert torch.equal(cap["enc2.0"].output, model.enc[0](model.blocks[1](model.blocks[0](x))))


def test_predicate_that_raises_names_the_layer() -> None:
    def picky(module: nn.Module) -> bool:
        return module.out_features > 2  # type: ignore[no-any-return]

    match = r"predicate 'picky' raised AttributeError.*'1' \(ReLU\)"
    with pytest.raises(hs.UsageError, match=match):
        hs.capture(mlp(), picky)


def test_a_type_that_is_not_a_module_is_refused() -> None:
    with pytest.raises(hs.UsageError, match=r"type selector must be an nn\.Module subclass"):
        hs.capture(mlp(), int)  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match="cannot select layers with 3"):
        hs.capture(mlp(), 3)  # type: ignore[arg-type]


def test_unknown_key_into_a_capture_gives_close_matches() -> None:
    model = mlp()
    with torch.no_grad(), hs.capture(model, ["0", "2"]) as cap:
        model(torch.randn(1, 3))
    with pytest.raises(hs.LayerNotFoundError, match=r"'3' is not one of this capture's layers"):
        cap["3"]
    with pytest.raises(KeyError):  # a mapping's KeyError, so `in` / dict idioms behave
        cap["nope"]
    assert "3" not in cap and "0" in cap


class ModelOut(OrderedDict[str, Tensor]):
    """Stands in for a Hugging Face ModelOutput (an OrderedDict subclass)."""


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x: Tensor) -> ModelOut:
        h = self.lin(x)
        return ModelOut(last_hidden_state=h, pooled=h.mean(1))


def test_integer_position_into_a_mapping_output_says_to_use_keys() -> None:
    model = nn.Sequential(Encoder())
    with pytest.raises(hs.EditError, match=r"selected by key.*'last_hidden_state'"):
        with torch.no_grad(), hs.edit(model, {"0": hs.ablate(at=0)}):
            model(torch.randn(2, 3))


class StarArgs(nn.Module):
    def forward(self, *args: Tensor, **kwargs: Tensor) -> Tensor:
        return args[0] * 2 + kwargs["bias"]


def test_inputs_of_a_star_args_forward_are_named() -> None:
    x, b = torch.randn(2), torch.randn(2)

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = StarArgs()

        def forward(self, x: Tensor) -> Tensor:
            return self.inner(x, x + 1, bias=b)

    outer = Outer()
    with torch.no_grad(), hs.capture(outer, "inner", inputs=True) as cap:
        outer(x)
    assert list(cap["inner"].inputs) == ["arg0", "arg1", "bias"]
    assert torch.equal(cap["inner"].input, x)
    with torch.no_grad(), hs.edit(outer, {"inner": hs.replace(0.0, on="input", at="bias")}):
        assert torch.equal(outer(x), x * 2)


def test_grad_of_a_tensor_made_without_gradients_says_how_it_came_to_be() -> None:
    w = torch.randn(3, requires_grad=True)
    with torch.no_grad():
        z = w * 2
    with pytest.raises(hs.GradientUnavailableError, match=r"made under torch\.no_grad\(\)"):
        hs.grad_of(z)
    with pytest.raises(hs.GradientUnavailableError, match=r"torch\.int64 tensor; only floating"):
        hs.grad_of(torch.ones(2, dtype=torch.long))
    with torch.inference_mode():
        t = torch.ones(2)
    with pytest.raises(hs.GradientUnavailableError, match="inference_mode"):
        hs.grad_of(t)


def test_errors_after_the_forward_are_not_blamed_on_a_layer() -> None:
    model = mlp()
    with pytest.raises(ValueError, match="after") as info:
        with hs.capture(model, "0"):
            model(torch.randn(1, 3))
            raise ValueError("raised after the forward")
    assert not getattr(info.value, "__notes__", [])


def test_errors_inside_the_forward_name_the_last_layer_seen() -> None:
    class Breaks(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(3, 3)

        def forward(self, x: Tensor) -> Tensor:
            return self.a(x).view(7)  # a shape bug in the user's model

    model = Breaks()
    with pytest.raises(RuntimeError, match="shape") as info:
        with hs.capture(model, "a"):
            model(torch.randn(1, 3))
    assert "last layer this capture saw finish was 'a'" in "\n".join(info.value.__notes__)
    with pytest.raises(RuntimeError, match="shape") as info:
        with hs.capture(model, "a"), hs.capture(model, "a"):  # two captures: the note once
            model(torch.randn(1, 3))
    assert [n for n in info.value.__notes__ if "saw finish" in n] == [
        "hookscope: raised inside the model's forward; the last layer this capture saw "
        "finish was 'a'"
    ]


def test_clip_grad_says_it_is_per_parameter_tensor() -> None:
    doc = hs.clip_grad.__doc__ or ""
    assert "each parameter tensor on its own" in doc and "clip_grad_norm_" in doc
