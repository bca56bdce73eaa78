"""Capture, edits, features, operation sites and summaries never read a tensor back to the
host: on a GPU such a read waits for the device, and these run inside users' training and
inference loops. On CUDA the oracle is CUDA's own accounting (``torch.cuda.set_sync_debug_mode``
warns at every synchronising call); on the CPU every read of values into Python is counted
(``.item()``, ``bool(t)``, ``.tolist()`` and the aten operators that read or size by value),
so CI checks the same promise without a GPU. The diagnose tools, which read once per phase by
design, are counted in ``test_cuda_syncs.py``; attribution targets in ``test_explain_cuda.py``
and ``test_explain_contract.py``."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs
from syncs import host_reads, syncs


class Attention(nn.Module):
    """Causal self-attention through the fused kernel (2 heads of 8)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.transpose(1, 2).reshape(b, t, 16)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1)
        self.bn = nn.BatchNorm2d(16)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.attn = Attention()
        self.head = nn.Linear(16, 10)

    def forward(self, x: Tensor) -> Tensor:
        h = self.pool(self.relu(self.bn(self.conv(x))))
        h = self.attn(h.flatten(2).transpose(1, 2))
        return self.head(h.mean(1))


def _capture(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, ["conv", "attn"]) as cap:
        model(x)
    assert cap["conv"].output.shape == (4, 16, 8, 8)


def _capture_grads(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, ["conv", "attn", "head"], inputs=True, grads=True) as cap:
        model(x).sum().backward()
    assert cap["head"].grad is not None and cap["attn"].inputs["x"].shape == (4, 4, 16)


def _reference(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, ["bn", "head"], copy="reference") as cap:
        model(x)
    assert cap["head"].output.shape == (4, 10)


def _reduced_kept(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, ["conv", "bn"], reduce="spatial_mean", keep="all", max_bytes=2**20):
        model(x)
        model(x)


def _stop(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, "bn", stop=True) as cap:
        model(x)
    assert cap["bn"].output.shape == (4, 16, 8, 8)


def _edit(model: nn.Module, x: Tensor) -> None:
    with hs.edit(model, {"conv": hs.scale(0.5), "attn": hs.add(1.0), "bn": hs.ablate()}):
        model(x)


def _edit_grad(model: nn.Module, x: Tensor) -> None:
    with hs.edit(model, {"conv": hs.scale(0.5, on="grad"), "attn": hs.scale(2.0, on="grad")}):
        model(x).sum().backward()


def _features(model: nn.Module, x: Tensor) -> None:
    feats = hs.features(model, x, ["bn", "attn"])
    assert feats["attn"].shape == (4, 4, 16)


def _extractor(model: nn.Module, x: Tensor) -> None:
    feats = hs.FeatureExtractor(model, ["bn", "attn"])(x)
    assert feats["bn"].shape == (4, 16, 8, 8)


def _operation(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, "attn::scaled_dot_product_attention", grads=True) as cap:
        model(x).sum().backward()
    assert cap["attn::scaled_dot_product_attention"].grad is not None


def _attention_weights(model: nn.Module, x: Tensor) -> None:
    with hs.capture(model, "attn::attention_weights") as cap:
        model(x)
    weights = cap["attn::attention_weights"].output  # computed from the kernel's inputs here
    assert weights.shape == (4, 2, 4, 4)


def _edit_operation(model: nn.Module, x: Tensor) -> None:
    with hs.edit(model, {"attn::scaled_dot_product_attention": hs.scale(2.0)}):
        model(x)


def _summary(model: nn.Module, x: Tensor) -> None:
    s = hs.summary(model, x)
    assert s.total_flops > 0


SCENARIOS: dict[str, Callable[[nn.Module, Tensor], None]] = {
    "capture": _capture,
    "capture inputs and gradients": _capture_grads,
    "capture by reference": _reference,
    "capture reduced, every pass kept, a byte budget": _reduced_kept,
    "capture with an early stop": _stop,
    "edit outputs": _edit,
    "edit gradients": _edit_grad,
    "features": _features,
    "a FeatureExtractor": _extractor,
    "an operation and its gradient": _operation,
    "attention weights of the fused kernel": _attention_weights,
    "edit an operation": _edit_operation,
    "summary": _summary,
}

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
    ),
]


def _counter(device: str) -> AbstractContextManager[list[str]]:
    return host_reads() if device == "cpu" else syncs()


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def model_and_input(device: str) -> tuple[nn.Module, Tensor]:
    torch.manual_seed(0)
    model = Net().to(device).eval()  # eval: the forwards leave batch-norm's statistics alone
    x = torch.randn(4, 3, 8, 8, device=device)
    model(x).sum().backward()  # the first forward and backward: torch's own lazy set-up
    model.zero_grad(set_to_none=True)
    return model, x


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_reads_nothing_back_to_the_host(
    name: str, device: str, model_and_input: tuple[nn.Module, Tensor]
) -> None:
    model, x = model_and_input
    with _counter(device) as seen:
        SCENARIOS[name](model, x)
    assert seen == [], seen


READS: dict[str, Callable[[Tensor], object]] = {
    "bool": lambda t: bool(t.sum() > 0),
    "item": lambda t: t.sum().item(),
    "tolist": lambda t: t[0, 0, 0].tolist(),
    "nonzero": lambda t: t.nonzero(),
    "equal": lambda t: torch.equal(t, t),
}


@pytest.mark.parametrize("read", list(READS))
def test_the_counter_sees_a_read(
    read: str, device: str, model_and_input: tuple[nn.Module, Tensor]
) -> None:
    """The oracle itself: a hook that reads values is seen."""
    model, x = model_and_input

    def reads(module: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
        READS[read](out)

    handle = model.bn.register_forward_hook(reads)
    try:
        with _counter(device) as seen:
            model(x)
    finally:
        handle.remove()
    assert seen


@pytest.mark.mutates_model  # training steps change the weights on purpose
def test_monitor_steps_between_logs_read_nothing(
    device: str, model_and_input: tuple[nn.Module, Tensor]
) -> None:
    model, x = model_and_input
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    with hs.Monitor(model, every=5, optimizer=opt):
        with _counter(device) as logged:
            step()  # step 0 is logged, and read when the next forward starts (the scalars
            model(x)  # logged after opt.step() join that read)
        with _counter(device) as seen:
            for _ in range(4):
                step()
    assert seen == [], seen
    assert len(logged) == 1, logged
