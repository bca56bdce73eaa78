"""The registry of attribution methods: what each is and what it needs.

It drives the contract tests (``tests/test_explain_contract.py``), the command line's
``--method`` and the documentation. Every method registers itself where it is defined.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["METHODS", "MethodInfo", "register"]


@dataclass(frozen=True)
class MethodInfo:
    """One attribution method.

    Attributes:
        name: its registry key and ``Explanation.method`` (e.g. ``"gradcam"``).
        cls: the class: ``cls(model, layers, **requires)`` for ``kind="layer"``,
            ``cls(model, **requires)`` for ``"input"`` and ``"attention"``, ``cls(**requires)``
            for ``"wrapper"``.
        kind: ``"layer"`` (maps at a layer's resolution, upsampled), ``"input"`` (maps of the
            input's shape), ``"wrapper"`` (built from other methods), or ``"attention"`` (maps
            over the tokens of a transformer, from its attention weights: models without
            attention are refused).
        gradients: it runs a backward pass.
        perturbation: it runs extra forwards (``cost()``, ``batch_size=``, ``top_k=``).
        requires: constructor keywords that have no default (CAM's ``fc``).
        reference: the paper it implements.
        per_channel: its ``maps`` are ``(N, C, H, W)``, one per input channel (saliency,
            guided backpropagation, Guided Grad-CAM), rather than one ``(N, H, W)`` map per
            image; a wrapper's are those of the method it wraps.
    """

    name: str
    cls: type
    kind: Literal["layer", "input", "wrapper", "attention"]
    gradients: bool
    perturbation: bool = False
    requires: tuple[str, ...] = ()
    reference: str = ""
    per_channel: bool = False


#: name -> :class:`MethodInfo`, filled as the method modules are imported
METHODS: dict[str, MethodInfo] = {}


def register(info: MethodInfo) -> MethodInfo:
    """Add a method to :data:`METHODS` (its name must be new)."""
    if info.name in METHODS and METHODS[info.name].cls is not info.cls:
        raise ValueError(f"two attribution methods are called {info.name!r}")
    METHODS[info.name] = info
    return info
