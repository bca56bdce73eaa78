"""The package's layering, checked on its source, rule by rule as ARCHITECTURE.md states them
(each rule there names the test here that checks it: ``test_every_rule_of_the_page_is_a_test``).

The checks read the source's syntax (``ast``), not its text: comments and docstrings may talk
about anything."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest
import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "hookscope"
CAPABILITIES = ("look", "diagnose", "explain", "extract", "show", "integrations")
LIFETIME = PACKAGE / "core" / "_lifetime.py"
TORCH_LIST = PACKAGE / "core" / "_torch.py"
#: private names of other libraries than torch that hookscope uses, and why
FOREIGN_PRIVATE = {
    "_getframe": "sys._getframe: CPython's frame access (module calls on the Python stack)",
    "_fields": "a namedtuple's public field list",
    "_make": "a namedtuple's public constructor from an iterable",
    "_check_writable": "zarr's LocalStore, which extract's store subclasses",
    "_is_open": "zarr's LocalStore, which extract's store subclasses",
}


def _files(where: str = "") -> list[Path]:
    return sorted((PACKAGE / where).rglob("*.py"))


def _rel(path: Path) -> str:
    return str(path.relative_to(PACKAGE))


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("hookscope", *parts))


def _imports(path: Path) -> Iterator[tuple[int, str]]:
    """``(line, module)`` of every module an import statement of ``path`` names (at any level:
    function-level and ``TYPE_CHECKING`` imports too), made absolute: ``from .x import y``
    names ``package.x`` and ``package.x.y`` (which is a module, or a name in one),
    ``from . import x`` names ``package.x``."""
    package = _module_name(path)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            module = ".".join([*base, *(node.module or "").split(".")]).strip(".")
            if node.module:
                yield node.lineno, module
            for alias in node.names:
                yield node.lineno, f"{module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name


def _hookscope_modules() -> dict[str, Path]:
    return {_module_name(p): p for p in _files()}


# -- layering ----------------------------------------------------------------------------------
@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_use_core_through_its_public_names(capability: str) -> None:
    """Capabilities import ``hookscope.core`` and its list of torch internals, ``core._torch``;
    no other private module of core."""
    bad = [
        f"{_rel(path)}:{line}: {name}"
        for path in _files(capability)
        for line, name in _imports(path)
        if name.startswith("hookscope.core.")
        and not name.startswith("hookscope.core._torch")
        and not _is_public_name_of_core(name)
    ]
    assert not bad, "private core modules imported:\n" + "\n".join(bad)


def _is_public_name_of_core(name: str) -> bool:
    """``hookscope.core.X`` for a name ``from ..core import X`` takes (not a module)."""
    import hookscope.core

    rest = name.removeprefix("hookscope.core.")
    return "." not in rest and rest in hookscope.core.__all__


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_do_not_reach_into_each_others_private_modules(capability: str) -> None:
    others = [c for c in CAPABILITIES if c != capability]
    pattern = re.compile(rf"^hookscope\.({'|'.join(others)})\._")
    bad = [
        f"{_rel(path)}:{line}: {name}"
        for path in _files(capability)
        for line, name in _imports(path)
        if pattern.match(name)
    ]
    assert not bad, "another capability's private modules imported:\n" + "\n".join(bad)


def test_no_import_circle_anywhere_in_the_package() -> None:
    """Every import statement of every module, at any level (function-level and
    ``TYPE_CHECKING`` imports included), as an edge: the graph has no cycle."""
    modules = _hookscope_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for _, target in _imports(path):
            if target in modules and target != name:
                edges[name].add(target)
    cycles = _cycles(edges)
    assert not cycles, "import circles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One cycle per strongly connected component with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_the_circle_check_finds_a_circle() -> None:
    """The check itself can fail: a two-module circle and a three-module one are found."""
    assert _cycles({"a": {"b"}, "b": {"a"}, "c": set()}) == [["a", "b"]]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


# -- what touches a model or the process -------------------------------------------------------
_HOOK_CALL = re.compile(r"^register_\w*hook$")
_INTERCEPTORS = {"TorchFunctionMode", "TorchDispatchMode", "DispatchMode"}


def _calls_and_names(path: Path) -> Iterator[tuple[int, str]]:
    """Every called attribute or function name, and every name or attribute read."""
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Attribute):
            yield node.lineno, node.attr
        elif isinstance(node, ast.Name):
            yield node.lineno, node.id
        elif isinstance(node, ast.alias):
            yield getattr(node, "lineno", 0), node.name.split(".")[-1]


def test_only_the_lifetime_module_registers_hooks() -> None:
    """Module, tensor, node and optimizer hooks (any ``register_*hook``) are registered in
    ``core/_lifetime.py`` only; everything else goes through its ``HookSet``."""
    bad = [
        f"{_rel(path)}:{line}: {name}"
        for path in _files()
        if path != LIFETIME
        for line, name in _calls_and_names(path)
        if _HOOK_CALL.match(name)
    ]
    assert not bad, "hooks registered outside core/_lifetime.py:\n" + "\n".join(bad)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_hook_models_as_sessions(capability: str) -> None:
    """A capability never builds a ``HookSet``: it hooks a model as a core ``Session``."""
    bad = [
        f"{_rel(path)}:{node.lineno}"
        for path in _files(capability)
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Call) and _called(node) == "HookSet"
    ]
    assert not bad, "HookSet built outside core:\n" + "\n".join(bad)


def _called(node: ast.Call) -> str:
    func = node.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def test_interceptors_and_process_state_live_in_the_lifetime_module() -> None:
    """Torch function and dispatch modes are subclasses of the lifetime module's
    ``FunctionInterceptor`` / ``DispatchInterceptor``; the copy hooks (``copyreg``) and the
    compiler stance (``set_stance``) are set there too."""
    bad = [
        f"{_rel(path)}:{line}: {name}"
        for path in _files()
        if path not in (LIFETIME, TORCH_LIST)
        for line, name in _calls_and_names(path)
        if name in _INTERCEPTORS
        or name in ("copyreg", "dispatch_table", "set_stance")
        or name == "_python_dispatch"
    ]
    assert not bad, "outside core/_lifetime.py:\n" + "\n".join(bad)


# -- private torch names -----------------------------------------------------------------------
@cache
def _torch_private_attrs() -> frozenset[str]:
    """Private attribute names of torch's objects: tensors, modules, optimizers, operators,
    and the torch namespaces hookscope reaches."""
    owners: list[object] = [
        torch,
        torch.Tensor,
        torch.empty(0),
        nn.Module,
        nn.Module(),
        nn,
        nn.modules,
        torch.optim.Optimizer,
        torch.ops.aten,
        torch.ops.aten.add.Tensor,
        torch.autograd,
        torch.utils,
    ]
    names = {n for owner in owners for n in dir(owner) if n.startswith("_")}
    return frozenset(n for n in names if not (n.startswith("__") and n.endswith("__")))


def _private_torch_uses(path: Path) -> Iterator[tuple[int, str]]:
    aliases = {"torch", "nn", "F", "aten"}
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            names = [module] if module else [a.name for a in node.names]
            for name in names:
                parts = (name or "").split(".")
                if parts[0] == "torch" and any(p.startswith("_") for p in parts):
                    yield node.lineno, f"import {name}"
        elif isinstance(node, ast.Attribute) and node.attr.startswith("_"):
            if node.attr.startswith("__") and node.attr.endswith("__"):
                continue
            receiver = node.value
            if isinstance(receiver, ast.Name) and receiver.id in ("self", "cls"):
                continue  # hookscope's own objects
            root = receiver
            while isinstance(root, ast.Attribute):
                root = root.value
            rooted = isinstance(root, ast.Name) and root.id in aliases
            if rooted or node.attr in _torch_private_attrs():
                yield node.lineno, f".{node.attr}"


def test_private_torch_names_live_in_one_module() -> None:
    """Every private torch name (``torch.*._name``, a private torch module, a tensor's
    ``._version``, an operator's ``._schema``, private ``nn`` base classes, a module's
    ``._modules``...) is reached through ``core/_torch.py``, which lists it in ``INTERNALS``
    and raises TorchCompatError where it is missing."""
    bad = [
        f"{_rel(path)}:{line}: {what}"
        for path in _files()
        if path != TORCH_LIST
        for line, what in _private_torch_uses(path)
    ]
    assert not bad, "private torch names outside core/_torch.py:\n" + "\n".join(bad)


def test_the_private_name_check_catches_each_kind(tmp_path: Path) -> None:
    source = (
        "import torch\nfrom torch import nn\nfrom torch.utils._python_dispatch import X\n"
        "a = t._version\nb = func._schema\nc = torch._foreach_norm\n"
        "d = nn.modules.conv._ConvNd\ne = m._modules\nf = self._version\n"
    )
    path = tmp_path / "probe.py"
    path.write_text(source)
    found = [what for _, what in _private_torch_uses(path)]
    assert found == [
        "import torch.utils._python_dispatch",
        "._version",
        "._schema",
        "._foreach_norm",
        "._ConvNd",
        "._modules",
    ]


def test_private_names_of_other_libraries_are_only_these() -> None:
    """A ``._name`` hookscope does not define itself and that is not torch's is one of
    FOREIGN_PRIVATE, with the reason it is used."""
    defined = _defined_names()
    found: dict[str, list[str]] = {}
    for path in _files():
        if path == TORCH_LIST:
            continue
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_")):
                continue
            if node.attr.startswith("__") or node.attr in defined:
                continue
            found.setdefault(node.attr, []).append(f"{_rel(path)}:{node.lineno}")
    unknown = {k: v for k, v in found.items() if k not in FOREIGN_PRIVATE}
    assert not unknown, f"private names of other libraries: {unknown}"


def _defined_names() -> set[str]:
    names: set[str] = set()
    for path in _files():
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.arg):
                names.add(node.arg)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                names.add(node.value)  # __slots__ entries
    return names


def test_every_internal_resolves_on_this_torch() -> None:
    from hookscope.core import _torch

    assert _torch.missing() == []
    assert len(_torch.INTERNALS) >= 20


def test_core_exports_what_a_session_needs_and_nothing_of_torchs() -> None:
    """``core.__all__``: names defined by hookscope itself (no torch function re-exported
    under a hookscope name)."""
    import hookscope.core as core

    defined = {
        node.name if isinstance(node, (ast.FunctionDef, ast.ClassDef)) else target.id
        for path in _files("core")
        for node in _tree(path).body
        for target in (node.targets if isinstance(node, ast.Assign) else [node])
        if isinstance(node, (ast.FunctionDef, ast.ClassDef))
        or (isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(target, ast.Name))
    }
    defined |= {
        node.target.id
        for path in _files("core")
        for node in _tree(path).body
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
    }
    foreign = [name for name in core.__all__ if name not in defined]
    assert not foreign, f"core.__all__ re-exports names hookscope does not define: {foreign}"
    for name in core.__all__:
        module = getattr(getattr(core, name), "__module__", "hookscope")
        assert module is None or not module.startswith("torch"), name


def test_importing_hookscope_or_its_command_line_does_not_import_dynamo() -> None:
    """``torch._dynamo`` takes most of a second to import (twice torch's own time here): the
    internals hookscope needs from it are looked up when a compiled model needs them, so
    ``import hookscope`` and ``hookscope --help`` cost about what ``import torch`` does."""
    code = (
        "import sys, torch; before = 'torch._dynamo' in sys.modules; "
        "import hookscope, hookscope.show; print(before, 'torch._dynamo' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    before, after = done.stdout.split()
    assert after == before, "importing hookscope imported torch._dynamo"


#: what the trainer integrations and the tracker sinks wrap: imported only where used
OPTIONAL_LIBRARIES = (
    "lightning",
    "pytorch_lightning",
    "transformers",
    "accelerate",
    "wandb",
    "mlflow",
)


def test_importing_hookscope_imports_no_integration_nor_what_they_wrap() -> None:
    """``import hookscope`` (and its command line) imports neither ``hookscope.integrations``
    nor the trainers and trackers it wraps; importing ``hookscope.integrations`` imports no
    trainer either (each callback module needs its extra)."""
    code = (
        "import sys, hookscope, hookscope.show, hookscope.diagnose; "
        "first = sorted(m for m in sys.modules if m.split('.')[0] in WRAPPED "
        "or m.startswith('hookscope.integrations')); "
        "import hookscope.integrations; "
        "then = sorted(m for m in sys.modules if m.split('.')[0] in WRAPPED); "
        "print(first, then)"
    ).replace("WRAPPED", repr(OPTIONAL_LIBRARIES))
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[] []", done.stdout


# -- the page ----------------------------------------------------------------------------------
def test_every_rule_of_the_page_is_a_test() -> None:
    """ARCHITECTURE.md's "Rules" list names, in each rule, the tests that check it, and they
    are tests of this file: the page says what the tests enforce, no more."""
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("\n## Rules\n", 1)[1].split("\n## ", 1)[0]
    rules = [r for r in re.split(r"\n(?=- )", section.strip()) if r.startswith("- ")]
    assert len(rules) >= 7
    here = {n.name for n in _tree(Path(__file__)).body if isinstance(n, ast.FunctionDef)}
    for rule in rules:
        named = re.findall(r"`(test_\w+)`", rule)
        assert named, f"a rule names no test: {rule[:80]}"
        missing = [n for n in named if n not in here]
        assert not missing, f"the rule names tests that do not exist: {missing}"
    checks = {n for n in here if n.startswith("test_") and not n.startswith("test_the_")}
    checks -= {
        "test_every_rule_of_the_page_is_a_test",
        "test_every_internal_resolves_on_this_torch",
    }
    stated = {n for rule in rules for n in re.findall(r"`(test_\w+)`", rule)}
    assert checks <= stated, f"tests of rules the page does not state: {checks - stated}"
