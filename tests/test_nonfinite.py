"""hs.nonfinite: models built to go non-finite at a known place, in forward and in backward,
compared with what torch.autograd.detect_anomaly says about the same step."""

from __future__ import annotations

import contextlib
import copy
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import hookscope as hs


@pytest.fixture(params=["fewest operators", "least arithmetic", "each tensor at once"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The checks a GPU makes (many tensors per operator, read once per pass) and those the
    CPU makes (read at once; a large tensor checked alone as it arrives: here every one), all
    run on the CPU."""
    import hookscope.diagnose._nonfinite as tracer
    import hookscope.diagnose._stats as stats

    few = request.param == "fewest operators"
    monkeypatch.setattr(stats, "few_operators", lambda device: few)
    if request.param == "each tensor at once":
        monkeypatch.setattr(tracer, "_AT_ONCE_BYTES", 0)
    return str(request.param)


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


def test_forward_division_by_zero_names_block_and_operator(path: str) -> None:
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


def test_backward_sqrt_at_zero_names_the_layer(path: str) -> None:
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


def test_log_zero_in_the_loss_comes_from_outside(path: str) -> None:
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


def test_nan_in_the_input_batch(path: str) -> None:
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


def test_intended_minus_inf_masks_raise_nothing_without_allow() -> None:
    """Infinities that never reach the output (attention masks) are not reported."""
    torch.manual_seed(0)
    model, x = Masked(), torch.randn(2, 5, 8)
    with hs.nonfinite(model) as report:
        model(x).sum().backward()
    assert report.ok and report.forwards == report.backwards == 1
    # a -inf mask given as an input
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True, dropout=0.0)
    causal = nn.Transformer.generate_square_subsequent_mask(5)
    with hs.nonfinite(layer) as report:
        layer(x, src_mask=causal).sum().backward()
    assert report.ok


class LogProbs(nn.Module):
    """Log-probabilities with -inf for classes ruled out: an output meant to hold -inf."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x: Tensor) -> Tensor:
        ruled_out = torch.tensor([False, True, False])
        return self.lin(x).log_softmax(-1).masked_fill(ruled_out, float("-inf"))


class LogOfZero(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x - x)  # -inf everywhere, by arithmetic


def test_infinities_reaching_the_output_on_purpose_or_allowed() -> None:
    torch.manual_seed(0)
    with hs.nonfinite(LogProbs()) as report:  # a -inf constant, put there on purpose
        LogProbs()(torch.randn(2, 4))
    assert report.ok
    model = nn.Sequential(nn.Linear(4, 4), LogOfZero())
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(2, 4))
    assert (info.value.module, info.value.op) == ("1", "aten.log")
    with hs.nonfinite(model, allow="1") as report:  # the user says it is intended
        model(torch.randn(2, 4))
    assert report.ok


class FullyMasked(nn.Module):
    """Attention whose first query may attend to nothing: softmax of a row of -inf is NaN."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = q @ k.transpose(-1, -2)
        mask = torch.zeros(x.shape[1], x.shape[1], dtype=torch.bool)
        mask[0] = True  # the first query is masked everywhere
        scores = scores.masked_fill(mask, float("-inf"))
        return scores.softmax(-1) @ v


def test_fully_masked_attention_row_is_blamed_where_the_nan_arises() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), FullyMasked(), nn.Linear(8, 2))
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(2, 5, 8))
    assert (info.value.module, info.value.op) == ("1", "aten._softmax")
    assert info.value.stats["inputs"]["neginf"] > 0 and info.value.stats["inputs"]["nan"] == 0
    assert info.value.stats["outputs"]["nan"] > 0


class Plant(nn.Module):
    """A block whose output gets one NaN, as a forward hook planted in a real model would."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 4, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv(x)
        return h + torch.where(h > 1e9, h, torch.zeros_like(h)).sum() * float("nan")


def test_minus_inf_padding_before_the_faulty_block_is_not_blamed() -> None:
    """A stem pads with -inf before a max-pool (a hybrid ViT's convolutional stem does): the
    -inf never reaches the output; the NaN planted in the next block does."""
    torch.manual_seed(0)

    class Stem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1)
            self.pool = nn.MaxPool2d(3, stride=2)

        def forward(self, x: Tensor) -> Tensor:
            return self.pool(F.pad(self.conv(x), (1, 1, 1, 1), value=float("-inf")))

    model = nn.Sequential(Stem(), Plant(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 2))
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(2, 3, 8, 8)).sum().backward()
    assert (info.value.phase, info.value.module) == ("forward", "1")
    assert info.value.op == "aten.mul"


@pytest.mark.parametrize("n", [4, 1000, 100_000])
def test_a_freed_temporarys_address_taken_by_a_later_tensor_is_another_value(n: int) -> None:
    """The replay tells values apart by storage and version. A temporary freed mid-forward
    leaves its address to the next tensor of its size (the allocator reuses it), which must
    not be mistaken for it: once, following the NaN back from the output looped through the
    later tensor and named no operator (the failure depended on the allocator's history, and
    made a dropout test fail in one full run of the suite)."""

    class Reuse(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            t = x.sqrt()  # the NaN's producer
            y = t + 1
            del t  # its storage is freed here: ``u`` may get the same address
            u = y * 2
            return u + y

    model = nn.Sequential(nn.Identity(), Reuse())
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(-torch.ones(n))
    assert (info.value.phase, info.value.module, info.value.op) == ("forward", "1", "aten.sqrt")


@pytest.mark.mutates_model  # a training step: BatchNorm statistics move
def test_dropout_under_deterministic_algorithms_does_not_blame_filled_memory() -> None:
    """torch.use_deterministic_algorithms fills fresh memory with NaN before operators write
    it (dropout's mask, BatchNorm's buffers): those NaN never reach the output."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Sequential(nn.Conv2d(4, 4, 3, padding=1), nn.Dropout2d(0.2)),
        Plant(),
        nn.Dropout(0.1),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 2),
    ).train()
    old = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert torch.utils.deterministic.fill_uninitialized_memory  # type: ignore[attr-defined]
        with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
            model(torch.randn(2, 3, 8, 8)).sum().backward()
    finally:
        torch.use_deterministic_algorithms(old)
    assert (info.value.phase, info.value.module, info.value.op) == ("forward", "5", "aten.mul")


def test_warn_mode_records_and_goes_on() -> None:
    model, x = _div_net(), torch.randn(3, 4)
    with pytest.warns(RuntimeWarning) as warned, hs.nonfinite(model, mode="warn") as report:  # noqa: PT031
        model(x).sum().backward()
        model(x)
    # the backward of the first step is not a finding of its own: its NaN come from the
    # forward already reported
    assert [(f.phase, f.module) for f in report.findings] == [("forward", "2"), ("forward", "2")]
    assert "aten.div" in str(warned[0].message) and len(warned) == 2
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


def test_guide_message_is_the_real_one() -> None:
    """The NaN tracing guide shows a real NonFiniteError message: rebuild its step and
    compare."""
    from pathlib import Path

    page = Path(__file__).parent.parent / "docs" / "guides" / "diagnose.md"
    section = page.read_text().split("## Finding the first NaN", 1)[1]
    code = section.split("```python\n", 1)[1].split("```", 1)[0]
    shown = section.split("```text\n", 1)[1].split("```", 1)[0]
    namespace: dict[str, object] = {"print": lambda *a: None}
    exec(compile(code, str(page), "exec"), namespace)
    assert namespace["message"] + "\n" == shown
    # and what the guide says detect_anomaly makes of the same step
    torch.manual_seed(0)
    net = copy.deepcopy(namespace["net"])
    assert isinstance(net, nn.Module)
    assert "'AddmmBackward0' returned nan" in _anomaly(net, _step(torch.randn(2, 4)))


class InplaceLog(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.sub_(x).log_()  # log(0) in place on its input: same tensor object out


def test_in_place_producer_is_found(path: str) -> None:
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
    """Count every Tensor -> host read (item, tolist, bool, cpu, numpy) in clean steps: what
    a GPU would pay. (On the CPU, where reads are free, each tensor's check is read at once:
    counted here is the path other devices take.)"""
    import hookscope.diagnose._stats as stats

    monkeypatch.setattr(stats, "few_operators", lambda device: True)
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


# -- the engine's policies, and what a NaN tracer must not get wrong -----------------------------


def test_compiled_model_that_already_ran() -> None:
    model, x = _div_net(), torch.randn(3, 4)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(x)  # its compiled code ran: new hooks would be ignored
    with pytest.raises(hs.CompiledModelError), hs.nonfinite(compiled):
        pass
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(compiled, recompile=True):
        compiled(x)
    assert (info.value.module, info.value.op) == ("2", "aten.div")


class CatchesItsOwnError(nn.Module):
    """A model that tries a layer, catches its error and carries on (as fallback code does)."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.fragile = nn.Linear(3, 3)  # fails on 4 features
        self.last = DivBlock()

    def forward(self, x: Tensor) -> Tensor:
        h = self.first(x)
        with contextlib.suppress(RuntimeError):
            h = self.fragile(h)
        return self.last(h)


def test_nan_found_after_exceptions_caught_inside_and_outside_the_model() -> None:
    torch.manual_seed(0)
    model = CatchesItsOwnError()
    with hs.nonfinite(model, mode="warn") as report, warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        for _ in range(2):
            model(torch.randn(2, 4))
    assert [(f.module, f.op) for f in report.findings] == [("last", "aten.div")] * 2
    net = _div_net()
    with hs.nonfinite(net) as report:
        with pytest.raises(RuntimeError):
            net(torch.randn(3, 5))  # the wrong width: raises in the first layer; caught here
        with pytest.raises(hs.NonFiniteError) as info:
            net(torch.randn(3, 4))
    assert (info.value.module, info.value.op) == ("2", "aten.div")


def test_large_finite_values_are_no_false_alarm(path: str) -> None:
    """Values near 1e37 are finite; their float32 sum overflows (the old check's false
    alarm)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU())
    with hs.nonfinite(model) as report:
        model(torch.full((8, 4), 1e37))
    assert report.ok


def test_infinity_only_in_parameter_gradients(path: str) -> None:
    """Activations and the gradients reaching layer outputs are finite; the weight's gradient,
    a sum over the batch of input x output-gradient, overflows."""
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1e-30)
    x = torch.full((64, 4), 1e37)
    with torch.no_grad():
        assert torch.isfinite(lin(x)).all()
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(lin):
        (lin(x) * 1e3).sum().backward()
    assert info.value.phase == "backward" and info.value.stats["parameters"] == ["weight"]
    assert info.value.op == "aten.mm"
    lin.weight.grad = None


@pytest.mark.mutates_model  # the optimizer step (skipped, then taken) and the scaler
def test_grad_scaler_overflows_are_recorded_not_raised() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**127)  # overflows the float32 grads
    before = [p.detach().clone() for p in model.parameters()]
    with hs.nonfinite(model, scaler=scaler) as report:
        scaler.scale(model(torch.randn(8, 4)).pow(2).sum() * 100).backward()
        scaler.step(opt)  # skipped: the gradients are not finite
        scaler.update()
    assert report.ok and len(report.overflows) == 1 and report.overflows[0].phase == "backward"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(hs.NonFiniteError, match="GradScaler"), hs.nonfinite(model):
        opt.zero_grad()
        (model(torch.randn(8, 4)).pow(2).sum() * 2.0**127).backward()


@pytest.mark.mutates_model  # a training step: BatchNorm statistics move
def test_warn_mode_replay_leaves_the_users_backward_working() -> None:
    """The replay runs inside the user's forward; it must not touch the BatchNorm buffers
    the user's graph saved (a version bump makes backward fail)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), DivBlock(), nn.Linear(4, 1)).train()
    with pytest.warns(RuntimeWarning), hs.nonfinite(model, mode="warn") as report:
        model(torch.randn(6, 4)).sum().backward()  # would raise "modified by an inplace op"
    assert [(f.phase, f.module) for f in report.findings] == [("forward", "2")]


def test_nested_tensors_of_a_padded_transformer_encoder() -> None:
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).eval()
    x = torch.randn(2, 5, 8)
    pad = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # nested tensors are a prototype
        with torch.no_grad(), hs.nonfinite(encoder) as report:
            encoder(x, src_key_padding_mask=pad)
        assert report.ok
        x[1, 0, 0] = float("nan")  # a NaN in a token that is not padding
        with pytest.raises(hs.NonFiniteError) as info, torch.no_grad(), hs.nonfinite(encoder):
            encoder(x, src_key_padding_mask=pad)
    assert info.value.module == "<input>"


def test_a_model_that_changes_its_inputs_in_place_is_named_without_a_replay() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), DivBlock())  # the ReLU changes the input
    x = torch.randn(3, 4)
    with pytest.raises(hs.NonFiniteError, match="not replayed") as info, hs.nonfinite(model):
        model(x)
    assert (info.value.module, info.value.op) == ("1", None)


# -- who is blamed in backward ------------------------------------------------------------------
def _fp16_overflow_net() -> tuple[nn.Module, Tensor]:
    """Under float16 autocast, the last Linear's weight and bias gradients (sums over 512
    rows of a scaled gradient of 1024) overflow float16; nothing else does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 64), nn.ReLU(), nn.Linear(64, 1))
    with torch.no_grad():
        model[2].weight.fill_(1e-3)
    return model, torch.randn(512, 4)


def _fp16_step(model: nn.Module, x: Tensor, scaler: torch.amp.GradScaler) -> None:
    with torch.autocast("cpu", dtype=torch.float16):
        out = model(x)
    scaler.scale(out.float().sum()).backward()


@pytest.mark.mutates_model  # backward writes .grad
def test_a_float16_autocast_overflow_is_blamed_where_it_happens() -> None:
    model, x = _fp16_overflow_net()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    _fp16_step(model, x, scaler)  # the oracle: plain torch, which parameters overflowed
    bad = [n for n, p in model.named_parameters() if not p.grad.isfinite().all()]
    assert bad == ["2.weight", "2.bias"]
    model.zero_grad()
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        _fp16_step(model, x, scaler)  # the replay runs under the forward's autocast
    e = info.value
    assert (e.phase, e.module, e.call, e.op) == ("backward", "2", 1, "aten.addmm")
    assert e.stats["parameters"] == bad
    model.zero_grad()
    with hs.nonfinite(model, scaler=scaler) as report:  # no replay: tier 1's own blame
        _fp16_step(model, x, scaler)
    assert report.ok and [(o.module, o.op) for o in report.overflows] == [("2", None)]


@pytest.mark.mutates_model  # backward writes .grad
def test_an_infinity_in_the_first_layers_weight_gradient_is_blamed_on_it() -> None:
    """The model makes no autograd node outside its Linear '0': their ranges of nodes are
    the same, and the inner call made them."""
    lin = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        lin.weight.fill_(1e-30)
    model = nn.Sequential(lin, nn.Identity())
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        (model(torch.full((64, 4), 1e37)) * 1e3).sum().backward()
    assert (info.value.module, info.value.op, info.value.stats["parameters"]) == (
        "0",
        "aten.mm",
        ["0.weight"],
    )


class SqrtOfChild(nn.Module):
    """The root's own code takes sqrt(0) of its child's output: infinite derivative."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return torch.sqrt(self.q(x) * 0)


@pytest.mark.mutates_model  # backward writes .grad
def test_an_operation_of_the_models_own_forward_is_blamed_on_the_model() -> None:
    torch.manual_seed(0)
    model = SqrtOfChild()
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(3, 4)).sum().backward()
    assert (info.value.module, info.value.call, info.value.op) == ("", 1, "aten.sqrt")
    assert "first produced by SqrtOfChild" in str(info.value)


class BadSqrt(torch.autograd.Function):
    """A custom Function whose backward divides by zero."""

    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (x,) = ctx.saved_tensors
        return grad / (x - x)


class UsesBadSqrt(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return BadSqrt.apply(self.lin(x))


@pytest.mark.mutates_model  # backward writes .grad
def test_a_custom_autograd_function_is_named_as_itself() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), UsesBadSqrt(), nn.Linear(4, 1))
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(3, 4)).sum().backward()
    assert (info.value.module, info.value.op) == ("1", f"{__name__}.BadSqrt")
    assert f"in the backward of {__name__}.BadSqrt" in str(info.value)


# -- unusual tensors ----------------------------------------------------------------------------
class SparseLog(nn.Module):
    """log of its input, returned as a sparse tensor (NaN where the input is negative)."""

    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x).to_sparse()


class Dense(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to_dense()


@pytest.mark.mutates_model  # backward writes .grad
def test_sparse_outputs_are_checked_by_their_values() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Sigmoid(), SparseLog(), Dense(), nn.Linear(4, 1))
    with hs.nonfinite(model) as report:  # it died reading a sparse tensor's nbytes
        model(torch.randn(3, 4)).sum().backward()
    assert report.ok and report.forwards == report.backwards == 1
    model = nn.Sequential(nn.Linear(4, 4), nn.Identity(), SparseLog(), Dense(), nn.Linear(4, 1))
    with pytest.raises(hs.NonFiniteError) as info, hs.nonfinite(model):
        model(torch.randn(3, 4))  # negative inputs reach the log: NaN
    assert (info.value.phase, info.value.module, info.value.op) == ("forward", "2", "aten.log")


@pytest.mark.mutates_model  # backward writes .grad (meta tensors)
def test_a_meta_device_model_has_no_values_to_find_non_finite() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 1))
    with hs.nonfinite(model) as report:  # it failed copying out of meta
        model(torch.randn(3, 4, device="meta")).sum().backward()
    assert report.ok and report.forwards == report.backwards == 1
