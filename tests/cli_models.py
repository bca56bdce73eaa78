"""Factories the command-line tests name as ``path/to/cli_models.py:factory``."""

from __future__ import annotations

import torch
from torch import Tensor, nn


def small_cnn(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 6, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(6, classes),
    )  # fmt: skip


class _Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)  # NaN for negative inputs


def nan_model() -> nn.Module:
    """``log`` of a linear layer's output: NaN wherever that output is negative."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), _Log(), nn.Linear(8, 2))


def not_a_module() -> int:
    return 3
