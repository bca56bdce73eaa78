"""The residue check in conftest.py catches every kind of residue it promises to.

A copy of the library is made with one fault injected at each place a real bug could leave
residue (each fault switched on by an environment variable), and a small test session runs
against that copy with this project's conftest.py: every faulty run must fail in the fixture,
naming what was left behind, and the clean run must pass."""

from __future__ import annotations

import pathlib
import shutil

import pytest

pytest_plugins = ["pytester"]

ROOT = pathlib.Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"

#: kind -> (file in hookscope/core, anchor line, injected code, what the fixture must say)
FAULTS: dict[str, tuple[str, str, str, str]] = {
    "module_hook": (
        "_lifetime.py",
        "        while self._handles:",
        "            self._handles = self._handles[1:]  # leak the first hook",
        "hooks changed on ''",
    ),
    "parameter_hook": (
        "_session.py",
        "            self._install(hooks)",
        "            next(self._layers.root.parameters()).register_hook(lambda g: None)",
        "parameter list, identity, requires_grad or parameter hooks changed",
    ),
    "training_flag": (
        "_lifetime.py",
        "                    if h.module.training != h.flag:",
        "                    if h is held[0]: continue  # forget the root's flag",
        "module tree or training flags changed",
    ),
    "requires_grad": (
        "_session.py",
        "            self._install(hooks)",
        "            next(self._layers.root.parameters()).requires_grad_(False)",
        "parameter list, identity, requires_grad or parameter hooks changed",
    ),
    "attribute": (
        "_session.py",
        "            self._install(hooks)",
        "            self._layers.root.seen_by_hookscope = True",
        "attributes changed on '': ['seen_by_hookscope']",
    ),
    "parameter_value": (
        "_session.py",
        "            self._install(hooks)",
        "            next(self._layers.root.parameters()).data.add_(1.0)",
        "parameter '0.weight' values changed",
    ),
    "parameter_added": (
        "_session.py",
        "            self._install(hooks)",
        "self._layers.root.register_parameter('extra', torch.nn.Parameter(torch.ones(1)))",
        "parameter list, identity, requires_grad or parameter hooks changed",
    ),
    "buffer_value": (
        "_session.py",
        "            self._install(hooks)",
        "            next(self._layers.root.buffers()).add_(1.0)",
        "buffer '2.running_mean' values changed",
    ),
    "global_hook": (
        "_session.py",
        "            self._install(hooks)",
        "            torch.nn.modules.module.register_module_forward_hook(lambda *a: None)",
        "global state changed: _global_forward_hooks",
    ),
    "dynamo_config": (
        "_session.py",
        "            self._install(hooks)",
        "            torch._dynamo.config.skip_nnmodule_hook_guards = False",
        "global state changed: dynamo config",
    ),
    "copy_hooks": (
        "_lifetime.py",
        "        while self._classes:",
        "            self._classes.clear()  # forget to release the copy rules",
        "global state changed: copyreg.dispatch_table",
    ),
    "function_mode": (
        "_torch.py",
        '    length, at, push, pop = need("torch._C torch function mode stack")',
        "    return  # forget to take the operation mode off the stack",
        "global state changed: torch function modes",
    ),
    "tensor_hook": (
        "_grad.py",
        "            hooks.close()",
        "            hooks._handles.clear()  # forget the hook instead of removing it",
        "a tensor's hooks changed",
    ),
}

INNER_TEST = """
import pytest
import torch
from torch import nn

import hookscope as hs


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.BatchNorm1d(2).eval())


@pytest.mark.parametrize("kind", ["clean", *{kinds!r}])
def test_uses_hookscope(kind, monkeypatch):
    monkeypatch.setenv("HOOKSCOPE_FAULT", kind)
    m, x = model(), torch.randn(3, 2, requires_grad=True)
    with hs.capture(m, "0", grads=True) as cap:
        m(x).sum().backward()
    assert cap["0"].grad.shape == (3, 2)
    hs.features(m, x, "1")
    with hs.capture(m, "1::tanh") as ops:  # an operation selector: a mode while "1" runs
        m(x)
    assert torch.equal(ops["1::tanh"].output, torch.tanh(m[0](x)))
    z = x * 2
    with hs.grad_of(z) as g:
        z.sum().backward()
    assert g.grad.shape == (3, 2)
"""


def _faulty_copy(dest: pathlib.Path) -> None:
    shutil.copytree(ROOT / "src" / "hookscope", dest / "hookscope")
    for kind, (file, anchor, code, _) in FAULTS.items():
        path = dest / "hookscope" / "core" / file
        source = path.read_text()
        assert anchor in source, f"{kind}: anchor {anchor!r} no longer in {file}"
        indent = anchor[: len(anchor) - len(anchor.lstrip())]
        guarded = (
            f"{indent}if __import__('os').environ.get('HOOKSCOPE_FAULT') == {kind!r}:\n"
            f"{indent}    import torch, torch._dynamo\n"
            f"{indent}    {code.strip()}\n"
        )
        path.write_text(source.replace(anchor, guarded + anchor, 1))


@pytest.mark.slow
def test_the_fixture_catches_each_kind_of_residue(pytester: pytest.Pytester) -> None:
    _faulty_copy(pytester.path)
    pytester.makeconftest((TESTS / "conftest.py").read_text())
    pytester.makepyfile(residue=(TESTS / "residue.py").read_text())
    pytester.makepyfile(test_inner=INNER_TEST.format(kinds=list(FAULTS)))
    pytester.makeini("[pytest]\nfilterwarnings =\n    error\n")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    output = result.stdout.str()
    result.assert_outcomes(passed=len(FAULTS) + 1, errors=len(FAULTS))
    assert "ERROR at teardown of test_uses_hookscope[clean]" not in output
    for kind, (*_, message) in FAULTS.items():
        block = output.split(f"ERROR at teardown of test_uses_hookscope[{kind}]", 1)
        assert len(block) == 2, f"{kind}: the fixture did not fail"
        assert message in block[1].split("ERROR at teardown", 1)[0], f"{kind}: {message!r}"
