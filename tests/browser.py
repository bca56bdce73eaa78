"""Open an HTML file in a real headless Chromium (Debian's ``chromium``, driven by Playwright)
and report what a reader's browser sees. The test of the demo's report uses it; so does the
README's screenshot: ``python tests/browser.py hookscope-demo/report.html docs/report.png``.
"""

from __future__ import annotations

import io
import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path


def chromium() -> str | None:
    """The Chromium executable: $HOOKSCOPE_CHROMIUM, or ``chromium`` on the PATH."""
    return os.environ.get("HOOKSCOPE_CHROMIUM") or shutil.which("chromium")


@dataclass
class Seen:
    console_errors: list[str] = field(default_factory=list)
    page_errors: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)  # anything but file: and data: URLs
    images: list[dict[str, int]] = field(default_factory=list)  # naturalWidth/Height, complete
    sections: list[str] = field(default_factory=list)
    figures: dict[str, int] = field(default_factory=dict)  # per section id
    pixel_std: float = 0.0  # of the screenshot's gray levels: 0 for a blank page
    height: int = 0
    width: int = 0  # of the viewport
    scroll_width: int = 0  # of the page: more than `width` means a horizontal scroll bar
    image_right: list[float] = field(default_factory=list)  # each image's right edge, CSS px


def look(page_file: Path, screenshot: Path | None = None, width: int = 1280) -> Seen:
    from PIL import Image, ImageStat
    from playwright.sync_api import sync_playwright

    exe = chromium()
    assert exe, "no Chromium: install Debian's chromium or set HOOKSCOPE_CHROMIUM"
    seen = Seen()
    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=exe,
            args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
        )
        try:
            page = browser.new_page(viewport={"width": width, "height": 900})
            page.on(
                "console",
                lambda m: seen.console_errors.append(m.text) if m.type == "error" else None,
            )
            page.on("pageerror", lambda e: seen.page_errors.append(str(e)))
            page.on(
                "request",
                lambda r: (
                    None if r.url.startswith(("file:", "data:")) else seen.requests.append(r.url)
                ),
            )
            page.goto(page_file.resolve().as_uri(), wait_until="load")
            seen.images = page.eval_on_selector_all(
                "img",
                "els => els.map(e => ({w: e.naturalWidth, h: e.naturalHeight,"
                " ok: e.complete ? 1 : 0}))",
            )
            seen.sections = page.eval_on_selector_all("section", "els => els.map(e => e.id)")
            seen.width = width
            seen.scroll_width = page.evaluate("document.documentElement.scrollWidth")
            seen.image_right = page.eval_on_selector_all(
                "img", "els => els.map(e => e.getBoundingClientRect().right)"
            )
            seen.figures = page.evaluate(
                "Object.fromEntries([...document.querySelectorAll('section')]"
                ".map(s => [s.id, s.querySelectorAll('figure').length]))"
            )
            shot = page.screenshot(full_page=True)
        finally:
            browser.close()
    image = Image.open(io.BytesIO(shot)).convert("L")
    seen.pixel_std = ImageStat.Stat(image).stddev[0]
    seen.height = image.size[1]
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        screenshot.write_bytes(shot)
    return seen


if __name__ == "__main__":
    shot = Path(sys.argv[2]) if len(sys.argv) > 2 else None
    print(look(Path(sys.argv[1]), shot))
    if shot is not None:  # for the README: 256 colours keep the PNG small
        from PIL import Image

        Image.open(shot).convert("RGB").quantize(256).save(shot, optimize=True)
