"""Shared fixtures. The autouse ``untouched_models`` check is the zero-residue promise:
every model hookscope touched during a test must afterwards have exactly the hooks,
per-module training flags, requires_grad, parameters, buffers and attributes it had
before hookscope first touched it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import nn

from hookscope import _lifetime

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
torch.set_num_threads(min(2, torch.get_num_threads()))

_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


@dataclass
class ModelState:
    """Everything hookscope promises to leave as found, for one model."""

    modules: list[tuple[str, int, bool, dict[str, tuple[Any, ...]], tuple[str, ...]]]
    params: list[tuple[str, int, bool, Any, torch.Tensor]]
    buffers: list[tuple[str, int, torch.Tensor | None]]

    @staticmethod
    def of(model: nn.Module) -> ModelState:
        modules = []
        for name, m in model.named_modules(remove_duplicate=False):
            hooks = {d: tuple(getattr(m, d, {}).items()) for d in _HOOK_DICTS}
            modules.append((name, id(m), m.training, hooks, tuple(sorted(vars(m)))))
        params = [
            (
                n,
                id(p),
                p.requires_grad,
                tuple((p._backward_hooks or {}).items()),
                p.detach().clone(),
            )
            for n, p in model.named_parameters(remove_duplicate=False)
        ]
        buffers = [
            (n, id(b), None if b is None else b.detach().clone())
            for n, b in model.named_buffers(remove_duplicate=False)
        ]
        return ModelState(modules, params, buffers)

    def diff(self, other: ModelState, *, values: bool) -> list[str]:
        problems: list[str] = []
        if [m[:3] for m in self.modules] != [m[:3] for m in other.modules]:
            problems.append("module tree or training flags changed")
        for a, b in zip(self.modules, other.modules):
            if a[3] != b[3]:
                changed = [d for d in _HOOK_DICTS if a[3][d] != b[3][d]]
                problems.append(f"hooks changed on {a[0]!r}: {changed}")
            if a[4] != b[4]:
                problems.append(f"attributes changed on {a[0]!r}: {set(a[4]) ^ set(b[4])}")
        for a, b in zip(self.params, other.params):
            if a[:4] != b[:4]:
                problems.append(f"parameter {a[0]!r} identity/requires_grad/hooks changed")
            elif values and not torch.equal(a[4], b[4]):
                problems.append(f"parameter {a[0]!r} values changed")
        if [b[:2] for b in self.buffers] != [b[:2] for b in other.buffers]:
            problems.append("buffers replaced")
        elif values:
            for a, b in zip(self.buffers, other.buffers):
                if (a[2] is None) != (b[2] is None) or (
                    a[2] is not None and not torch.equal(a[2], b[2])  # type: ignore[arg-type]
                ):
                    problems.append(f"buffer {a[0]!r} values changed")
        return problems


@pytest.fixture(autouse=True)
def untouched_models(request: pytest.FixtureRequest) -> Iterator[None]:
    """Snapshot each model when hookscope first touches it; compare after the test."""
    seen: dict[int, tuple[nn.Module, ModelState]] = {}

    def listener(model: nn.Module) -> None:
        if id(model) not in seen:
            seen[id(model)] = (model, ModelState.of(model))

    _lifetime.session_listeners.append(listener)
    try:
        yield
    finally:
        _lifetime.session_listeners.remove(listener)
    leaked = _lifetime.live_hooksets()
    assert not leaked, f"hookscope left {sum(map(len, leaked))} hooks registered"
    values = request.node.get_closest_marker("mutates_model") is None
    for model, before in seen.values():
        problems = before.diff(ModelState.of(model), values=values)
        assert not problems, f"{type(model).__name__} not left as found: {problems}"
