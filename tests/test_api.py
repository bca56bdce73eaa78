"""The public surface: exact __all__, typed package, error hierarchy, runnable docs."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import sys

import pytest

import hookscope as hs
from hookscope import errors

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_all_is_exact_and_sorted() -> None:
    public = {n for n, v in vars(hs).items() if not n.startswith("_") and not inspect.ismodule(v)}
    assert set(hs.__all__) == public | {"__version__"}
    # ruff's RUF022 order: CONSTANTS, then CamelCase classes, then functions, each sorted
    kind = {True: 0, False: 1}
    assert list(hs.__all__) == sorted(
        hs.__all__, key=lambda n: (kind[n.isupper()] if n[:1].isupper() else 2, n)
    )


def test_public_names_report_hookscope_as_their_module() -> None:
    """help(), reprs and docs show where users import them from, not a private module."""
    for name in hs.__all__:
        obj = getattr(hs, name)
        if hasattr(obj, "__module__") and not isinstance(obj, str):
            assert obj.__module__ == "hookscope", name


def test_typed_package() -> None:
    assert (ROOT / "src" / "hookscope" / "py.typed").exists()


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.LayerNotFoundError, LookupError),
        (errors.CaptureError, RuntimeError),
        (errors.GradientUnavailableError, RuntimeError),
        (errors.StaleCaptureError, RuntimeError),
        (errors.CaptureBudgetError, MemoryError),
        (errors.EditError, ValueError),
        (errors.CompiledModelError, RuntimeError),
    ],
)
def test_errors_subclass_natural_builtins(cls: type, builtin: type) -> None:
    assert issubclass(cls, errors.HookscopeError) and issubclass(cls, builtin)


def _modules() -> list[str]:
    return ["hookscope"] + [
        m.name
        for m in pkgutil.walk_packages(hs.__path__, prefix="hookscope.")  # type: ignore[attr-defined]
    ]


@pytest.mark.parametrize("name", _modules())
def test_docstring_examples_run(name: str) -> None:
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


@pytest.mark.parametrize("path", sorted((ROOT / "examples").glob("*.py")), ids=lambda p: p.name)
def test_examples_run(path: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every example the README points to runs (they are executed, not just imported), as
    ``python examples/<name>.py`` with no arguments (not with pytest's)."""
    import runpy

    monkeypatch.setattr(sys, "argv", [str(path)])
    runpy.run_path(str(path), run_name="__main__")


@pytest.mark.mutates_model  # the README trains models (Monitor, clipping): values change
def test_readme_examples_run() -> None:
    """The README's python blocks run, in order, in one namespace."""
    text = (ROOT / "README.md").read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    assert len(blocks) >= 4
    namespace: dict[str, object] = {}
    for block in blocks:
        exec(compile(block, "README.md", "exec"), namespace)
