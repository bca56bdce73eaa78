"""Registry-parametrised contract tests: every zoo model, every layer, against hand-written
references (plain forward hooks storing ``detach().clone()``; ``torch.autograd.grad``)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from zoo import (
    ZOO,
    GradMap,
    HandHooks,
    ZooEntry,
    ZooError,
    assert_same_tree,
    layer_modules,
    make_loss,
    reference_input_grads,
    reference_output_grads,
    tree_get,
    tree_leaves,
    tree_map,
    unwrap,
    with_aliases,
)

# Dynamo reads ``.grad`` of non-leaf tensors while tracing hooks and only *hides* the
# resulting UserWarning (torch._dynamo.variables.builder.safe_has_grad), which does not work
# under ``-W error``: it then raises InternalTorchDynamoError. Not hookscope's doing.
DYNAMO_GRAD_WARNING = pytest.mark.filterwarnings(
    "ignore:The .grad attribute of a Tensor that is not a leaf Tensor:UserWarning"
)


def _marks(e: ZooEntry) -> list[Any]:
    marks = [pytest.mark.mutates_model] if e.mutates else []
    if e.wrapper == "compile":
        marks.append(DYNAMO_GRAD_WARNING)
    return marks


def zoo_params(pred: Callable[[ZooEntry], bool] = lambda e: True) -> list[Any]:
    return [pytest.param(e, id=e.name, marks=_marks(e)) for e in ZOO.values() if pred(e)]


def eager(entry: ZooEntry, model: nn.Module) -> nn.Module:
    """The model to run references on: a compiled model's eager original (running the
    compiled one would compile it before hookscope gets to add its hooks)."""
    return unwrap(model) if entry.wrapper == "compile" else model


def forward(
    entry: ZooEntry, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Any:
    if entry.raises is not None:
        with pytest.raises(entry.raises):
            model(*args, **kwargs)
        return None
    return model(*args, **kwargs)


def leaf_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The same inputs with every float tensor a leaf that requires grad."""

    def leaf(t: Tensor) -> Tensor:
        return t.detach().clone().requires_grad_() if t.is_floating_point() else t

    return tree_map(leaf, args), tree_map(leaf, kwargs)


def hooks_left(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in unwrap(model).modules()
    )


# ---------------------------------------------------------------------------------------
# Names
# ---------------------------------------------------------------------------------------
def listed_type(m: nn.Module) -> str:
    """The type ``hs.names`` lists: a container without a ``forward`` of its own is marked."""
    return type(m).__name__ + (" (container)" if type(m).forward is nn.Module.forward else "")


@pytest.mark.parametrize("entry", zoo_params())
def test_names_are_named_modules_of_unwrapped_model(entry: ZooEntry) -> None:
    model, _, _ = entry.build()
    expected = {n: listed_type(m) for n, m in unwrap(model).named_modules() if n}
    assert hs.names(model) == expected
    assert set(entry.layers) <= set(hs.names(model))


# ---------------------------------------------------------------------------------------
# (a) a no-op capture leaves the output bit-identical
# ---------------------------------------------------------------------------------------
NOOP_OPTIONS = {
    "default": {},
    "inputs+grads": {"inputs": True, "grads": True},
    "reference": {"copy": "reference"},
}


@pytest.mark.parametrize("options", list(NOOP_OPTIONS.values()), ids=list(NOOP_OPTIONS))
@pytest.mark.parametrize("entry", zoo_params(lambda e: e.raises is None))
def test_noop_capture_is_bit_identical(entry: ZooEntry, options: dict[str, Any]) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref:
        expected = eager(entry, model)(*args, **kwargs)
    with hs.capture(model, list(mods), **options) as cap:
        actual = model(*args, **kwargs)
    assert_same_tree(actual, expected, where="model output")
    assert {n: cap[n].count for n in mods} == {n: len(r) for n, r in ref.records.items()}
    assert not set(entry.not_run) & {n for n in mods if cap[n].count}


# ---------------------------------------------------------------------------------------
# (b) captured outputs and inputs equal hand-hook clones, per call, in order
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("inputs", [False, True], ids=["outputs", "inputs"])
@pytest.mark.parametrize("entry", zoo_params())
def test_captures_match_hand_hooks(entry: ZooEntry, inputs: bool) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref:
        forward(entry, eager(entry, model), args, kwargs)
    with hs.capture(model, list(mods), inputs=inputs) as cap:
        forward(entry, model, args, kwargs)
    assert list(cap) == list(mods)
    for name in mods:
        rec, want = cap[name], ref.records[name]
        assert rec.count == len(rec.calls) == len(want), name
        if name in entry.reused or name in entry.not_run:
            assert rec.count == entry.reused.get(name, 0), name
        for k, (got, exp) in enumerate(zip(rec.calls, want)):
            assert_same_tree(got.output, exp.output, where=f"{entry.name}:{name}[{k}].output")
            if inputs:
                assert_same_tree(got.inputs, exp.inputs, where=f"{entry.name}:{name}[{k}].inputs")
                first = next(iter(exp.inputs.values()))
                assert_same_tree(got.input, first, where=f"{name}[{k}].input")
        if want:
            assert_same_tree(rec.output, want[-1].output, where=f"{name}.output (latest)")


@pytest.mark.parametrize("entry", zoo_params(lambda e: bool(e.nested)))
def test_nested_outputs_keep_their_container_type(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    with HandHooks({n: mods[n] for n in entry.nested}) as ref:
        forward(entry, eager(entry, model), args, kwargs)
    with hs.capture(model, list(entry.nested)) as cap:
        forward(entry, model, args, kwargs)
    for name in entry.nested:
        exp = ref.records[name][-1].output
        assert not isinstance(exp, Tensor)
        assert type(cap[name].output) is type(exp)
        assert_same_tree(cap[name].output, exp)


# ---------------------------------------------------------------------------------------
# In place: the clone default is right, a detach-only hook is wrong, references go stale
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", zoo_params())
def test_inplace_metadata_matches_version_oracle(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref:
        forward(entry, eager(entry, model), args, kwargs)
    overwritten = {
        n for n in mods if any(ref.overwritten(n, k) for k in range(len(ref.records[n])))
    }
    assert overwritten == set(entry.inplace)


@pytest.mark.parametrize("entry", zoo_params(lambda e: bool(e.inplace)))
def test_inplace_clone_is_value_at_exit_detach_is_not(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = {n: layer_modules(model)[n] for n in entry.inplace}
    detached: dict[str, list[Tensor]] = {n: [] for n in mods}
    with HandHooks(mods, keep_live=True) as ref:
        forward(entry, eager(entry, model), args, kwargs)
    for n in mods:  # what a hand-written ``output.detach()`` hook would hold now
        detached[n] = [c.live_output.detach() for c in ref.records[n]]
    with hs.capture(model, list(mods)) as cap:
        forward(entry, model, args, kwargs)
    for n in mods:
        assert any(not torch.equal(d, c.output) for d, c in zip(detached[n], ref.records[n])), (
            f"{n}: in-place change did not alter the value; the zoo entry is not awkward"
        )
        for got, exp in zip(cap[n].calls, ref.records[n]):
            assert torch.equal(got.output, exp.output)


@pytest.mark.parametrize("entry", zoo_params())
def test_reference_copy_equals_or_reports_stale(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref:
        forward(entry, eager(entry, model), args, kwargs)
    with hs.capture(model, list(mods), copy="reference") as cap:
        forward(entry, model, args, kwargs)
    for name in mods:
        for k, exp in enumerate(ref.records[name]):
            got = cap[name].calls[k]
            if ref.overwritten(name, k):
                with pytest.raises(hs.StaleCaptureError, match=re.escape(repr(name))):
                    _ = got.output
            else:
                assert_same_tree(got.output, exp.output, where=f"{name}[{k}]")


# ---------------------------------------------------------------------------------------
# (c) gradients equal an autograd reference
# ---------------------------------------------------------------------------------------
def check_grad_tree(read: Callable[[], Any], expected: GradMap, where: str) -> None:
    """hookscope's grad tree matches autograd leaf by leaf; ``None`` where autograd has none;
    GradientUnavailableError exactly when no leaf has a gradient."""
    if not expected:
        return
    if all(g is None for g in expected.values()):
        with pytest.raises(hs.GradientUnavailableError):
            read()
        return
    got = read()
    for path, want in expected.items():
        value = tree_get(got, path)
        if want is None:
            assert value is None, f"{where}{list(path)}: autograd has no gradient, got {value!r}"
        else:
            assert isinstance(value, Tensor), f"{where}{list(path)}: got {value!r}"
            torch.testing.assert_close(value, want, msg=lambda m, p=path: f"{where}{list(p)}: {m}")


@pytest.mark.parametrize("leaf", [False, True], ids=["plain-inputs", "leaf-inputs"])
@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(
            e,
            id=e.name,
            marks=_marks(e),
        )
        for e in ZOO.values()
        if e.float_grads
    ],
)
def test_grads_match_autograd(entry: ZooEntry, leaf: bool) -> None:
    """Every layer's output gradients, and its input gradients (every layer with plain
    inputs; the metadata's interesting layers with leaf inputs, to stay fast)."""
    model, args, kwargs = entry.build()
    if leaf:
        args, kwargs = leaf_inputs(args, kwargs)
    mods = layer_modules(model)
    ref_model = eager(entry, model)
    with HandHooks(mods) as order:
        expected = ref_model(*args, **kwargs)
    out_grads = reference_output_grads(ref_model, mods, args, kwargs)
    in_grads = {
        name: [
            with_aliases(
                reference_input_grads(ref_model, mods[name], c.start, args, kwargs),
                entry.aliased.get(name, ()),
            )
            for c in calls
        ]
        for name, calls in order.records.items()
        if not leaf or name in entry.layers
    }

    with hs.capture(model, list(mods), grads=True) as cap:
        out = model(*args, **kwargs)
        make_loss(out).backward()
    model.zero_grad(set_to_none=True)
    assert_same_tree(out, expected, where="model output")  # grads=True is a no-op too

    checked = 0
    for name in mods:
        rec = cap[name]
        assert len(rec.calls) == len(out_grads[name]), name
        for k, call in enumerate(rec.calls):
            if name not in entry.shared_outputs:  # see test_grad_of_output_also_used_inside...
                check_grad_tree(lambda c=call: c.grad, out_grads[name][k], f"{name}[{k}].grad")
            if name not in in_grads:
                continue
            wanted = {("input", *p): g for p, g in in_grads[name][k].items()}
            check_grad_tree(
                lambda c=call: {"input": c.grad_inputs}, wanted, f"{name}[{k}].grad_inputs"
            )
            checked += sum(g is not None for g in out_grads[name][k].values())
    assert checked, "no gradient was compared at all"


@pytest.mark.parametrize(
    ("entry_name", "layer"),
    [
        ("functional", "l2"),
        ("tuple_out", "split"),
        ("same_tensor_twice", "mix"),
        ("residual_skip", "block"),
        ("lstm", "head"),
        ("dict_out", "enc.mu"),
    ],
)
def test_grads_match_full_backward_hooks(entry_name: str, layer: str) -> None:
    """A second oracle, PyTorch's own ``register_full_backward_hook`` (usable here: no
    in-place ops, tensor/tuple outputs, positional inputs): it agrees with the autograd
    reference above, and with hookscope."""
    model, args, kwargs = ZOO[entry_name].build()
    args, kwargs = leaf_inputs(args, kwargs)
    module = layer_modules(model)[layer]
    seen: dict[str, Any] = {}
    handle = module.register_full_backward_hook(lambda m, gi, go: seen.update(gi=gi, go=go))
    try:
        make_loss(model(*args, **kwargs)).backward()
    finally:
        handle.remove()
    ref_out = reference_output_grads(model, {layer: module}, args, kwargs)[layer][0]
    ref_in = reference_input_grads(model, module, 0, args, kwargs)
    go = seen["go"]
    for path, want in ref_out.items():
        fb = go[path[0]] if path else go[0]
        assert (fb is None) == (want is None)
        if want is not None:
            torch.testing.assert_close(fb, want)
    for i, want in enumerate(ref_in.values()):
        torch.testing.assert_close(seen["gi"][i], want)

    with hs.capture(model, layer, grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    got = cap[layer].grad
    got_out = got if isinstance(got, tuple) else (got,)
    for g, fb in zip(got_out, go):
        assert (g is None) == (fb is None)
        if fb is not None:
            torch.testing.assert_close(g, fb)
    names = list(ref_in)
    torch_gi = with_aliases(
        {n: g for n, g in zip(names, seen["gi"], strict=True)},
        ZOO[entry_name].aliased.get(layer, ()),
    )
    for g, fb in zip(cap[layer].grad_inputs.values(), torch_gi.values(), strict=True):
        torch.testing.assert_close(g, fb)


class FeatsAndLogits(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 3)
        self.fc = nn.Linear(3, 2)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = torch.tanh(self.lin(x))
        return h, self.fc(h)  # h is returned *and* used for the second output


class UsesBoth(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = FeatsAndLogits()

    def forward(self, x: Tensor) -> Tensor:
        h, logits = self.block(x)
        return (h * 2).sum() + logits.sum()


def test_grad_of_output_also_used_inside_layer_is_downstream_only() -> None:
    model, x = UsesBoth(), torch.randn(2, 3, requires_grad=True)
    seen: dict[str, Any] = {}
    handle = model.block.register_full_backward_hook(lambda m, gi, go: seen.update(go=go))
    try:
        model(x).backward()
    finally:
        handle.remove()
    assert torch.equal(seen["go"][0], torch.full((2, 3), 2.0))  # d(2h)/dh, downstream only
    with hs.capture(model, "block", grads=True) as cap:
        model(x).backward()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(cap["block"].grad[0], seen["go"][0])


@pytest.mark.parametrize("entry", zoo_params(lambda e: bool(e.shared_outputs)))
def test_grad_of_shared_outputs_in_zoo(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = {n: layer_modules(model)[n] for n in entry.shared_outputs}
    ref = reference_output_grads(model, mods, args, kwargs)
    with hs.capture(model, list(mods), grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    for name in mods:
        check_grad_tree(lambda n=name: cap[n].grad, ref[name][0], f"{name}.grad")


# ---------------------------------------------------------------------------------------
# Gradient errors say why
# ---------------------------------------------------------------------------------------
def test_frozen_part_without_grad_says_nothing_upstream() -> None:
    model, args, kwargs = ZOO["frozen"].build()
    with hs.capture(model, ["backbone", "head"], grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    with pytest.raises(hs.GradientUnavailableError, match="nothing upstream"):
        _ = cap["backbone"].grad
    with pytest.raises(hs.GradientUnavailableError, match="nothing upstream"):
        _ = cap["head"].grad_input
    assert cap["head"].grad.shape == (3, 2)


@pytest.mark.parametrize(
    ("mode", "why"),
    [(torch.no_grad, r"no_grad"), (torch.inference_mode, r"inference_mode")],
    ids=["no_grad", "inference_mode"],
)
def test_grad_under_no_grad_says_why(mode: Callable[[], Any], why: str) -> None:
    model, args, kwargs = ZOO["functional"].build()
    with hs.capture(model, ["l1", "l2"], grads=True) as cap, mode():
        model(*args, **kwargs)
    with pytest.raises(hs.GradientUnavailableError, match=why):
        _ = cap["l2"].grad
    with pytest.raises(hs.GradientUnavailableError, match=why):
        _ = cap["l2"].grad_input


def test_grad_before_backward_says_backward_never_reached_it() -> None:
    model, args, kwargs = ZOO["functional"].build()
    with hs.capture(model, "l2", grads=True) as cap:
        model(*args, **kwargs)
        with pytest.raises(hs.GradientUnavailableError, match="backward has not reached"):
            _ = cap["l2"].grad
    with pytest.raises(hs.GradientUnavailableError, match="not reached it when the capture closed"):
        _ = cap["l2"].grad


def test_int_output_leaf_has_no_grad_but_float_leaf_does() -> None:
    model, args, kwargs = ZOO["int_output"].build()
    expected = reference_output_grads(model, {"topk": model.topk}, args, kwargs)["topk"][0]
    with hs.capture(model, "topk", grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    values_grad, indices_grad = cap["topk"].grad
    torch.testing.assert_close(values_grad, expected[(0,)])
    assert indices_grad is None


def test_partial_grads_of_lstm_and_masked_block_are_readable() -> None:
    """LSTM's unused cell state and a block's float mask have no gradient; the other leaves
    (output, h_n; hidden_states) must still be readable."""
    model, args, kwargs = ZOO["lstm"].build()
    ref = reference_output_grads(model, {"lstm": model.lstm}, args, kwargs)["lstm"][0]
    with hs.capture(model, "lstm", grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    out_g, (h_g, c_g) = cap["lstm"].grad
    torch.testing.assert_close(out_g, ref[(0,)])
    torch.testing.assert_close(h_g, ref[(1, 0)])
    assert ref[(1, 1)] is None and c_g is None

    model, args, kwargs = ZOO["kwargs_only"].build()
    kwargs["hidden_states"].requires_grad_()  # the float mask does not require grad
    ref_in = reference_input_grads(model, model.block, 0, args, kwargs)
    with hs.capture(model, "block", grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    gi = cap["block"].grad_inputs
    torch.testing.assert_close(gi["hidden_states"], ref_in[("hidden_states",)])
    assert gi["mask"] is None and ref_in[("mask",)] is None
    torch.testing.assert_close(cap["block"].grad_input, ref_in[("hidden_states",)])


@pytest.mark.parametrize(
    ("entry_name", "layer"),
    [
        ("inplace_relu", "1"),
        ("alexnet", "features.1"),
        pytest.param("inplace_custom", "act"),
    ],
)
def test_grad_input_of_layer_that_edits_its_input_in_place(entry_name: str, layer: str) -> None:
    model, args, kwargs = ZOO[entry_name].build()
    mods = layer_modules(model)
    with HandHooks({layer: mods[layer]}) as order:
        model(*args, **kwargs)
    assert order.records[layer][0].edits_inputs
    refs = reference_input_grads(model, mods[layer], 0, args, kwargs)
    ref = next(iter(refs.values()))  # the first (only) parameter: `input` or `x`
    assert ref is not None
    with hs.capture(model, layer, grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(cap[layer].grad_input, ref)


def test_grad_through_layer_is_not_total_grad_of_input() -> None:
    """``residual_skip``: h feeds ``block`` and the skip; grad_input is block's share only."""
    model, args, kwargs = ZOO["residual_skip"].build()
    through = reference_input_grads(model, model.block, 0, args, kwargs)[("input",)]
    total = reference_output_grads(model, {"pre": model.pre}, args, kwargs)["pre"][0][()]
    assert through is not None and total is not None
    assert not torch.allclose(through, total)
    with hs.capture(model, ["pre", "block"], grads=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    torch.testing.assert_close(cap["block"].grad_input, through)
    torch.testing.assert_close(cap["pre"].grad, total)


def test_same_tensor_twice_stays_one_tensor() -> None:
    """``mix(h, h)``: the layer still gets one tensor (layers test ``a is b``), and each name
    reports the gradient through the layer w.r.t. that tensor: the sum of both uses."""
    model, args, kwargs = ZOO["same_tensor_twice"].build()
    ref = reference_input_grads(model, model.mix, 0, args, kwargs)
    seen: list[bool] = []
    with hs.capture(model, "mix", grads=True, inputs=True) as cap:
        probe = model.mix.register_forward_hook(lambda m, a, out: seen.append(a[0] is a[1]))
        make_loss(model(*args, **kwargs)).backward()
        probe.remove()
    model.zero_grad(set_to_none=True)
    gi = cap["mix"].grad_inputs
    assert seen == [True]
    torch.testing.assert_close(gi["a"], ref[("a",)] + ref[("b",)])
    torch.testing.assert_close(gi["b"], ref[("a",)] + ref[("b",)])


def test_grad_inputs_of_non_tensor_arguments_are_none() -> None:
    model, args, kwargs = ZOO["non_tensor_args"].build()
    args, kwargs = leaf_inputs(args, kwargs)
    with hs.capture(model, "scaled", grads=True, inputs=True) as cap:
        make_loss(model(*args, **kwargs)).backward()
    model.zero_grad(set_to_none=True)
    assert cap["scaled"].inputs == {"x": cap["scaled"].input, "scale": 2.0, "mode": "neg"}
    gi = cap["scaled"].grad_inputs
    assert isinstance(gi["x"], Tensor)
    assert gi["scale"] is None and gi["mode"] is None


# ---------------------------------------------------------------------------------------
# (d) per-call records
# ---------------------------------------------------------------------------------------
def test_reused_module_gives_three_ordered_distinct_records() -> None:
    model, (x,), _ = ZOO["reused"].build()
    with HandHooks({"fc": model.fc}) as ref:
        model(x)
    with hs.capture(model, "fc", inputs=True) as cap:
        model(x)
    rec = cap["fc"]
    assert rec.count == len(rec) == 3
    assert [c.index for c in rec] == [0, 1, 2]
    assert len({c.pass_index for c in rec}) == 1
    for got, exp in zip(rec, ref.records["fc"]):
        assert torch.equal(got.output, exp.output)
        assert torch.equal(got.input, exp.inputs["input"])
    outs = rec.outputs
    assert not torch.equal(outs[0], outs[1]) and not torch.equal(outs[1], outs[2])
    # call k+1's input is tanh(call k's output)
    for a, b in zip(rec.calls, rec.calls[1:]):
        assert torch.equal(b.input, torch.tanh(a.output))
    assert torch.equal(rec.output, outs[-1])
    assert rec[1] is rec.calls[1]
    with pytest.raises(hs.CaptureError, match="3 kept calls"):
        rec.only()


@pytest.mark.parametrize(
    ("keep", "kept"),
    [("pass", [3, 4, 5]), ("all", [0, 1, 2, 3, 4, 5]), ("last", [5]), (2, [4, 5])],
)
def test_reused_module_keep_over_two_forwards(keep: Any, kept: list[int]) -> None:
    model, (x,), _ = ZOO["reused"].build()
    x2 = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    with HandHooks({"fc": model.fc}) as ref:
        model(x)
        model(x2)
    with hs.capture(model, "fc", keep=keep) as cap:
        model(x)
        model(x2)
    rec = cap["fc"]
    assert rec.count == 6
    assert [c.index for c in rec] == kept
    for c in rec:
        assert torch.equal(c.output, ref.records["fc"][c.index].output)
        assert c.pass_index == c.index // 3


def test_gru_cell_loop_records_every_time_step() -> None:
    model, (x,), _ = ZOO["gru_cell_loop"].build()
    with hs.capture(model, "cell", inputs=True) as cap:
        model(x)
    calls = cap["cell"].calls
    assert len(calls) == x.shape[1] == 5
    for t, c in enumerate(calls):
        assert torch.equal(c.inputs["input"], x[:, t])  # oracle: the data itself
        expected_h = calls[t - 1].output if t else torch.zeros(2, 4)
        assert torch.equal(c.inputs["hx"], expected_h)
        assert torch.equal(c.output, model.cell(x[:, t], expected_h).detach())


def test_recursive_module_pairs_inputs_with_outputs() -> None:
    model, (x,), _ = ZOO["recursive"].build()
    with HandHooks({"rec": model.rec}) as ref:
        model(x)
    with hs.capture(model, "rec", inputs=True, grads=True) as cap:
        make_loss(model(x)).backward()
    model.zero_grad(set_to_none=True)
    rec = cap["rec"]
    assert [c.inputs["depth"] for c in rec] == [0, 1, 2, 3]  # completion order
    for got, exp in zip(rec, ref.records["rec"]):
        assert torch.equal(got.output, exp.output)
        assert_same_tree(got.inputs, exp.inputs)
        assert isinstance(got.grad, Tensor)


def test_call_index_does_not_depend_on_inputs_option() -> None:
    model, (x,), _ = ZOO["recursive"].build()
    with hs.capture(model, "rec") as plain:
        model(x)
    with hs.capture(model, "rec", inputs=True) as with_inputs:
        model(x)
    assert [c.index for c in plain["rec"]] == [c.index for c in with_inputs["rec"]]


class RecursiveRoot(nn.Module):
    """The root itself recurses: ``lin`` runs before each recursive call of the root."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor, depth: int = 3) -> Tensor:
        h = torch.tanh(self.lin(x))
        return h if depth == 0 else self(h, depth - 1)


def test_recursive_root_keeps_every_call_of_the_top_level_forward() -> None:
    model, x = RecursiveRoot(), torch.randn(2, 4)
    with HandHooks({"lin": model.lin}) as ref:
        model(x)
    with hs.capture(model, "lin") as cap:
        model(x)
    assert len(cap["lin"].calls) == len(ref.records["lin"]) == 4
    for got, exp in zip(cap["lin"], ref.records["lin"]):
        assert torch.equal(got.output, exp.output)


def test_shared_alias_module_is_one_layer_called_twice() -> None:
    model, (x,), _ = ZOO["shared_alias"].build()
    assert "again" not in hs.names(model)  # like named_modules(): first name only
    with HandHooks({"first": model.first}) as ref:
        model(x)
    with hs.capture(model, model.again) as cap:
        model(x)
    assert list(cap) == ["first"]
    for got, exp in zip(cap["first"], ref.records["first"], strict=True):
        assert torch.equal(got.output, exp.output)


def test_direct_forward_call_is_reported_as_never_run() -> None:
    model, (x,), _ = ZOO["direct_forward"].build()
    with HandHooks({"sub.lin": model.sub.lin}) as ref:
        model(x)
    with hs.capture(model, ["sub", "sub.lin"]) as cap:
        model(x)
    assert cap["sub"].calls == [] and cap["sub"].count == 0
    with pytest.raises(hs.CaptureError, match=r"'sub'.*has not run"):
        _ = cap["sub"].output
    assert torch.equal(cap["sub.lin"].output, ref.records["sub.lin"][0].output)


# ---------------------------------------------------------------------------------------
# (e) a model that raises mid-forward
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("options", [{}, {"inputs": True, "grads": True}], ids=["plain", "grads"])
def test_raising_model_propagates_and_cleans_up(options: dict[str, Any]) -> None:
    model, (x,), _ = ZOO["raises"].build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref, pytest.raises(ZooError):
        model(x)
    with pytest.raises(ZooError, match="boom after b") as info:
        with hs.capture(model, ["a", "b", "c"], **options) as cap:
            model(x)
    assert type(info.value) is ZooError
    assert any("'b'" in note for note in getattr(info.value, "__notes__", []))
    assert hooks_left(model) == 0
    for name in ("a", "b"):
        assert torch.equal(cap[name].only().output, ref.records[name][0].output)
    with pytest.raises(hs.CaptureError, match="has not run"):
        _ = cap["c"].output
    # the same model captures normally afterwards (no stale per-call state)
    with pytest.raises(ZooError), hs.capture(model, ["a", "b"], **options) as again:
        model(x)
    assert again["a"].count == 1 and torch.equal(again["a"].output, ref.records["a"][0].output)


# ---------------------------------------------------------------------------------------
# (f) selection on the zoo
# ---------------------------------------------------------------------------------------
def _deep() -> tuple[nn.Module, tuple[Any, ...]]:
    model, args, _ = ZOO["deep_nesting"].build()
    return model, args


DEEP_NAMES = list(layer_modules(_deep()[0]))


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("blocks.enc.*.0", ["blocks.enc.0.0", "blocks.enc.1.0"]),
        ("blocks.*.*.0", ["blocks.enc.0.0", "blocks.enc.1.0", "blocks.dec.0.0"]),
        (
            "blocks.**.0",
            [n for n in DEEP_NAMES if n.startswith("blocks.") and n.split(".")[-1] == "0"],
        ),
        ("blocks.enc.1.2.0", ["blocks.enc.1.2.0"]),
        (
            re.compile(r"blocks\.enc\.\d\.\d"),
            [f"blocks.enc.{i}.{j}" for i in range(2) for j in range(3)],
        ),
        (nn.Tanh, ["blocks.enc.0.1", "blocks.enc.1.1"]),
        (
            nn.Linear,
            [
                "blocks.enc.0.0",
                "blocks.enc.0.2.0",
                "blocks.enc.1.0",
                "blocks.enc.1.2.0",
                "blocks.dec.0.0",
            ],
        ),
        (
            lambda m: isinstance(m, nn.Sequential) and len(m) == 1,
            ["blocks.enc.0.2", "blocks.enc.1.2", "blocks.dec.0"],
        ),
        (
            lambda name, m: name.endswith(".2") and isinstance(m, nn.Sequential),
            ["blocks.enc.0.2", "blocks.enc.1.2"],
        ),
        (
            ["blocks.dec.0.0", nn.Tanh, "blocks.enc.0.1", re.compile(r"blocks\.enc\.0\.0")],
            ["blocks.dec.0.0", "blocks.enc.0.1", "blocks.enc.1.1", "blocks.enc.0.0"],
        ),
    ],
    ids=[
        "glob-segment",
        "glob-two-segments",
        "glob-doublestar",
        "exact",
        "regex",
        "type-tanh",
        "type-linear",
        "predicate-module",
        "predicate-name-module",
        "list-mixed",
    ],
)
def test_selectors_on_deep_nesting(selector: Any, expected: list[str]) -> None:
    model, args = _deep()
    mods = layer_modules(model)
    assert set(expected) <= set(mods)
    with HandHooks({n: mods[n] for n in expected}) as ref:
        model(*args)
    with hs.capture(model, selector) as cap:
        model(*args)
    assert list(cap) == expected
    for name in expected:
        assert torch.equal(cap[name].output, ref.records[name][0].output)
    assert list(hs.names(model, selector)) == [n for n in mods if n in expected]


def test_module_object_selector_on_deep_nesting() -> None:
    model, args = _deep()
    target = model.blocks["enc"][1][2][0]
    with HandHooks({"blocks.enc.1.2.0": target}) as ref:
        model(*args)
    with hs.capture(model, [target, model.blocks["dec"][0]]) as cap:
        model(*args)
    assert list(cap) == ["blocks.enc.1.2.0", "blocks.dec.0"]
    assert torch.equal(cap["blocks.enc.1.2.0"].output, ref.records["blocks.enc.1.2.0"][0].output)
    # a ModuleDict / ModuleList is never called itself: refused up front, pointing at children
    with pytest.raises(hs.UsageError, match=r"'blocks\.dec' is a ModuleList.*'blocks\.dec\.0'"):
        hs.capture(model, model.blocks["dec"])


@pytest.mark.parametrize(
    ("entry_name", "selector", "pattern"),
    [
        ("alexnet", "feature.0", r"'feature\.0'.*'features\.0'"),
        ("alexnet", "classifer.4", r"'classifer\.4'.*'classifier\.4'"),
        ("alexnet", nn.LSTM, r"'LSTM'"),
        ("alexnet", re.compile(r"feature\.\d"), r"feature\\\\?\.\\\\?d.*whole name"),
        ("deep_nesting", "blocks*0", r"'blocks\*0'.*'\*\*'"),
        ("deep_nesting", "blocks.enc.0.3", r"'blocks\.enc\.0\.3'.*'blocks\.enc\.0\.\d'"),
        ("data_parallel", "module.featurs", r"featurs.*'features'"),
        ("compiled", "_orig_mod.3", r"'_orig_mod\.3'"),
    ],
)
def test_selection_miss_names_selector_and_close_match(
    entry_name: str, selector: Any, pattern: str
) -> None:
    model, _, _ = ZOO[entry_name].build()
    with pytest.raises(hs.LayerNotFoundError, match=pattern):
        hs.capture(model, selector)  # raises at once: before any forward, no hooks added
    assert hooks_left(model) == 0
    with pytest.raises(LookupError):
        hs.names(model, selector)


def test_foreign_module_selector_is_rejected() -> None:
    model, _, _ = ZOO["alexnet"].build()
    with pytest.raises(hs.LayerNotFoundError, match="not part of this"):
        hs.capture(model, nn.Linear(2, 2))


@pytest.mark.parametrize("entry_name", ["data_parallel", "compiled"])
def test_wrapped_names_work_with_and_without_prefix(entry_name: str) -> None:
    entry = ZOO[entry_name]
    model, args, kwargs = entry.build()
    prefix = "module." if entry.wrapper == "dp" else "_orig_mod."
    expected = {n: type(m).__name__ for n, m in unwrap(model).named_modules() if n}
    assert hs.names(model) == expected
    plain, wrapped = entry.layers[0], prefix + entry.layers[-1]
    with HandHooks(layer_modules(model)) as ref:
        eager(entry, model)(*args, **kwargs)
    with hs.capture(model, [plain, wrapped]) as cap:
        model(*args, **kwargs)
    assert list(cap) == [plain, entry.layers[-1]]
    assert cap[prefix + plain] is cap[plain]
    assert cap[wrapped] is cap[entry.layers[-1]]
    assert prefix + plain in cap
    for name in (plain, entry.layers[-1]):
        assert torch.equal(cap[name].output, ref.records[name][0].output)


def test_double_wrapping_names() -> None:
    base, _, _ = ZOO["deep_nesting"].build()
    expected = {n: listed_type(m) for n, m in base.named_modules() if n}
    assert hs.names(nn.DataParallel(torch.compile(base, backend="eager"))) == expected
    assert hs.names(torch.compile(nn.DataParallel(base), backend="eager")) == expected


# ---------------------------------------------------------------------------------------
# torch.compile specifics
# ---------------------------------------------------------------------------------------
def test_compiled_model_that_ran_needs_recompile_and_hooks_go_away() -> None:
    entry = ZOO["compiled"]
    model, (x,), _ = entry.build()
    mods = layer_modules(model)
    with HandHooks(mods) as ref:
        expected = unwrap(model)(x)  # eager reference, before the compiled model runs
    assert torch.equal(model(x), expected)  # now it has run compiled
    with pytest.raises(hs.CompiledModelError, match="recompile=True"):
        hs.capture(model, "0").open()
    assert hooks_left(model) == 0
    with hs.capture(model, ["0", "2"], recompile=True) as cap:
        assert torch.equal(model(x), expected)
    assert torch.equal(cap["0"].output, ref.records["0"][0].output)
    assert torch.equal(cap["2"].output, ref.records["2"][0].output)
    # after the capture closed: no more records, same output
    assert torch.equal(model(x), expected)
    assert cap["0"].count == 1 and cap["2"].count == 1


# ---------------------------------------------------------------------------------------
# hs.features and hs.edit over the zoo
# ---------------------------------------------------------------------------------------
def feature_inputs(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """What ``features`` takes: a tensor, a tuple of positional args, or keyword args."""
    if kwargs:
        assert not args
        return kwargs
    return args[0] if len(args) == 1 else args


def other_inputs(
    args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Different inputs of the same shapes (float: affine change; ids: reversed along every
    dim, so that a model pooling over the sequence still sees other ids per sample)."""

    def change(t: Tensor) -> Tensor:
        return t * -0.5 + 0.3 if t.is_floating_point() else t.flip(list(range(t.dim())))

    return tree_map(change, args), tree_map(change, kwargs)


def _once(entry: ZooEntry) -> list[str]:
    return [n for n in entry.layers if n not in entry.reused and n not in entry.not_run]


@pytest.mark.parametrize("entry", zoo_params(lambda e: bool(_once(e))))
def test_features_match_eval_no_grad_reference(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    wanted = _once(entry)
    flags = [(m, m.training) for m in model.modules()]
    for m in model.modules():
        m.training = False
    try:
        with torch.no_grad(), HandHooks({n: mods[n] for n in wanted}) as ref:
            forward(entry, eager(entry, model), args, kwargs)
    finally:
        for m, flag in flags:
            m.training = flag
    buffers = {n: b.clone() for n, b in model.named_buffers()}
    if entry.wrapper:  # snapshot the unwrapped root now; see test_features_notifies_root...
        hs.capture(model, wanted).open().close()

    feats = hs.features(model, feature_inputs(args, kwargs), wanted)

    assert list(feats) == wanted
    for name in wanted:
        assert_same_tree(feats[name], ref.records[name][0].output, where=name)
        assert not any(t.requires_grad for _, t in tree_leaves(feats[name]))
    assert [m.training for m in model.modules()] == [flag for _, flag in flags]
    for n, b in model.named_buffers():  # eval mode: BatchNorm statistics untouched
        assert torch.equal(b, buffers[n]), n


@pytest.mark.parametrize(("entry_name", "layer"), [("reused", "fc"), ("gru_cell_loop", "cell")])
def test_features_of_layer_run_several_times(entry_name: str, layer: str) -> None:
    """Early stop (default) ends the forward after the first call, which is what it returns;
    a full forward (stop=False) sees every call and refuses to pick one."""
    model, args, kwargs = ZOO[entry_name].build()
    model.eval()
    with torch.no_grad(), HandHooks({layer: layer_modules(model)[layer]}) as ref:
        model(*args, **kwargs)
    assert len(ref.records[layer]) > 1
    first = hs.features(model, feature_inputs(args, kwargs), [layer])[layer]
    assert_same_tree(first, ref.records[layer][0].output)
    with pytest.raises(hs.CaptureError, match="times"):
        hs.features(model, feature_inputs(args, kwargs), [layer], stop=False)


def test_features_of_layer_that_never_runs_raises() -> None:
    model, args, kwargs = ZOO["direct_forward"].build()
    with pytest.raises(hs.CaptureError, match=r"'sub'.*did not run"):
        hs.features(model, feature_inputs(args, kwargs), ["sub.lin", "sub"])


def _with(fn: Callable[..., Any], module: nn.Module, run: Callable[[], Any]) -> Any:
    handle = module.register_forward_hook(fn)
    try:
        return run()
    finally:
        handle.remove()


@pytest.mark.parametrize("entry", zoo_params(lambda e: e.raises is None))
def test_noop_edit_is_bit_identical(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    expected = eager(entry, model)(*args, **kwargs)
    every = list(layer_modules(model))
    with hs.edit(model, {n: hs.transform(torch.clone, at="*") for n in every}):
        actual = model(*args, **kwargs)
    assert_same_tree(actual, expected, where="model output")


@pytest.mark.parametrize("entry", zoo_params(lambda e: e.raises is None))
def test_ablate_matches_hand_hook(entry: ZooEntry) -> None:
    model, args, kwargs = entry.build()
    mods = layer_modules(model)
    recompile = entry.wrapper == "compile"
    for layer in entry.layers:

        def zero(m: nn.Module, a: Any, out: Any) -> Any:
            return tree_map(torch.zeros_like, out)

        want = _with(zero, mods[layer], lambda: eager(entry, model)(*args, **kwargs))
        ablate = hs.ablate(at="*") if layer in entry.nested else hs.ablate()
        with hs.edit(model, {layer: ablate}, recompile=recompile) as ed:
            got = model(*args, **kwargs)
        assert_same_tree(got, want, where=f"ablate {layer}")
        if layer not in entry.nested:
            assert ed.applied[layer] == entry.reused.get(layer, 0 if layer in entry.not_run else 1)


@pytest.mark.parametrize("entry", zoo_params(lambda e: e.raises is None))
def test_patch_matches_hand_hooks(entry: ZooEntry) -> None:
    """Activation patching: every interesting layer gets, call by call, the output it had
    for other inputs."""
    model, args, kwargs = entry.build()
    args2, kwargs2 = other_inputs(args, kwargs)
    mods = {n: layer_modules(model)[n] for n in entry.layers}
    with HandHooks(mods) as source:
        eager(entry, model)(*args2, **kwargs2)
    counters = dict.fromkeys(mods, 0)

    def patched(name: str) -> Callable[..., Any]:
        def hook(m: nn.Module, a: Any, out: Any) -> Any:
            k, counters[name] = counters[name], counters[name] + 1
            return tree_map(torch.clone, source.records[name][k].output)

        return hook

    handles = [m.register_forward_hook(patched(n)) for n, m in mods.items()]
    try:
        want = eager(entry, model)(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    plain = eager(entry, model)(*args, **kwargs)

    recompile = entry.wrapper == "compile"
    with hs.capture(model, list(mods)) as cap:
        model(*args2, **kwargs2)
    edits = {n: hs.patch(cap, at="*") if n in entry.nested else hs.patch(cap) for n in mods}
    with hs.edit(model, edits, recompile=recompile):
        got = model(*args, **kwargs)
    assert_same_tree(got, want, where="patched output")
    if any(source.records[n] for n in mods):
        assert not all(
            torch.equal(a, b) for (_, a), (_, b) in zip(tree_leaves(got), tree_leaves(plain))
        )


def test_edit_input_by_name_on_kwargs_only_block() -> None:
    model, args, kwargs = ZOO["kwargs_only"].build()
    with hs.edit(model, {"block": hs.replace(0.0, on="input", at="mask")}):
        out = model(*args, **kwargs)
    # block output is lin(h) * 0, so the model output is the head's bias everywhere
    assert torch.equal(out, model.head.bias.expand_as(out))
