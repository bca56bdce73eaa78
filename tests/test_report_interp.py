"""A patching grid as a heatmap and the logit lens as a table: in the HTML report, in a real
browser, and as text for the terminal (``Patching.to_text``, ``Lens.to_text``).

Oracles: grids and lenses built by hand (their values, colours and likeliest tokens worked out
here, the colours from the documented ends of the scale); for a real sweep, each cell of the
page against ``Patching.at`` of its labels, in the nested order of layers, heads, positions."""

from __future__ import annotations

import io
import os
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest
import torch

import hookscope as hs

pytest.importorskip("matplotlib")
pytest.importorskip("PIL.Image")
transformers = pytest.importorskip("transformers")

NAN = float("nan")


class _Cells(HTMLParser):
    """The ``<td>`` of a page that carry data attributes, in document order, and the section
    ids."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.cells: list[dict[str, str]] = []
        self.sections: list[str] = []
        self._open: dict[str, str] | None = None
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = {k: v or "" for k, v in attrs}
        if tag == "section":
            self.sections.append(a["id"])
        if tag == "td" and "data-layer" in a:
            self._open = {**a, "text": ""}
            self.cells.append(self._open)

    def handle_data(self, data: str) -> None:
        if self._open is not None:
            self._open["text"] += data

    def handle_endtag(self, tag: str) -> None:
        if tag == "td":
            self._open = None


def _gpt2() -> Any:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50)
    return transformers.GPT2LMHeadModel(config).eval()


def _runs() -> tuple[torch.Tensor, torch.Tensor, Any]:
    clean = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    corrupt = torch.cat([clean[:, :1], clean[:, 1:].flip(1)], 1)
    a, b = int(clean[0, -1]), int(clean[1, -1])
    return clean, corrupt, lambda out: (out.logits[:, -1, a] - out.logits[:, -1, b]).mean()


def _hand_grid() -> hs.Patching:
    values = torch.tensor([[-4.0, 0.0, 4.0], [1.0, NAN, -1.0]])
    return hs.Patching(values, ("blocks.0", "blocks.1"), (0, 2, 5))


def _hand_lens() -> hs.Lens:
    """Two layers, one sample, two positions, a vocabulary of four, logits the logarithms of
    chosen probabilities: each cell's likeliest tokens are known."""
    probs = torch.tensor(
        [
            [[[0.1, 0.6, 0.2, 0.1], [0.05, 0.15, 0.3, 0.5]]],
            [[[0.7, 0.1, 0.15, 0.05], [0.4, 0.35, 0.2, 0.05]]],
        ]
    )
    return hs.Lens(probs.log(), ("embed", "block"), (0, 1))


def _report(tmp_path: Path, **kwargs: Any) -> tuple[str, _Cells]:
    model = _gpt2()
    ids = torch.randint(0, 50, (1, 6), generator=torch.Generator().manual_seed(0))
    path = hs.report(model, ids, tmp_path / "r.html", **kwargs)
    text = path.read_text()
    return text, _Cells(text)


def test_heatmap_cells_hold_the_sweep_in_the_order_of_at(tmp_path: Path) -> None:
    model = _gpt2()
    clean, corrupt, metric = _runs()
    resid = hs.patching(model, clean, corrupt, metric, ["transformer.drop", "transformer.h.0"])
    z = [f"transformer.h.{i}.attn::scaled_dot_product_attention" for i in range(2)]
    heads = hs.patching(model, clean, corrupt, metric, z, heads=True, positions=[-1, 1])
    _, page = _report(tmp_path, patching=[resid, heads])
    cells = [c for c in page.cells if "data-value" in c]
    expected = [(layer, p, None) for layer in resid.layers for p in resid.positions]
    expected += [(layer, p, h) for layer in heads.layers for h in heads.heads for p in (4, 1)]
    got = [
        (
            c["data-layer"],
            int(c["data-position"]),
            int(c["data-head"]) if "data-head" in c else None,
        )
        for c in cells
    ]
    assert got == expected  # rows: layers (then heads); columns: positions as the grid has them
    for cell, (layer, p, h) in zip(cells, expected, strict=True):
        assert float(cell["data-value"]) == (resid if h is None else heads).at(layer, p, h)
        assert cell["text"] == f"{float(cell['data-value']):.3g}"
    assert resid.values.std() > 0 and heads.values.std() > 0  # cells that differ
    assert page.sections[:2] == ["overview", "patching"] and "lens" not in page.sections


def test_colours_diverge_at_zero_and_not_finite_cells_are_grey(tmp_path: Path) -> None:
    text, page = _report(tmp_path, patching=_hand_grid())
    colours = {
        (c["data-layer"], int(c["data-position"])): (c["style"], c["data-value"], c["text"])
        for c in page.cells
    }
    # ColorBrewer RdBu's ends at the largest |value| (4), white at 0; 1 and -1 a quarter of
    # the way from white: red 255 + (178 - 255) / 4 = 235.75 -> 236 (0xec), then 197.25 ->
    # 197 (0xc5), 202 (0xca); blue 199.5 -> 200 (0xc8), 216.75 -> 217 (0xd9), 234.25 -> 234
    assert colours["blocks.0", 0][0] == "background:#2166ac"
    assert colours["blocks.0", 2][0] == "background:#ffffff"
    assert colours["blocks.0", 5][0] == "background:#b2182b"
    assert colours["blocks.1", 0][0] == "background:#ecc5ca"
    assert colours["blocks.1", 5][0] == "background:#c8d9ea"
    assert colours["blocks.1", 2] == ("background:#d0d5de", "nan", "nan")
    assert "colour: -4 <span" in text and "</span> 4 (0 is white" in text  # the legend's range


def test_an_all_zero_or_all_nan_grid_is_white_or_grey(tmp_path: Path) -> None:
    grids = [
        hs.Patching(torch.zeros(1, 2), ("a",), (0, 1)),
        hs.Patching(torch.full((1, 2), NAN), ("b",), (0, 1)),
    ]
    _, page = _report(tmp_path, patching=grids)
    assert [c["style"] for c in page.cells] == ["background:#ffffff"] * 2 + [
        "background:#d0d5de"
    ] * 2


def test_tokens_label_the_columns_and_the_lens_table_holds_the_likeliest_tokens(
    tmp_path: Path,
) -> None:
    text, page = _report(
        tmp_path,
        patching=_hand_grid(),
        lens=_hand_lens(),
        tokens=["The", " cat", " sat", " on", " the", " mat"],
        tokenizer=lambda i: "abcd"[i],
    )
    assert page.sections[:3] == ["overview", "patching", "lens"]
    assert '<th scope="col">5 &#x27; mat&#x27;</th>' in text  # position 5, its token
    lens = {(c["data-layer"], int(c["data-position"])): c for c in page.cells if "data-tokens" in c}
    assert lens["embed", 0]["data-tokens"].split()[:2] == ["1", "2"]
    assert lens["embed", 0]["text"].startswith("'b' 0.60'c' 0.20")  # <br> between them
    assert lens["embed", 1]["text"].startswith("'d' 0.50'c' 0.30")
    assert lens["block", 0]["text"].startswith("'a' 0.70'c' 0.15")
    assert lens["block", 1]["text"].startswith("'a' 0.40'b' 0.35")


def test_text_tables_for_the_terminal() -> None:
    grid = _hand_grid()
    assert str(grid) == (
        "layer \\ position   0    2   5\n"
        "blocks.0          -4    0   4\n"
        "blocks.1           1  nan  -1"
    )
    heads = hs.Patching(torch.tensor([[[0.5, -0.25]]]), ("attn",), (3,), (0, 1))
    assert heads.to_text(tokens=["a", "b", "c", "d"]) == (
        "layer, head \\ position  3 'd'\n"
        "attn head 0               0.5\n"
        "attn head 1             -0.25"
    )
    assert _hand_lens().to_text(lambda i: "abcd"[i], k=2) == (
        "layer \\ position                   0                   1\n"
        "embed             'b' 0.60, 'c' 0.20  'd' 0.50, 'c' 0.30\n"
        "block             'a' 0.70, 'c' 0.15  'a' 0.40, 'b' 0.35"
    )


def test_bad_arguments_fail_before_anything_is_written(tmp_path: Path) -> None:
    out = tmp_path / "r.html"
    model = _gpt2()
    ids = torch.zeros(1, 6, dtype=torch.long)
    with pytest.raises(hs.UsageError, match="one token per position"):
        hs.report(model, ids, out, patching=_hand_grid(), tokens=["a", "b"])
    with pytest.raises(hs.UsageError, match=r"what hs\.patching returns"):
        hs.report(model, ids, out, patching=torch.zeros(2, 3))
    with pytest.raises(hs.UsageError, match=r"hs\.logit_lens"):
        hs.report(model, ids, out, lens=_hand_grid())
    with pytest.raises(hs.UsageError, match="decode method"):
        hs.report(model, ids, out, lens=_hand_lens(), tokenizer=3)
    with pytest.raises(hs.UsageError, match="sample must be"):
        _hand_lens().to_text(sample=1)
    assert not out.exists()


def test_the_heatmap_in_a_real_browser(tmp_path: Path) -> None:
    """The page with both sections in headless Chromium: no error, no request, no horizontal
    scroll bar on a phone or a laptop (a wide grid scrolls inside its box), and the colours
    the browser paints are the scale's."""
    import browser

    if browser.chromium() is None:
        if os.environ.get("HOOKSCOPE_REQUIRE_BROWSER"):
            pytest.fail("HOOKSCOPE_REQUIRE_BROWSER is set but no Chromium was found")
        pytest.skip("no Chromium here (scripts/test.sh installs Debian's chromium as root)")
    sync_api = pytest.importorskip("playwright.sync_api")
    wide = hs.Patching(
        torch.linspace(-3, 3, 4 * 40).reshape(4, 40), tuple("abcd"), tuple(range(40))
    )
    _report(tmp_path, patching=[_hand_grid(), wide], lens=_hand_lens())
    page_file = tmp_path / "r.html"
    for width in (390, 1280):
        seen = browser.look(page_file, width=width)
        assert seen.scroll_width <= width, (width, seen.scroll_width)
    assert seen.console_errors == [] and seen.page_errors == [] and seen.requests == []
    assert seen.sections[:3] == ["overview", "patching", "lens"]
    with sync_api.sync_playwright() as p:
        chromium = p.chromium.launch(executable_path=browser.chromium(), args=["--no-sandbox"])
        try:
            page = chromium.new_page()
            page.goto(page_file.resolve().as_uri())
            painted = page.eval_on_selector_all(
                "td[data-value]",
                "els => els.map(e => [e.dataset.layer, e.dataset.position,"
                " getComputedStyle(e).backgroundColor, e.getBoundingClientRect().width])",
            )
        finally:
            chromium.close()
    colours = {(layer, int(p)): rgb for layer, p, rgb, _ in painted}
    assert colours["blocks.0", 0] == "rgb(33, 102, 172)"  # the most negative cell
    assert colours["blocks.0", 5] == "rgb(178, 24, 43)"  # the most positive
    assert colours["blocks.0", 2] == "rgb(255, 255, 255)"  # 0
    assert colours["blocks.1", 2] == "rgb(208, 213, 222)"  # NaN
    assert all(w > 0 for *_, w in painted) and len(painted) == 6 + 4 * 40


def test_the_png_heatmap_paints_the_scale_and_not_finite_cells() -> None:
    """The PNG (``hookscope patching --png``) uses the HTML's colours: the largest |value|
    of each sign at the scale's ends, grey only where a cell is not finite (each cell covers
    thousands of pixels; the colour bar's ends a few)."""
    from PIL import Image

    from hookscope.show._interp import NAN_COLOUR, NEGATIVE, POSITIVE, patching_png

    def pixels(values: list[list[float]]) -> dict[tuple[int, int, int], int]:
        grid = hs.Patching(torch.tensor(values), ("blocks.0",), (0, 1, 2))
        image = Image.open(io.BytesIO(patching_png(grid, ["a", "b", "c"], "title")))
        return {rgb: n for n, rgb in image.convert("RGB").getcolors(maxcolors=1 << 24)}

    with_nan = pixels([[-2.0, NAN, 2.0]])
    assert with_nan.get(NEGATIVE, 0) > 1000 and with_nan.get(POSITIVE, 0) > 1000
    assert with_nan.get(NAN_COLOUR, 0) > 1000
    finite = pixels([[-2.0, 0.5, 1.0]])
    assert finite.get(NAN_COLOUR, 0) == 0 and finite.get(NEGATIVE, 0) > 1000
    assert finite.get(POSITIVE, 0) < 100  # 1.0 is half the scale: only the bar's end
