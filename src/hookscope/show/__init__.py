"""Show: the HTML report (``hs.report``), the demo and the ``hookscope`` command line.

The demo's data and model are public for examples and tests: :func:`shapes` (squares, disks,
triangles on noise, with their masks), :class:`ShapesCNN` and :func:`train`.
"""

from __future__ import annotations

import sys

from ._report import Section, report
from ._shapes import CLASSES, ShapesCNN, shapes, train

__all__ = ["CLASSES", "Section", "ShapesCNN", "main", "report", "shapes", "train"]


def main(argv: list[str] | None = None) -> None:
    """The ``hookscope`` console script."""
    try:
        from ._cli import cli
    except ImportError as e:
        if e.name != "click":
            raise
        print('the hookscope command needs click: pip install "hookscope[cli]"', file=sys.stderr)
        raise SystemExit(1) from None
    cli.main(args=argv, prog_name="hookscope")
