"""The public surface: exact __all__, typed package, error hierarchy, runnable docs."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pathlib
import pkgutil
import re
import sys
import types
from typing import Any

import pytest
import torch
from torch import nn

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
        alias = isinstance(obj, (str, types.UnionType)) or type(obj).__module__ == "typing"
        if hasattr(obj, "__module__") and not alias:
            assert obj.__module__ == "hookscope", name  # type aliases (unions) have none


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


def _drawn_hierarchy() -> dict[str, tuple[str, ...]]:
    """Each error's bases as errors.py's docstring draws them: its parent in the tree, then
    the built-ins in parentheses after its name."""
    drawn: dict[str, tuple[str, ...]] = {}
    parents = ["HookscopeError"]  # the class at each depth of the tree
    for line in (errors.__doc__ or "").splitlines():
        found = re.search(r"[├└]── (\w+)(?: \(([^)]*)\))?", line)
        if found:
            depth = found.start() // 4  # four columns per level, under HookscopeError
            name, builtins = found[1], found[2] or ""
            parents[depth:] = [name]
            drawn[name] = (parents[depth - 1], *filter(None, re.split(r",\s*", builtins)))
    return drawn


def test_error_hierarchy_is_the_one_drawn_in_the_docstring() -> None:
    """Every error's bases are the drawing's, in its order (NonFiniteError was drawn and built
    without RuntimeError, which torch raises for the same finding)."""
    drawn = _drawn_hierarchy()
    assert set(drawn) | {"HookscopeError"} == set(errors.__all__)
    for name, bases in drawn.items():
        cls = getattr(errors, name)
        assert tuple(b.__name__ for b in cls.__bases__) == bases, name
    assert issubclass(errors.NonFiniteError, RuntimeError)
    # the troubleshooting page's table: "also a" lists the same bases but HookscopeError
    table = (ROOT / "docs" / "troubleshooting.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+Error)` \| ([^|]*) \|", table, flags=re.M))
    assert set(rows) == set(drawn)
    for name, bases in drawn.items():
        listed = tuple(re.findall(r"`(\w+)`", rows[name]))
        assert listed == tuple(b for b in bases if b != "HookscopeError"), name


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
def test_examples_run(
    path: pathlib.Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> None:
    """Every example the README points to runs (they are executed, not just imported), as
    ``python examples/<name>.py`` with no arguments (not with pytest's).

    An example that trains the demo's CNN as ``hookscope demo --quick`` does (300 steps on
    32 px images, seed 0) gets that training's result, trained once for the whole test run
    (``shapes_cnn``): the same function with the same seeds, so the same model."""
    import runpy

    from hookscope import show

    train = show.train

    def trained_once(steps: int = 300, *, size: int = 64, seed: int = 0, **rest: Any) -> nn.Module:
        if (steps, size, seed) == (300, 32, 0):
            model: nn.Module = request.getfixturevalue("shapes_cnn")
            return model
        return train(steps, size=size, seed=seed, **rest)

    monkeypatch.setattr(show, "train", trained_once)
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


def _public_signatures() -> list[tuple[str, inspect.Signature]]:
    """Every public function's and class constructor's signature in hs.__all__, with string
    annotations resolved."""
    found = []
    for name in hs.__all__:
        obj = getattr(hs, name)
        if isinstance(obj, type) and issubclass(obj, BaseException):
            continue
        fn = obj.__init__ if isinstance(obj, type) else obj
        if not callable(fn) or getattr(fn, "__module__", "").startswith(("torch", "builtins")):
            continue
        # eval_str: type checkers' and documentation tools' view; an alias that only works as
        # a string (``"A | B" | None``) raises here, as in typing.get_type_hints
        found.append((name, inspect.signature(fn, eval_str=True)))
    return found


def test_layer_arguments_are_typed_as_layer_selectors() -> None:
    """Every public parameter that picks layers says so in its type (13 took Any); records'
    ``layer`` fields hold names (str)."""
    untyped = [
        f"{where}({p.name})"
        for where, sig in _public_signatures()
        for p in sig.parameters.values()
        if p.name in ("layer", "layers", "fc", "feature_layers", "allow", "select")
        and p.annotation in (Any, inspect.Parameter.empty)
    ]
    assert not untyped, untyped


#: Parameters that choose one of a fixed set of modes.
MODES = {"on_error", "engine", "rank", "ranks", "mode", "copy", "keep", "on", "scale"}


def test_string_modes_are_literals() -> None:
    loose = [
        f"{where}({p.name}: {p.annotation})"
        for where, sig in _public_signatures()
        for p in sig.parameters.values()
        if p.name in MODES
        and "Literal" not in str(p.annotation)
        and "Keep" not in str(p.annotation)
        and "CopyMode" not in str(p.annotation)
        and "EditTarget" not in str(p.annotation)
    ]
    checked = [p.name for _, sig in _public_signatures() for p in sig.parameters.values()]
    assert {"on_error", "engine", "rank", "ranks", "mode"} <= set(checked)
    assert not loose, loose


def test_a_keyword_an_entry_point_lacks_is_a_type_error(tmp_path: pathlib.Path) -> None:
    """No rename tombstones: a misspelled or old keyword fails as Python fails it (and a type
    checker catches it before)."""
    net = torch.nn.Sequential(torch.nn.Linear(4, 3))
    with pytest.raises(TypeError, match="device"):
        hs.extract(net, torch.randn(4, 4), ["0"], out=tmp_path / "a", device="cpu")  # type: ignore[call-arg]
    assert not (tmp_path / "a").exists()
    with pytest.raises(TypeError, match="device"):
        hs.summary(net, input_size=(1, 4), device="cpu")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="device"):
        hs.capture(net, "0", device="cpu")  # type: ignore[call-arg]
    with pytest.raises(TypeError, match="positional"):
        hs.summary(net, torch.ones(1, 4), torch.ones(1, 4))  # type: ignore[misc]
    store = hs.extract(net, torch.randn(4, 4), ["0"], out=tmp_path / "b", input_device="cpu")
    assert store["0"].shape == (4, 3)


def test_the_declared_platforms_are_the_tested_ones() -> None:
    """The package declares the Python CI runs (3.11, the version of the pinned CPU torch
    wheel at hand), and every tool checks against that same version; the torch version
    hookscope says it is tested on is the one CI pins."""
    import tomllib

    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["project"]["requires-python"] == ">=3.11"
    assert "Programming Language :: Python :: 3.11" in config["project"]["classifiers"]
    assert config["tool"]["ruff"]["target-version"] == "py311"
    assert config["tool"]["mypy"]["python_version"] == "3.11"
    assert sys.version_info[:2] >= (3, 11)
    pinned = (ROOT / "constraints.txt").read_text().split("torch==", 1)[1].split()[0]
    from hookscope.core import _torch

    with pytest.raises(hs.TorchCompatError, match=rf"tested on torch {pinned[:4]}\b"):
        _torch.need("no such internal")


def test_an_exception_inside_a_captured_model_keeps_its_type_and_gets_a_note() -> None:
    """``add_note`` (3.11+) names the last layer the capture saw finish; the exception stays
    the model's own."""

    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise KeyError("from the model")

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), Boom())
    with pytest.raises(KeyError, match="from the model") as info, hs.capture(model, "0"):
        model(torch.ones(1, 2))
    assert any("last layer this capture saw finish was '0'" in n for n in info.value.__notes__)
