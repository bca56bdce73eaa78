"""``hs.logit_lens`` refusals and a hand-computed lens on a small model (TransformerLens is the
oracle on GPT-2 and Llama in ``tests/test_units_transformer_lens.py``)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


class Stack(nn.Module):
    """(N, T) ids -> logits through two residual blocks, a final LayerNorm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(9, 6)
        self.blocks = nn.ModuleList([nn.Linear(6, 6) for _ in range(2)])
        self.outs = nn.ModuleList([nn.Identity() for _ in range(2)])
        self.norm = nn.LayerNorm(6)
        self.head = nn.Linear(6, 9)
        self.act = nn.Tanh()

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        for block, out in zip(self.blocks, self.outs, strict=True):
            h = out(h + self.act(block(h)))
        return self.head(self.norm(h))


def _model() -> Stack:
    torch.manual_seed(0)
    model = Stack().eval()
    with torch.no_grad():
        model.norm.weight.uniform_(0.5, 1.5)
        model.norm.bias.uniform_(-0.5, 0.5)
    return model


IDS = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
LAYERS = ["embed", "outs.0", "outs.1"]


def test_both_scales_by_hand() -> None:
    model = _model()
    streams = []
    hooks = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o: streams.append(o))
        for n in LAYERS
    ]
    with torch.no_grad():
        logits = model(IDS)
    for h in hooks:
        h.remove()
    final = streams[-1]
    s = (final.var(-1, unbiased=False, keepdim=True) + model.norm.eps).sqrt()
    w, b = model.norm.weight, model.norm.bias
    with torch.no_grad():
        own = torch.stack([model.head(model.norm(r)) for r in streams])
        frozen = torch.stack(
            [model.head((r - r.mean(-1, keepdim=True)) / s * w + b) for r in streams]
        )
    got = hs.logit_lens(model, IDS, LAYERS, norm="norm", unembed="head")
    torch.testing.assert_close(got.logits, own, rtol=1e-6, atol=1e-6)
    got = hs.logit_lens(model, IDS, LAYERS, norm="norm", unembed="head", scale="frozen")
    torch.testing.assert_close(got.logits, frozen, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got.logits[-1], logits, rtol=1e-6, atol=1e-6)
    assert (own[0] - frozen[0]).abs().max() > 1e-2


def test_refusals_name_the_problem() -> None:
    model = _model()
    with pytest.raises(hs.UsageError, match="scale must be 'own' or 'frozen'"):
        hs.logit_lens(model, IDS, LAYERS, norm="norm", unembed="head", scale="mine")  # type: ignore[arg-type]
    with pytest.raises(hs.UsageError, match="no module 'ln_f'"):
        hs.logit_lens(model, IDS, LAYERS, norm="ln_f", unembed="head")
    with pytest.raises(hs.UsageError, match="must be a LayerNorm or an RMSNorm"):
        hs.logit_lens(model, IDS, LAYERS, norm="act", unembed="head", scale="frozen")
    with pytest.raises(hs.UsageError, match="choose layers whose output is the residual stream"):
        hs.logit_lens(model, IDS, ["head"], norm="norm", unembed="head")
    with pytest.raises(hs.UsageError, match=r"out of range for its 4 positions"):
        hs.logit_lens(model, IDS, LAYERS, norm="norm", unembed="head", positions=[4])


class Padded(Stack):
    """A Stack that takes a tokenizer's ``attention_mask`` (the lens reads "last" from it)."""

    def forward(self, ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return super().forward(ids)


def _by_hand(model: Stack, at: list[list[int]], frozen: bool) -> Tensor:
    """The lens written with plain forward hooks, the final norm and the head applied by hand
    at ``at[i]``, the positions of sample ``i``: ``(layers, batch, len(at[0]), vocabulary)``."""
    streams: list[Tensor] = []
    hooks = [
        model.get_submodule(n).register_forward_hook(lambda m, a, o: streams.append(o))
        for n in LAYERS
    ]
    with torch.no_grad():
        model(IDS)
    for h in hooks:
        h.remove()
    rows = torch.tensor(at)
    picked = [r[torch.arange(2)[:, None], rows] for r in streams]
    final = picked[-1]
    s = (final.var(-1, unbiased=False, keepdim=True) + model.norm.eps).sqrt()
    w, b = model.norm.weight, model.norm.bias
    with torch.no_grad():
        if frozen:
            return torch.stack(
                [model.head((r - r.mean(-1, keepdim=True)) / s * w + b) for r in picked]
            )
        return torch.stack([model.head(model.norm(r)) for r in picked])


RIGHT = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])  # last real tokens: 2 and 3
LEFT = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])  # 3 and 3


@pytest.mark.parametrize("scale", ["own", "frozen"])
@pytest.mark.parametrize(
    ("positions", "mask", "at"),
    [
        (1, RIGHT, [[1], [1]]),
        (-1, LEFT, [[3], [3]]),
        ([-1, 0, 2], RIGHT, [[3, 0, 2], [3, 0, 2]]),
        ("last", RIGHT, [[2], [3]]),
        ("last", LEFT, [[3], [3]]),
        ("last", None, [[3], [3]]),  # no mask: every token is real
    ],
)
def test_positions_as_capture_takes_them_by_hand(
    positions: int | list[int] | str, mask: Tensor | None, at: list[list[int]], scale: str
) -> None:
    model = Padded().eval()
    model.load_state_dict(_model().state_dict())
    inputs = {"ids": IDS} if mask is None else {"ids": IDS, "attention_mask": mask}
    lens = hs.logit_lens(
        model,
        inputs,
        LAYERS,
        norm="norm",
        unembed="head",
        positions=positions,
        scale=scale,  # type: ignore[arg-type]
    )
    torch.testing.assert_close(
        lens.logits, _by_hand(model, at, scale == "frozen"), rtol=1e-6, atol=1e-6
    )
    assert lens.index is not None and lens.index.tolist() == at
    assert lens.positions == tuple(at[0])


def test_last_reads_a_positional_mask_and_labels_each_sample_by_its_own() -> None:
    model = Padded().eval()
    model.load_state_dict(_model().state_dict())
    lens = hs.logit_lens(model, (IDS, RIGHT), LAYERS, norm="norm", unembed="head", positions="last")
    torch.testing.assert_close(
        lens.logits, _by_hand(model, [[2], [3]], False), rtol=1e-6, atol=1e-6
    )
    assert "2 'c'" in lens.to_text(str, tokens=list("abcd"), sample=0)
    assert "3 'd'" in lens.to_text(str, tokens=list("abcd"), sample=1)


@pytest.mark.parametrize(
    ("positions", "match"),
    [
        ("first", "give an index, a list of indices"),
        ([1, 1], "names an index twice"),
        ([], "non-empty list"),
        (True, "give an int or a non-empty list"),
        (-5, "out of range for its 4 positions"),
    ],
)
def test_positions_refused_as_capture_refuses_them(positions: object, match: str) -> None:
    with pytest.raises(hs.UsageError, match=match):
        hs.logit_lens(_model(), IDS, LAYERS, norm="norm", unembed="head", positions=positions)  # type: ignore[arg-type]


def test_last_refuses_a_sample_without_a_real_token() -> None:
    model = Padded().eval()
    inputs = {"ids": IDS, "attention_mask": torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])}
    with pytest.raises(hs.UsageError, match="keeps none of this call's positions"):
        hs.logit_lens(model, inputs, LAYERS, norm="norm", unembed="head", positions="last")


def test_a_session_open_on_the_model_sees_the_forward_only() -> None:
    """The lens applies the norm and the head to each layer's stream after the forward: those
    are not calls of the model, and a capture the user holds open records one call of each
    (it recorded one more per layer)."""
    model = _model()
    with hs.capture(model, ["norm", "head"]) as outer:
        hs.logit_lens(model, IDS, LAYERS, norm="norm", unembed="head", scale="frozen")
    assert outer["norm"].count == 1 and outer["head"].count == 1
