"""Values of every kind: inference tensors, low-precision models, integer tensors, odd
reductions, dict outputs with any keys, and torch.func transforms. Each works, or is refused
with a clear error before anything wrong is stored. References are written by hand."""

from __future__ import annotations

import enum

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


def mlp(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)).to(dtype)


# -- 6. inference_mode ---------------------------------------------------------------------------
EDITS = {
    "scale": (lambda: hs.scale(2.0), lambda t: t * 2.0),
    "add": (lambda: hs.add(torch.ones(6)), lambda t: t + 1.0),
    "replace": (lambda: hs.replace(0.5), lambda t: torch.full_like(t, 0.5)),
    "ablate": (lambda: hs.ablate(), torch.zeros_like),
    "mean_ablate": (lambda: hs.mean_ablate(), lambda t: t.mean(0, keepdim=True).expand_as(t)),
    "transform": (lambda: hs.transform(torch.tanh), torch.tanh),
    "input": (lambda: hs.scale(0.0, on="input"), None),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_edits_under_inference_mode(name: str) -> None:
    model, x = mlp(), torch.randn(3, 4)
    make, by_hand = EDITS[name]
    with torch.inference_mode(), hs.edit(model, {"0": make()}) as editor:
        out = model(x)
    if by_hand is None:  # the input edit: zeros in, bias out
        want = model[2](torch.relu(model[0].bias.expand(3, 6)))
    else:
        want = model[2](torch.relu(by_hand(model[0](x))))
    torch.testing.assert_close(out, want.detach())
    assert editor.applied == {"0": 1}


def test_reference_capture_under_inference_mode() -> None:
    model, x = mlp(), torch.randn(3, 4)
    with torch.inference_mode(), hs.capture(model, ["0", "2"], copy="reference") as cap:
        out = model(x)
    # the in-place ReLU overwrote layer 0's output; no version counter exists to tell,
    # so hookscope copied the inference tensors instead of returning the overwritten one
    assert torch.equal(cap["0"].output, model[0](x).detach())
    assert (cap["0"].output < 0).any()
    assert torch.equal(cap["2"].output, out)


def test_patch_from_an_inference_mode_capture() -> None:
    model, x, y = mlp(), torch.randn(3, 4), torch.randn(3, 4)
    with torch.inference_mode():
        with hs.capture(model, "0") as src:
            model(y)
        with hs.edit(model, {"0": hs.patch(src)}):
            out = model(x)
        assert torch.equal(out, model(y))


# -- 7. edit values are cast to the tensor's dtype -------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["add", "scale", "mean_ablate", "replace"])
def test_float32_values_on_a_low_precision_model(dtype: torch.dtype, kind: str) -> None:
    model, x = mlp(dtype), torch.randn(3, 4).to(dtype)
    value = torch.linspace(-1, 1, 6)  # float32
    edit = {
        "add": hs.add(value),
        "scale": hs.scale(value),
        "mean_ablate": hs.mean_ablate(mean=value),
        "replace": hs.replace(value),
    }[kind]
    cast = value.to(dtype)
    by_hand = {
        "add": lambda t: t + cast,
        "scale": lambda t: t * cast,
        "mean_ablate": lambda t: cast.expand_as(t),
        "replace": lambda t: cast.expand_as(t),
    }[kind]
    with torch.no_grad(), hs.edit(model, {"0": edit}):
        out = model(x)
    with torch.no_grad():
        want = model[2](torch.relu(by_hand(model[0](x))))
    assert out.dtype == dtype
    assert torch.equal(out, want)


# -- 8. reducers and odd values -----------------------------------------------------------------
class Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        return self.proj(self.emb(ids)) * mask[..., None]


@pytest.mark.parametrize("reduce", ["token_mean", "batch_mean", "spatial_mean"])
def test_builtin_reducers_keep_integer_tensors_as_they_are(reduce: str) -> None:
    model = Embedder()
    ids, mask = torch.randint(0, 10, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    with torch.no_grad(), hs.capture(model, "emb", inputs=True, reduce=reduce) as cap:
        model(ids, mask)
    assert torch.equal(cap["emb"].input, ids)  # token ids are not averaged
    full = model.emb(ids).detach()
    want = {
        "token_mean": full.mean(1),
        "batch_mean": full.mean(0),
        "spatial_mean": full.mean(2),
    }[reduce]
    torch.testing.assert_close(cap["emb"].output, want)


def test_reduce_returning_a_python_number() -> None:
    model, x = mlp(), torch.randn(3, 4)
    with torch.no_grad(), hs.capture(model, ["0", "2"], reduce=lambda t: t.norm().item()) as cap:
        model(x)
    out = cap["2"].output
    assert isinstance(out, Tensor) and out.ndim == 0
    torch.testing.assert_close(out, model(x).norm())


def test_reduce_returning_something_else_is_refused() -> None:
    model = mlp()
    with pytest.raises(hs.CaptureError, match=r"reduce= returned list for '0' output"):
        with hs.capture(model, "0", reduce=lambda t: [t]):
            model(torch.randn(3, 4))


class Color(enum.Enum):
    RED = 1
    BLUE = 2


class OddKeys(nn.Module):
    """Returns dicts keyed by tuples and enums, with an in-place change after the fact."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> dict[object, Tensor]:
        h = self.lin(x)
        return {("a", 1): h * 2, Color.RED: h + 1}


class UsesOddKeys(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.odd = OddKeys()

    def forward(self, x: Tensor) -> Tensor:
        out = self.odd(x)
        first = out[("a", 1)]
        result = first.sum() + (out[Color.RED] * 3).sum()
        first.zero_()  # after use: a capture by reference would now hold zeros
        return result


def test_dict_outputs_with_tuple_and_enum_keys_are_copied_and_hooked() -> None:
    model = UsesOddKeys()
    x = torch.randn(2, 4, requires_grad=True)
    with hs.capture(model, "odd", grads=True) as cap:
        model(x).backward()
    h = model.odd.lin(x).detach()
    out, grad = cap["odd"].output, cap["odd"].grad
    assert set(out) == {("a", 1), Color.RED}
    torch.testing.assert_close(out[("a", 1)], h * 2)  # a copy, not the zeroed tensor
    torch.testing.assert_close(out[Color.RED], h + 1)
    torch.testing.assert_close(grad[("a", 1)], torch.ones(2, 4))
    torch.testing.assert_close(grad[Color.RED], torch.full((2, 4), 3.0))
    model.zero_grad(set_to_none=True)


def test_capture_inside_vmap_is_refused() -> None:
    model = mlp()
    with hs.capture(model, "0") as cap, pytest.raises(hs.UnsupportedModelError, match="vmap"):
        torch.func.vmap(model)(torch.randn(5, 3, 4))
    assert cap["0"].count == 0  # nothing half-recorded


# -- jagged nested tensors (layout=torch.jagged) ------------------------------------------------
def _jagged(requires_grad: bool = False) -> Tensor:
    parts = [torch.randn(3, 4, generator=torch.Generator().manual_seed(i)) for i in (1, 2)]
    parts[1] = torch.cat([parts[1], torch.randn(2, 4, generator=torch.manual_seed(3))])
    return torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=requires_grad)


@pytest.mark.mutates_model  # backward writes .grad
def test_capture_of_jagged_nested_tensors_with_gradients_equals_raw_hooks() -> None:
    model = mlp()
    seen: dict[str, Tensor] = {}

    def hook(m: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        seen["output"] = out.detach().clone()
        out.register_hook(lambda g: seen.__setitem__("grad", g))

    handle = model[0].register_forward_hook(hook)
    x = _jagged(requires_grad=True)
    model(x).values().pow(2).sum().backward()
    handle.remove()
    x = _jagged(requires_grad=True)
    with hs.capture(model, "0", grads=True) as cap:  # the forward died in new_empty()
        model(x).values().pow(2).sum().backward()
    got = cap["0"]
    assert got.output.is_nested and got.grad.is_nested
    torch.testing.assert_close(got.output.values(), seen["output"].values())
    torch.testing.assert_close(got.grad.values(), seen["grad"].values())


def test_summary_of_jagged_nested_tensors_reads_their_sizes() -> None:
    from hookscope.look import NestedShape

    model, x = mlp(), _jagged()
    rows = {r.name: r for r in hs.summary(model, x).rows}  # it died reading the shapes
    want = tuple(tuple(c.shape) for c in model[0](x).unbind())
    assert rows["0"].output == NestedShape(want) and want == ((3, 6), (5, 6))
    assert rows["0"].flops == 2 * (3 + 5) * 4 * 6 and rows["2"].flops == 2 * (3 + 5) * 6 * 2


def test_jagged_nested_tensors_have_no_batch_mean_and_say_so() -> None:
    model = mlp()
    means = hs.features(model, _jagged(), ["0"], reduce="token_mean")["0"]
    torch.testing.assert_close(
        means, torch.stack([c.mean(0) for c in model[0](_jagged()).unbind()])
    )
    with pytest.raises(hs.UsageError, match=r"batch_mean' of a nested tensor.*token_mean"):
        hs.features(model, _jagged(), ["0"], reduce="batch_mean")


def test_edits_of_jagged_nested_tensors_equal_the_edit_by_hand() -> None:
    model = mlp()
    want = model[2](model[1](model[0](_jagged()) * 2.0)).values()
    with hs.edit(model, {"0": hs.scale(2.0)}):
        got = model(_jagged()).values()
    torch.testing.assert_close(got, want)


class ToSparse(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu().to_sparse()


class ToDense(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to_dense()


def test_sparse_outputs_are_captured_and_edited_as_they_are() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), ToSparse(), ToDense(), nn.Linear(6, 2))
    x = torch.randn(3, 4)
    sparse = model[1](model[0](x))
    with hs.capture(model, "1") as cap:
        model(x)
    assert cap["1"].output.is_sparse
    torch.testing.assert_close(cap["1"].output.to_dense(), sparse.to_dense())
    with hs.edit(model, {"1": hs.scale(3.0)}):
        got = model(x)
    torch.testing.assert_close(got, model[3]((sparse * 3.0).to_dense()))
