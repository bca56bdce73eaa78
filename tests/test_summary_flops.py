"""hs.summary's FLOP counting against oracles outside it: attention kernels with grouped
queries on fake CUDA tensors (analytic counts written here), PyTorch's own formula registry,
FlopCounterMode per module, and hand counts for calls whose operators depend on values.

Leaf calls of a kind already seen are charged their learned profile without a Python call
per operator: the tests here also prove those rows equal an operator-by-operator count.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode, flop_registry

import hookscope as hs

aten = torch.ops.aten


class Op(nn.Module):
    """Calls one aten operator on its inputs (as a CUDA attention backend would)."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Any:
        return self.fn(q, k, v)


B, HQ, HKV, SQ, SK, D = 2, 8, 2, 16, 24, 64
ANALYTIC = 2 * B * HQ * SQ * SK * D * 2  # Q·Kᵀ and A·V, every query head, K/V heads shared

KERNELS: dict[str, tuple[str, Callable[..., Any]]] = {
    # name: (layout, call)
    "flash": ("bhsd", lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v)),
    "efficient": (
        "bhsd",
        lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, False),
    ),
    "cudnn": (
        "bhsd",
        lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, False),
    ),
    "flash_forward": (
        "bshd",
        lambda q, k, v: aten._flash_attention_forward(
            q, k, v, None, None, SQ, SK, 0.0, False, False
        ),
    ),
    "efficient_forward": (
        "bshd",
        lambda q, k, v: aten._efficient_attention_forward(
            q, k, v, None, None, None, SQ, SK, 0.0, 0
        ),
    ),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_grouped_query_attention_on_every_cuda_kernel(kernel: str) -> None:
    """Fake CUDA tensors run each kernel's shape function on this CPU-only machine: the CUDA
    kernels get K and V with fewer heads than Q (torch 2.11's formula asserted there)."""
    layout, call = KERNELS[kernel]
    with FakeTensorMode():

        def make(heads: int, seq: int) -> Tensor:
            shape = (B, heads, seq, D) if layout == "bhsd" else (B, seq, heads, D)
            return torch.empty(shape, device="cuda", dtype=torch.bfloat16)

        q, k, v = make(HQ, SQ), make(HKV, SK), make(HKV, SK)
        s = hs.summary(Op(call), (q, k, v))
    assert s.total_flops == ANALYTIC
    assert s.uncounted == {}


def test_grouped_query_attention_on_the_cpu_kernel() -> None:
    q, k, v = torch.randn(B, HQ, SQ, D), torch.randn(B, HKV, SK, D), torch.randn(B, HKV, SK, D)
    s = hs.summary(
        Op(lambda q, k, v: aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)), (q, k, v)
    )
    assert s.total_flops == ANALYTIC


@pytest.mark.parametrize(
    ("op", "args"),
    [
        (aten.mm, ((5, 7), (7, 3))),
        (aten.addmm, ((3,), (5, 7), (7, 3))),
        (aten.bmm, ((4, 5, 7), (4, 7, 3))),
        (aten.baddbmm, ((4, 5, 3), (4, 5, 7), (4, 7, 3))),
    ],
)
def test_matrix_formulas_equal_the_registry(op: Any, args: tuple[tuple[int, ...], ...]) -> None:
    tensors = [torch.randn(s) for s in args]

    class M(nn.Module):
        def forward(self, *xs: Tensor) -> Tensor:
            return op(*xs)  # type: ignore[no-any-return]

    out = op(*tensors)
    assert hs.summary(M(), tuple(tensors)).total_flops == flop_registry[op](*tensors, out_val=out)


@pytest.mark.parametrize("transposed", [False, True])
def test_convolution_formula_equals_the_registry(transposed: bool) -> None:
    conv = (nn.ConvTranspose2d if transposed else nn.Conv2d)(4, 6, 3, stride=2, groups=2)
    x = torch.randn(2, 4, 9, 9)
    out = conv(x)
    expected = flop_registry[aten.convolution](
        x,
        conv.weight,
        conv.bias,
        conv.stride,
        conv.padding,
        conv.dilation,
        transposed,
        conv.output_padding,
        conv.groups,
        out_val=out,
    )
    assert hs.summary(conv, x).total_flops == expected


def _bert(layers: int = 3) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        num_hidden_layers=layers, hidden_size=64, num_attention_heads=4, intermediate_size=128
    )
    config._attn_implementation = "eager"  # matmuls: FlopCounterMode counts them on the CPU
    torch.manual_seed(0)
    return transformers.BertModel(config).eval()  # type: ignore[no-any-return]


@pytest.mark.hf
def test_every_row_equals_flop_counter_mode_per_module() -> None:
    """Repeated layers are charged learned profiles: each row still equals FlopCounterMode's
    count for that module (inclusive), and each row's total its own plus its callees'."""
    model = _bert()
    ids = torch.randint(0, 100, (2, 7))
    with torch.no_grad(), FlopCounterMode(display=False) as oracle:
        model(ids)
    counts = {k: sum(v.values()) for k, v in oracle.get_flop_counts().items()}
    s = hs.summary(model, ids)
    assert s.total_flops == counts["Global"] > 0
    for i, row in enumerate(s.rows):
        key = "BertModel" + (f".{row.name}" if row.name else "")
        assert row.flops_total == counts.get(key, 0), row.name
        callees = sum(r.flops_total for r in s.rows if r.parent == i)
        assert row.flops_total == row.flops + callees, row.name


@contextmanager
def dispatch_calls() -> Iterator[list[int]]:
    """Counts Python ``__torch_dispatch__`` calls (of any dispatch mode) while open."""
    seen = [0]

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code.co_name == "__torch_dispatch__":
            seen[0] += 1

    sys.setprofile(profile)
    try:
        yield seen
    finally:
        sys.setprofile(None)


class Gated(nn.Module):
    """A parameter-free leaf of three elementwise operators."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(x) + x


def test_repeated_blocks_run_without_a_python_call_per_operator() -> None:
    """A kind of leaf call is watched once to see it runs several operators, once more to
    learn them; its later calls run with the counter off and still get their own rows."""
    model = nn.Sequential(*(nn.Sequential(nn.Linear(16, 16), Gated()) for _ in range(12)))
    x = torch.randn(4, 16)
    with dispatch_calls() as calls:
        s = hs.summary(model, x)
    assert s.total_flops == 12 * 2 * 4 * 16 * 16
    assert [r.flops for r in s.rows if r.type == "Linear"] == [2 * 4 * 16 * 16] * 12
    assert s.uncounted == {"aten.add": 12, "aten.mul": 12, "aten.sigmoid": 12}
    assert all(
        r.uncounted == {"aten.add": 1, "aten.mul": 1, "aten.sigmoid": 1}
        for r in s.rows
        if r.type == "Gated"
    )
    ops = 2 + 3  # a Linear (t, addmm) and a Gated block
    assert calls[0] == 2 * ops  # the first two blocks only, of the 12


class SignDependent(nn.Module):
    """A leaf whose operators depend on its input's values, not only on its shapes."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        y = x @ self.w
        if y.sum() > 0:  # reads a value: a second matmul only for some inputs
            y = y @ self.w
        return y


class Lengths(nn.Module):
    """A leaf outside torch.nn steered by an integer tensor read without an operator."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor, lengths: Tensor) -> Tensor:
        return torch.stack([(x[:n] @ self.w).sum(0) for n in lengths.tolist()])


def test_value_dependent_leaf_calls_are_counted_operator_by_operator() -> None:
    sign = SignDependent()
    with torch.no_grad():
        sign.w.copy_(torch.eye(4))
    lengths = Lengths()

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.sign, self.lengths = sign, lengths

        def forward(self, x: Tensor) -> Tensor:
            a = self.sign(x) + self.sign(-x)  # same shapes, other values
            n = torch.tensor([1, 2])
            return a + self.lengths(x, n).sum() + self.lengths(x, n + 2).sum()

    x = torch.ones(5, 4)
    s = hs.summary(Twice(), x)
    mm = 2 * 5 * 4 * 4
    assert [r.flops for r in s.rows if r.name == "sign"] == [2 * mm, mm]
    assert [r.flops for r in s.rows if r.name == "lengths"] == [
        2 * 4 * 4 * (1 + 2),
        2 * 4 * 4 * (3 + 4),
    ]


class Passthrough(TorchDispatchMode):
    """A dispatch mode of the model's own, pushed inside its forward."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
        return func(*args, **(kw or {}))


def test_a_dispatch_mode_inside_the_forward_keeps_counts_exact() -> None:
    """A learned leaf kind is not muted while another mode is innermost: it is counted
    operator by operator then, never twice."""

    class Inside(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(8, 8)
            self.gates = nn.ModuleList([Gated() for _ in range(4)])

        def forward(self, x: Tensor) -> Tensor:
            for gate in self.gates[:2]:  # watched, then learned
                x = gate(self.fc(x))
            with Passthrough():
                for gate in self.gates[2:]:  # known kinds, under the model's own mode
                    x = gate(self.fc(x))
            return x

    s = hs.summary(Inside(), torch.randn(3, 8))
    assert s.total_flops == 4 * 2 * 3 * 8 * 8
    assert s.uncounted == {"aten.add": 4, "aten.mul": 4, "aten.sigmoid": 4}


def test_keyboard_interrupt_inside_a_muted_call_leaves_no_mode_behind() -> None:
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    seen: list[int] = []

    class Flaky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(1)
            y = x * torch.sigmoid(x) + x
            if len(seen) == 3:  # the third call: a learned kind, run with the counter off
                raise KeyboardInterrupt
            return y

    model = nn.Sequential(Flaky(), Flaky(), Flaky())
    with pytest.raises(KeyboardInterrupt):
        hs.summary(model, torch.ones(2, 2))
    assert _get_current_dispatch_mode() is None
    s = hs.summary(model, torch.ones(2, 2))  # the next summary starts clean
    assert [r.raised for r in s.rows] == [False] * 4
    assert s.uncounted == {"aten.add": 3, "aten.mul": 3, "aten.sigmoid": 3}


def test_exception_caught_after_a_muted_call_counts_what_follows() -> None:
    seen: list[int] = []

    class Picky(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(1)
            y = x * torch.sigmoid(x) + x
            if len(seen) == 3:  # the third call: a learned kind, run muted, raises
                raise ValueError("no")
            return y

    class Parent(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gates = nn.ModuleList([Picky() for _ in range(3)])
            self.w = nn.Parameter(torch.randn(4, 4))

        def forward(self, x: Tensor) -> Tensor:
            for gate in self.gates:
                try:
                    x = gate(x)
                except ValueError:
                    x = x @ self.w  # counted: the counter is on again
            return x

    with dispatch_calls() as calls:
        s = hs.summary(Parent(), torch.ones(3, 4))
    assert [(r.name, r.raised) for r in s.rows] == [
        ("", False),
        ("gates.0", False),
        ("gates.1", False),
        ("gates.2", True),
    ]
    assert calls[0] == 3 + 3 + 1  # two watched calls, then the muted one, then the matmul
    assert s.rows[0].flops == s.total_flops == 2 * 3 * 4 * 4


def test_a_formula_that_raises_is_uncounted_with_its_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A FLOP formula that does not fit its arguments never crashes the summary, and the
    operator is listed as uncounted saying why, not silently."""
    from hookscope.look import _formulas

    def broken(*args: Any, **kwargs: Any) -> int:
        raise ValueError("shapes this formula does not know\nsecond line")

    monkeypatch.setitem(_formulas.FORMULAS, torch.ops.aten.addmm, broken)
    s = hs.summary(nn.Linear(4, 3), torch.randn(2, 4))
    key = "aten.addmm (its FLOP formula raised ValueError: shapes this formula does not know)"
    assert s.uncounted == {key: 1}
    assert s.total_flops == 0
    assert key in str(s)
