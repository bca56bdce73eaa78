"""The documentation site (docs/, mkdocs.yml): every python block of every page runs, the site
builds with ``mkdocs build --strict``, its API reference lists every name of
``hookscope.__all__`` with its docstring (the index as the site shows docstrings, verbs
first), every link works from the disk (file://), and every page opens in a real Chromium with
no console error, no request leaving the machine, every image decoded, 120-column examples
whole at 1280 px, names unbroken, and nothing wider than a 390 px phone but what scrolls."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import functools
import http.server
import itertools
import os
import re
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

import hookscope as hs

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)
GUIDES = sorted((DOCS / "guides").glob("*.md"))
#: Pages whose blocks take more than a few seconds (they train, or load transformers).
SLOW_PAGES = {
    "guides/summaries.md",
    "guides/diagnose.md",
    "guides/attribution.md",
    "guides/operations.md",
    "guides/interpretability.md",
    "guides/integrations.md",
}
#: Warnings the libraries a page runs emit about themselves (pytest makes warnings errors).
PAGE_WARNINGS = {
    "guides/integrations.md": [
        # Lightning's advice on data loader workers, and its use of a pytree class torch 2.13
        # deprecates: Lightning's, not the page's
        "ignore:The '\\w+_dataloader' does not have many workers",
        "ignore:`isinstance\\(treespec, LeafSpec\\)` is deprecated",
        "ignore:The number of training batches",
    ],
}
#: Languages a fenced block may have: python blocks run here; the others are shell sessions
#: and program output. A block that is Python but must not run has no place in the docs.
LANGUAGES = {"python", "bash", "text"}
FENCE = re.compile(r"^```(\S*)", re.MULTILINE)


#: A python block right after this comment is a script for several processes
#: (``torchrun``): the test it names runs it so, not this file.
RANKS = "<!-- run: "


def _python_blocks(page: Path, *, ranks: bool = False) -> list[str]:
    """The page's python blocks, but those marked :data:`RANKS` (all of them: ``ranks``)."""
    parts = re.split(r"^```python\n", page.read_text(), flags=re.M)
    blocks = []
    for before, block in itertools.pairwise(parts):
        marked = before.rstrip().rsplit("\n", 1)[-1].startswith(RANKS)
        if ranks or not marked:
            blocks.append(block.split("\n```", 1)[0])
    return blocks


def _page_id(page: Path) -> str:
    return page.relative_to(DOCS).as_posix()


def test_the_docs_have_every_guide() -> None:
    names = {p.stem for p in GUIDES}
    expected = {
        "capture",
        "edits",
        "operations",
        "interpretability",
        "features",
        "summaries",
        "diagnose",
        "attribution",
        "cli",
        "integrations",
        "sharded",
    }
    assert names == expected
    assert {p.name for p in DOCS.glob("*.md")} >= {
        "index.md",
        "getting-started.md",
        "guarantees.md",
        "troubleshooting.md",
        "performance.md",
    }


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_code_blocks_are_python_bash_or_text(page: Path) -> None:
    fences = FENCE.findall(page.read_text())
    openers = fences[0::2]  # every other fence closes a block
    assert all(closer == "" for closer in fences[1::2]), f"{page}: unbalanced fences"
    assert set(openers) <= LANGUAGES, f"{page}: blocks in {set(openers) - LANGUAGES}"


def test_every_guide_has_code_that_runs() -> None:
    assert all(_python_blocks(page, ranks=True) for page in GUIDES)


@pytest.mark.mutates_model  # the guides train models (Monitor, clipping): values change
@pytest.mark.parametrize(
    "page",
    [
        pytest.param(
            p,
            marks=[pytest.mark.slow] * (_page_id(p) in SLOW_PAGES)
            + [pytest.mark.filterwarnings(w) for w in PAGE_WARNINGS.get(_page_id(p), [])],
        )
        for p in PAGES
        if _python_blocks(p)
    ],
    ids=_page_id,
)
def test_page_examples_run(
    page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A page's python blocks run in order in one namespace, in an empty folder (files they
    write land there), as a reader pasting them into one session would run them."""
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        for block in _python_blocks(page):
            exec(compile(block, str(page), "exec"), namespace)
    finally:  # a page's W&B run: its process-wide setup would hold the next test's WANDB_DIR
        if "wandb" in sys.modules:
            sys.modules["wandb"].teardown()


# -- the built site -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``mkdocs build --strict`` of the repository's docs into a fresh folder."""
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "WARNING" not in done.stderr, done.stderr
    return out


class _Entries(HTMLParser):
    """The text of each API entry: from a heading with an id ``hookscope.<name>`` to the next
    heading of the same or a higher level, signatures left out."""

    def __init__(self) -> None:
        super().__init__()
        self.text: dict[str, list[str]] = {}
        self._current: str | None = None
        self._level = 0
        self._skip = 0  # depth inside a signature block

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        found = dict(attrs)
        if re.fullmatch(r"h[1-6]", tag):
            level = int(tag[1])
            ident = found.get("id") or ""
            if ident.startswith("hookscope."):
                self._current, self._level = ident, level
                self.text[ident] = []
            elif self._current is not None and level <= self._level:
                self._current = None
        if self._skip or "doc-signature" in (found.get("class") or ""):
            self._skip += 1

    def handle_endtag(self, tag: str) -> None:
        if self._skip:
            self._skip -= 1

    def handle_data(self, data: str) -> None:
        if self._current is not None and not self._skip and data.strip():
            self.text[self._current].append(data.strip())


def _entries(site: Path) -> dict[str, str]:
    parser = _Entries()
    for page in sorted((site / "reference").rglob("*.html")):
        parser.feed(page.read_text())
    return {ident: " ".join(words) for ident, words in parser.text.items()}


@pytest.mark.slow
def test_reference_documents_every_public_name(site: Path) -> None:
    """Every name of ``hookscope.__all__`` has an entry in the built reference whose text
    includes the first line of its docstring (so the docstring exists and was rendered)."""
    entries = _entries(site)
    package = Path(hs.__file__).parent
    problems = []
    for name in hs.__all__:
        # a name that is also a subpackage (``extract``) is found under the subpackage
        clash = (package / name).is_dir()
        text = entries.get(f"hookscope.{name}.{name}" if clash else f"hookscope.{name}")
        if text is None:
            problems.append(f"{name}: no entry")
            continue
        doc = _docstring(name)
        summary = _letters(doc.split("\n\n", 1)[0])  # its first paragraph
        if not summary or summary[:60] not in _letters(text):
            problems.append(f"{name}: docstring {doc[:60]!r} not in its entry {text[:200]!r}")
    assert not problems, "\n".join(problems)


def _docstring(name: str) -> str:
    """A public name's docstring; for a type alias or a constant, the one written after its
    assignment (which Python does not keep at run time)."""
    obj = getattr(hs, name)
    alias = isinstance(obj, (str, types.UnionType)) or type(obj).__module__ == "typing"
    if not alias:  # an alias: a string, or a union (of types, or typing's of a Literal)
        return (obj.__doc__ or "").strip()
    module = {"__version__": "_version"}.get(name, "core/_types")
    tree = ast.parse((Path(hs.__file__).parent / f"{module}.py").read_text())
    for statement, after in zip(tree.body, tree.body[1:]):
        targets = [statement.target] if isinstance(statement, ast.AnnAssign) else []
        targets += statement.targets if isinstance(statement, ast.Assign) else []
        if any(getattr(t, "id", None) == name for t in targets):
            value = getattr(after, "value", None)
            return value.value if isinstance(value, ast.Constant) else ""
    return ""


def _letters(text: str) -> str:
    """Letters and digits only: markup, roles and the site's spacing left out."""
    text = re.sub(r":\w+:`~[\w.]*\.", "", text)  # a role's ~path. shows the last name only
    return re.sub(r"\W+", "", re.sub(r":\w+:`", "", text))


def _pages(site: Path) -> list[str]:
    """Every page's path in the site: a file (``guides/capture.html``), never a folder."""
    return sorted(
        p.relative_to(site).as_posix()
        for p in site.rglob("*.html")
        if "assets" not in p.relative_to(site).parts and p.name != "404.html"
    )


class _Links(HTMLParser):
    """Every ``href`` and ``src`` of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.targets: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.targets += [v for k, v in attrs if k in ("href", "src") and v]


@pytest.mark.slow
def test_every_link_works_from_the_disk(site: Path) -> None:
    """Opened from file:// (mkdocs.yml says the site reads offline), a link to a folder shows
    a directory listing, not the page: every relative link of every page must name a file."""
    broken = []
    for path in _pages(site):
        parser = _Links()
        parser.feed((site / path).read_text())
        for target in parser.targets:
            if re.match(r"[a-z]+:|#|//", target):  # another scheme, a fragment, a host
                continue
            file = (site / path).parent / target.split("#", 1)[0].split("?", 1)[0]
            if not file.is_file():
                broken.append(f"{path}: {target}")
    assert not broken, "\n".join(broken[:20])


@pytest.mark.slow
def test_reference_index_reads_as_the_site_shows_docstrings(site: Path) -> None:
    """The index's one-line descriptions: no raw Sphinx role, a type alias described by its
    own docstring (not its type's, "a PEP 604 union type"), and each area's verbs before its
    classes."""
    text = (site / "reference" / "index.html").read_text()
    assert not re.findall(r":(?:py:)?(?:func|class|meth|attr|data|mod|exc|obj):`", text)
    assert "PEP 604" not in text and "union type" not in text
    rows = re.findall(
        r"<tr>\s*<td><a [^>]*><code>([^<]+)</code></a></td>\s*<td>(.*?)</td>", text, re.S
    )
    described = {name: re.sub(r"<[^>]+>", "", html) for name, html in rows}
    assert set(described) == set(hs.__all__) - {"__version__"}
    assert _letters(described["LayerSelector"]).startswith(_letters("The type of every layers"))
    tables = text.split("<table>")[1:]
    for table in tables:
        names = re.findall(r"<td><a [^>]*><code>([^<]+)</code>", table)
        verbs = [i for i, n in enumerate(names) if n[:1].islower()]
        assert verbs == list(range(len(verbs))), names  # the verbs come first


@contextlib.contextmanager
def _served(folder: Path) -> Iterator[str]:
    """The folder over HTTP on the loopback interface (Material's search runs in a web
    worker, which browsers refuse to start from file: URLs)."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.mark.slow
def test_every_page_in_a_real_browser(site: Path) -> None:
    """Chromium opens every page: no console or page error, no request beyond the local
    server (no web font, no CDN), every image decoded, and the page is not blank."""
    import browser

    if browser.chromium() is None:
        if os.environ.get("HOOKSCOPE_REQUIRE_BROWSER"):
            pytest.fail("HOOKSCOPE_REQUIRE_BROWSER is set but no Chromium was found")
        pytest.skip("no Chromium here (scripts/test.sh installs Debian's chromium as root)")
    problems, images = asyncio.run(_browse(site, browser.chromium()))
    assert not problems, "\n".join(problems)
    assert images >= 2  # the report and the Grad-CAM picture, at least


async def _browse(site: Path, executable: str) -> tuple[list[str], int]:
    """The problems :func:`test_every_page_in_a_real_browser` looks for, and the number of
    images seen. Three tabs take the pages in turn, all at once (a page's wait for the network
    to be idle, 500 ms, is time the others use); each page is checked at 1280 px, then the tab
    is narrowed to a phone's 390 px and the same page measured again, as a window resized."""
    from playwright.async_api import async_playwright

    problems: list[str] = []
    images = [0]
    wide, narrow = {"width": 1280, "height": 900}, {"width": 390, "height": 800}

    async def tab(chromium: Any, base: str, todo: Iterator[str]) -> None:
        page = await chromium.new_page(viewport=wide)
        where = [""]  # the page this tab shows, for the messages of its handlers
        page.on(
            "console",
            lambda m: (
                problems.append(f"{where[0]}: console: {m.text}") if m.type == "error" else None
            ),
        )
        page.on("pageerror", lambda e: problems.append(f"{where[0]}: page error: {e}"))
        page.on(
            "request",
            lambda r: (
                None
                if r.url.startswith((base, "data:"))
                else problems.append(f"{where[0]}: request to {r.url}")
            ),
        )
        for path in todo:  # shared by the tabs: each takes the next page not yet taken
            where[0] = path
            await page.set_viewport_size(wide)
            response = await page.goto(base + path, wait_until="networkidle")
            assert response is not None and response.ok, path
            seen = await page.eval_on_selector_all(
                "img", "els => els.map(e => [e.currentSrc, e.complete, e.naturalWidth])"
            )
            images[0] += len(seen)
            problems.extend(f"{path}: not decoded: {s}" for s, ok, w in seen if not ok or not w)
            if len((await page.inner_text("article")).split()) < 20:
                problems.append(f"{path}: almost no text")
            for size in (wide, narrow):
                if size is narrow:
                    await page.set_viewport_size(narrow)
                await page.evaluate("document.fonts.ready.then(() => true)")
                layout = _layout(await page.evaluate(_LAYOUT), size["width"])
                problems.extend(f"{path} at {size['width']} px: {p}" for p in layout)

    with _served(site) as base:
        async with async_playwright() as p:
            chromium = await p.chromium.launch(
                executable_path=executable,
                args=["--no-sandbox", "--disable-gpu", "--disable-background-networking"],
            )
            try:
                todo = iter(_pages(site))
                await asyncio.gather(*(tab(chromium, base, todo) for _ in range(3)))
                on_disk = await chromium.new_page(viewport=wide)
                await on_disk.goto((site / "index.html").as_uri())
                await on_disk.click("a[href='getting-started.html']")
                if not on_disk.url.endswith("getting-started.html") or "pip install" not in (
                    await on_disk.inner_text("article")
                ):
                    problems.append(f"from file://, the navigation led to {on_disk.url}")
            finally:
                await chromium.close()
    return problems, images[0]


#: How a page lays out its code and names, in Chromium: for each code block its longest line,
#: its width and the width it needs, whether it scrolls; each first-column name of a table
#: and how many lines it takes; how wide the whole page is.
_LAYOUT = """() => ({
  code: [...document.querySelectorAll('article pre > code')].map(c => [
    Math.max(...c.textContent.split('\\n').map(l => l.length)), c.clientWidth,
    c.scrollWidth, getComputedStyle(c).overflowX]),
  names: [...document.querySelectorAll('article table td:first-child code')].map(c => [
    c.textContent, c.getClientRects().length]),
  page: document.documentElement.scrollWidth,
})"""


def _layout(seen: dict[str, Any], width: int) -> list[str]:
    """What ``_LAYOUT`` measured in a page at a viewport ``width`` px wide, judged: examples
    up to 120 columns fit whole at 1280 px (they were clipped to a 670 px column); wider ones,
    and every one on a phone, scroll inside their box, never the page; a name in a table's
    first column is never broken across lines."""
    problems = []
    for columns, shown, needed, overflow in seen["code"]:
        if width >= 1280 and columns <= 120 and needed > shown:
            problems.append(f"a {columns}-column example needs {needed} px, has {shown}")
        if needed > shown and overflow not in ("auto", "scroll"):
            problems.append(f"a {columns}-column example is cut off (overflow-x {overflow})")
    problems += [f"{name!r} broken over {n} lines" for name, n in seen["names"] if n > 1]
    if seen["page"] > width:
        problems.append(f"the page is {seen['page']} px wide")
    return problems


# -- docstrings ----------------------------------------------------------------------------------

#: Public methods and properties allowed to lack a docstring: none. The test fails when one of
#: them gets a docstring too (shrink the set), and when anything else lacks one.
UNDOCUMENTED: set[str] = set()


def _members_without_docstrings() -> set[str]:
    """``Class.member`` for every public method and property (inherited ones included) of
    every class in ``hookscope.__all__`` whose docstring is empty."""
    missing = set()
    for name in hs.__all__:
        cls = getattr(hs, name)
        if not isinstance(cls, type) or issubclass(cls, BaseException):
            continue
        for attr in dir(cls):
            if attr.startswith("_"):
                continue
            owner = next(k for k in cls.__mro__ if attr in vars(k))
            if not owner.__module__.startswith("hookscope"):
                continue  # nn.Module's and dataclasses' own
            value = vars(owner)[attr]
            function = value.fget if isinstance(value, property) else value
            function = getattr(function, "__func__", function)
            if callable(function) and not (getattr(function, "__doc__", None) or "").strip():
                missing.add(f"{name}.{attr}")
    return missing


def test_every_public_method_and_property_has_a_docstring() -> None:
    missing = _members_without_docstrings()
    assert not missing - UNDOCUMENTED, f"undocumented: {sorted(missing - UNDOCUMENTED)}"
    assert not UNDOCUMENTED - missing, f"documented now: {sorted(UNDOCUMENTED - missing)}"


def _attribute_docstrings() -> list[tuple[str, str]]:
    """``(where, docstring)`` of every module-level assignment followed by a string in the
    package: documentation tools read them, but doctest does not find them."""
    found = []
    for path in sorted(Path(hs.__file__).parent.rglob("*.py")):
        body = ast.parse(path.read_text()).body
        for statement, after in itertools.pairwise(body):
            value = getattr(after, "value", None)
            if isinstance(statement, (ast.Assign, ast.AnnAssign)) and (
                isinstance(value, ast.Constant) and isinstance(value.value, str)
            ):
                found.append((f"{path.name}:{after.lineno}", value.value))
    return found


@pytest.mark.parametrize(
    ("where", "docstring"),
    [d for d in _attribute_docstrings() if ">>>" in d[1]],
    ids=lambda v: v if ":" in v and len(v) < 40 else "",
)
def test_attribute_docstring_examples_run(where: str, docstring: str) -> None:
    import doctest

    test = doctest.DocTestParser().get_doctest(docstring, {}, where, where, 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    runner.run(test)
    assert runner.failures == 0 and runner.tries > 0
