"""The package's layering, checked on its source: one way to hook a model (a core session),
capabilities that use core only through its public names, and no capability reaching into
another's private modules."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "hookscope"
CAPABILITIES = ("look", "diagnose", "explain", "extract", "show")
HOOK_CALLS = re.compile(
    r"register_(forward_hook|forward_pre_hook|full_backward_hook|full_backward_pre_hook|"
    r"backward_hook|hook)\b|\bHookSet\("
)


def _modules(where: str) -> list[Path]:
    return sorted((PACKAGE / where).rglob("*.py"))


def _imports(path: Path) -> list[str]:
    """Every module an import statement of ``path`` names, made absolute."""
    package = ".".join(("hookscope", *path.relative_to(PACKAGE).parent.parts))
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            base = base[: len(base) - node.level + 1] if node.level else []
            found.append(".".join([*base, *(node.module or "").split(".")]).strip("."))
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
    return found


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_use_core_through_its_public_names(capability: str) -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules(capability)
        for name in _imports(path)
        if name.startswith("hookscope.core._")
    ]
    assert not bad, "private core modules imported:\n" + "\n".join(bad)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_capabilities_do_not_reach_into_each_others_private_modules(capability: str) -> None:
    others = [c for c in CAPABILITIES if c != capability]
    pattern = re.compile(rf"^hookscope\.({'|'.join(others)})\._")
    bad = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for path in _modules(capability)
        for name in _imports(path)
        if pattern.match(name)
    ]
    assert not bad, "another capability's private modules imported:\n" + "\n".join(bad)


@pytest.mark.parametrize("capability", CAPABILITIES)
def test_only_core_hooks_models(capability: str) -> None:
    """Every capability hooks a model as a core Session subclass, never by hand."""
    bad = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in _modules(capability)
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if HOOK_CALLS.search(line) and not line.lstrip().startswith("#")
    ]
    assert not bad, "hooks registered outside core:\n" + "\n".join(bad)


def test_private_torch_internals_live_in_one_module() -> None:
    """``torch._C`` and other private torch names are reached only through core/_torch.py."""
    pattern = re.compile(
        r"torch\._C\b|torch\._dynamo\.(eval_frame|external_utils)|\._sequence_nr\(|"
        r"_current_graph_task_id|_execution_engine"
    )
    bad = [
        f"{path.relative_to(PACKAGE)}:{i}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.name != "_torch.py"
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert not bad, "private torch internals outside core/_torch.py:\n" + "\n".join(bad)


def test_every_internal_resolves_on_this_torch() -> None:
    from hookscope.core import _torch

    assert _torch.missing() == []
    assert len(_torch.INTERNALS) >= 10


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
