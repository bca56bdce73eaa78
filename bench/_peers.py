"""Peer tools called the way their documentation shows, each on its own copy of the model.

* nnsight replaces ``forward`` on every module of the model it wraps, so it gets a deep copy.
  ``.save()`` keeps the live tensor (no copy).
* torchlens wraps the whole torch namespace on its first ``trace`` and leaves it wrapped. Its
  variants run as one block per round between :func:`torchlens_wrap` and
  :func:`torchlens_unwrap`; every other variant runs with torch unwrapped.
"""

from __future__ import annotations

import functools
import operator
import warnings
from typing import Any

import torch
from torch import nn

from _cases import Case

__all__ = ["NnsightSaver", "TorchlensTracer", "torchlens_unwrap", "torchlens_wrap"]


def _envoy(root: Any, name: str) -> Any:
    """nnsight's proxy for the module at dotted ``name`` (``ModuleList`` parts by index)."""
    for part in name.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


class NnsightSaver:
    """``with NNsight(copy).trace(x): [m.output.save() for m in modules]``, under no_grad.

    ``names`` must be in execution order (nnsight 0.5+ refuses out-of-order access).
    """

    def __init__(self, case: Case, model_copy: nn.Module, names: list[str]) -> None:
        from nnsight import NNsight

        self.case = case
        self.wrapped = NNsight(model_copy)
        self.names = names
        self.envoys = [_envoy(self.wrapped, n) for n in names]

    def __call__(self) -> dict[str, Any]:
        saved = []
        with torch.no_grad(), self.wrapped.trace(*self.case.args, **self.case.kwargs):
            for envoy in self.envoys:
                saved.append(envoy.output.save())
        return dict(zip(self.names, saved, strict=True))


class TorchlensTracer:
    """``torchlens.trace(copy, x, save=...)``: the selected modules, or every op (``None``)."""

    def __init__(self, case: Case, model_copy: nn.Module, names: list[str] | None) -> None:
        import torchlens as tl

        self.case = case
        self.model = model_copy
        self.names = names
        # save=None keeps torchlens' default, which saves every op's output.
        self.save: Any = (
            None if names is None else functools.reduce(operator.or_, (tl.module(n) for n in names))
        )

    def __call__(self) -> Any:
        import torchlens as tl

        # torchlens warns on every GPT-2 trace (a tensor-to-scalar escape in transformers'
        # masking code); the warning is not about the benchmark.
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return tl.trace(
                self.model, list(self.case.args), input_kwargs=self.case.kwargs, save=self.save
            )

    def outputs(self, trace: Any) -> dict[str, Any]:
        """The saved outputs of the selected modules, by name."""
        return {n: trace.modules[n].out for n in self.names or []}


def torchlens_wrap() -> None:
    from torchlens.backends.torch.wrappers import wrap_torch

    wrap_torch()


def torchlens_unwrap() -> None:
    from torchlens.backends.torch.wrappers import unwrap_torch

    unwrap_torch()
