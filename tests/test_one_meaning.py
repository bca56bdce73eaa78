"""One meaning per word, one resolver, one reducer: the same selector and the same ``reduce=``
mean the same thing to every entry point.

Oracles are hand-written: a mean over the tokens an ``attention_mask`` keeps, plain forward
hooks and ``torch.autograd``; the entry points are compared with each other only where the
point is that they agree (``features`` and ``extract`` give the same rows bit for bit).
"""

from __future__ import annotations

import pathlib

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


class Encoder(nn.Module):
    """A token model with a tokenizer's keyword interface; its padding rows are not zero, so a
    mean that counted them would differ."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        h = self.mix(self.embed(input_ids)).tanh()
        h = h + attention_mask[..., None].to(h.dtype)  # the mask shapes what comes out
        return torch.softmax(self.head(h), dim=-1)


def padded_batch() -> dict[str, Tensor]:
    """A 2 x 4 batch: the second sample has two real tokens and two of padding."""
    return {
        "input_ids": torch.tensor([[3, 5, 7, 9], [4, 6, 0, 0]]),
        "attention_mask": torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]]),
    }


def masked_mean(t: Tensor, mask: Tensor) -> Tensor:
    """Each sample's mean over its real tokens, written out."""
    rows = [t[i, mask[i].bool()].mean(dim=0) for i in range(len(t))]
    return torch.stack(rows)


def test_token_mean_counts_only_real_tokens_in_capture_and_features() -> None:
    model, batch = Encoder(), padded_batch()
    with torch.no_grad():
        hidden = model.mix(model.embed(batch["input_ids"]))
    want = masked_mean(hidden, batch["attention_mask"])
    assert not torch.allclose(want, hidden.mean(dim=1), atol=1e-3)  # padding would move it
    got = hs.features(model, batch, "mix", reduce="token_mean")["mix"]
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    with torch.no_grad(), hs.capture(model, "mix", reduce="token_mean") as cap:
        model(**batch)
    assert torch.equal(cap["mix"].output, got)
    with torch.no_grad(), hs.capture(model, "mix", reduce="token_mean") as cap:
        model.mix(model.embed(batch["input_ids"]))  # a layer called outside a forward: no mask
    torch.testing.assert_close(cap["mix"].output, hidden.mean(dim=1), rtol=1e-6, atol=1e-6)


def test_features_and_extract_give_the_same_rows_bit_for_bit(tmp_path: pathlib.Path) -> None:
    model, batch = Encoder(), padded_batch()
    for reduce in ("token_mean", "spatial_mean", None):
        feats = hs.features(model, batch, ["mix", "::softmax"], reduce=reduce)
        store = hs.extract(
            model, iter([batch]), ["mix", "::softmax"], out=tmp_path / str(reduce), reduce=reduce
        )
        for name, value in feats.items():
            assert torch.equal(torch.from_numpy(store[name][:]), value), (reduce, name)


def test_extract_takes_operation_sites(tmp_path: pathlib.Path) -> None:
    """``"layer::op"`` is understood by extract as by capture: the softmax inside the model's
    own forward, against a hand computation."""
    model, batch = Encoder(), padded_batch()
    with torch.no_grad():
        h = model.mix(model.embed(batch["input_ids"])).tanh()
        want = torch.softmax(model.head(h + batch["attention_mask"][..., None]), dim=-1)
    store = hs.extract(model, iter([batch]), ["::softmax"], out=tmp_path / "s")
    torch.testing.assert_close(torch.from_numpy(store["::softmax"][:]), want, rtol=0, atol=0)


def test_monitor_takes_operation_sites() -> None:
    model, batch = Encoder(), padded_batch()
    with hs.Monitor(model, ["mix", "::softmax"], every=1) as mon:
        out = model(**batch)
        out.pow(2).sum().backward()
        mon.step()
    by = {(r["layer"], r["kind"]): r for r in mon.records}
    with torch.no_grad():
        h = model.mix(model.embed(batch["input_ids"])).tanh()
        soft = torch.softmax(model.head(h + batch["attention_mask"][..., None]), dim=-1)
    assert by["::softmax", "activation"]["norm"] == pytest.approx(float(soft.norm()), rel=1e-5)
    assert ("::softmax", "gradient") in by
    assert ("mix", "activation") in by


@pytest.mark.parametrize(
    ("call", "why"),
    [
        (lambda m: hs.GradCAM(m, "head::softmax"), "layer must be a module"),
        (lambda m: hs.nonfinite(m, allow="head::softmax").__enter__(), "allow the layer"),
        (lambda m: hs.names(m, "head::softmax"), "ops=True"),
        (lambda m: hs.feature_grids(m, padded_batch(), "head::softmax"), "select the module"),
    ],
)
def test_entry_points_that_cannot_hook_an_operation_say_why(call: object, why: str) -> None:
    with pytest.raises(hs.UsageError, match=rf"selects an operation inside a layer: .*{why}"):
        call(Encoder())  # type: ignore[operator]


def test_capture_and_edit_are_their_session_classes() -> None:
    """``hs.capture`` and ``hs.edit`` are named for ``with``; they are the classes."""
    assert hs.capture is hs.Capture and hs.edit is hs.Editor
    model = nn.Sequential(nn.Linear(2, 2))
    assert isinstance(hs.edit(model, {"0": hs.ablate()}), hs.Editor)


def test_a_gradient_hook_installs_when_its_block_opens_like_every_session() -> None:
    x = torch.tensor(2.0, requires_grad=True)
    z = x * 3
    hook = hs.grad_of(z)
    (z * z).backward(retain_graph=True)  # before the block: not hooked
    with pytest.raises(hs.GradientUnavailableError, match="never installed"):
        hook.grad  # noqa: B018
    with hook:
        (z * z).backward()
    assert hook.grad == 12.0 and hook.count == 1
