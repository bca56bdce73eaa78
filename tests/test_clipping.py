"""hs.clip_grad_norm against torch.nn.utils.clip_grad_norm_ on copies of the same gradients,
per-layer clipping by hand, and non-finite gradients named."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


def _model_with_grads(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 2))
    model[2].requires_grad_(False)  # frozen: no gradient, skipped
    (model(torch.randn(5, 4)) ** 2).sum().backward()
    return model


@pytest.mark.mutates_model  # clipping changes .grad on purpose; values are compared below
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("max_norm", [0.5, 1e6])
def test_equals_torch(norm_type: float, max_norm: float) -> None:
    ours, theirs = _model_with_grads(), _model_with_grads()
    total = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm, norm_type=norm_type)
    report = hs.clip_grad_norm(ours, max_norm, norm_type=norm_type)
    assert report.total_norm == pytest.approx(float(total), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        assert (a.grad is None) == (b.grad is None)
        if a.grad is not None:
            torch.testing.assert_close(a.grad, b.grad)
    assert set(report.layers) == {"0", "3"}  # layer "2" is frozen
    if max_norm < float(total):
        assert report.clipped == pytest.approx(
            {"0": max_norm / float(total), "3": max_norm / float(total)}, rel=1e-5
        )
        assert report.total_norm_after == pytest.approx(max_norm, rel=1e-4)
    else:
        assert report.clipped == {} and not report.was_clipped


@pytest.mark.mutates_model
def test_per_layer_by_hand() -> None:
    model = _model_with_grads()
    before = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    norms = {
        layer: math.sqrt(
            sum(float(before[f"{layer}.{k}"].pow(2).sum()) for k in ("weight", "bias"))
        )
        for layer in ("0", "3")
    }
    report = hs.clip_grad_norm(model, 0.1, per_layer=True)
    assert report.layers == pytest.approx(norms, rel=1e-6)
    for layer, norm in norms.items():
        factor = min(1.0, 0.1 / (norm + 1e-6))
        for k in ("weight", "bias"):
            torch.testing.assert_close(
                getattr(model, layer).get_parameter(k).grad, before[f"{layer}.{k}"] * factor
            )
        if factor < 1:
            assert report.clipped[layer] == pytest.approx(factor, rel=1e-5)


@pytest.mark.mutates_model
def test_nonfinite_gradient_named() -> None:
    model, theirs, reported = _model_with_grads(), _model_with_grads(), _model_with_grads()
    for m in (model, theirs, reported):
        m[3].bias.grad[1] = float("nan")
    total = torch.nn.utils.clip_grad_norm_(theirs.parameters(), 1.0)
    assert math.isnan(float(total))  # torch only says the total is nan
    report = hs.clip_grad_norm(reported, 1.0)
    assert math.isnan(report.total_norm) and report.nonfinite == ["3.bias"]
    kept = model[0].weight.grad.clone()
    with pytest.raises(hs.NonFiniteError, match=r"3\.bias") as info:
        hs.clip_grad_norm(model, 1.0, error_if_nonfinite=True)
    assert info.value.module == "3.bias" and torch.equal(model[0].weight.grad, kept)


@pytest.mark.mutates_model
def test_code_written_for_torchs_nonfinite_error_catches_ours() -> None:
    """torch raises a RuntimeError for non-finite gradients: the except clause written for it
    catches hookscope's NonFiniteError too (a FloatingPointError as well, as before)."""
    caught = []
    for clip in (torch.nn.utils.clip_grad_norm_, hs.clip_grad_norm):
        model = _model_with_grads()
        model[3].bias.grad[1] = float("inf")
        params = [p for p in model.parameters() if p.grad is not None]
        try:
            clip(params, 1.0, error_if_nonfinite=True)
        except RuntimeError as e:
            caught.append(type(e))
    assert caught == [RuntimeError, hs.NonFiniteError]
    assert issubclass(hs.NonFiniteError, FloatingPointError)


@pytest.mark.mutates_model
def test_parameter_lists_tied_weights_and_errors() -> None:
    emb = nn.Embedding(5, 3)
    head = nn.Linear(3, 5, bias=False)
    head.weight = emb.weight  # tied: one tensor
    head(emb(torch.tensor([1, 2]))).sum().backward()
    g = emb.weight.grad.clone()
    report = hs.clip_grad_norm([("emb", emb.weight), ("head", head.weight)], 1e9)
    assert list(report.layers) == ["emb"] and report.total_norm == pytest.approx(float(g.norm()))
    assert hs.clip_grad_norm(nn.Linear(2, 2), 1.0).total_norm == 0.0  # no gradients yet
    for bad in (0, -1.0, "1", True):
        with pytest.raises(hs.UsageError, match="max_norm"):
            hs.clip_grad_norm(emb, bad)  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match="norm_type"):
        hs.clip_grad_norm(emb, 1.0, norm_type=0)


# -- hs.clip_grad: clipping as gradients arrive, with the same kind of report -------------------


def _grads(model: nn.Module, x: Tensor) -> dict[str, Tensor]:
    """Each parameter's gradient of the test loss, by a plain backward (the reference)."""
    model.zero_grad()
    (model(x) ** 2).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.mutates_model  # the edited backward writes .grad on purpose
@pytest.mark.parametrize("value", [None, 0.05])
def test_clip_grad_edit_reports_what_it_did(value: float | None) -> None:
    model, x = _model_with_grads(), torch.randn(6, 4) * 5
    plain = _grads(model, x)
    clip = hs.clip_grad(norm=0.5, value=value)
    model.zero_grad()
    with hs.edit(model, {"0": clip, "3": clip}):
        (model(x) ** 2).sum().backward()
    report = clip.report()
    names = ["0.weight", "0.bias", "3.weight", "3.bias"]
    assert sorted(report.layers) == sorted(names) and report.max_norm == 0.5
    after = {}
    for n in names:
        g = plain[n] if value is None else plain[n].clamp(-value, value)
        after[n] = g * min(1.0, 0.5 / (float(g.norm()) + 1e-6))
        assert report.layers[n] == pytest.approx(float(plain[n].norm()), rel=1e-5)
        assert torch.allclose(dict(model.named_parameters())[n].grad, after[n], atol=1e-6)
    assert report.clipped == pytest.approx(
        {
            n: float(after[n].norm() / plain[n].norm())
            for n in names
            if after[n].norm() < plain[n].norm()
        },
        rel=1e-4,
    )
    assert report.clipped  # the bound is below these gradients' norms
    assert report.total_norm == pytest.approx(
        float(torch.stack([plain[n].norm() for n in names]).norm()), rel=1e-5
    )
    assert report.total_norm_after == pytest.approx(
        float(torch.stack([after[n].norm() for n in names]).norm()), rel=1e-4
    )
    assert report.nonfinite == [] and report.norm_type == 2.0


@pytest.mark.mutates_model
def test_clip_grad_report_describes_the_latest_backward_and_names_nan() -> None:
    model = _model_with_grads()
    clip = hs.clip_grad(norm=1e6)  # never scales: the report shows the gradients themselves
    with hs.edit(model, {"0": clip, "3": clip}):
        for scale in (1.0, 3.0):  # gradient accumulation: two backwards
            (model(torch.ones(2, 4) * scale) ** 2).sum().backward()
        latest = _grads(model, torch.ones(2, 4) * 3.0)  # another backward, same as the last
        assert clip.report().layers == pytest.approx(
            {n: float(latest[n].norm()) for n in ["0.weight", "0.bias", "3.weight", "3.bias"]}
        )
        assert not clip.report().clipped
        model.zero_grad()
        h = model[0](torch.ones(2, 4))
        h.register_hook(lambda g: torch.full_like(g, math.nan))  # NaN reaches layer 0 only
        (model[3](model[2](model[1](h))) ** 2).sum().backward()
    report = clip.report()
    assert sorted(report.nonfinite) == ["0.bias", "0.weight"]
    assert math.isnan(report.total_norm)
    assert hs.clip_grad(value=1.0).report() == hs.ClipReport(0.0, 0.0, math.inf, 2.0)


# -- overflow, parametrized layers, float64 -------------------------------------------------------


@pytest.mark.mutates_model  # gradients are set on purpose
def test_a_total_norm_that_overflows_is_caught_as_torch_does() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for p in net.parameters():
        p.grad = torch.full_like(p, 1e30)  # finite gradients, squares overflow float32
    with pytest.raises(RuntimeError, match="non-finite"):
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0, error_if_nonfinite=True)
    before = [p.grad.clone() for p in net.parameters()]
    with pytest.raises(hs.NonFiniteError, match=r"overflows torch\.float32") as info:
        hs.clip_grad_norm(net, 1.0, error_if_nonfinite=True)
    assert info.value.module in ("0", "1")
    assert all(torch.equal(a, p.grad) for a, p in zip(before, net.parameters(), strict=True))


@pytest.mark.mutates_model
def test_per_layer_keeps_a_parametrized_layer_whole() -> None:
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    net = nn.Sequential(weight_norm(nn.Linear(4, 4)), nn.Linear(4, 2))
    net(torch.randn(3, 4)).pow(2).sum().backward()
    norms = {
        layer: float(torch.cat([p.grad.reshape(-1) for p in net[int(layer)].parameters()]).norm())
        for layer in ("0", "1")
    }
    report = hs.clip_grad_norm(net, 1e-3, per_layer=True)
    assert report.layers == pytest.approx(norms, rel=1e-6)  # "0" once, not "0" and "0.param..."
    for layer in ("0", "1"):
        after = torch.cat([p.grad.reshape(-1) for p in net[int(layer)].parameters()]).norm()
        assert float(after) == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.mutates_model
def test_float64_gradients_get_a_float64_norm() -> None:
    net = nn.Linear(3, 1).double()
    net.weight.grad = torch.tensor([[1.0, 1e-9, 1.0]], dtype=torch.float64)
    net.bias.grad = torch.tensor([1e-9], dtype=torch.float64)
    want = torch.nn.utils.get_total_norm([net.weight.grad, net.bias.grad])
    report = hs.clip_grad_norm(net, 10.0)
    assert report.total_norm == float(want)  # exactly: no float32 rounding on the way
    assert report.total_norm != float(want.float())


def _sparse_model() -> nn.Module:
    """An embedding with sparse gradients (repeated lookups: an uncoalesced gradient, the
    same row listed once per lookup) beside a dense layer."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, sparse=True), nn.Linear(4, 2))
    (model(torch.tensor([[1, 1, 2], [3, 1, 9]])) ** 2).sum().backward()
    return model


@pytest.mark.mutates_model  # clipping changes .grad on purpose; values are compared below
@pytest.mark.parametrize("norm_type", [2.0, 1.0, math.inf])
@pytest.mark.parametrize("per_layer", [False, True])
def test_sparse_embedding_gradients_equal_torch_on_their_dense_form(
    norm_type: float, per_layer: bool
) -> None:
    """torch's clip_grad_norm_ has no sparse norm kernel: the oracle is torch's clipping of
    the same gradients made dense (the values a sparse gradient stands for)."""
    ours, theirs = _sparse_model(), _sparse_model()
    assert ours[0].weight.grad.is_sparse and not ours[0].weight.grad.is_coalesced()
    for p in theirs.parameters():
        p.grad = p.grad.to_dense()
    groups = [list(m.parameters()) for m in theirs] if per_layer else [list(theirs.parameters())]
    totals = [torch.nn.utils.clip_grad_norm_(g, 0.5, norm_type=norm_type) for g in groups]
    report = hs.clip_grad_norm(ours, 0.5, norm_type=norm_type, per_layer=per_layer)
    if per_layer:
        assert report.layers == pytest.approx({"0": float(totals[0]), "1": float(totals[1])})
    else:
        assert report.total_norm == pytest.approx(float(totals[0]), rel=1e-6)
    assert ours[0].weight.grad.is_sparse  # scaled in place, still sparse
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad.to_dense(), b.grad)
