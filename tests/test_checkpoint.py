"""Activation checkpointing: a segment recomputed in backward is the same calls again.

Oracles, all on the same model *without* checkpointing (same weights, same inputs) and never
through hookscope: hand-written forward hooks for values and call counts, the zoo's autograd
references for gradients, and edits written by hand as hooks. Both ``use_reentrant=False``
(backward runs through the first run's graph) and ``True`` (the first run is under no_grad;
backward runs through the replay's graph) are covered, with a block reused across segments,
nested checkpoints and Hugging Face's gradient checkpointing."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs
from zoo import HandHooks, make_loss, reference_input_grads, reference_output_grads, tree_leaves

REENTRANT = pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.b(torch.tanh(self.a(x)))


class Net(nn.Module):
    """Three blocks, each checkpointed (``reentrant=None``: no checkpointing), or one block
    applied three times when ``shared``."""

    def __init__(self, reentrant: bool | None, shared: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([Block()] * 3 if shared else [Block() for _ in range(3)])
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            if self.reentrant is None:
                x = block(x)
            else:
                x = checkpoint(block, x, use_reentrant=self.reentrant)
        return x


def plain(net: Net) -> Net:
    ref = copy.deepcopy(net)
    ref.reentrant = None
    return ref


def param_grads(model: nn.Module) -> list[Tensor]:
    """Parameter gradients (a missing one as zeros: reentrant checkpoints give zeros where a
    plain backward gives None), then reset."""
    out = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@REENTRANT
@pytest.mark.parametrize("shared", [False, True], ids=["three-blocks", "one-block-thrice"])
def test_capture_records_each_call_once_with_its_gradients(reentrant: bool, shared: bool) -> None:
    net = Net(reentrant, shared)
    ref = plain(net)
    x = torch.randn(2, 4, requires_grad=True)
    layers = {"blocks.1.a": ref.blocks[1].a, "blocks.1": ref.blocks[1]}
    with HandHooks(layers) as hand:
        ref(x)
    out_grads = reference_output_grads(ref, layers, (x,), {})
    with hs.capture(net, list(layers), grads=True, inputs=True) as got:
        make_loss(net(x)).backward()
    net.zero_grad(set_to_none=True)
    for name, module in layers.items():
        calls = got[name].calls
        assert len(calls) == got[name].count == len(hand.records[name]) == (3 if shared else 1)
        for k, (call, want) in enumerate(zip(calls, hand.records[name], strict=True)):
            torch.testing.assert_close(call.output, want.output)
            torch.testing.assert_close(
                call.input, want.inputs["x" if name == "blocks.1" else "input"]
            )
            torch.testing.assert_close(call.grad, out_grads[name][k][()])
            through = reference_input_grads(ref, module, want.start, (x,), {})
            torch.testing.assert_close(call.grad_input, next(iter(through.values())))


@REENTRANT
def test_nested_checkpoints(reentrant: bool) -> None:
    net = Net(reentrant, shared=True)
    block = net.blocks[0]

    def inner_outer(x: Tensor) -> Tensor:
        return checkpoint(block, block(x), use_reentrant=reentrant)

    class Twice(nn.Module):  # the same computation without checkpointing
        def __init__(self) -> None:
            super().__init__()
            self.block = copy.deepcopy(block)

        def forward(self, x: Tensor) -> Tensor:
            return self.block(self.block(x))

    x = torch.randn(2, 4, requires_grad=True)
    ref = Twice()
    want = reference_output_grads(ref, {"block.a": ref.block.a}, (x,), {})["block.a"]
    warns = pytest.warns(UserWarning, match="None of the inputs") if reentrant else _nothing()
    with warns, hs.capture(net, "blocks.0.a", grads=True) as got:
        make_loss(checkpoint(inner_outer, x, use_reentrant=reentrant)).backward()
    net.zero_grad(set_to_none=True)
    assert got["blocks.0.a"].count == 2
    for call, grads in zip(got["blocks.0.a"].calls, want, strict=True):
        torch.testing.assert_close(call.grad, grads[()])


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


# Each edit as hookscope spells it, and as hooks written by hand on the plain model.
def _patch_by_hand(ref: Net, value: Tensor) -> list[Any]:
    return [ref.blocks[1].a.register_forward_hook(lambda m, a, o: value.clone())]


def _add_by_hand(ref: Net, value: Tensor) -> list[Any]:
    return [ref.blocks[1].b.register_forward_hook(lambda m, a, o: o + torch.ones(4))]


def _grad_by_hand(ref: Net, value: Tensor) -> list[Any]:
    def hook(m: nn.Module, a: Any, o: Tensor) -> None:
        o.register_hook(lambda g: 2.0 * g)

    return [ref.blocks[2].a.register_forward_hook(hook)]


def _input_grad_by_hand(ref: Net, value: Tensor) -> list[Any]:
    def pre(m: nn.Module, a: tuple[Tensor]) -> tuple[Tensor]:
        x = a[0].clone()
        x.register_hook(lambda g: 3.0 * g)
        return (x,)

    return [ref.blocks[1].a.register_forward_pre_hook(pre)]


EDITS: dict[str, tuple[Callable[[hs.Capture], dict[str, hs.Edit]], Callable[..., list[Any]]]] = {
    "patch": (lambda src: {"blocks.1.a": hs.patch(src)}, _patch_by_hand),
    "add": (lambda src: {"blocks.1.b": hs.add(torch.ones(4))}, _add_by_hand),
    "grad": (lambda src: {"blocks.2.a": hs.scale(2.0, on="grad")}, _grad_by_hand),
    "input_grad": (lambda src: {"blocks.1.a": hs.scale(3.0, on="input_grad")}, _input_grad_by_hand),
}


@REENTRANT
@pytest.mark.parametrize("kind", list(EDITS))
def test_edits_apply_once_per_call_and_match_hand_hooks(reentrant: bool, kind: str) -> None:
    net = Net(reentrant)
    ref = plain(net)
    x = torch.randn(2, 4, requires_grad=True)
    other = torch.randn(2, 4)
    with hs.capture(ref, "blocks.1.a") as src:  # the source run needs no checkpointing
        ref(other)
    with torch.no_grad():
        value = ref.blocks[1].a(ref.blocks[0](other))  # the source value, by hand
    make_edits, by_hand = EDITS[kind]
    handles = by_hand(ref, value)
    try:
        want_out = ref(x)
        make_loss(want_out).backward()
    finally:
        for handle in handles:
            handle.remove()
    edits = make_edits(src)
    with hs.edit(net, edits) as editor:
        got_out = net(x)
        make_loss(got_out).backward()
    torch.testing.assert_close(got_out, want_out)
    for a, b in zip(param_grads(net), param_grads(ref), strict=True):
        torch.testing.assert_close(a, b)
    assert editor.applied == {next(iter(edits)): 1}


def test_whole_model_checkpointed_keeps_its_pass() -> None:
    """The replay of a checkpointed root is not a new forward: keep='pass' keeps the calls."""
    net = Net(None)
    x = torch.randn(2, 4, requires_grad=True)
    with hs.capture(net, "blocks.0.a", grads=True) as cap:
        make_loss(checkpoint(net, x, use_reentrant=False)).backward()
    want = reference_output_grads(net, {"blocks.0.a": net.blocks[0].a}, (x,), {})
    net.zero_grad(set_to_none=True)
    assert cap["blocks.0.a"].count == 1
    torch.testing.assert_close(cap["blocks.0.a"].grad, want["blocks.0.a"][0][()])


@pytest.mark.hf
@REENTRANT
def test_hugging_face_gradient_checkpointing(reentrant: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2,
        n_embd=32,
        n_head=2,
        vocab_size=100,
        n_positions=16,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).train()
    net = copy.deepcopy(ref)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(net, "activation_checkpointing_enable"):  # the new name (transformers 5)
        net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    inputs = {"input_ids": torch.randint(0, 100, (2, 8)), "use_cache": False}
    names = ["transformer.h.0.mlp.c_fc", "transformer.h.1.mlp", "transformer.h.1"]
    mods = {n: ref.get_submodule(n) for n in names}
    want = reference_output_grads(ref, mods, (), inputs)
    with hs.capture(net, names, grads=True) as got:
        make_loss(net(**inputs)).backward()
    for name in names:
        assert got[name].count == 1, name
        grads = dict(tree_leaves(got[name].grad))
        assert grads.keys() == {p for p, g in want[name][0].items() if g is not None}, name
        for path, grad in grads.items():
            torch.testing.assert_close(grad, want[name][0][path])

    # a patch from another input, and a gradient edit, written by hand on the plain model
    other = {"input_ids": torch.randint(0, 100, (2, 8)), "use_cache": False}
    with HandHooks({"mlp": ref.transformer.h[0].mlp}) as source:
        ref(**other)
    patched = source.records["mlp"][0].output

    def grad_hook(m: nn.Module, a: Any, o: Tensor) -> None:
        o.register_hook(lambda g: 0.5 * g)

    handles = [
        ref.transformer.h[0].mlp.register_forward_hook(lambda m, a, o: patched.clone()),
        ref.transformer.h[1].mlp.c_proj.register_forward_hook(grad_hook),
    ]
    try:
        make_loss(ref(**inputs)).backward()
    finally:
        for handle in handles:
            handle.remove()
    with hs.capture(ref, "transformer.h.0.mlp") as src:
        ref(**other)
    edits = {
        "transformer.h.0.mlp": hs.patch(src),
        "transformer.h.1.mlp.c_proj": hs.scale(0.5, on="grad"),
    }
    net.zero_grad(set_to_none=True)
    with hs.edit(net, edits) as editor:
        make_loss(net(**inputs)).backward()
    assert editor.applied == {"transformer.h.0.mlp": 1, "transformer.h.1.mlp.c_proj": 1}
    for a, b in zip(param_grads(net), param_grads(ref), strict=True):
        torch.testing.assert_close(a, b)
