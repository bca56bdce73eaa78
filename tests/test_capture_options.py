"""capture() options: keep, copy modes, reduce, budget, early stop, inputs, gradient errors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hookscope as hs


class Chain(nn.Module):
    """a -> b -> c, with the reused ``shared`` Linear called twice."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(4, 4)
        self.shared = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.c = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.shared(self.a(x))
        x = self.shared(self.b(x))
        return self.c(x)


def hand_outputs(model: nn.Module, x: torch.Tensor, name: str) -> list[torch.Tensor]:
    """Independent reference: a raw forward hook storing detached clones."""
    seen: list[torch.Tensor] = []
    handle = model.get_submodule(name).register_forward_hook(
        lambda m, a, o: seen.append(o.detach().clone())
    )
    try:
        model(x)
    finally:
        handle.remove()
    return seen


def test_keep_pass_all_last_ring() -> None:
    model, x = Chain(), torch.randn(3, 4)
    ref = hand_outputs(model, x, "shared")
    with hs.capture(model, "shared") as per_pass, hs.capture(model, "shared", keep="all") as every:
        with (
            hs.capture(model, "shared", keep="last") as last,
            hs.capture(model, "shared", keep=3) as ring,
        ):
            model(x)
            model(x)
    assert [c.index for c in per_pass["shared"].calls] == [2, 3]
    assert all(c.pass_index == 1 for c in per_pass["shared"].calls)
    assert len(every["shared"]) == 4 and every["shared"].count == 4
    assert len(last["shared"]) == 1 and torch.equal(last["shared"].output, ref[1])
    assert [c.index for c in ring["shared"].calls] == [1, 2, 3]
    for got, want in zip(per_pass["shared"].outputs, ref):
        assert torch.equal(got, want)


def test_reference_mode_detects_in_place_change() -> None:
    lin = nn.Linear(3, 3)
    model = nn.Sequential(lin, nn.ReLU(inplace=True))
    x = torch.tensor([[1.0, -2.0, 3.0]])
    with hs.capture(model, "0", copy="reference") as ref, hs.capture(model, "0") as safe:
        model(x)
    with pytest.raises(hs.StaleCaptureError, match="modified in place"):
        _ = ref["0"].output
    assert torch.equal(safe["0"].output, lin(x).detach())  # clone keeps negatives
    assert (safe["0"].output < 0).any()


def test_reference_mode_is_the_live_tensor_when_untouched() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh())
    x = torch.randn(2, 3)
    with hs.capture(model, "0", copy="reference") as cap:
        model(x)
    assert torch.equal(cap["0"].output, model[0](x).detach())


@pytest.mark.parametrize(
    ("reduce", "expect"),
    [
        ("spatial_mean", lambda t: t.mean(dim=(2, 3))),
        ("batch_mean", lambda t: t.mean(dim=0)),
        (lambda t: t.amax(dim=1), lambda t: t.amax(dim=1)),
    ],
)
def test_reduce_at_capture_time(reduce: object, expect: object) -> None:
    conv = nn.Conv2d(3, 5, 3)
    x = torch.randn(2, 3, 8, 8)
    model = nn.Sequential(conv)
    with hs.capture(model, "0", reduce=reduce) as cap:
        model(x)
    assert torch.allclose(cap["0"].output, expect(conv(x).detach()))  # type: ignore[operator]


def test_token_mean_and_reduce_that_returns_a_view_is_copied() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(2, 5, 4)
    with (
        hs.capture(model, "0", reduce="token_mean") as mean,
        hs.capture(model, "0", reduce=lambda t: t[:, 0]) as view,
    ):
        model(x)
    pre = model[0](x).detach()
    assert torch.allclose(mean["0"].output, pre.mean(dim=1))
    assert torch.equal(view["0"].output, pre[:, 0])  # not overwritten by the in-place ReLU


def test_budget_raises_before_it_is_exceeded() -> None:
    model = nn.Sequential(nn.Linear(256, 256), nn.Linear(256, 256))
    x = torch.randn(4, 256)  # each output: 4 KiB
    with pytest.raises(hs.CaptureBudgetError, match="max_bytes=6000") as info:
        with hs.capture(model, ["0", "1"], max_bytes=6000) as cap:
            model(x)
    assert "'1'" in str(info.value)
    assert cap.nbytes <= 6000 and len(cap["0"]) == 1 and len(cap["1"]) == 0


def test_budget_counts_evictions() -> None:
    model = nn.Sequential(nn.Linear(256, 256))
    with hs.capture(model, "0", max_bytes=5000, keep="last") as cap:
        for _ in range(5):
            model(torch.randn(4, 256))
    assert cap.nbytes == 4096


def test_stop_follows_execution_order_not_list_order() -> None:
    order: list[str] = []
    model = Chain()
    x = torch.randn(1, 4)
    with hs.capture(model, "c") as later, torch.no_grad():
        with hs.capture(model, ["b", "a"], stop=True) as cap:
            model(x)
            order.append("after")  # skipped: the with block exits quietly on the stop
    assert order == []
    assert later["c"].count == 0  # the forward stopped before c
    assert len(cap["a"]) == 1 and len(cap["b"]) == 1
    assert torch.equal(cap["b"].output, hand_outputs(model, x, "b")[0])


def test_stop_is_not_swallowed_by_model_code() -> None:
    class Catcher(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            try:
                x = self.a(x)
            except Exception:
                x = x * 0
            return self.b(x)

    model = Catcher()
    ran: list[int] = []
    with hs.capture(model, "a", stop=True), hs.capture(model, "b") as later:
        model(torch.ones(1, 2))
        ran.append(1)
    assert ran == [] and len(later["b"]) == 0


def test_stop_with_grads_is_refused() -> None:
    with pytest.raises(ValueError, match="stop=True"):
        hs.capture(nn.Sequential(nn.Linear(2, 2)), "0", stop=True, grads=True)


class KwargsOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(
        self, *, hidden_states: torch.Tensor, mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        out = self.proj(hidden_states)
        return out if mask is None else out * mask


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = KwargsOnly()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(hidden_states=x, mask=torch.ones_like(x))


def test_inputs_bound_by_name_when_passed_by_keyword() -> None:
    model, x = Outer(), torch.randn(2, 4)
    with hs.capture(model, "layer", inputs=True) as cap:
        model(x)
    assert set(cap["layer"].inputs) == {"hidden_states", "mask"}
    assert torch.equal(cap["layer"].inputs["hidden_states"], x)
    assert torch.equal(cap["layer"].input, x)


def test_inputs_not_captured_says_how() -> None:
    model = Outer()
    with hs.capture(model, "layer") as cap:
        model(torch.randn(2, 4))
    with pytest.raises(hs.CaptureError, match="inputs=True"):
        _ = cap["layer"].inputs


def test_input_capture_is_taken_before_in_place_modules() -> None:
    model = nn.Sequential(nn.Linear(3, 3), nn.ReLU(inplace=True))
    x = torch.tensor([[1.0, -5.0, 2.0]])
    with torch.no_grad(), hs.capture(model, "1", inputs=True) as cap:
        model(x)
    assert torch.equal(cap["1"].input, model[0](x))  # negatives kept


def test_kwargs_input_gradients() -> None:
    model, x = Outer(), torch.randn(2, 4, requires_grad=True)
    with hs.capture(model, "layer", grads=True) as cap:
        model(x).pow(2).sum().backward()
    (ref,) = torch.autograd.grad(model(x).pow(2).sum(), x)
    assert torch.allclose(cap["layer"].grad_inputs["hidden_states"], ref)


def test_gradient_errors_say_why() -> None:
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(1, 3)
    with torch.no_grad(), hs.capture(model, "0", grads=True) as cap:
        model(x)
    with pytest.raises(hs.GradientUnavailableError, match="no_grad"):
        _ = cap["0"].grad
    with torch.inference_mode(), hs.capture(model, "0", grads=True) as cap:
        model(x)
    with pytest.raises(hs.GradientUnavailableError, match="inference_mode"):
        _ = cap["0"].grad
    with hs.capture(model, "0", grads=True) as cap:
        model(x)  # x does not require grad: the input's gradient cannot exist
    with pytest.raises(hs.GradientUnavailableError, match="nothing upstream"):
        _ = cap["0"].grad_input
    with pytest.raises(hs.GradientUnavailableError, match="not reached it when the capture closed"):
        _ = cap["0"].grad
    with pytest.raises(hs.GradientUnavailableError, match="grads=True"):
        with hs.capture(model, "0") as plain:
            model(x)
        _ = plain["0"].grad


def test_layer_that_never_ran() -> None:
    model = Chain()
    with hs.capture(model, "c") as cap:
        model.a(torch.randn(1, 4))
    with pytest.raises(hs.CaptureError, match="has not run"):
        _ = cap["c"].output


def test_records_repr_is_informative() -> None:
    model = Chain()
    with hs.capture(model, ["shared", "c"], inputs=True) as cap:
        model(torch.randn(3, 4))
    assert "calls=2/2" in repr(cap["shared"]) and "Tensor[3, 4] float32" in repr(cap["shared"])
    assert repr(cap).startswith("Capture(2 layers, 3 calls kept")
    assert "inputs=dict(input=Tensor[3, 4]" in repr(cap["c"].last)


def test_nested_outputs_keep_structure() -> None:
    class Multi(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"a": x * 2, "pair": (x + 1, None), "n": 3}

    model = nn.Sequential(Multi())
    x = torch.randn(2)
    with hs.capture(model, "0") as cap:
        model(x)
    out = cap["0"].output
    assert set(out) == {"a", "pair", "n"} and out["n"] == 3 and out["pair"][1] is None
    assert torch.equal(out["pair"][0], x + 1)


def test_bad_options_are_refused() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    for kwargs, match in [
        ({"copy": "deep"}, "copy='deep'"),
        ({"keep": 0}, "keep=0"),
        ({"max_bytes": -1}, "max_bytes"),
        ({"reduce": "median"}, "reduce='median'"),
    ]:
        with pytest.raises(ValueError, match=match):
            hs.capture(model, "0", **kwargs)


def test_device_move_copies() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    x = torch.tensor([[1.0, -1.0]])
    with torch.no_grad(), hs.capture(model, "0", capture_device="cpu") as cap:
        model(x)
    assert torch.equal(cap["0"].output, model[0](x))


def test_functional_inplace_after_layer() -> None:
    class Dense(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return F.relu(self.norm(x), inplace=True)

    model = Dense().eval()
    x = torch.randn(6, 4)
    with torch.no_grad(), hs.capture(model, "norm") as cap:
        model(x)
    assert (cap["norm"].output < 0).any()
    assert torch.equal(cap["norm"].output, model.norm(x))


def test_a_capture_opened_again_follows_a_replaced_layer() -> None:
    """``model.a = ...`` between two blocks of one capture (or edit): the next block hooks
    the module now under that name; a layer removed altogether is refused saying so."""
    model = nn.Sequential(OrderedDict(a=nn.Linear(2, 3), b=nn.ReLU()))
    first, x = model.a, torch.ones(1, 2)
    cap = hs.capture(model, ["a", "a::linear"])
    ed = hs.edit(model, {"a": hs.scale(2.0)})
    with cap:
        model(x)
    model.a = nn.Linear(2, 3)
    try:
        with cap, ed:
            out = model(x)
        with torch.no_grad():
            want = model.a(x)
        assert torch.equal(cap["a"].output, want) and torch.equal(cap["a::linear"].output, want)
        assert torch.equal(out, torch.relu(2 * want))
        del model.a
        with pytest.raises(hs.LayerNotFoundError, match="'a' is no longer in the model"):
            cap.open()
    finally:
        second = model.b
        del model.b
        model.a, model.b = first, second  # the model as the test found it (in its order)


def test_autograd_grad_wrt_a_capture_needs_the_tensor_itself() -> None:
    """detach=False with copy="reference" keeps the model's own tensor: autograd.grad of the
    model's loss w.r.t. it works; the default differentiable clone is another tensor, as its
    docstring says."""
    model = nn.Sequential(nn.Linear(2, 3), nn.Tanh(), nn.Linear(3, 1))
    x = torch.ones(4, 2)
    with hs.capture(model, "1", detach=False, copy="reference") as cap:
        loss = model(x).sum()
    (g,) = torch.autograd.grad(loss, cap["1"].output)
    torch.testing.assert_close(g, model[2].weight.expand(4, 3))
    with hs.capture(model, "1", detach=False) as clone:
        loss = model(x).sum()
    with pytest.raises(RuntimeError, match="not have been used in the graph"):
        torch.autograd.grad(loss, clone["1"].output)


def test_a_capture_reads_like_a_mapping() -> None:
    """keys, values, items and get agree with [] and in, in selection order."""
    model = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    with hs.capture(model, ["2", nn.ReLU]) as cap:
        model(torch.randn(4, 2))
    assert cap.keys() == ["2", "1"]
    assert cap.values() == [cap["2"], cap["1"]]
    assert cap.items() == list(zip(cap.keys(), cap.values(), strict=True))
    assert dict(cap.items()) == {k: cap[k] for k in cap}
    assert cap.get("1") is cap["1"] and cap.get("0") is None and cap.get("0", 7) == 7
    assert ("0" in cap, "1" in cap) == (False, True)
