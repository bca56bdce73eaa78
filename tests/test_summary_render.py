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


class AnExtraordinarilyLongClassNameForAConvolutionalFeatureExtractorBlockWithManyWords(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.an_extremely_long_attribute_name_that_somebody_chose_for_their_projection = nn.Linear(
            4, 4
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layer = self.an_extremely_long_attribute_name_that_somebody_chose_for_their_projection
        out: torch.Tensor = layer(x)
        return out


class LongNames(nn.Module):
    """Class, attribute and output key names longer than any column can hold whole."""

    def __init__(self) -> None:
        super().__init__()
        self.the_first_stage_of_the_network_with_a_rather_long_descriptive_name = (
            AnExtraordinarilyLongClassNameForAConvolutionalFeatureExtractorBlockWithManyWords()
        )

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        h = self.the_first_stage_of_the_network_with_a_rather_long_descriptive_name(x)
        return {"a_long_output_key_name_for_the_hidden_states_of_the_first_stage": h, "b": [x, x]}


def _columns(text: str) -> dict[str, str]:
    """Each of the Layer, Type and Output columns read down, the pieces of its cells joined."""
    lines = text.splitlines()
    header = next(line for line in lines if line.startswith("Layer"))
    starts = [header.index(h) for h in ("Layer", "Type", "Output", "Params")]
    return {
        name: "".join(line[a:b].strip() for line in _table(text))
        for name, a, b in zip(("Layer", "Type", "Output"), starts, starts[1:], strict=False)
    }


@pytest.mark.parametrize("width", [120, 80])
def test_long_class_attribute_and_key_names_fit_and_are_never_cut(width: int) -> None:
    """196 columns at the default 120 before: names were broken at dots only, and class
    names and shapes not at all."""
    s = hs.summary(LongNames(), torch.randn(2, 4))
    text = s.to_text(max_width=width)
    assert max(map(len, text.splitlines())) <= width
    read = _columns(text)
    for row in s.rows[1:]:  # each name relative to its caller, whole once its pieces are joined
        assert row.name.split(".")[-1] in read["Layer"]
    assert (
        type(
            LongNames().the_first_stage_of_the_network_with_a_rather_long_descriptive_name
        ).__name__
        in read["Type"]
    )
    assert "a_long_output_key_name_for_the_hidden_states_of_the_first_stage:[2,4]" in read[
        "Output"
    ].replace(" ", "")


@pytest.mark.hf
def test_a_small_t5_fits_120_columns() -> None:
    """Its dict output holds an EncoderDecoderCache: 129 columns before."""
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(
        vocab_size=320, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).eval()
    ids = torch.randint(0, 320, (2, 7))
    text = str(hs.summary(model, {"input_ids": ids, "decoder_input_ids": ids[:, :5]}))
    assert max(map(len, text.splitlines())) <= 120
    assert "cache:EncoderDecoderCache" in _columns(text)["Output"].replace(" ", "")
