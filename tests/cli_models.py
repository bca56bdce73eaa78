"""Factories the command-line tests name as ``path/to/cli_models.py:factory``."""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch
from torch import Tensor, nn


def small_cnn(classes: int = 3) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(6, classes),
    )


class _Log(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return torch.log(x)  # NaN for negative inputs


def nan_model() -> nn.Module:
    """``log`` of a linear layer's output: NaN wherever that output is negative."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), _Log(), nn.Linear(8, 2))


def not_a_module() -> int:
    return 3


def brightness_cnn() -> nn.Module:
    """Class 0's logit is the mean of ReLU(R + G + B): its Grad-CAM at layer "1" is the image's
    brightness (up to a positive factor), a map known without running any CAM code."""
    conv = nn.Conv2d(3, 1, 1)
    linear = nn.Linear(1, 2)
    with torch.no_grad():
        conv.weight.fill_(1.0)
        conv.bias.zero_()
        linear.weight.copy_(torch.tensor([[1.0], [-1.0]]))
        linear.bias.zero_()
    return nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), linear)


#: batch sizes of every forward of counting_cnn's models, in order
CALLS: list[int] = []


class _Counting(nn.Sequential):
    def forward(self, x: Tensor) -> Tensor:
        CALLS.append(x.shape[0])
        return super().forward(x)


def counting_cnn() -> nn.Module:
    """small_cnn that records the batch size of each of its forwards in CALLS."""
    return _Counting(*small_cnn())


class _Tokens(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 8)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(self.embed(ids).mean(1))


def token_model() -> nn.Module:
    """Token ids (N, T) below 50 -> 3 logits; its first layer is an embedding."""
    torch.manual_seed(0)
    return _Tokens()


def flat_cnn() -> nn.Module:
    """No global pooling: its classifier takes 6 x 8 x 8 inputs, so CAM has no fc to use."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(4, 6, 3, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(6 * 8 * 8, 3),
    )


def random_cnn() -> nn.Module:
    """small_cnn's layers with the global random state's weights (--seed decides them)."""
    return nn.Sequential(
        nn.Conv2d(3, 4, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(4, 3),
    )


class _Sleepy(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        Path(os.environ["HOOKSCOPE_TEST_MARK"]).write_text("running")
        time.sleep(120)  # until the test interrupts the command
        return x


def sleepy() -> nn.Module:
    """Writes $HOOKSCOPE_TEST_MARK when its forward starts, then sleeps (to be interrupted)."""
    return _Sleepy()


def dropout_log_model() -> nn.Module:
    """``log`` after dropout of positive values: -Inf wherever dropout zeroes a value, so only
    in training; finite in eval mode."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Softplus(), nn.Dropout(0.5), _Log(), nn.Linear(8, 3))


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.qkv(x).view(*x.shape[:2], 3, 2, 4).permute(2, 0, 3, 1, 4)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return x + out.transpose(1, 2).flatten(2)


class _ViT(nn.Module):
    """4x4 patches and a CLS token, two SDPA attention layers, 3 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 8, 4, stride=4)
        self.cls = nn.Parameter(torch.randn(1, 1, 8))
        self.layers = nn.Sequential(_Attention(), _Attention())
        self.head = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patch(x).flatten(2).transpose(1, 2)
        h = torch.cat([self.cls.expand(len(x), -1, -1), tokens], 1)
        return self.head(self.layers(h)[:, 0])


def small_vit() -> nn.Module:
    torch.manual_seed(0)
    return _ViT()
