"""hs.summary on models that broke it: compiled after running, nested tensors, lazy modules,
TorchScript, forward keywords that collide with summary's options.

Expected counts are written by hand from the shapes (2 FLOPs per multiply-accumulate).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from hookscope.look import NestedShape, format_shape


def _rows(s: hs.Summary) -> list[tuple[str, str, object, int, int, bool]]:
    return [(r.name, r.type, r.output, r.flops, r.flops_total, r.raised) for r in s.rows]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4)))


@pytest.mark.parametrize("how", ["wrapper", "in_place", "submodule"])
def test_compiled_model_that_already_ran_equals_the_eager_summary(how: str) -> None:
    x = torch.randn(2, 3)
    eager = hs.summary(_model(), x)
    model = _model()
    if how == "wrapper":
        model = torch.compile(model, backend="eager")
    elif how == "in_place":
        model.compile(backend="eager")
    else:  # a compiled block inside an eager model: its rows keep the eager names
        model[2] = torch.compile(model[2], backend="eager")  # type: ignore[assignment]
    model(x)  # the compiled code has run: hooks added now would be ignored by it
    try:
        s = hs.summary(model, x)
    finally:
        torch._dynamo.reset()
    assert _rows(s) == _rows(eager)
    assert s.total_flops == eager.total_flops == 2 * 2 * (3 * 4 + 4 * 4)
    assert s.uncounted == eager.uncounted


def _encoder(layers: int, e: int, f: int) -> nn.Module:
    layer = nn.TransformerEncoderLayer(e, 2, f, batch_first=True, dropout=0.0)
    return nn.TransformerEncoder(layer, layers, enable_nested_tensor=True).eval()


# torch's own warning, on the model's first nested tensor (a plain forward warns the same)
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")
def test_nested_tensors_of_a_padded_transformer_encoder() -> None:
    """In eval mode with a padding mask, nn.TransformerEncoder turns the batch into a nested
    tensor: its layers see ragged sequences (here 5 and 3 tokens)."""
    torch.manual_seed(0)
    e, f, n = 8, 16, 2
    model = _encoder(n, e, f)
    x = torch.randn(2, 5, e)
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    s = hs.summary(model, x, forward_kwargs={"src_key_padding_mask": mask})
    rows = {r.name: r for r in s.rows}
    ragged = NestedShape(((5, e), (3, e)))
    assert rows["layers.0"].inputs == {"src": ragged} and rows["layers.0"].output == ragged
    assert format_shape(ragged) == "nested[2, (5|3), 8]"
    assert rows["layers.1.linear1"].output == NestedShape(((5, f), (3, f)))
    assert rows[""].output == (2, 5, e)  # padded again at the end
    # per sequence of s tokens: Q, K, V and output projections, Q·Kᵀ and A·V over s x s,
    # and the two feed-forward matrices
    per_layer = sum(2 * 4 * s_ * e * e + 2 * 2 * s_ * s_ * e + 2 * 2 * s_ * e * f for s_ in (5, 3))
    assert s.total_flops == n * per_layer
    assert rows["layers.0.self_attn"].flops == sum(
        2 * 4 * s_ * e * e + 2 * 2 * s_ * s_ * e for s_ in (5, 3)
    )
    assert rows["layers.0.linear1"].flops == 2 * (5 + 3) * e * f
    assert "nested[2, (5|3), 8]" in s.to_text(max_width=None)
    back = hs.Summary.from_json(s.to_json())
    assert back.rows[1].output == ragged and back == s


def test_lazy_modules_are_counted_after_the_forward_on_a_copy() -> None:
    model = nn.Sequential(nn.LazyLinear(4), nn.ReLU(), nn.LazyLinear(2))
    s = hs.summary(model, torch.randn(5, 3))
    assert s.total_params == (3 * 4 + 4) + (4 * 2 + 2)
    assert [(r.name, r.type, r.params) for r in s.rows] == [
        ("", "Sequential", 0),
        ("0", "Linear", 16),
        ("1", "ReLU", 0),
        ("2", "Linear", 10),
    ]
    assert s.total_flops == 2 * 5 * (3 * 4 + 4 * 2)
    # the user's model is still lazy: the forward ran on a copy
    assert isinstance(model[0], nn.LazyLinear)
    assert torch.nn.parameter.is_lazy(model[0].weight)


def _script(module: nn.Module) -> torch.jit.ScriptModule:
    with pytest.warns(DeprecationWarning, match="deprecated"):  # torch 2.13 deprecates it
        scripted: torch.jit.ScriptModule = torch.jit.script(module)
    return scripted


class WithScripted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 4)
        self.block = _script(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
        self.head = nn.Linear(4, 1)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.block(self.pre(x)))


def test_torchscript_submodule_is_an_opaque_row() -> None:
    s = hs.summary(WithScripted(), torch.randn(2, 3))
    assert [(r.name, r.type, r.opaque) for r in s.rows] == [
        ("", "WithScripted", False),
        ("pre", "Linear", False),
        ("head", "Linear", False),
        ("block", "Sequential", True),  # after its caller's other calls: when it ran is unseen
    ]
    block = s.rows[3]
    assert block.parent == 0 and block.params_total == 4 * 4 + 4 and block.output is None
    # its insides run in C++, unhooked: their operators count in the caller's own FLOPs
    assert s.rows[0].flops == 2 * 2 * 4 * 4
    assert s.total_flops == 2 * 2 * (3 * 4 + 4 * 4 + 4 * 1)
    assert s.total_params == 16 + 20 + 5
    assert "(TorchScript: not hooked)" in str(s)


def test_fully_scripted_model_is_refused_clearly() -> None:
    scripted = _script(nn.Sequential(nn.Linear(3, 3), nn.ReLU()))
    with pytest.raises(hs.UnsupportedModelError, match="does not allow Python hooks"):
        hs.summary(scripted, torch.randn(2, 3))


class Timed(nn.Module):
    """A forward whose own keywords are named like summary's options."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(2, 2)

    def forward(self, x: Tensor, time: Tensor | None = None, depth: int = 0) -> Tensor:
        y = self.fc(x)
        return y if time is None else y * time + depth


def test_forward_keywords_named_like_options_reach_the_model() -> None:
    x, t = torch.randn(3, 2), torch.randn(3, 1)
    s = hs.summary(Timed(), x, forward_kwargs={"time": t, "depth": 5})
    assert s.rows[0].inputs == {"x": (3, 2), "time": (3, 1)}
    assert s.rows[0].time_ms is None  # summary's own time= stayed off
    s = hs.summary(Timed(), {"x": x, "time": t}, time=True)
    assert s.rows[0].inputs == {"x": (3, 2), "time": (3, 1)} and s.rows[0].time_ms is not None
    with pytest.raises(TypeError, match="mask"):  # the forward's keywords: forward_kwargs=
        hs.summary(Timed(), x, mask=t)  # type: ignore[call-arg]
