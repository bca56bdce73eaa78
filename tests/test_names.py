"""names() and selectors: exact, glob, regex, type, predicate, module, lists, wrappers."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import hookscope as hs
from hookscope.core._naming import resolve


def alexnet_like() -> nn.Module:
    class AlexNetish(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.features = nn.Sequential(
                nn.Conv2d(3, 4, 3),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(2),
                nn.Sequential(nn.Conv2d(4, 4, 3), nn.ReLU(inplace=True)),
            )
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(4 * 4 * 4, 10))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(self.features(x))

    return AlexNetish()


def test_names_lists_every_module_with_type() -> None:
    assert hs.names(alexnet_like()) == {
        "features": "Sequential",
        "features.0": "Conv2d",
        "features.1": "ReLU",
        "features.2": "MaxPool2d",
        "features.3": "Sequential",
        "features.3.0": "Conv2d",
        "features.3.1": "ReLU",
        "classifier": "Sequential",
        "classifier.0": "Flatten",
        "classifier.1": "Linear",
    }


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("features.3.0", ["features.3.0"]),
        ("features.*", ["features.0", "features.1", "features.2", "features.3"]),
        ("features.**.0", ["features.0", "features.3.0"]),
        ("**.1", ["features.1", "features.3.1", "classifier.1"]),
        ("features.?", ["features.0", "features.1", "features.2", "features.3"]),
        ("features.[02]", ["features.0", "features.2"]),
        (re.compile(r"features\.\d"), ["features.0", "features.1", "features.2", "features.3"]),
        (nn.Conv2d, ["features.0", "features.3.0"]),
        (lambda m: isinstance(m, nn.ReLU), ["features.1", "features.3.1"]),
        (lambda name, m: name.startswith("classifier."), ["classifier.0", "classifier.1"]),
        (
            ["classifier.1", nn.Conv2d, "classifier.1"],
            ["classifier.1", "features.0", "features.3.0"],
        ),
    ],
)
def test_selectors(selector: object, expected: list[str]) -> None:
    assert list(resolve(alexnet_like(), selector)) == expected  # type: ignore[arg-type]


def test_module_object_selector() -> None:
    model = alexnet_like()
    assert list(resolve(model, model.features[3][0])) == ["features.3.0"]
    with pytest.raises(hs.LayerNotFoundError, match="not part of this AlexNetish"):
        resolve(model, nn.Linear(2, 2))


def test_miss_names_selector_closest_and_how_to_list() -> None:
    with pytest.raises(
        hs.LayerNotFoundError,
        match=r"matches 'feature\.0'.*Closest names: 'features\.0'.*hookscope\.names\(model\)",
    ):
        hs.capture(alexnet_like(), ["classifier", "feature.0"])


def test_glob_star_hint() -> None:
    with pytest.raises(hs.LayerNotFoundError, match=r"use '\*\*' to cross dots"):
        resolve(alexnet_like(), "feat*.0.weird")


def test_regex_fullmatch_hint_and_bad_types() -> None:
    with pytest.raises(hs.LayerNotFoundError, match=r"re\.fullmatch"):
        resolve(alexnet_like(), re.compile("conv"))
    with pytest.raises(TypeError, match="cannot select layers with 3"):
        resolve(alexnet_like(), 3)  # type: ignore[arg-type]
    with pytest.raises(hs.LayerNotFoundError, match="empty layer selection"):
        resolve(alexnet_like(), [])


def test_shared_module_selectable_once() -> None:
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    assert hs.names(model) == {"0": "Linear", "1": "ReLU"}
    with hs.capture(model, "0") as cap:
        model(torch.randn(1, 2))
    assert cap["0"].count == 2


def test_names_through_dataparallel_and_compile() -> None:
    model = alexnet_like()
    compiled = torch.compile(model, backend="eager")  # before hookscope sees the model
    plain = hs.names(model)
    assert hs.names(nn.DataParallel(model)) == plain
    assert hs.names(compiled) == plain
    child_compiled = nn.Sequential(nn.Linear(2, 2), torch.compile(nn.Linear(2, 2), backend="eager"))
    assert hs.names(child_compiled) == {"0": "Linear", "1": "Linear"}
    assert hs.names(model, "features.3.*") == {"features.3.0": "Conv2d", "features.3.1": "ReLU"}


def test_capture_through_dataparallel_with_either_spelling() -> None:
    model = alexnet_like().eval()
    wrapped = nn.DataParallel(model)
    x = torch.randn(1, 3, 14, 14)
    with torch.no_grad(), hs.capture(wrapped, ["features.3.0", "module.classifier.1"]) as cap:
        out = wrapped(x)
    assert list(cap.records) == ["features.3.0", "classifier.1"]
    assert torch.equal(cap["module.classifier.1"].output, out)


@pytest.mark.mutates_model  # DDP's forward sets bookkeeping attributes on the wrapper
def test_capture_through_ddp(tmp_path: object) -> None:
    if not dist.is_available():
        pytest.skip("torch.distributed not built")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = alexnet_like().eval()
        ddp = nn.parallel.DistributedDataParallel(model)
        assert hs.names(ddp) == {n: type(m).__name__ for n, m in model.named_modules() if n}
        x = torch.randn(1, 3, 14, 14)
        with torch.no_grad(), hs.capture(ddp, "classifier.1") as cap:
            out = ddp(x)
        assert torch.equal(cap["classifier.1"].output, out)
    finally:
        dist.destroy_process_group()


def test_module_under_a_second_attribute_name_is_an_alias() -> None:
    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.first = nn.Linear(2, 2)
            self.again = self.first

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.again(x)

    model = Twice()
    assert hs.names(model) == {"first": "Linear"}
    assert list(resolve(model, "again")) == ["first"]
    with hs.capture(model, "again") as cap:
        out = model(torch.randn(1, 2))
    assert torch.equal(cap["again"].output, out.detach())


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Linear(2, 2), nn.ReLU()])
        self.heads = nn.ModuleDict({"out": nn.Linear(2, 1)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.heads["out"](x)


def test_names_mark_the_containers_capture_refuses() -> None:
    model = Blocks()
    listed = hs.names(model)
    assert listed == {
        "blocks": "ModuleList (container)",
        "blocks.0": "Linear",
        "blocks.1": "ReLU",
        "heads": "ModuleDict (container)",
        "heads.out": "Linear",
    }
    for name, kind in listed.items():  # what names marks is exactly what capture refuses
        if kind.endswith("(container)"):
            with pytest.raises(hs.UsageError, match="container"):
                hs.capture(model, name)
    layers = [n for n, kind in listed.items() if not kind.endswith("(container)")]
    with hs.capture(model, layers) as cap:
        model(torch.randn(3, 2))
    assert [cap[n].count for n in layers] == [1, 1, 1]
    with_ops = hs.names(model, ops=True, inputs=torch.randn(3, 2))
    assert with_ops["blocks"] == "ModuleList (container)" and "blocks.0::linear" in with_ops
