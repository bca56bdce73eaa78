"""Griffe extension for the API reference: docstrings written for ``help()`` read as Markdown.

hookscope's docstrings are Google style, read by ``help()`` and doctest as much as by the site.
Three habits there would show badly on the site, and are rewritten as the docstrings load:

* Sphinx roles (``:class:`Call```, ``:func:`~hookscope.core.run_eagerly```) become inline
  code, linked to the reference entry when they name a public ``hookscope`` name;
* an ``Example:`` section becomes ``Examples:`` (the Google parser's name for runnable
  examples; ``Example:`` would be an admonition with the ``>>>`` lines as quotes);
* a paragraph ending in ``::`` (an RST literal block follows) ends in ``:``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import griffe

import hookscope

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|data|mod|exc|obj):`(~?)([^`]+)`")
_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
_LITERAL = re.compile(r"::[ \t]*$", re.MULTILINE)
_PUBLIC = set(hookscope.__all__)


def _path_of(name: str) -> str:
    """The reference entry of a public name (as in reference.py: ``extract`` is also a
    subpackage, whose function's entry is ``hookscope.extract.extract``)."""
    folder = Path(hookscope.__file__).parent
    if (folder / name).is_dir() or (folder / f"{name}.py").is_file():
        return f"hookscope.{name}.{name}"
    return f"hookscope.{name}"


def markdown(text: str) -> str:
    """``text`` rewritten for the site (see the module docstring)."""

    def one(match: re.Match[str]) -> str:
        tilde, target = match.groups()
        target = target.strip("!")
        shown = target.rsplit(".", 1)[-1] if tilde else target
        last = target.rsplit(".", 1)[-1]
        if last in _PUBLIC and (target == last or target.startswith("hookscope.")):
            return f"[`{shown}`][{_path_of(last)}]"
        return f"`{shown}`"

    text = _EXAMPLE.sub(r"\1Examples:", _ROLE.sub(one, text))
    return _LITERAL.sub(":", text)


class ForTheSite(griffe.Extension):
    """Rewrites the docstring of every loaded object (see the module docstring)."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown(obj.docstring.value)
