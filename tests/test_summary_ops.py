"""``hs.summary(ops=True)``: a row per operation of each module's own code.

Oracles, never the summary itself: FLOPs and shapes written out by hand for a hand-written
model, the names ``hs.names(ops=True)`` lists (an independent pass of the core's listing),
what ``hs.capture`` records for a row's name, the closed-form attention count of GPT-2, and
the same summary without ``ops`` for every total."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import _get_current_function_mode_stack as mode_stack

import hookscope as hs
from test_summary import check_golden

GOLDEN = Path(__file__).parent / "golden" / "summary_ops.txt"  # checked by hand


class Mixer(nn.Module):
    """Two matmuls (so ``#1`` / ``#2``), a softmax, a relu around a child Linear, a
    ``size()`` call (a number: no row) and a property (``.T``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(4, 8))
        self.proj = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        a = torch.matmul(x, self.w)
        p = F.softmax(a, dim=-1)
        h = F.relu(self.proj(p))
        n = h.size(-1)
        return torch.matmul(h, self.w.T) / n


class Outer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mix = Mixer()
        self.head = nn.Linear(4, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.mix(x)) * 2


B, T = 2, 5
X = torch.randn(B, T, 4)
#: (name, type, output, FLOPs) of every row, in the order they started, by hand
EXPECTED = [
    ("", "Outer", (B, T, 2), 0),
    ("mix", "Mixer", (B, T, 4), 2 * B * T * 4 * 8 + 2 * B * T * 8 * 4),
    ("mix::matmul#1", "torch.matmul", (B, T, 8), 2 * B * T * 4 * 8),
    ("mix::softmax", "torch.nn.functional.softmax", (B, T, 8), 0),
    ("mix.proj", "Linear", (B, T, 8), 2 * B * T * 8 * 8),
    ("mix.proj::linear", "torch.nn.functional.linear", (B, T, 8), 2 * B * T * 8 * 8),
    ("mix::relu", "torch.nn.functional.relu", (B, T, 8), 0),
    ("mix::T", "torch.Tensor.T", (8, 4), 0),
    ("mix::matmul#2", "torch.matmul", (B, T, 4), 2 * B * T * 8 * 4),
    ("mix::div", "torch.Tensor.div", (B, T, 4), 0),
    ("head", "Linear", (B, T, 2), 2 * B * T * 4 * 2),
    ("head::linear", "torch.nn.functional.linear", (B, T, 2), 2 * B * T * 4 * 2),
    ("::mul", "torch.Tensor.mul", (B, T, 2), 0),
]


def _ops(s: hs.Summary) -> list[hs.SummaryRow]:
    return [r for r in s.rows if r.kind == "op"]


def test_rows_names_shapes_and_flops_by_hand() -> None:
    s = hs.summary(Outer(), X, ops=True)
    got = [(r.name, r.type, r.output, r.flops) for r in s.rows]
    assert got == EXPECTED
    rows = {r.name: r for r in s.rows}
    for r in _ops(s):
        module = r.name.partition("::")[0]
        assert s.rows[r.parent].name == module  # type: ignore[index]
        assert r.depth == rows[module].depth + 1 and r.flops_total == r.flops
        assert r.params == r.params_total == 0 and r.dtype == "float32"
    assert rows["mix::softmax"].uncounted == {"aten._softmax": 1}  # its own operators
    assert rows["mix::relu"].uncounted == {"aten.relu": 1}


def test_op_names_are_those_names_lists() -> None:
    model = Outer()
    listed = hs.names(model, ops=True, inputs=X)
    s = hs.summary(model, X, ops=True)
    assert sorted(r.name for r in _ops(s)) == sorted(n for n in listed if "::" in n)
    for r in _ops(s):
        assert listed[r.name] == r.type  # how the code called it, as names says


def test_each_row_name_captures_that_operation() -> None:
    model = Outer()
    s = hs.summary(model, X, ops=True)
    names = [r.name for r in _ops(s)]
    with hs.capture(model, names) as cap:
        model(X)
    for r in _ops(s):
        assert tuple(cap[r.name].output.shape) == r.output, r.name


def test_totals_and_module_rows_are_unchanged() -> None:
    model = Outer()
    plain, with_ops = hs.summary(model, X), hs.summary(model, X, ops=True)
    modules = [r for r in with_ops.rows if r.kind == "module"]
    assert _by_parent_name(with_ops, modules) == _by_parent_name(plain, plain.rows)
    for field in ("total_params", "total_flops", "output_bytes", "param_bytes", "uncounted"):
        assert getattr(with_ops, field) == getattr(plain, field), field
    assert sum(r.flops for r in modules) == with_ops.total_flops == 2 * B * T * (32 * 2 + 64 + 8)
    for i, row in enumerate(with_ops.rows):  # each module's own FLOPs: its operations'
        own = [r for r in _ops(with_ops) if r.parent == i]
        if own:
            assert sum(r.flops for r in own) == row.flops
    assert repr(with_ops).startswith("<Summary of Outer: 4 calls, 9 operations,")
    assert repr(plain).startswith("<Summary of Outer: 4 calls, ")


def _by_parent_name(s: hs.Summary, rows: list[hs.SummaryRow]) -> list[dict[str, object]]:
    """Rows' fields, the parent by name (indices move when operation rows come in)."""
    return [
        {**r.to_dict(), "parent": None if r.parent is None else s.rows[r.parent].name} for r in rows
    ]


def test_off_by_default_and_no_function_mode_without_it() -> None:
    seen: list[int] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(len(mode_stack()))
            return x.relu()

    assert all(r.kind == "module" for r in hs.summary(Probe(), X).rows)
    hs.summary(Probe(), X, ops=True)
    assert seen == [0, 1] and mode_stack() == []
    with pytest.raises(hs.UsageError, match="ops must be True or False"):
        hs.summary(Probe(), X, ops="relu")  # type: ignore[arg-type]


def test_reused_module_gets_its_rows_per_call() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    s = hs.summary(model, X, ops=True)
    linear = [r for r in s.rows if r.name == "0::linear"]
    assert [(r.call, r.calls) for r in linear] == [(1, 2), (2, 2)]
    assert [s.rows[r.parent].call for r in linear] == [1, 2]  # type: ignore[index]
    lines = s.to_text().splitlines()
    assert sum(line.startswith("    0::linear  F.linear  ") for line in lines) == 2  # no [k/n]
    assert sum(line.startswith("  0 [2/2]  ") for line in lines) == 1  # the call is its row's


def test_depth_keeps_the_operations_of_modules_shown_with_their_sub_calls() -> None:
    s = hs.summary(Outer(), X, ops=True)
    one = hs.summary(Outer(), X, ops=True, depth=1)
    assert [r.name for r in one.rows] == ["", "mix", "head", "::mul"]
    two = s.fold(2)
    assert [r.name for r in two.rows] == [n for n, *_ in EXPECTED if n != "mix.proj::linear"]
    assert [r.name for r in s.fold(0).rows] == [""]
    for folded in (one, two, s.fold(0)):
        assert folded.total_flops == s.total_flops
        assert sum(r.flops for r in folded.rows if r.kind == "module") == s.total_flops


def test_json_round_trip_and_rendering() -> None:
    s = hs.summary(Outer(), X, ops=True, time=True)
    data = json.loads(s.to_json())
    assert [r["kind"] for r in data["rows"]] == [
        "op" if "::" in n else "module" for n, *_ in EXPECTED
    ]
    back = hs.Summary.from_json(s.to_json())
    assert back == s and str(back) == str(s)
    assert all(r.time_ms is not None for r in s.rows)
    assert all((r.peak_bytes is None) == (r.kind == "op") for r in s.rows)
    old = {**data, "rows": [{k: v for k, v in r.items() if k != "kind"} for r in data["rows"]]}
    assert {r.kind for r in hs.Summary.from_dict(old).rows} == {"module"}  # older JSON


def test_golden_text_table() -> None:
    check_golden(GOLDEN, hs.summary(Outer(), X, ops=True).to_text(max_width=100))


def test_rich_table_has_the_operation_rows() -> None:
    rich_console = pytest.importorskip("rich.console")
    console = rich_console.Console(width=120, record=True, color_system=None)
    console.print(hs.summary(Outer(), X, ops=True))
    shown = console.export_text()
    assert "::matmul#2" in shown and "F.softmax" in shown and "layer::op" in shown


@pytest.mark.hf
def test_gpt2_attention_rows_equal_the_closed_form() -> None:
    transformers = pytest.importorskip("transformers")
    c = transformers.GPT2Config()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(c).eval()
    b, t = 2, 16
    ids = torch.randint(0, c.vocab_size, (b, t))
    kwargs = {"use_cache": False}
    s = hs.summary(model, ids, forward_kwargs=kwargs, ops=True)
    plain = hs.summary(model, ids, forward_kwargs=kwargs)
    assert (s.total_flops, s.total_params, s.uncounted) == (
        plain.total_flops,
        plain.total_params,
        plain.uncounted,
    )
    sdpa = [r for r in s.rows if r.name.endswith("::scaled_dot_product_attention")]
    attns = [f"transformer.h.{i}.attn" for i in range(c.n_layer)]
    assert [s.rows[r.parent].name for r in sdpa] == attns  # type: ignore[index]
    for r in sdpa:  # Q @ K^T and A @ V over the full T x T, every head
        assert r.flops == 2 * 2 * b * t * t * c.n_embd
        assert r.output == (b, c.n_head, t, c.n_embd // c.n_head)
    listed = hs.names(model, ops=True, inputs={"input_ids": ids, **kwargs})
    ops = {n for n in listed if "::" in n and not n.endswith("::attention_weights")}
    assert {r.name for r in s.rows if r.kind == "op"} == ops
