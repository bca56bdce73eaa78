"""Activation checkpointing: a segment recomputed in backward is the same calls again.

Oracle: the same model without checkpointing (same weights, same inputs), observed by the
same hookscope session kind; plus hand-written hooks counting calls. Both
``use_reentrant=False`` (backward runs through the first run's graph) and ``True`` (the first
run is under no_grad; backward runs through the replay's graph) are covered, with a block
reused across segments, nested checkpoints and Hugging Face's gradient checkpointing."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs

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


def loss(out: Tensor) -> Tensor:
    return (out * torch.arange(1.0, 5.0)).pow(2).sum()


def param_grads(model: nn.Module) -> list[Tensor]:
    """Parameter gradients (a missing one as zeros: reentrant checkpoints give zeros where a
    plain backward gives None), then reset."""
    out = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


def plain(net: Net) -> Net:
    ref = copy.deepcopy(net)
    ref.reentrant = None
    return ref


@REENTRANT
@pytest.mark.parametrize("shared", [False, True], ids=["three-blocks", "one-block-thrice"])
def test_capture_records_each_call_once_with_its_gradients(reentrant: bool, shared: bool) -> None:
    net = Net(reentrant, shared)
    ref = plain(net)
    x = torch.randn(2, 4, requires_grad=True)
    layers = ["blocks.1.a", "blocks.1"]
    with hs.capture(ref, layers, grads=True, inputs=True) as want:
        loss(ref(x)).backward()
    with hs.capture(net, layers, grads=True, inputs=True) as got:
        loss(net(x)).backward()
    for name in layers:
        calls = 3 if shared else 1
        assert len(got[name].calls) == got[name].count == calls, name
        for a, b in zip(got[name].calls, want[name].calls, strict=True):
            torch.testing.assert_close(a.output, b.output)
            torch.testing.assert_close(a.input, b.input)
            torch.testing.assert_close(a.grad, b.grad)
            torch.testing.assert_close(a.grad_input, b.grad_input)


@REENTRANT
def test_nested_checkpoints(reentrant: bool) -> None:
    net = Net(reentrant, shared=True)
    block = net.blocks[0]

    def inner_outer(x: Tensor) -> Tensor:
        return checkpoint(block, block(x), use_reentrant=reentrant)

    x = torch.randn(2, 4, requires_grad=True)
    with hs.capture(net, "blocks.0.a", grads=True) as want:
        loss(block(block(x))).backward()
    with pytest.warns(UserWarning, match="None of the inputs") if reentrant else _nothing():
        with hs.capture(net, "blocks.0.a", grads=True) as got:
            loss(checkpoint(inner_outer, x, use_reentrant=reentrant)).backward()
    assert got["blocks.0.a"].count == 2
    for a, b in zip(got["blocks.0.a"].calls, want["blocks.0.a"].calls, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


EDITS: dict[str, Callable[[hs.Capture], dict[str, hs.Edit]]] = {
    "patch": lambda src: {"blocks.1.a": hs.patch(src)},
    "add": lambda src: {"blocks.1.b": hs.add(torch.ones(4))},
    "grad": lambda src: {"blocks.2.a": hs.scale(2.0, on="grad")},
    "input_grad": lambda src: {"blocks.1.a": hs.scale(3.0, on="input_grad")},
}


@REENTRANT
@pytest.mark.parametrize("kind", list(EDITS))
@pytest.mark.mutates_model  # the point is the gradients the edits leave on the parameters
def test_edits_apply_once_per_call_and_match_no_checkpointing(reentrant: bool, kind: str) -> None:
    net = Net(reentrant)
    ref = plain(net)
    x = torch.randn(2, 4, requires_grad=True)
    with hs.capture(ref, "blocks.1.a") as src:
        ref(torch.randn(2, 4))
    edits = EDITS[kind](src)
    with hs.edit(ref, edits) as want:
        want_out = ref(x)
        loss(want_out).backward()
    with hs.edit(net, edits) as got:
        got_out = net(x)
        loss(got_out).backward()
    torch.testing.assert_close(got_out, want_out)
    for a, b in zip(param_grads(net), param_grads(ref), strict=True):
        torch.testing.assert_close(a, b)
    assert got.applied == want.applied == {next(iter(edits)): 1}


def test_whole_model_checkpointed_keeps_its_pass() -> None:
    """The replay of a checkpointed root is not a new forward: keep='pass' keeps the calls."""
    net = Net(None)
    x = torch.randn(2, 4, requires_grad=True)
    with hs.capture(net, "blocks.0.a", grads=True) as cap:
        loss(checkpoint(net, x, use_reentrant=False)).backward()
    assert cap["blocks.0.a"].count == 1
    assert cap["blocks.0.a"].grad.shape == (2, 4)


@pytest.mark.hf
@REENTRANT
@pytest.mark.mutates_model
def test_hugging_face_gradient_checkpointing(reentrant: bool) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16, bos_token_id=0,
        eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(config).train()
    net = copy.deepcopy(ref)
    kwargs = {"use_reentrant": reentrant}
    if hasattr(net, "activation_checkpointing_enable"):  # the new name (transformers 5)
        net.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        net.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    ids = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))
    layers = ["transformer.h.0.mlp.c_fc", "transformer.h.1.attn", "transformer.h.1"]
    results = []
    for model in (ref, net):
        with hs.capture(model, layers, grads=True) as cap:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        results.append(cap)
        model.zero_grad(set_to_none=True)
    for name in layers:
        assert results[1][name].count == 1, name
        torch.testing.assert_close(results[1][name].grad, results[0][name].grad)
    with hs.capture(ref, "transformer.h.0.mlp") as src:
        ref(input_ids=torch.randint(0, 100, (2, 8)), use_cache=False)
    edits = {
        "transformer.h.0.mlp": hs.patch(src),
        "transformer.h.1.mlp.c_proj": hs.scale(0.5, on="grad"),
    }
    for model in (ref, net):
        with hs.edit(model, edits) as editor:
            model(input_ids=ids, use_cache=False).logits.sum().backward()
        assert editor.applied == {"transformer.h.0.mlp": 1, "transformer.h.1.mlp.c_proj": 1}
    for a, b in zip(param_grads(net), param_grads(ref), strict=True):
        torch.testing.assert_close(a, b)
