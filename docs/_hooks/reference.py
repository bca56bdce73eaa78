"""MkDocs hook: the API reference pages, written at build time from ``hookscope.__all__``.

Each public name goes on the page of the subpackage that exports it (``hookscope.core``,
``look``, ``diagnose``, ``explain``, ``extract``, ``show``, ``errors``), rendered by
mkdocstrings from its docstring; a name added to ``__all__`` appears without editing any page,
and a name whose subpackage has no page stops the build. The names a subpackage exports beyond
``hookscope.__all__`` (log sinks, the method registry, the metrics) follow under their own
heading. The index and the pages list each area's verbs first (what a reader looks for), then
its classes, then the rest, each with the first paragraph of its docstring rewritten for the
site as the entries are (``docstrings.py``). ``tests/test_docs.py`` checks the built pages list
every name with its docstring.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import inspect
import types
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

import hookscope


def _sibling(name: str) -> Any:
    """A module of this folder (MkDocs loads hooks by path, not as a package)."""
    spec = importlib.util.spec_from_file_location(
        f"_hooks_{name}", Path(__file__).with_name(f"{name}.py")
    )
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load docs/_hooks/{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_docstrings = _sibling("docstrings")

#: subpackage -> (title, what it holds); the order of the reference's pages.
AREAS: dict[str, tuple[str, str]] = {
    "core": (
        "Capture, edit, gradients",
        "Layer names, captures and their records, edits, features and tensor gradients.",
    ),
    "look": ("Summaries and feature maps", "Per-call summaries with FLOPs; feature-map grids."),
    "diagnose": ("Diagnose", "The NaN/Inf tracer, the training monitor and clipping reports."),
    "explain": (
        "Attribution maps",
        "The CAM family, input-space, path and perturbation methods, transformer attention "
        "maps, overlays, activation patching sweeps, the logit lens and direct logit "
        "attribution.",
    ),
    "extract": ("Extraction", "Dataset-scale feature extraction into Zarr stores."),
    "show": ("Report", "The self-contained HTML report."),
    "integrations": (
        "Trainer integrations",
        "Callbacks for Lightning and Hugging Face's Trainer (each needs its extra; not "
        "imported by `import hookscope`), and the maps they log.",
    ),
    "errors": ("Errors", "Every error hookscope raises; each is also a built-in exception."),
}
#: Public modules documented whole, on the page of their subpackage.
MODULES = {
    "explain": ["hookscope.explain.metrics"],
    "integrations": ["hookscope.integrations.lightning", "hookscope.integrations.transformers"],
}
#: Names public in a subpackage but not meant for users' reference (machinery for
#: capability authors, documented in ARCHITECTURE.md and in their docstrings).
INTERNAL = {"core"}


def path_of(name: str) -> str:
    """Where griffe finds a public name: ``hookscope.extract`` is both the function and its
    subpackage, and griffe resolves the dotted path to the subpackage."""
    folder = Path(hookscope.__file__).parent
    if (folder / name).is_dir() or (folder / f"{name}.py").is_file():
        return f"hookscope.{name}.{name}"
    return f"hookscope.{name}"


def area_of(name: str) -> str:
    """The subpackage whose ``__all__`` exports ``name`` (``"package"`` for ``__version__``)."""
    for area in AREAS:
        module = importlib.import_module(f"hookscope.{area}")
        if name in getattr(module, "__all__", ()):
            return area
    if name == "__version__":
        return "package"
    raise RuntimeError(
        f"hookscope.{name} is exported by no documented subpackage ({', '.join(AREAS)}): "
        "add its subpackage to AREAS in docs/_hooks/reference.py"
    )


def docstring(name: str) -> str:
    """A public name's docstring; for a type alias or a constant (a union, a string), the one
    written after its assignment, which Python does not keep (``inspect.getdoc`` would give
    the docstring of the alias's type: "Represent a PEP 604 union type")."""
    obj = getattr(hookscope, name)
    if not isinstance(obj, (str, int, float, types.UnionType)):
        return inspect.getdoc(obj) or ""
    for path in sorted(Path(hookscope.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for statement, after in zip(tree.body, tree.body[1:], strict=False):
            target = statement.target if isinstance(statement, ast.AnnAssign) else None
            targets = [target] if target is not None else getattr(statement, "targets", [])
            value = getattr(after, "value", None)
            if any(getattr(t, "id", None) == name for t in targets) and isinstance(
                value, ast.Constant
            ):
                return inspect.cleandoc(str(value.value))
    return ""


def summary_line(name: str) -> str:
    """The first paragraph of a public name's docstring, as the site shows docstrings (roles
    become code and links), for the index table."""
    if name == "__version__":
        return "The installed version (semantic versioning)."
    first = docstring(name).split("\n\n", 1)[0].replace("\n", " ")
    return str(_docstrings.markdown(first)).replace("|", "\\|")


def _rank(name: str) -> int:
    """The verbs first (functions, and ``capture``: a class called like one), then classes,
    then the rest (type aliases, constants)."""
    obj = getattr(hookscope, name, None)
    if callable(obj) and name[:1].islower():
        return 0
    return 1 if isinstance(obj, type) else 2


def grouped() -> dict[str, list[str]]:
    """``hookscope.__all__`` by area: functions, classes, the rest, each in ``__all__``'s
    order."""
    groups: dict[str, list[str]] = {area: [] for area in (*AREAS, "package")}
    for name in sorted(hookscope.__all__, key=_rank):  # a stable sort keeps __all__'s order
        groups[area_of(name)].append(name)
    return groups


def area_page(area: str, names: list[str]) -> str:
    title, intro = AREAS[area]
    lines = [f"# {title}", "", intro, ""]
    lines += [f"::: {path_of(name)}\n" for name in names]
    module = importlib.import_module(f"hookscope.{area}")
    more = [n for n in getattr(module, "__all__", ()) if n not in hookscope.__all__]
    if area not in INTERNAL and (more or area in MODULES):
        lines += [f"## Also in `hookscope.{area}`", ""]
        lines += [f"::: hookscope.{area}.{n}\n    options:\n      heading_level: 3\n" for n in more]
        lines += [
            f"::: {m}\n    options:\n      heading_level: 3\n      show_root_full_path: true\n"
            "      inherited_members: false\n"  # a callback's base is the trainer's, not ours
            for m in MODULES.get(area, [])
        ]
    return "\n".join(lines)


def index_page(groups: dict[str, list[str]]) -> str:
    lines = [
        "# API reference",
        "",
        "Every name in `hookscope.__all__`, imported as `import hookscope as hs`, then "
        "`hs.<name>`. Generated from the docstrings (`help(hs.capture)` shows the same text).",
        "",
        "::: hookscope.__version__",
        "    options:",
        "      show_root_heading: true",
        "",
    ]
    for area, (title, _) in AREAS.items():
        if not groups[area]:
            continue
        lines += [f"## {title}", "", "| name | what it is |", "|---|---|"]
        lines += [f"| [`{n}`]({area}.md#{path_of(n)}) | {summary_line(n)} |" for n in groups[area]]
        lines.append("")
    return "\n".join(lines)


def on_files(files: Files, config: Any, **kwargs: Any) -> Files:
    """Add the generated reference pages to the site's files."""
    groups = grouped()
    files.append(File.generated(config, "reference/index.md", content=index_page(groups)))
    for area in AREAS:
        content = area_page(area, groups[area])
        files.append(File.generated(config, f"reference/{area}.md", content=content))
    return files
