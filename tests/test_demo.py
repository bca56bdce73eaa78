"""``hookscope demo --quick`` end to end as a real subprocess (run once for the whole test run:
``demo_run`` in conftest.py): the model it trains is measured here (accuracy on fresh held-out
images, pointing game against the shapes' masks), and its report is opened in a real headless
Chromium."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("click")
pytest.importorskip("matplotlib")
pytest.importorskip("PIL")

import browser
from conftest import DemoRun

pytestmark = pytest.mark.slow


@pytest.fixture
def demo(demo_run: DemoRun) -> tuple[Path, str]:
    return demo_run.report, demo_run.stdout


def _printed(stdout: str, label: str) -> float:
    found = re.search(rf"{label} ([\d.]+)", stdout)
    assert found, stdout
    return float(found[1])


def test_demo_trains_a_model_whose_maps_land_on_the_shapes(demo: tuple[Path, str]) -> None:
    report, stdout = demo
    assert report.is_file() and f"report: {report.resolve()}" in stdout
    accuracy, pointing = _printed(stdout, "accuracy"), _printed(stdout, "pointing game")
    center, random = _printed(stdout, "center"), _printed(stdout, "random")
    assert accuracy >= 0.85  # chance is 1/3
    assert pointing >= 0.85 and pointing >= center + 0.3 and pointing >= random + 0.3
    text = report.read_text()
    assert f"<b>{accuracy:.3f}</b>" in text  # the report says what the command printed


def test_demo_model_measured_independently(demo_run: DemoRun, shapes_cnn: nn.Module) -> None:
    """The model the demo trained, loaded from the weights it wrote, measured here on images
    it never saw, with the pointing game computed by hand (distance from each map's maximum to
    the shape's pixels)."""
    import hookscope as hs
    from hookscope.show._shapes import shapes

    assert f"weights: {demo_run.weights.resolve()}" in demo_run.stdout
    model = shapes_cnn  # loaded from demo_run.weights
    held_out, labels, _ = shapes(600, torch.Generator().manual_seed(12345), size=32)
    with torch.no_grad():  # the weights are the model the demo measured: its held-out images
        same = (model(held_out).argmax(1) == labels).float().mean().item()
    assert f"accuracy {same:.3f}" in demo_run.stdout, (same, demo_run.stdout)
    x, y, masks = shapes(300, torch.Generator().manual_seed(2024), size=32)
    with torch.no_grad():
        assert (model(x).argmax(1) == y).float().mean() >= 0.85
    maps = hs.GradCAM(model, "7")(x, targets=y).maps
    hits = 0
    for m, mask in zip(maps, masks):
        top = (m == m.max()).nonzero().float()  # (k, 2) maxima
        pixels = mask.nonzero().float()
        hits += bool((torch.cdist(top, pixels) < 0.067 * 32).any())
    assert hits / len(x) >= 0.85


def test_report_in_a_real_browser(demo: tuple[Path, str]) -> None:
    if browser.chromium() is None:
        if os.environ.get("HOOKSCOPE_REQUIRE_BROWSER"):
            pytest.fail("HOOKSCOPE_REQUIRE_BROWSER is set but no Chromium was found")
        pytest.skip("no Chromium here (scripts/test.sh installs Debian's chromium as root)")
    pytest.importorskip("playwright")
    report, _ = demo
    for width in (390, 1280):  # a phone, a laptop: the page fits, its images scale down
        fits = browser.look(report, width=width)
        assert fits.scroll_width <= width, (width, fits.scroll_width)
        assert fits.image_right and max(fits.image_right) <= width, (width, fits.image_right)
    seen = browser.look(report)
    assert seen.console_errors == [] and seen.page_errors == [] and seen.requests == []
    assert seen.images and all(i["ok"] and i["w"] > 0 and i["h"] > 0 for i in seen.images)
    assert seen.pixel_std > 20  # not a blank page
    text = report.read_text()
    # the structure matches what the report says it holds
    nav = text[text.index("<nav>") : text.index("</nav>")]
    assert seen.sections == re.findall(r'<a href="#(\w+)">', nav)
    assert seen.sections == [
        "overview",
        "training",
        "summary",
        "statistics",
        "features",
        "cam",
        "findings",
    ]
    assert seen.figures["cam"] == 9 + 1  # three of each shape, as the demo asks; the colour scale
    assert seen.figures["features"] == 3  # the CNN's three convolutions
    assert len(seen.images) == text.count("<img ")


def test_the_demo_output_folder_is_ignored_by_git() -> None:
    root = Path(__file__).resolve().parent.parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    done = subprocess.run(
        ["git", "check-ignore", "-q", "hookscope-demo/report.html"], cwd=root, check=False
    )
    assert done.returncode == 0  # `bash scripts/demo.sh` leaves no untracked file behind
