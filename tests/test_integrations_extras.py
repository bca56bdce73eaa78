"""Each integration and tracker sink is an extra: without its library, importing or building
it fails with the exact install line; the callbacks' and maps' arguments are checked before
any training starts."""

from __future__ import annotations

import importlib
import sys

import pytest
import torch

import hookscope as hs
from hookscope.integrations import Maps


@pytest.mark.parametrize(
    ("module", "missing", "extra"),
    [
        ("hookscope.integrations.lightning", "lightning", "lightning"),
        ("hookscope.integrations.transformers", "transformers", "transformers"),
    ],
)
def test_a_callback_without_its_trainer_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, module: str, missing: str, extra: str
) -> None:
    for name in [m for m in sys.modules if m.startswith(f"{missing}.")]:
        monkeypatch.delitem(sys.modules, name)  # imported by earlier tests: forgotten here
    monkeypatch.setitem(sys.modules, missing, None)  # `import missing` raises ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf'pip install "hookscope\[{extra}\]"'):
        importlib.import_module(module)


@pytest.mark.parametrize(("sink", "extra"), [("WandbSink", "wandb"), ("MLflowSink", "mlflow")])
def test_a_tracker_sink_without_its_library_names_its_extra(
    monkeypatch: pytest.MonkeyPatch, sink: str, extra: str
) -> None:
    import hookscope.diagnose

    monkeypatch.setitem(sys.modules, extra, None)
    with pytest.raises(ImportError, match=rf'pip install "hookscope\[{extra}\]"'):
        getattr(hookscope.diagnose, sink)()


def test_arguments_are_checked_when_the_callback_is_made() -> None:
    pytest.importorskip("lightning")
    from hookscope.integrations.lightning import HookscopeCallback

    for bad, match in [
        ({"every": 0}, "every must be"),
        ({"ranks": "all"}, "ranks must be"),
        ({"nonfinite": "loud"}, "nonfinite must be"),
        ({"histograms": "some"}, "histograms must be"),
        ({"maps": "gradcam"}, "maps must be"),
        ({"monitor": False}, "nothing to do"),
    ]:
        with pytest.raises(hs.UsageError, match=match):
            HookscopeCallback(**bad)


def test_maps_arguments() -> None:
    images = torch.zeros(2, 3, 8, 8)
    with pytest.raises(hs.UsageError, match="method must be a CAM"):
        Maps(images, layer="0", method="saliency")  # an input-space method: no layer map
    with pytest.raises(hs.UsageError, match="needs options="):
        Maps(images, layer="0", method="cam")  # CAM needs the classifier: options={"fc": ...}
    with pytest.raises(hs.UsageError, match=r"images \(N, C, H, W\)"):
        Maps(torch.zeros(2, 8), layer="0")
    with pytest.raises(hs.UsageError, match="every must be"):
        Maps(images, layer="0", every=0)
    assert Maps(images, layer="net.3").name == "maps/gradcam/net.3"
    assert [e for e in range(6) if Maps(images, layer="0", every=3).due(e)] == [0, 3]
