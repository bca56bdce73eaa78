"""hs.feature_grid / hs.feature_grids: feature maps tiled into uint8 grids (article 004).

Every expected pixel is written by hand (min -> 0, max -> 255, rounded half up), layer
outputs come from calling the layers directly, PNG files are read back with Pillow and
TensorBoard events with TensorBoard's own reader.
"""

from __future__ import annotations

import io
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import Tensor, nn
from torch.utils.tensorboard import SummaryWriter

import hookscope as hs
from hookscope.errors import UsageError

P = 200  # a pad value no hand-written map pixel below uses


def two_maps() -> Tensor:
    """Map 0 holds 0..8, map 1 the columns 10, 20, 30."""
    return torch.tensor(
        [[[0.0, 1, 2], [3, 4, 5], [6, 7, 8]], [[10.0, 20, 30], [10, 20, 30], [10, 20, 30]]]
    )


# k/8*255 rounded half up: 31.875 -> 32, 127.5 -> 128, 159.375 -> 159 ...; 15/30*255 = 127.5
EACH = [
    [P] * 9,
    [P, 0, 32, 64, P, 0, 128, 255, P],
    [P, 96, 128, 159, P, 0, 128, 255, P],
    [P, 191, 223, 255, P, 0, 128, 255, P],
    [P] * 9,
]
# one range 0..30: v/30*255 = 8.5 v: 8.5 -> 9, 25.5 -> 26, 42.5 -> 43, 59.5 -> 60
ALL = [
    [P] * 9,
    [P, 0, 9, 17, P, 85, 170, 255, P],
    [P, 26, 34, 43, P, 85, 170, 255, P],
    [P, 51, 60, 68, P, 85, 170, 255, P],
    [P] * 9,
]


# -- feature_grid: layout and values ---------------------------------------------------------
@pytest.mark.parametrize(("scale", "want"), [("each", EACH), ("all", ALL)])
def test_hand_computed_grid(scale: str, want: list[list[int]]) -> None:
    out = hs.feature_grid(two_maps(), padding=1, pad_value=P, scale=scale)
    assert out.dtype == torch.uint8 and out.device.type == "cpu"
    assert out.tolist() == want


def test_default_padding_is_two_pixels_of_zero() -> None:
    out = hs.feature_grid(two_maps())
    assert out.shape == (3 + 2 * 2, 2 * 3 + 3 * 2)
    assert out[2:5, 2:5].tolist() == [[0, 32, 64], [96, 128, 159], [191, 223, 255]]
    assert out[2:5, 7:10].tolist() == [[0, 128, 255]] * 3
    mask = torch.ones_like(out, dtype=torch.bool)
    mask[2:5, 2:5] = mask[2:5, 7:10] = False
    assert (out[mask] == 0).all()


def test_ncols_and_empty_cells() -> None:
    maps = torch.tensor([[[0.0, 1.0]], [[1.0, 0.0]], [[0.0, 2.0]]])  # three 1x2 maps
    assert hs.feature_grid(maps, padding=1, pad_value=P).tolist() == [  # ceil(sqrt(3)) = 2 per row
        [P] * 7,
        [P, 0, 255, P, 255, 0, P],
        [P] * 7,
        [P, 0, 255, P, P, P, P],  # the empty cell is padding
        [P] * 7,
    ]
    column = hs.feature_grid(maps, ncols=1, padding=0)
    assert column.tolist() == [[0, 255], [255, 0], [0, 255]]
    assert torch.equal(
        hs.feature_grid(maps, ncols=99, padding=0), hs.feature_grid(maps, ncols=3, padding=0)
    )
    assert hs.feature_grid(maps, ncols=3, padding=0).tolist() == [[0, 255, 255, 0, 0, 255]]


def test_batched_maps_one_sample_per_row() -> None:
    maps = torch.tensor(
        [[[[0.0, 1]], [[1.0, 0]], [[0.0, 3]]], [[[5.0, 4]], [[2.0, 2]], [[0.0, 9]]]]
    )
    assert hs.feature_grid(maps, padding=0).tolist() == [  # (N=2, C=3): ncols = C
        [0, 255, 255, 0, 0, 255],
        [255, 0, 0, 0, 0, 255],
    ]
    one = torch.arange(5.0).reshape(1, 5, 1, 1)  # N=1 is laid out like (C, H, W)
    assert torch.equal(hs.feature_grid(one), hs.feature_grid(one[0]))
    assert hs.feature_grid(one[0], padding=0).shape == (2, 3)  # ceil(sqrt(5)) = 3 per row


def test_constant_maps_are_black() -> None:
    maps = torch.tensor([[[9.0, 9], [9, 9]], [[18.0, 18], [18, 18]]])
    assert hs.feature_grid(maps, padding=0).tolist() == [[0, 0, 0, 0]] * 2
    assert hs.feature_grid(maps, padding=0, scale="all").tolist() == [[0, 0, 255, 255]] * 2


def test_non_finite_values() -> None:
    nan, inf = math.nan, math.inf
    maps = torch.tensor(
        [
            [[nan, 1.0, inf], [-inf, 3.0, 2.0]],
            [[nan, nan, nan], [inf, -inf, nan]],
            [[0.0, 0, 0], [0, 0, 6]],
        ]
    )
    out = hs.feature_grid(maps, ncols=3, padding=0)
    assert out.tolist() == [  # range from the finite values; +inf 255, -inf and NaN 0
        [0, 0, 255, 0, 0, 0, 0, 0, 0],
        [0, 255, 128, 255, 0, 0, 0, 0, 255],
    ]
    shared = hs.feature_grid(maps, ncols=3, padding=0, scale="all")  # one range: 0..6
    assert shared.tolist() == [
        [0, 43, 255, 0, 0, 0, 0, 0, 0],
        [0, 128, 85, 255, 0, 0, 0, 0, 255],
    ]


@pytest.mark.parametrize(
    "dtype", [torch.int64, torch.uint8, torch.int8, torch.float16, torch.bfloat16, torch.float64]
)
def test_any_real_dtype(dtype: torch.dtype) -> None:
    maps = torch.tensor([[[0, 1, 2]], [[4, 4, 4]]]).to(dtype)
    assert hs.feature_grid(maps, padding=0).tolist() == [[0, 128, 255, 0, 0, 0]]


def test_bool_maps() -> None:
    maps = torch.tensor([[[True, False]]])
    assert hs.feature_grid(maps, padding=0).tolist() == [[255, 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_input_is_not_modified(dtype: torch.dtype) -> None:
    maps = (two_maps() - 5).to(dtype).requires_grad_()
    before = maps.detach().clone()
    out = hs.feature_grid(maps)
    assert torch.equal(maps.detach(), before) and maps.requires_grad and maps.grad is None
    assert not out.requires_grad
    out[:] = 7  # the grid shares no memory with the input
    assert torch.equal(maps.detach(), before)


# -- feature_grid: errors ----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("maps", "match"),
    [
        (
            torch.zeros(3, 3),
            r"\(C, H, W\) or \(N, C, H, W\) tensor, got torch.float32 of shape "
            r"\(3, 3\); add a channel dimension with maps.unsqueeze\(0\)",
        ),
        (torch.zeros(1, 1, 1, 1, 1), r"of shape \(1, 1, 1, 1, 1\)"),
        (torch.zeros(0, 4, 4), r"non-empty .* of shape \(0, 4, 4\)"),
        (torch.zeros(2, 3, 3, dtype=torch.complex64), r"real .* got torch.complex64"),
        ([[[1.0]]], r"maps must be a torch.Tensor, got list"),
    ],
)
def test_bad_maps(maps: Any, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        hs.feature_grid(maps)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"ncols": 0}, r"ncols must be 1 or more, got 0"),
        ({"ncols": 2.0}, r"ncols must be an int, got 2.0 \(float\)"),
        ({"ncols": True}, r"ncols must be an int, got True \(bool\)"),
        ({"padding": -1}, r"padding must be 0 or more, got -1"),
        ({"pad_value": 256}, r"pad_value must be 0..255, got 256"),
        ({"pad_value": -1}, r"pad_value must be 0..255, got -1"),
        ({"scale": "max"}, r"scale must be \"each\" \(per map\) or \"all\" \(shared\), got 'max'"),
        ({"save": "grid.jpg"}, r"saved as PNG: give a .png path, got '.*grid.jpg'"),
    ],
)
def test_bad_options(options: dict[str, Any], match: str, tmp_path: Path) -> None:
    if "save" in options:
        options = {"save": tmp_path / options["save"]}
    with pytest.raises(UsageError, match=match):
        hs.feature_grid(two_maps(), **options)
    assert not list(tmp_path.iterdir())


# -- PNG files ---------------------------------------------------------------------------------
def read_png(path: Path) -> list[list[int]]:
    with Image.open(path) as image:
        assert image.format == "PNG" and image.mode == "L"
        width, height = image.size
        pixels = list(image.tobytes())
    return [pixels[r * width : (r + 1) * width] for r in range(height)]


def test_save_png(tmp_path: Path) -> None:
    path = tmp_path / "new" / "folder" / "maps.png"
    out = hs.feature_grid(two_maps(), padding=1, pad_value=P, save=path)
    assert read_png(path) == out.tolist() == EACH
    hs.feature_grid(
        two_maps(), padding=1, pad_value=P, scale="all", save=str(path)
    )  # str, overwrite
    assert read_png(path) == ALL


def test_missing_pillow(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "PIL", None)
    monkeypatch.setitem(sys.modules, "PIL.Image", None)
    with pytest.raises(ImportError, match=r'saving feature grids as PNG .* "hookscope\[images\]"'):
        hs.feature_grid(two_maps(), save=tmp_path / "g.png")
    assert hs.feature_grid(two_maps()).shape == (7, 12)  # without save= Pillow is not needed
    model = Counting()  # its forward raises: Pillow is looked for before the forward
    with pytest.raises(ImportError, match=r"hookscope\[images\]"):
        hs.feature_grids(model, torch.ones(1, 1, 2, 2), out_dir=tmp_path)
    assert not model.calls and not list(tmp_path.iterdir())


# -- feature_grids -----------------------------------------------------------------------------
def seed_conv() -> nn.Sequential:
    """Article 004: Conv2d(1, 2, 3), filter 0 all ones, filter 1 all twos, zero bias."""
    conv = nn.Conv2d(1, 2, 3)
    with torch.no_grad():
        conv.weight[0] = 1.0
        conv.weight[1] = 2.0
        nn.init.zeros_(conv.bias)
    return nn.Sequential(conv, nn.MaxPool2d(2, 2))


def test_article_004_seed_vector() -> None:
    model, x = seed_conv(), torch.ones(1, 1, 4, 4)
    assert model[0](x).tolist() == [[[[9.0, 9.0], [9.0, 9.0]], [[18.0, 18.0], [18.0, 18.0]]]]
    out = hs.feature_grids(model, x)
    assert list(out) == ["2x1x3x3"]
    assert out["2x1x3x3"].tolist() == [[0] * 10] * 6  # two constant 2x2 maps: black
    shared = hs.feature_grids(model, x, scale="all", padding=1, pad_value=P)["2x1x3x3"]
    assert shared.tolist() == [
        [P] * 7,
        [P, 0, 0, P, 255, 255, P],
        [P, 0, 0, P, 255, 255, P],
        [P] * 7,
    ]
    assert list(hs.feature_grids(model, x, group="layer")) == ["0"]


class Three(nn.Module):
    """Two convs with the same kernel shape (2x2x3x3) and one different (2x1x3x3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.c1 = nn.Conv2d(1, 2, 3)
        self.c2 = nn.Conv2d(2, 2, 3)
        self.act = nn.ReLU()
        self.c3 = nn.Conv2d(2, 2, 3)
        self.norm = nn.BatchNorm2d(2)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(self.c3(self.act(self.c2(self.c1(x)))))


def maps_by_hand(model: Three, x: Tensor, sample: int = 0) -> dict[str, Tensor]:
    with torch.no_grad():
        c1 = model.c1(x)
        c2 = model.c2(c1)
        c3 = model.c3(model.act(c2))
    return {"c1": c1[sample], "c2": c2[sample], "c3": c3[sample]}


def by_hand(v: float, lo: float, hi: float) -> int:
    return math.floor((v - lo) / (hi - lo) * 255 + 0.5) if hi > lo else 0


def test_grouped_by_kernel_shape() -> None:
    model, x = Three(), torch.randn(1, 1, 7, 7)
    ref = maps_by_hand(model, x)  # c1 (2, 5, 5), c2 (2, 3, 3), c3 (2, 1, 1)
    out = hs.feature_grids(model, x, padding=1, pad_value=P)
    assert list(out) == ["2x1x3x3", "2x2x3x3"]
    assert torch.equal(out["2x1x3x3"], hs.feature_grid(ref["c1"], padding=1, pad_value=P))
    group = out["2x2x3x3"]  # c2's two maps then c3's, 2 per row, in 3x3 cells
    assert group.shape == (2 * 4 + 1, 2 * 4 + 1)
    for i, (y, x0) in enumerate([(1, 1), (1, 5)]):
        assert torch.equal(
            group[y : y + 3, x0 : x0 + 3], hs.feature_grid(ref["c2"][i : i + 1], padding=0)
        )
    for y, x0 in [(5, 1), (5, 5)]:  # 1x1 maps are constant: 0, the rest of the cell padding
        assert group[y, x0] == 0
        cell = group[y : y + 3, x0 : x0 + 3].flatten().tolist()
        assert cell == [0] + [P] * 8
    assert (group[:, 0] == P).all() and (group[:, 4] == P).all() and (group[4] == P).all()


def test_grouped_with_one_shared_range() -> None:
    model, x = Three(), torch.randn(1, 1, 7, 7)
    ref = maps_by_hand(model, x)
    values = [*ref["c2"].flatten().tolist(), *ref["c3"].flatten().tolist()]
    lo, hi = min(values), max(values)
    group = hs.feature_grids(model, x, padding=0, pad_value=P, scale="all")["2x2x3x3"]
    for i, x0 in enumerate([0, 3]):
        want = [[by_hand(v, lo, hi) for v in row] for row in ref["c2"][i].tolist()]
        assert group[0:3, x0 : x0 + 3].tolist() == want
        assert group[3, x0].item() == by_hand(ref["c3"][i, 0, 0].item(), lo, hi)


def test_one_grid_per_layer_and_sample() -> None:
    model, x = Three(), torch.randn(3, 1, 7, 7)
    ref = maps_by_hand(model, x, sample=2)
    out = hs.feature_grids(model, x, group="layer", sample=2, ncols=1)
    assert list(out) == ["c1", "c2", "c3"]
    for name in out:
        assert torch.equal(out[name], hs.feature_grid(ref[name], ncols=1))
    picked = hs.feature_grids(model, x, ["c3", "act"], group="layer", padding=0)
    assert list(picked) == ["c3", "act"]  # selection order
    with torch.no_grad():
        act = model.act(model.c2(model.c1(x)))[0]
    assert torch.equal(picked["act"], hs.feature_grid(act, padding=0))


def test_model_left_as_found() -> None:
    model, x = Three().train(), torch.randn(2, 1, 7, 7)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    hs.feature_grids(model, x)
    assert all(m.training for m in model.modules())
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    assert all(p.requires_grad and p.grad is None for p in model.parameters())


class Counting(nn.Module):
    """A conv, then a layer that must never run: the forward stops after the conv."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.calls: list[int] = []  # the same list after a call: the model is not changed

    def forward(self, x: Tensor, *, boom: bool = True) -> Tensor:
        self.calls.append(1)
        out = self.conv(x)
        if boom:
            raise RuntimeError("ran past the last selected layer")
        return out


def test_one_forward_stopped_early_with_any_inputs() -> None:
    model = Counting()
    x = torch.tensor([[[[1.0, 2.0], [3.0, 4.0]]]])
    with torch.no_grad():
        want = hs.feature_grid(model.conv(x)[0], padding=0)
    assert torch.equal(hs.feature_grids(model, x, padding=0)["1x1x1x1"], want)
    assert torch.equal(hs.feature_grids(model, (x,), padding=0)["1x1x1x1"], want)
    assert torch.equal(hs.feature_grids(model, {"x": x, "boom": False}, padding=0)["1x1x1x1"], want)
    assert len(model.calls) == 3


class Tupled(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


class Odd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.flat = nn.Flatten()
        self.fc = nn.Linear(8, 3)
        self.pair = Tupled()
        self.blocks = nn.ModuleDict({"a/b c": nn.Conv2d(1, 1, 1)})

    def forward(self, x: Tensor) -> Tensor:
        self.pair(self.blocks["a/b c"](x))
        return self.fc(self.flat(self.conv(x)))


@pytest.mark.parametrize(
    ("layers", "match"),
    [
        (
            "fc",
            r"layer 'fc' \(Linear\) returned torch.float32 tensor of shape \(1, 3\), not a "
            r"real 4-D \(N, C, H, W\) tensor",
        ),
        ("pair", r"layer 'pair' \(Tupled\) returned tuple, not a real 4-D"),
    ],
)
def test_layer_outputs_that_are_not_maps(layers: str, match: str) -> None:
    with pytest.raises(UsageError, match=match):
        hs.feature_grids(Odd(), torch.ones(1, 1, 4, 4), layers, group="layer")


def test_kernel_grouping_needs_weights() -> None:
    model = Counting()  # its forward raises: the error must come before any forward
    model.conv = nn.Identity()  # type: ignore[assignment]
    with pytest.raises(UsageError, match=r"layer 'conv' \(Identity\) has no weight") as info:
        hs.feature_grids(model, torch.ones(1, 1, 2, 2), "conv")
    assert 'use group="layer"' in str(info.value)
    assert not model.calls


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"group": "type"}, r"group must be \"kernel\" or \"layer\", got 'type'"),
        ({"sample": 1}, r"sample=1 is out of range for layer '0''s batch of 1: use 0..0"),
        ({"sample": -1}, r"sample must be 0 or more, got -1"),
        ({"step": "3"}, r"step must be an int, got '3' \(str\)"),
        ({"padding": -2}, r"padding must be 0 or more, got -2"),
        ({"scale": "each_map"}, r"scale must be"),
    ],
)
def test_feature_grids_bad_options(options: dict[str, Any], match: str) -> None:
    with pytest.raises(UsageError, match=match):
        hs.feature_grids(seed_conv(), torch.ones(1, 1, 4, 4), **options)


def test_out_dir_png_files(tmp_path: Path) -> None:
    model, x = Odd(), torch.randn(1, 1, 4, 4)
    out_dir = tmp_path / "maps"
    out = hs.feature_grids(model, x, out_dir=out_dir, padding=1, pad_value=P)
    assert list(out) == ["2x1x3x3", "1x1x1x1"]
    assert sorted(p.name for p in out_dir.iterdir()) == ["1x1x1x1.png", "2x1x3x3.png"]
    for key, image in out.items():
        assert read_png(out_dir / f"{key}.png") == image.tolist()
    by_layer = hs.feature_grids(model, x, [nn.Conv2d], group="layer", out_dir=str(out_dir))
    assert list(by_layer) == ["conv", "blocks.a/b c"]
    assert read_png(out_dir / "conv.png") == by_layer["conv"].tolist()
    assert read_png(out_dir / "blocks.a_b_c.png") == by_layer["blocks.a/b c"].tolist()


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Tensor, dict[str, Any]]] = []

    def add_image(self, tag: str, img_tensor: Tensor, **kwargs: Any) -> None:
        self.calls.append((tag, img_tensor, kwargs))


def test_writer_calls() -> None:
    recorder = Recorder()
    out = hs.feature_grids(Three(), torch.randn(1, 1, 7, 7), writer=recorder, step=5)
    assert [(tag, kw) for tag, _, kw in recorder.calls] == [
        ("feature maps/2x1x3x3", {"global_step": 5, "dataformats": "HW"}),
        ("feature maps/2x2x3x3", {"global_step": 5, "dataformats": "HW"}),
    ]
    assert all(img is out[tag.split("/")[1]] for tag, img, _ in recorder.calls)


def test_tensorboard_round_trip(tmp_path: Path) -> None:
    model, x = Three(), torch.randn(1, 1, 7, 7)
    writer = SummaryWriter(log_dir=str(tmp_path))
    try:
        out = hs.feature_grids(model, x, writer=writer, step=322, pad_value=P)
        hs.feature_grids(model, x, writer=writer, step=323, group="layer")
    finally:
        writer.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0})
    events.Reload()
    assert sorted(events.Tags()["images"]) == [
        "feature maps/2x1x3x3",
        "feature maps/2x2x3x3",
        "feature maps/c1",
        "feature maps/c2",
        "feature maps/c3",
    ]
    for key, image in out.items():
        (event,) = events.Images(f"feature maps/{key}")
        assert event.step == 322 and (event.height, event.width) == tuple(image.shape)
        with Image.open(io.BytesIO(event.encoded_image_string)) as png:
            assert png.mode == "RGB"  # TensorBoard stores an HW image as three equal channels
            rgb = torch.tensor(list(png.tobytes()), dtype=torch.uint8)
        assert torch.equal(rgb.reshape(*image.shape, 3), image[..., None].expand(-1, -1, 3))
