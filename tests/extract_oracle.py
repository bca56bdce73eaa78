"""The extraction tests' small CNN, and their oracle: plain forward hooks copying outputs."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def cnn() -> nn.Module:
    """conv -> ReLU -> conv -> ReLU -> pool -> flatten -> linear, seeded; ``"1"`` is a map,
    ``"6"`` the logits. Ray workers import it from here by name (the tests put this folder on
    their path), as they would a factory from a user's module."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 3),
    )  # fmt: skip


def hand_hooks(model: nn.Module, x: Tensor, names: list[str]) -> dict[str, Tensor]:
    """A copy of each named layer's output in one eval-mode forward, by plain forward hooks."""
    modules = dict(model.named_modules())
    seen: dict[str, Tensor] = {}
    handles = [
        modules[n].register_forward_hook(
            lambda m, a, o, n=n: seen.__setitem__(n, o.detach().clone())
        )
        for n in names
    ]
    was = model.training
    try:
        with torch.no_grad():
            model.eval()(x)
    finally:
        model.train(was)
        for h in handles:
            h.remove()
    return seen


def hand(model: nn.Module, x: Tensor, name: str) -> Tensor:
    """One layer's output (see :func:`hand_hooks`)."""
    return hand_hooks(model, x, [name])[name]
