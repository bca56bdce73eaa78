"""One self-contained HTML page: inline CSS, images as PNG data URIs, and a Content Security
Policy that forbids every network request, so the file opens from disk anywhere."""

from __future__ import annotations

import base64
import html
from collections.abc import Iterable, Sequence

__all__ = ["figure", "image", "page", "section", "table"]

_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
# Fits any width: images scale down to the page (never up), wide tables scroll inside their
# box, long names wrap; a phone (390 px) gets smaller margins.
_CSS = """
body { font: 15px/1.45 system-ui, sans-serif; margin: 0 auto; max-width: 1200px;
       padding: 0 1.5em 3em; color: #1d2330; overflow-wrap: anywhere; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #d0d5de; padding-bottom: 0.2em; }
nav { display: flex; flex-wrap: wrap; gap: 0.2em 1em; } .muted { color: #667085; }
table { border-collapse: collapse; font-size: 13px; margin: 0.5em 0; }
th, td { padding: 2px 8px; text-align: left; border-bottom: 1px solid #eceff3;
         overflow-wrap: normal; white-space: nowrap; }
th { position: sticky; top: 0; background: #f6f7f9; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
.scroll { max-height: 32em; max-width: 100%; overflow: auto; border: 1px solid #eceff3; }
figure { display: inline-block; margin: 0.4em 0.8em 0.8em 0; vertical-align: top;
         max-width: 100%; }
figcaption { font-size: 13px; color: #444c5c; max-width: 40em; }
img { max-width: 100%; height: auto; }
figure.wide { display: block; margin-right: 0; }
.panels { display: flex; flex-wrap: wrap; gap: 0.5em 12px; }
img.pixel { image-rendering: pixelated; }
li.warn::marker { content: "⚠ "; } li.ok::marker { content: "✓ "; }
@media (max-width: 600px) { body { padding: 0 0.6em 2em; } figure { margin: 0.3em 0; } }
"""


def page(title: str, subtitle: str, sections: Sequence[tuple[str, str, str]]) -> str:
    """The whole document; ``sections`` are ``(id, heading, body html)``."""
    nav = " ".join(f'<a href="#{i}">{html.escape(h)}</a>' for i, h, _ in sections)
    body = "\n".join(section(i, h, b) for i, h, b in sections)
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)}</title><style>{_CSS}</style></head>
<body><header><h1>{html.escape(title)}</h1><p class="muted">{html.escape(subtitle)}</p>
<nav>{nav}</nav></header>
{body}
</body></html>
"""


def section(id_: str, heading: str, body: str) -> str:
    return f'<section id="{id_}"><h2>{html.escape(heading)}</h2>\n{body}\n</section>'


def table(
    headers: Sequence[str], rows: Iterable[Sequence[object]], *, numeric: Iterable[int] = ()
) -> str:
    """A table; columns in ``numeric`` are right-aligned. Cells are escaped."""
    right = set(numeric)

    def cells(tag: str, values: Sequence[object]) -> str:
        return "".join(
            f"<{tag}{' class=n' if i in right else ''}>{html.escape(str(v))}</{tag}>"
            for i, v in enumerate(values)
        )

    body = "\n".join(f"<tr>{cells('td', r)}</tr>" for r in rows)
    head = f"<thead><tr>{cells('th', headers)}</tr></thead>"
    return f'<div class="scroll"><table>{head}\n<tbody>{body}</tbody></table></div>'


def image(data: bytes, alt: str, *, width: int | None = None, pixel: bool = False) -> str:
    """An ``<img>`` holding PNG ``data`` (shown ``width`` CSS pixels wide)."""
    uri = "data:image/png;base64," + base64.b64encode(data).decode()
    size = f' width="{width}"' if width else ""
    cls = ' class="pixel"' if pixel else ""
    return f'<img src="{uri}" alt="{html.escape(alt)}"{size}{cls}>'


def figure(content: str, caption: str, *, wide: bool = False) -> str:
    """``content`` with its caption; ``wide``: on a line of its own (several images inside)."""
    cls = ' class="wide"' if wide else ""
    return f"<figure{cls}>{content}<figcaption>{html.escape(caption)}</figcaption></figure>"
