"""hs.nonfinite: models built to go non-finite at a known place, in forward and in backward,
compared with what torch.autograd.detect_anomaly says about the same step."""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable

import pytest
import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs


class DivBlock(nn.Module):
    """Divides by a zero it computes itself."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        h = self.lin(x)
        return h / (h - h)


def _div_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.ReLU()),
        nn.Sequential(nn.Linear(4, 4), nn.Tanh()),
        DivBlock(),  # the third block
        nn.Linear(4, 2),
    )


class SqrtNorm(nn.Module):
    """Finite forward (sqrt(0) = 0), infinite derivative at 0 in backward."""

    def forward(self, x: Tensor) -> Tensor:
        return x + torch.sqrt((x - x).pow(2).sum(-1, keepdim=True))


def _sqrt_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh(), SqrtNorm(), nn.Linear(4, 1))


def _anomaly(model: nn.Module, step: Callable[[nn.Module], None]) -> str:
    """What detect_anomaly says about the same step (on a copy), or '' if it says nothing."""
    # detect_anomaly warns that it is on, and again with the forward traceback of the node
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        with torch.autograd.detect_anomaly():
            try:
                step(copy.deepcopy(model))
            except RuntimeError as e:
                return str(e)
    return ""


def _step(x: Tensor) -> Callable[[nn.Module], None]:
    def run(model: nn.Module) -> None:
        model(x).sum().backward()

    return run


def test_forward_division_by_zero_names_block_and_operator() -> None:
    model, x = _div_net(), torch.randn(3, 4)
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        _step(x)(model)
    e = info.value
    assert (e.phase, e.module, e.call, e.op) == ("forward", "2", 1, "aten.div")
    assert e.stats["inputs"]["nan"] == 0 and e.stats["outputs"]["min"] is None
    assert "'2'" in str(e) and "aten.div" in str(e)
    assert isinstance(e, FloatingPointError)
    # detect_anomaly checks backward only: it blames the last Linear's backward
    assert "'AddmmBackward0' returned nan" in _anomaly(model, _step(x))


def test_backward_sqrt_at_zero_names_the_layer() -> None:
    model, x = _sqrt_net(), torch.randn(3, 4)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()  # the forward is finite
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        _step(x)(model)
    e = info.value
    assert (e.phase, e.module, e.call, e.op) == ("backward", "2", 1, "aten.sqrt")
    assert e.stats["gradient in"]["nan"] == e.stats["gradient in"]["posinf"] == 0
    # detect_anomaly looks for NaN only: it names the next node, where -inf * 0 became NaN
    assert "'PowBackward0' returned nan" in _anomaly(model, _step(x))


def test_log_zero_in_the_loss_comes_from_outside() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 1), nn.Sigmoid())
    x = torch.randn(3, 4)

    def step(m: nn.Module) -> None:
        p = m(x)
        (-torch.log(p - p)).mean().backward()  # log(0) in a custom loss

    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        step(model)
    assert (info.value.phase, info.value.module, info.value.op) == ("backward", "<loss>", None)
    assert "comes from the loss" in str(info.value)
    # detect_anomaly blames the model's Sigmoid, where the loss's inf gradient became NaN
    assert "'SigmoidBackward0' returned nan" in _anomaly(model, step)


def test_nan_in_the_input_batch() -> None:
    model, x = _div_net()[:2], torch.randn(3, 4)
    x[1, 2] = float("nan")
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(x)
    assert (info.value.phase, info.value.module) == ("forward", "<input>")
    assert info.value.stats["inputs"]["nan"] == 1


class MaskBuilder(nn.Module):
    def forward(self, n: int) -> Tensor:
        return torch.full((n, n), float("-inf")).triu(1)


class Masked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask = MaskBuilder()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.attn(x, x, x, attn_mask=self.mask(x.shape[1]), need_weights=False)[0]


def test_allowed_minus_inf_masks_raise_nothing() -> None:
    torch.manual_seed(0)
    model, x = Masked(), torch.randn(2, 5, 8)
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(x)
    assert (info.value.module, info.value.op) == ("mask", "aten.full")  # torch.full(-inf)
    with hs.nonfinite(model, allow="mask") as report:
        model(x).sum().backward()
    assert report.ok and report.forwards == report.backwards == 1
    # a -inf mask given as an input
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with pytest.raises(hs.NonFiniteError, match="inputs already hold"), hs.nonfinite(layer):
        layer(x, src_mask=causal)
    with hs.nonfinite(layer, allow="<input>") as report:
        layer(x, src_mask=causal).sum().backward()
    assert report.ok


def test_warn_mode_records_and_goes_on() -> None:
    model, x = _div_net(), torch.randn(3, 4)
    with pytest.warns(RuntimeWarning) as warned, hs.nonfinite(model, mode="warn") as report:  # noqa: PT031
        model(x).sum().backward()
        model(x)
    assert [(f.phase, f.module) for f in report.findings] == [
        ("forward", "2"),
        ("backward", "3"),
        ("forward", "2"),
    ]
    assert "aten.div" in str(warned[0].message) and len(warned) == 3
    assert not report.ok and report.forwards == 2 and report.backwards == 1


@pytest.mark.mutates_model  # the training step moves BatchNorm statistics, as it should
def test_replay_leaves_grads_rng_and_buffers_as_a_plain_step_would() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), SqrtNorm(), nn.Linear(4, 1)
    ).train()
    plain = copy.deepcopy(model)
    x = torch.randn(6, 4)
    torch.manual_seed(1)
    plain(x).sum().backward()
    rng_plain = torch.get_rng_state()
    torch.manual_seed(1)
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(x).sum().backward()
    assert info.value.module == "3" and info.value.phase == "backward"
    assert torch.equal(torch.get_rng_state(), rng_plain)
    for a, b in zip(model.state_dict().values(), plain.state_dict().values(), strict=True):
        assert torch.equal(a, b)  # BatchNorm statistics moved once, as in the plain step
    for a, b in zip(model.parameters(), plain.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=0, equal_nan=True)  # not doubled


def test_gradient_accumulation_checkpointing_and_no_grad() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 1))
    with hs.nonfinite(model) as report:
        for _ in range(3):  # three micro-batches, one optimizer step
            model(torch.randn(2, 4)).sum().backward()
        h = checkpoint(model[0], torch.randn(2, 4, requires_grad=True), use_reentrant=False)
        model[2](model[1](h)).sum().backward()
        with torch.no_grad():
            model(torch.randn(2, 4))
        with torch.inference_mode():
            model(torch.randn(2, 4))
    # forwards: 3 micro-batches, 3 layers called on their own around the checkpoint, 2 more
    assert report.ok and report.forwards == 8 and report.backwards == 4


def test_with_a_capture_open() -> None:
    model, x = _sqrt_net(), torch.randn(3, 4)
    with hs.capture(model, "2", grads=True) as cap:
        with pytest.raises(hs.NonFiniteError), hs.nonfinite(model):
            model(x).sum().backward()
        assert cap["2"].count >= 1


def test_usage_errors() -> None:
    with (
        pytest.raises(hs.UsageError, match="mode must be"),
        hs.nonfinite(nn.Linear(2, 2), mode="log"),
    ):  # type: ignore[arg-type]
        pass
    with pytest.raises(hs.LayerNotFoundError), hs.nonfinite(nn.Linear(2, 2), allow="nope"):
        pass


def test_readme_message_is_the_real_one() -> None:
    """The README shows a real NonFiniteError message: rebuild its step and compare."""
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    section = readme.split("### Finding the first NaN", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {"torch": torch, "nn": nn, "hs": hs, "print": lambda *a: None}
    exec(compile(code, "README.md", "exec"), namespace)
    assert namespace["message"] + "\n" == shown
    # and what the README says detect_anomaly makes of the same step
    torch.manual_seed(0)
    net = copy.deepcopy(namespace["net"])
    assert isinstance(net, nn.Module)
    assert "'AddmmBackward0' returned nan" in _anomaly(net, _step(torch.randn(2, 4)))


class InplaceLog(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sub_(x).log_()  # log(0) in place on its input: same tensor object out


def test_in_place_producer_is_found() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), InplaceLog(), nn.Linear(4, 1))
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(2, 4))
    assert (info.value.module, info.value.op) == ("1", "aten.log_")


@pytest.mark.hf
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_masked_attention_in_gpt2_and_bert_raises_nothing(impl: str) -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    small_gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000)
    small_bert = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=64,
        num_attention_heads=2,
        intermediate_size=128,
        vocab_size=1000,
    )
    for config, cls in (
        (small_gpt2, transformers.GPT2LMHeadModel),
        (small_bert, transformers.BertForMaskedLM),
    ):
        model = cls._from_config(config, attn_implementation=impl).train()
        ids = torch.randint(0, 1000, (2, 10))
        mask = torch.ones(2, 10, dtype=torch.long)
        mask[0, 7:] = 0  # padding: masked attention scores
        with hs.nonfinite(model) as report:
            model(input_ids=ids, attention_mask=mask, labels=ids).loss.backward()
        assert report.ok and report.forwards == report.backwards == 1, cls.__name__


@pytest.mark.mutates_model  # training steps move BatchNorm statistics, as they should
def test_tier_one_reads_the_device_once_per_forward_and_once_per_backward(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Count every Tensor -> host read (item, tolist, bool, cpu, numpy) in clean steps."""
    reads: list[str] = []
    for name in ("item", "tolist", "__bool__", "cpu", "numpy", "__float__", "__int__"):
        original = getattr(torch.Tensor, name)

        def counted(self: Tensor, *args: object, _f=original, _n=name, **kw: object) -> object:
            reads.append(_n)
            return _f(self, *args, **kw)

        monkeypatch.setattr(torch.Tensor, name, counted)
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 2)
    )
    x = torch.randn(2, 3, 8, 8)
    model(x).sum().backward()
    plain = len(reads)
    reads.clear()
    with hs.nonfinite(model) as report:
        for _ in range(3):
            model(x).sum().backward()
    assert report.ok and len(reads) - 3 * plain == 3 * 2, reads
