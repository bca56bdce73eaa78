"""hs.report: a self-contained HTML file whose sections hold what they say, whose findings are
the ones built into the test models, and which leaves the model (its .grad included) as found.
The same report in a real browser: tests/test_demo.py."""

from __future__ import annotations

import base64
import io
import re
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

pytest.importorskip("matplotlib")
Image = pytest.importorskip("PIL.Image")


class _Page(HTMLParser):
    """Sections (id -> tags inside), images, links and the CSP of a page."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.sections: dict[str, list[tuple[str, dict[str, str]]]] = {}
        self.current: str | None = None
        self.csp = ""
        self.sources: list[str] = []
        self.links: list[str] = []
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.current = a["id"]
            self.sections[self.current] = []
        elif self.current is not None:
            self.sections[self.current].append((tag, a))
        if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy":
            self.csp = a["content"]
        if tag in ("img", "script", "link", "iframe", "source"):
            self.sources.append(a.get("src", a.get("href", "")))
        if tag == "a":
            self.links.append(a["href"])

    def handle_endtag(self, tag: str) -> None:
        if tag == "section":
            self.current = None

    def count(self, section: str, tag: str) -> int:
        return sum(t == tag for t, _ in self.sections[section])


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 8, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def _decode(uri: str) -> Any:
    assert uri.startswith("data:image/png;base64,")
    image = Image.open(io.BytesIO(base64.b64decode(uri.split(",", 1)[1])))
    image.load()
    return image


def test_sections_images_and_no_network(tmp_path: Path) -> None:
    model, x = _cnn(), torch.randn(5, 3, 16, 16)
    path = hs.report(model, x, tmp_path / "sub" / "r.html", max_images=4, classes=["a", "b", "c"])
    text = path.read_text()
    page = _Page(text)
    assert list(page.sections) == [
        "overview",
        "summary",
        "statistics",
        "features",
        "cam",
        "findings",
    ]
    assert [f"#{s}" for s in page.sections] == [
        link for link in page.links if link.startswith("#")
    ][:6]
    assert page.csp.startswith("default-src 'none'") and "img-src data:" in page.csp
    assert page.sources and all(s.startswith("data:image/png;base64,") for s in page.sources)
    assert not re.search(r"https?://", text)  # nothing to fetch, no CDN
    for src in page.sources:
        assert min(_decode(src).size) > 0
    # what the sections hold: one figure per CAM image (max_images), one grid per conv layer
    # the overlays and their colour scale
    assert page.count("cam", "figure") == 4 + 1 and page.count("features", "figure") == 2
    with torch.no_grad():
        top = model(x).argmax(1)
    captions = re.findall(r"<figcaption>#(\d): (\w) \(logit", text)
    assert [(int(i), c) for i, c in captions] == [(i, "abc"[int(k)]) for i, k in enumerate(top[:4])]
    # the summary table: one row per call, the hand-counted conv FLOPs in the totals
    conv_flops = 2 * 5 * 16 * 16 * (4 * 3 * 9 + 8 * 4 * 9)  # 2 * N * H * W * Cout * Cin * k*k
    assert page.count("summary", "tr") == 1 + 8  # header + model + 7 layers
    assert f"{conv_flops + 2 * 5 * 8 * 3:,} FLOPs" in text  # + the linear layer
    assert not list(tmp_path.glob("sub/*.partial"))


def test_gradients_and_modes_are_left_as_found(tmp_path: Path) -> None:
    model = _cnn().train()
    model(torch.randn(2, 3, 8, 8)).sum().backward()
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    hs.report(model, torch.randn(2, 3, 8, 8), tmp_path / "r.html")
    assert model.training
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, before[n]), n


class _Scale(nn.Module):
    def __init__(self, k: float) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: Tensor) -> Tensor:
        return x * self.k


def _findings(text: str) -> list[str]:
    return re.findall(r'<li class="(?:warn|ok)">(.*?)</li>', text)


def _dead_column(text: str) -> dict[str, str]:
    """The statistics table's "dead %" cell of each layer."""
    head = re.search(r"<thead><tr>(.*?)</tr></thead>", text.split('id="statistics"')[1])
    assert head is not None
    column = re.findall(r"<th[^>]*>([^<]*)</th>", head[1]).index("dead %")
    table = text.split('id="statistics"')[1].split("</table>")[0]
    rows = [re.findall(r"<td[^>]*>([^<]*)</td>", r) for r in table.split("<tr>")[2:]]
    return {cells[0]: cells[column] for cells in rows}


def test_findings_name_dead_units_nonfinite_values_and_gradient_spans(tmp_path: Path) -> None:
    torch.manual_seed(0)
    dead = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))
    with torch.no_grad():
        dead[0].bias[:3] = -100.0  # three of six units can never be positive: 50 % dead
    text = hs.report(dead, torch.randn(8, 4), tmp_path / "dead.html").read_text()
    assert any(
        "Dead units" in f
        and "on any of the 8 input(s)" in f
        and "<code>1</code> (ReLU): 50 % of its channels" in f
        for f in _findings(text)
    ), _findings(text)
    assert _dead_column(text) == {"0": "-", "1": "50.0", "2": "-"}

    for bias, dead in ((-1.0, 0), (-100.0, 50)):
        torch.manual_seed(0)
        tanh = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))
        with torch.no_grad():  # half the units held at tanh(-1) (a gradient passes: alive),
            tanh[0].weight[:3] = 0.0  # or at tanh(-100) = -1.0 (saturated: none does)
            tanh[0].bias[:3] = bias
        text = hs.report(tanh, torch.randn(8, 4), tmp_path / "tanh.html").read_text()
        assert _dead_column(text)["1"] == f"{dead:.1f}"  # the table and the findings agree
        said = [f for f in _findings(text) if "Dead units" in f]
        assert len(said) == (1 if dead else 0), _findings(text)
        assert not dead or f"<code>1</code> (Tanh): {dead} % of its channels" in said[0]

    torch.manual_seed(0)
    steep = nn.Sequential(
        nn.Linear(4, 4), _Scale(1e5), nn.Linear(4, 4), _Scale(1e5), nn.Linear(4, 2)
    )
    text = hs.report(steep, torch.randn(8, 4), tmp_path / "steep.html").read_text()
    # gradients w.r.t. each output: 1e10 times larger before the two scalings than after
    span = re.search(
        r"Gradient norms span ([\d.]+) orders of magnitude: \S+ at <code>0</code> \(Linear\) .* "
        r"at <code>4</code> \(Linear\)",
        text,
    )
    assert span and 9 <= float(span[1]) <= 11, _findings(text)

    from cli_models import nan_model

    text = hs.report(nan_model(), torch.randn(8, 4), tmp_path / "nan.html").read_text()
    # the log layer (1) produces it, the next watched layer (2) shows 16 of them
    assert (
        "First non-finite value in the forward: <code>1</code> (operator <code>aten.log</code>)."
        in _findings(text)
    )
    assert any(
        f.startswith("Non-finite values") and f.endswith("<code>2</code> (Linear): 16 values.")
        for f in _findings(text)
    )

    text = hs.report(_cnn(), torch.randn(2, 3, 8, 8), tmp_path / "ok.html").read_text()
    assert "Non-finite" not in text
    # 2 * N * H * W * Cout * Cin * 9 per convolution, 2 * N * 8 * 3 for the linear layer
    convs = 2 * 2 * 64 * 4 * 3 * 9, 2 * 2 * 64 * 8 * 4 * 9
    total = sum(convs) + 2 * 2 * 8 * 3
    assert (
        f"Layers with the largest share of the {total:,} FLOPs: <code>2</code> (Conv2d): "
        f"{100 * convs[1] / total:.0f} %; <code>0</code> (Conv2d): {100 * convs[0] / total:.0f} %; "
        "<code>6</code> (Linear): &lt; 1 %." in text
    )


def test_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(hs.UsageError, match=r"\.html"):
        hs.report(_cnn(), torch.randn(1, 3, 8, 8), tmp_path / "r.txt")
    with pytest.raises(hs.UsageError, match="max_images"):
        hs.report(_cnn(), torch.randn(1, 3, 8, 8), tmp_path / "r.html", max_images=-1)
    assert not list(tmp_path.iterdir())


def test_models_without_class_logits_get_statistics_and_say_why_no_cam(tmp_path: Path) -> None:
    """A backbone (image features, no classifier) and a token encoder: the statistics come from
    each sample's output norm, hand-checked here on the last layer's gradient."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 5, 3))
    x = torch.randn(2, 3, 10, 10)
    text = hs.report(backbone, x, tmp_path / "b.html").read_text()
    assert "No Grad-CAM: class targets need (N, classes) logits" in text
    out = backbone(x)
    want = torch.autograd.grad(out.flatten(1).norm(dim=1).sum(), out)[0].norm()
    grads = re.findall(
        r"<tr><td>2</td><td>Conv2d</td>(?:<td class=n>[^<]*</td>){4}<td class=n>([^<]*)</td>", text
    )
    assert grads and float(grads[0]) == pytest.approx(float(want), rel=1e-2)  # 3 digits shown
    encoder = nn.Sequential(nn.Embedding(20, 8), nn.Linear(8, 8))
    ids = torch.randint(0, 20, (3, 5))
    text = hs.report(encoder, ids, tmp_path / "e.html").read_text()
    assert "No image input" in text and '<section id="statistics">' in text


def test_plots_label_every_layer_and_axis_and_draw_no_lines_between_layers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from hookscope.show import _plots

    figures: list[Any] = []
    monkeypatch.setattr(_plots, "_png", lambda plt, fig: figures.append(fig) or b"")
    labels = [f"layer{i}.block.conv (Conv2d)" for i in range(60)]  # many: none may be skipped
    values = [float(i) for i in range(60)]
    _plots.layer_panels(
        labels,
        [
            _plots.Panel("a", "value (unit)", {"mean": values}, errors={"mean": values}),
            _plots.Panel("b", "% of outputs", {"x": values, "y": values}, kind="bars"),
            _plots.Panel("c", "norm, log scale", {"g": [0.0, *values[1:]]}, log=True),
        ],
    )
    axes = [ax for fig in figures for ax in fig.axes]
    assert len(figures) == len(axes) == 3  # one image per panel
    for ax in axes:
        assert [t.get_text() for t in ax.get_yticklabels()] == labels
        assert ax.get_xlabel() and ax.get_ylabel()
        for line in ax.get_lines():  # points and error caps only, never a polyline
            assert line.get_linestyle() in ("None", "") or len(line.get_xdata()) <= 1
    import matplotlib.pyplot as plt

    for fig in figures:
        plt.close(fig)


@pytest.mark.slow
def test_figure_text_is_readable_on_a_phone_and_a_desktop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every figure with text (the statistics panels, the CAM colour scale), as Chromium lays
    the report out at 390 and 1280 px: its smallest text, in matplotlib's own sizes, scaled
    as the page scales the image, is at least 9 CSS pixels. (The three panels drawn as one
    1,450 px image were shown at a quarter of that on a phone: 3 px text.)"""
    import os

    import browser

    if browser.chromium() is None:
        if os.environ.get("HOOKSCOPE_REQUIRE_BROWSER"):
            pytest.fail("HOOKSCOPE_REQUIRE_BROWSER is set but no Chromium was found")
        pytest.skip("no Chromium here (scripts/test.sh installs Debian's chromium as root)")
    import matplotlib.text
    from playwright.sync_api import sync_playwright

    from hookscope.show import _plots

    smallest: dict[str, float] = {}  # an image's base64 data: its smallest text, in image px
    real = _plots._png

    def measured(plt: Any, fig: Any) -> bytes:
        texts = [t for t in fig.findobj(matplotlib.text.Text) if t.get_visible() and t.get_text()]
        size = min(t.get_fontsize() for t in texts) * fig.dpi / 72  # points to pixels
        data = real(plt, fig)
        smallest[base64.b64encode(data).decode()] = size
        return data

    monkeypatch.setattr(_plots, "_png", measured)
    path = hs.report(_cnn(), torch.randn(2, 3, 16, 16), tmp_path / "r.html")
    assert len(smallest) >= 2  # the statistics and the colour scale
    shown = []
    with sync_playwright() as p:
        chromium = p.chromium.launch(
            executable_path=browser.chromium(),
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            for width in (390, 1280):
                page = chromium.new_page(viewport={"width": width, "height": 900})
                page.goto(path.resolve().as_uri(), wait_until="load")
                images = page.eval_on_selector_all(
                    "img",
                    "els => els.map(e => [e.src, e.getBoundingClientRect().width, e.naturalWidth])",
                )
                for src, css_width, natural in images:
                    data = src.split(",", 1)[1]
                    if data in smallest:
                        shown.append((width, smallest[data] * css_width / natural))
        finally:
            chromium.close()
    assert len(shown) == 2 * len(smallest)
    assert all(px >= 9 for _, px in shown), shown


def test_the_cam_section_explains_its_colours_and_scores(tmp_path: Path) -> None:
    model, x = _cnn(), torch.randn(3, 3, 16, 16)
    text = hs.report(model, x, tmp_path / "r.html").read_text()
    cam = text[text.index('<section id="cam">') :]
    assert "Colour scale of the overlays: each map is scaled to 0..1 on its own" in cam
    assert "The logit is the model's raw output for that class" in cam
    with torch.no_grad():
        logits = model(x)
    p = logits.softmax(1).max(1).values
    for i in range(3):
        assert f"(logit {float(logits[i].max()):.3g}, softmax {float(p[i]):.3f})" in cam


def test_the_map_section_draws_any_method_that_needs_no_argument(tmp_path: Path) -> None:
    """``cam_method``: integrated gradients over the input of a CNN (per-channel maps drawn as
    their largest absolute value), attention rollout of a small SDPA vision transformer; the
    overlays are those of the library's own call."""
    import cli_models

    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    for model, method in (
        (_cnn(), "integrated_gradients"),
        (cli_models.small_vit(), "attention_rollout"),
    ):
        text = hs.report(model, x, tmp_path / f"{method}.html", cam_method=method).read_text()
        page = _Page(text)
        assert f"<h2>Attribution: {method}</h2>" in text or f"Attribution: {method}" in text
        assert page.count("cam", "img") == 1 + 2  # the colour scale and one overlay per image
        exp = hs.explain.METHODS[method].cls(model)(x)
        plane = exp.maps.abs().amax(1) if exp.maps.dim() == 4 else exp.maps
        picture = hs.overlay(x[0], plane[0], alpha=0.45)
        sources = [a["src"] for t, a in page.sections["cam"] if t == "img"]
        shown = Image.open(io.BytesIO(base64.b64decode(sources[1].split(",", 1)[1])))
        assert torch.equal(
            torch.frombuffer(bytearray(shown.convert("RGB").tobytes()), dtype=torch.uint8),
            picture.flatten(),
        )
    with pytest.raises(hs.UsageError, match=r"cam_method must be one of .*, got 'occlusion'"):
        hs.report(_cnn(), x, tmp_path / "r.html", cam_method="occlusion")
