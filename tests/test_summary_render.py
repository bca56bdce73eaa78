"""Rendering hs.summary: the default table fits 120 columns on real architectures (HF
BERT-base and ResNet-50, random weights, offline), rich never cuts a type name, the full
table stays one request away, and shapes are data until rendered.

The golden file here is checked by hand; ``HOOKSCOPE_UPDATE_GOLDEN=1`` rewrites it.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

import hookscope as hs
from hookscope.look import format_shape
from test_summary import Deep, check_golden

NARROW = Path(__file__).parent / "golden" / "summary_deep_70.txt"


@pytest.fixture(scope="module")
def bert() -> hs.Summary:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.BertModel(transformers.BertConfig()).eval()
    batch = {
        "input_ids": torch.randint(1000, 2000, (2, 12)),
        "attention_mask": torch.ones(2, 12, dtype=torch.long),
    }
    return hs.summary(model, batch)


@pytest.fixture(scope="module")
def resnet() -> hs.Summary:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.ResNetModel(transformers.ResNetConfig()).eval()
    return hs.summary(model, torch.randn(1, 3, 64, 64))


def _table(text: str) -> list[str]:
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    return lines[rules[0] + 1 : rules[1]]


@pytest.mark.hf
@pytest.mark.parametrize("which", ["bert", "resnet"])
def test_default_table_fits_120_columns(which: str, request: pytest.FixtureRequest) -> None:
    s: hs.Summary = request.getfixturevalue(which)
    full = s.to_text(max_width=None)
    assert max(map(len, full.splitlines())) > 120  # the full table is wider: it had to fit
    text = str(s)
    assert max(map(len, text.splitlines())) <= 120
    assert "to_text(max_width=None)" in text  # says how to get the rest
    table = _table(text)
    assert len(table) >= len(s.rows)  # every call has its line (long cells wrap)
    for row in s.rows:  # type names are whole, in the row's line
        assert any(re.search(rf"\b{re.escape(row.type)}\b", line) for line in table), row.type
    # the full table keeps every column and full dotted names
    assert all(h in full for h in ("Inputs", "Dtype", "Trainable", "Params (all)"))
    assert max(s.rows, key=lambda r: len(r.name)).name in full


@pytest.mark.hf
@pytest.mark.parametrize("which", ["bert", "resnet"])
def test_rich_at_120_columns_shows_full_type_names(
    which: str, request: pytest.FixtureRequest
) -> None:
    from rich.console import Console

    s: hs.Summary = request.getfixturevalue(which)
    console = Console(record=True, width=120)
    console.print(s)
    out = console.export_text()
    assert max(map(len, out.splitlines())) <= 120
    assert "…" not in out  # rich's ellipsis: nothing was cut
    for kind in {r.type for r in s.rows}:
        assert re.search(rf"\b{re.escape(kind)}\b", out), kind


def test_narrow_golden_table() -> None:
    check_golden(NARROW, hs.summary(Deep(), torch.ones(1, 2)).to_text(max_width=70))


def test_a_table_that_fits_is_left_whole() -> None:
    s = hs.summary(nn.Sequential(nn.Linear(3, 2)), torch.ones(1, 3))
    assert str(s) == s.to_text(max_width=None)  # nothing to leave out or abbreviate


def test_shapes_are_data_until_rendered() -> None:
    class Pair(nn.Module):
        def forward(self, x: torch.Tensor) -> dict[str, object]:
            return {"a": x, "b": (x.sum(0), None), "n": 3}

    row = hs.summary(Pair(), torch.ones(2, 5)).rows[0]
    assert row.output == {"a": (2, 5), "b": [(5,), None], "n": "int"}
    assert format_shape(row.output) == "{a: [2, 5], b: ([5], None), n: int}"
    assert row.inputs == {"x": (2, 5)}


def test_max_width_is_checked() -> None:
    s = hs.summary(nn.Linear(3, 2), torch.ones(1, 3))
    with pytest.raises(hs.UsageError, match=r"max_width must be None or an int >= 40, got 10"):
        s.to_text(max_width=10)
