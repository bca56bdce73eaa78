"""hs.summary: rows, shapes and operator-level FLOPs against hand-computed counts.

Every expected FLOP count below is written from the layer shapes by hand (2 FLOPs per
multiply-accumulate, matrix products / convolutions / attention only), and shapes are
compared with those raw forward hooks see.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import hookscope as hs
from hookscope.look import format_shape
from zoo import ZOO, ZooEntry
from zoo import unwrap as zoo_unwrap


def _rows(s: hs.Summary) -> dict[str, hs.SummaryRow]:
    return {r.name: r for r in s.rows}


def _raw_shapes(model: nn.Module, *args: Any) -> list[tuple[str, str]]:
    """(name, output shape) per call in post-hook order, from plain forward hooks."""
    seen: list[tuple[str, str]] = []
    handles = [
        m.register_forward_hook(lambda mod, a, out, n=n: seen.append((n, str(list(out.shape)))))
        for n, m in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(*args)
    finally:
        for h in handles:
            h.remove()
    return seen


# -- hand-computed rows ---------------------------------------------------------------------


def test_mlp_rows_flops_params() -> None:
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
    s = hs.summary(model, torch.randn(3, 8))
    assert [(r.name, r.type, r.depth, r.parent) for r in s.rows] == [
        ("", "Sequential", 0, None),
        ("0", "Linear", 1, 0),
        ("1", "ReLU", 1, 0),
        ("2", "Linear", 1, 0),
    ]
    rows = _rows(s)
    assert rows["0"].flops == 2 * 3 * 8 * 4 and rows["2"].flops == 2 * 3 * 4 * 2
    assert rows[""].flops == 0 and rows[""].flops_total == 192 + 48
    assert s.total_flops == 240 and s.total_macs == 120
    assert rows["0"].macs == 96
    assert (rows["0"].params, rows["1"].params, rows[""].params, rows[""].params_total) == (
        36,
        0,
        0,
        46,
    )
    assert rows["0"].inputs == {"input": (3, 8)} and rows["0"].output == (3, 4)
    assert rows["0"].dtype == "float32" and rows["1"].trainable == "-"
    assert s.total_params == s.trainable_params == 46 and s.param_bytes == 46 * 4
    assert s.output_bytes == (12 + 12 + 6) * 4  # the three leaf calls
    assert s.uncounted == {"aten.relu": 1}
    assert s.inputs == {"input": (3, 8)}


def test_conv_and_grouped_conv() -> None:
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 6, 3, stride=2, groups=2))
    x = torch.randn(2, 3, 16, 16)
    rows = _rows(hs.summary(model, x))
    assert rows["0"].flops == 2 * (2 * 8 * 16 * 16) * (3 * 3 * 3)
    assert rows["1"].output == (2, 6, 7, 7)
    assert rows["1"].flops == 2 * (2 * 6 * 7 * 7) * (4 * 3 * 3)  # 8 / groups inputs per output


class Attention(nn.Module):
    """Linear projections as layers, the attention products as functional calls."""

    def __init__(self, d: int = 8, sdpa: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.sdpa = sdpa

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, 2, d // 2).permute(2, 0, 3, 1, 4)
        if self.sdpa:
            a = F.scaled_dot_product_attention(q, k, v)
        else:
            a = (q @ k.transpose(-1, -2) / (d // 2) ** 0.5).softmax(-1) @ v
        return self.out(a.transpose(1, 2).reshape(b, t, d))


@pytest.mark.parametrize("sdpa", [False, True], ids=["matmul", "sdpa"])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_functional_attention_counts_in_parent(sdpa: bool, device: str) -> None:
    b, t, d = 2, 5, 8
    with torch.device(device):
        model = Attention(d, sdpa=sdpa)
    s = hs.summary(model, torch.randn(b, t, d))
    rows = _rows(s)
    attention = 2 * (b * 2) * t * t * (d // 2) * 2  # Q·Kᵀ and A·V over 2 heads of d/2
    assert rows[""].flops == attention
    assert rows["qkv"].flops == 2 * b * t * d * 3 * d and rows["out"].flops == 2 * b * t * d * d
    assert s.total_flops == attention + 2 * b * t * d * 4 * d


def test_grouped_query_sdpa() -> None:
    q = torch.randn(1, 4, 6, 8)
    kv = torch.randn(1, 2, 6, 8)

    class GQA(nn.Module):
        def forward(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    s = hs.summary(GQA(), (q, kv, kv))
    assert s.total_flops == 2 * 2 * 4 * 6 * 6 * 8  # both products over the 4 query heads


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.fc(torch.relu(self.fc(x))))


def test_reused_module_one_row_per_call() -> None:
    s = hs.summary(Twice(), torch.randn(3, 4))
    fc = [r for r in s.rows if r.name == "fc"]
    assert [(r.call, r.calls, r.reused) for r in fc] == [(1, 2, True), (2, 2, True)]
    assert all(r.flops == 2 * 3 * 4 * 4 for r in fc)
    assert s.total_params == 4 * 4 + 4 + 4 + 1  # counted once
    assert "fc [2/2]" in str(s)


@pytest.mark.parametrize("layers", [1, 2])
def test_lstm_and_gru(layers: int) -> None:
    t, b, n_in, h = 5, 2, 3, 4
    x = torch.randn(t, b, n_in)
    for cell, gates in ((nn.LSTM, 4), (nn.GRU, 3)):
        rnn = cell(n_in, h, num_layers=layers)
        expected = sum(2 * t * b * gates * h * ((n_in if i == 0 else h) + h) for i in range(layers))
        s = hs.summary(rnn, x)
        assert s.total_flops == expected, cell.__name__
        state = (layers, b, h)
        hidden = [state, state] if cell is nn.LSTM else state
        assert s.rows[0].output == [(t, b, h), hidden]
        assert format_shape(s.rows[0].output).startswith(f"([{t}, {b}, {h}], ")


def test_native_fast_paths_are_counted() -> None:
    """nn.TransformerEncoderLayer in eval mode under no_grad runs one fused kernel."""
    b, t, e, f = 2, 5, 8, 16
    layer = nn.TransformerEncoderLayer(e, 2, f, batch_first=True, dropout=0.0)
    s = hs.summary(layer, torch.randn(b, t, e))
    attention = 2 * b * t * 3 * e * e + 2 * 2 * b * t * t * e + 2 * b * t * e * e
    assert s.total_flops == attention + 2 * 2 * b * t * e * f
    mha = nn.MultiheadAttention(e, 2, batch_first=True)
    x = torch.randn(b, t, e)
    assert hs.summary(mha, (x, x, x)).total_flops == attention


def test_matrix_vector_products() -> None:
    class MV(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(6, 4))

        def forward(self, x: Tensor) -> Tensor:
            return (self.w @ x) @ (self.w @ x)  # mv, mv, dot

    assert hs.summary(MV(), torch.randn(4)).total_flops == 2 * 24 * 2 + 2 * 6


def test_shapes_match_raw_hooks_in_execution_order() -> None:
    model = nn.Sequential(
        nn.Conv2d(1, 2, 3),
        nn.ReLU(),
        nn.Sequential(nn.MaxPool2d(2), nn.Flatten()),
        nn.Linear(2 * 3 * 3, 5),
    )
    x = torch.randn(2, 1, 8, 8)
    s = hs.summary(model, x)
    raw = _raw_shapes(model, x)
    # rows are in call order (parent first), raw hooks fire in return order (parent last)
    ours = {(r.name, format_shape(r.output)) for r in s.rows}
    assert ours == set(raw)
    assert [r.name for r in s.rows] == ["", "0", "1", "2", "2.0", "2.1", "3"]


class Heads(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 2)

    def forward(self, x: Tensor, *, mask: Tensor | None = None, scale: float = 1.0) -> Any:
        y = self.a(x) * scale
        return {"y": y, "pair": (y, None)}


def test_nested_outputs_and_bound_inputs() -> None:
    s = hs.summary(
        Heads(), torch.randn(4, 3), forward_kwargs={"mask": torch.ones(4, 1), "scale": 2.0}
    )
    root = s.rows[0]
    assert root.inputs == {"x": (4, 3), "mask": (4, 1)}  # scale holds no tensor
    assert root.output == {"y": (4, 2), "pair": [(4, 2), None]}
    assert format_shape(root.output) == "{y: [4, 2], pair: ([4, 2], None)}"


def test_mapping_of_forward_keywords_is_passed_as_keywords() -> None:
    class KW(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(10, 4)

        def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
            return self.emb(input_ids) * attention_mask[..., None]

    batch = {"input_ids": torch.tensor([[1, 2, 3]]), "attention_mask": torch.ones(1, 3)}
    s = hs.summary(KW(), batch)
    assert s.rows[0].inputs == {"input_ids": (1, 3), "attention_mask": (1, 3)}

    class TakesDict(nn.Module):
        def forward(self, batch: dict[str, Tensor]) -> Tensor:
            return batch["a"] + 1

    # a mapping is always keywords (as hs.features takes it); a dict argument goes in a tuple
    s = hs.summary(TakesDict(), ({"a": torch.ones(2)},))
    assert s.rows[0].inputs == {"batch": {"a": (2,)}}


def test_input_size_and_dtypes() -> None:
    emb = nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 2))
    s = hs.summary(emb, input_size=(2, 7), dtypes=[torch.long])
    assert s.rows[0].inputs == {"input": (2, 7)} and s.rows[-1].output == (2, 7, 2)
    two = Attention()
    assert hs.summary(two, input_size=[(1, 3, 8)]).rows[0].output == (1, 3, 8)
    heads = Heads()  # keyword inputs go with input_size
    extra = {"mask": torch.ones(4, 1), "scale": 2.0}
    s = hs.summary(heads, input_size=(4, 3), forward_kwargs=extra)
    assert s.rows[0].inputs == {"x": (4, 3), "mask": (4, 1)}


def test_input_device_places_the_made_up_inputs() -> None:
    seen: list[torch.device] = []

    class Where(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(x.device)
            return x * 2

    s = hs.summary(Where(), input_size=(2, 3), input_device="meta")
    assert seen == [torch.device("meta")] and s.rows[0].output == (2, 3)


def test_inputs_are_not_modified() -> None:
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(3, 3))
    x = torch.tensor([[-1.0, 2.0, -3.0]])
    hs.summary(model, x)
    assert torch.equal(x, torch.tensor([[-1.0, 2.0, -3.0]]))


# -- totals, folding, rendering -------------------------------------------------------------


def test_tied_weights_counted_once() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(20, 6)
            self.head = nn.Linear(6, 20, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids: Tensor) -> Tensor:
            return self.head(self.emb(ids))

    model = Tied()
    s = hs.summary(model, torch.tensor([[1, 2]]))
    assert s.total_params == 120 == sum(p.numel() for p in model.parameters())
    assert _rows(s)["head"].params == 120  # the row still shows the module's own weight


def test_fold_keeps_totals() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Linear(4, 3))), nn.Linear(3, 1)
    )
    x = torch.randn(2, 4)
    full = hs.summary(model, x)
    for depth in range(4):
        folded = full.fold(depth)
        assert max(r.depth for r in folded.rows) == min(depth, 3)
        assert sum(r.flops for r in folded.rows) == full.total_flops == folded.total_flops
        assert folded.total_params == full.total_params
    assert [r.name for r in hs.summary(model, x, depth=1).rows] == ["", "0", "1"]
    assert _rows(full.fold(1))["0"].flops == 2 * 2 * 4 * 4 + 2 * 2 * 4 * 3
    with pytest.raises(hs.UsageError, match="depth"):
        full.fold(-1)


def test_json_round_trip() -> None:
    s = hs.summary(Twice(), torch.randn(3, 4), time=True)
    data = json.loads(s.to_json())
    assert data["total_flops"] == s.total_flops and data["total_macs"] == s.total_macs
    assert len(data["rows"]) == len(s.rows)
    back = hs.Summary.from_json(s.to_json())
    assert back == s and str(back) == str(s)


GOLDEN = Path(__file__).parent / "golden" / "summary_net.txt"  # checked by hand


def check_golden(path: Path, text: str) -> None:
    """``text`` equals the golden file; ``HOOKSCOPE_UPDATE_GOLDEN=1`` rewrites it instead
    (then read the diff before committing it)."""
    if os.environ.get("HOOKSCOPE_UPDATE_GOLDEN") == "1":
        path.write_text(text)
    assert text == path.read_text(), f"{path} differs (HOOKSCOPE_UPDATE_GOLDEN=1 rewrites it)"


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
        self.head = nn.Linear(4, 1)
        self.head.requires_grad_(False)
        self.register_buffer("mix", torch.eye(4))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.encoder(x) @ self.mix)  # the matmul is Net's own: 2·2·4·4


def test_golden_text_table() -> None:
    check_golden(GOLDEN, str(hs.summary(Net(), torch.randn(2, 3))))


# -- failures, borrowed model, interactions -------------------------------------------------


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(5, 4)])

    def forward(self, x: Tensor) -> Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_failing_forward_keeps_its_exception_and_partial_summary() -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied") as info:
        hs.summary(Blocks(), torch.randn(2, 4))
    error = info.value
    assert type(error) is RuntimeError  # the model's own exception, not a wrapper
    note = "\n".join(getattr(error, "__notes__", []))
    assert "'blocks.2' (Linear)" in note and "input=[2, 4]" in note
    partial = error.summary  # type: ignore[attr-defined]
    assert isinstance(partial, hs.Summary)
    assert [(r.name, r.raised) for r in partial.rows] == [
        ("", True),
        ("blocks.0", False),
        ("blocks.1", False),
        ("blocks.2", True),
    ]
    assert partial.rows[1].output == (2, 4) and partial.total_flops == 2 * (2 * 2 * 4 * 4)


def test_error_caught_inside_the_model_closes_the_call() -> None:
    class Fallback(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bad = nn.Linear(5, 4)
            self.good = nn.Linear(4, 4)

        def forward(self, x: Tensor) -> Tensor:
            try:
                return self.bad(x)
            except RuntimeError:
                return self.good(x)

    s = hs.summary(Fallback(), torch.randn(2, 4))
    assert [(r.name, r.depth, r.raised) for r in s.rows] == [
        ("", 0, False),
        ("bad", 1, True),
        ("good", 1, False),
    ]


def test_batchnorm_statistics_and_modes_untouched() -> None:
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5)).train()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    for train in (False, True):
        hs.summary(model, x, train=train)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)
        assert model.training and all(m.training for m in model.modules())


def test_train_mode_runs_in_training_mode() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(self.training)
            return x

    model = Probe().eval()
    hs.summary(model, torch.ones(1))
    hs.summary(model, torch.ones(1), train=True)
    assert seen == [False, True] and not model.training


class _Noisy(nn.Module):
    """Dropout in training, and a draw of its own in every mode."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.drop = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.fc(x)) + torch.rand(1, device=x.device)


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=_CUDA)])
@pytest.mark.parametrize(
    "how", [{"train": True}, {"train": False}, {"input_size": (2, 4)}, {"grad": True}]
)
def test_a_summary_leaves_the_random_stream_as_found(how: dict[str, Any], device: str) -> None:
    """A look at the model must not change a training run's random stream: the next draw
    (CPU, and the model's CUDA device) equals the one made without the summary (train=True
    advanced it: dropout's draws)."""
    model = _Noisy().train().to(device)
    x = None if "input_size" in how else torch.randn(2, 4, device=device)
    torch.manual_seed(123)  # seeds every device
    expected = torch.rand(5), torch.rand(5, device=device)
    torch.manual_seed(123)
    hs.summary(model, x, **how)
    assert torch.equal(torch.rand(5), expected[0])
    assert torch.equal(torch.rand(5, device=device), expected[1])


def test_no_grad_by_default_and_grad_on_request() -> None:
    seen: list[bool] = []

    class Probe(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            seen.append(torch.is_grad_enabled())
            return x * 2

    hs.summary(Probe(), torch.ones(1, requires_grad=True))
    hs.summary(Probe(), torch.ones(1, requires_grad=True), grad=True)
    assert seen == [False, True]


def test_with_a_capture_open_and_under_inference_mode() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    x = torch.randn(2, 3)
    with hs.capture(model, "0", keep="all") as cap:
        s = hs.summary(model, x)
        model(x)
    # the summary's forward is its own: the open capture sees the user's forward only
    assert cap["0"].count == 1 and s.total_flops == 2 * 2 * 3 * 4 + 2 * 2 * 4 * 2
    with torch.inference_mode():
        assert hs.summary(model, x).total_flops == s.total_flops


def test_wrapped_and_compiled_models() -> None:
    x = torch.randn(2, 3)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU())
    compiled = torch.compile(nn.Sequential(nn.Linear(3, 4), nn.ReLU()), backend="eager")
    compiled(x)  # compiled code has run: the summary must still see every call
    expected = [r.name for r in hs.summary(model, x).rows]
    assert [r.name for r in hs.summary(nn.DataParallel(model), x).rows] == expected
    s = hs.summary(compiled, x)
    assert [r.name for r in s.rows] == expected and s.total_flops == 2 * 2 * 3 * 4
    assert torch.compiler.is_compiling() is False


def test_time_and_memory_columns() -> None:
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8))
    s = hs.summary(model, torch.randn(16, 64), time=True)
    rows = _rows(s)
    assert all(r.time_ms is not None and r.time_ms >= 0 for r in s.rows)
    assert rows[""].time_ms >= rows["0"].time_ms  # type: ignore[operator]
    assert rows["0"].peak_bytes >= 16 * 256 * 4  # its output was allocated inside it
    assert "Time ms" in str(s) and "Peak mem" in str(s)
    assert hs.summary(model, torch.randn(16, 64)).rows[0].time_ms is None


def test_usage_errors() -> None:
    model = nn.Linear(2, 2)
    with pytest.raises(hs.UsageError, match="needs the model's inputs"):
        hs.summary(model)
    with pytest.raises(hs.UsageError, match="not both"):
        hs.summary(model, torch.ones(1, 2), input_size=(1, 2))
    # a forward keyword or a second input given as summary's own: Python's TypeError, which a
    # type checker reports before the call (the model's inputs are one argument and
    # forward_kwargs=)
    with pytest.raises(TypeError, match="mask"):
        hs.summary(model, torch.ones(1, 2), mask=torch.ones(1))  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        hs.summary(model, torch.ones(1, 2), torch.ones(1, 2))  # type: ignore[misc]
    with pytest.raises(hs.UsageError, match="both in the inputs mapping and in forward_kwargs"):
        hs.summary(model, {"input": torch.ones(1, 2)}, forward_kwargs={"input": 1})
    with pytest.raises(hs.UsageError, match="input_size must be"):
        hs.summary(model, input_size="1x2")
    with pytest.raises(hs.UsageError, match=r"one torch\.dtype per input"):
        hs.summary(model, input_size=[(1, 2), (1, 2)], dtypes=[torch.long])
    with pytest.raises(hs.UsageError, match="pass input_size too"):
        hs.summary(model, torch.ones(1, 2), dtypes=[torch.long])
    with pytest.raises(hs.UsageError, match="pass input_size too"):
        hs.summary(model, torch.ones(1, 2), input_device="cpu")
    with pytest.raises(hs.UsageError, match=r"nn\.Module"):
        hs.summary(lambda x: x, torch.ones(1))  # type: ignore[arg-type]


class Deep(nn.Module):
    """Calls a layer four containers down directly: its name is long even relative to the
    model (the containers are never called, so they have no row)."""

    SEGMENTS = ("transformer", "decoder_stack", "attention_block", "projection_layer")

    def __init__(self) -> None:
        super().__init__()
        inner: nn.Module = nn.Linear(2, 2)
        for name in reversed(self.SEGMENTS[1:]):
            inner = nn.ModuleDict({name: inner})
        self.transformer = inner

    def forward(self, x: Tensor) -> Tensor:
        layer: Any = self.transformer
        for name in self.SEGMENTS[1:]:
            layer = layer[name]
        return layer(x)  # type: ignore[no-any-return]


def test_long_names_wrap_at_dots_only() -> None:
    s = hs.summary(Deep(), torch.ones(1, 2))
    full = ".".join(Deep.SEGMENTS)
    assert full in s.to_text(max_width=None)  # the full table: one line per row
    text = s.to_text(max_width=70)
    assert full not in text
    lines = text.splitlines()
    rules = [i for i, line in enumerate(lines) if line and set(line) == {"-"}]
    table = lines[rules[0] + 1 : rules[1]]
    assert all(len(line) <= 70 for line in text.splitlines())
    firsts = [line.split()[0] for line in table if line.strip()]
    for token in firsts:  # every piece of a name is made of whole segments
        assert set(token.rstrip(".").split(".")) <= {*Deep.SEGMENTS, "Deep"}, token
    assert "".join(firsts[1:]) == full  # the Linear's name, wrapped at dots


def test_rich_table() -> None:
    from rich.console import Console

    s = hs.summary(Twice(), torch.randn(3, 4))
    console = Console(record=True, width=200)
    console.print(s)
    out = console.export_text()
    assert "fc [1/2]" in out and "fc [2/2]" in out and "Total FLOPs" in out
    assert "Twice summary" in out


def test_guide_table_is_the_real_output() -> None:
    """The table shown in the summaries guide is what str(summary) prints for its model."""
    page = Path(__file__).parent.parent / "docs" / "guides" / "summaries.md"
    shown = page.read_text().split("```text\n", 1)[1].split("```", 1)[0]
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 16),
        nn.ReLU(inplace=True),
        nn.Linear(16, 2),
    )
    assert str(hs.summary(model, torch.randn(4, 8))) == shown


def _leaf_shapes(obj: Any) -> list[list[int]]:
    if isinstance(obj, Tensor):
        return [list(obj.shape)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, (tuple, list)):
        return [s for item in obj for s in _leaf_shapes(item)]
    return []


def _tree_shapes(tree: Any) -> list[list[int]]:
    """Every tensor shape in a row's shape tree (tuples of ints), depth first."""
    if isinstance(tree, tuple):
        return [list(tree)]
    if isinstance(tree, dict):
        tree = list(tree.values())
    return [s for item in tree for s in _tree_shapes(item)] if isinstance(tree, list) else []


@pytest.mark.parametrize("entry", list(ZOO.values()), ids=list(ZOO))
def test_zoo_rows_match_raw_hooks(entry: ZooEntry) -> None:
    """Every zoo model: one row per call, in call order, with the shapes raw hooks see."""
    model, args, kwargs = entry.build()
    root = zoo_unwrap(model)
    seen: list[tuple[str, list[list[int]]]] = []
    started: list[str] = []
    handles = []
    for name, module in root.named_modules():
        handles.append(module.register_forward_pre_hook(lambda m, a, n=name: started.append(n)))
        handles.append(
            module.register_forward_hook(
                lambda m, a, out, n=name: seen.append((n, _leaf_shapes(out)))
            )
        )
    flags = [(m, m.training) for m in root.modules()]
    try:
        root.eval()
        with torch.no_grad(), contextlib.suppress(Exception):
            root(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, flag in flags:
            m.training = flag
    if entry.raises is not None:
        with pytest.raises(entry.raises) as info:
            hs.summary(model, args, forward_kwargs=kwargs)
        s = info.value.summary  # type: ignore[attr-defined]
    else:
        s = hs.summary(model, args, forward_kwargs=kwargs)
    assert [r.name for r in s.rows] == started
    returned = [r for r in s.rows if not r.raised]
    shown = sorted((r.name, _tree_shapes(r.output)) for r in returned)
    assert shown == sorted((n, [list(x) for x in shapes]) for n, shapes in seen)
    assert s.total_params == sum(p.numel() for p in model.parameters())


def test_rich_missing_says_which_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    s = hs.summary(nn.Linear(2, 2), torch.ones(1, 2))
    monkeypatch.setitem(sys.modules, "rich.table", None)  # as if rich were not installed
    with pytest.raises(ImportError, match=r'pip install "hookscope\[rich\]"'):
        s.__rich__()
    assert "Linear summary" in str(s)  # the plain table needs nothing
