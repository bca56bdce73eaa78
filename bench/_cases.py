"""The models, inputs and layer selections the benchmark runs (one :class:`Case` per model)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["MODELS", "THREADS_ENV", "Case", "build_case", "leaf_names", "set_threads", "tiny_mlp"]

MODELS = ("resnet50", "gpt2")
#: Environment variable the orchestrator sets to 1 for --quick, whose processes run two at a time.
THREADS_ENV = "HOOKSCOPE_BENCH_THREADS"


def set_threads() -> None:
    """Pin torch's thread pools (2, or $HOOKSCOPE_BENCH_THREADS); keep transformers offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    threads = int(os.environ.get(THREADS_ENV, "2"))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(threads)


def leaf_names(model: nn.Module) -> list[str]:
    """Every module without children (what 'every leaf' captures), in registration order."""
    return [n for n, m in model.named_modules() if n and not list(m.children())]


@dataclass
class Case:
    """One model, its input, and the layers each variant selects."""

    name: str
    model: nn.Module
    args: tuple[Tensor, ...]
    kwargs: dict[str, Any]
    selection: list[str]
    stop_layer: str
    reduce: str
    description: str
    leaves: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.leaves:
            self.leaves = leaf_names(self.model)

    def forward(self, model: nn.Module | None = None) -> Any:
        """Call ``model`` (default: the case's model) on the case's input."""
        return (model if model is not None else self.model)(*self.args, **self.kwargs)

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _resnet50(quick: bool) -> Case:
    from transformers import ResNetConfig, ResNetForImageClassification

    torch.manual_seed(0)
    model = ResNetForImageClassification(ResNetConfig(num_labels=1000)).eval()
    batch, side = (1, 64) if quick else (8, 224)
    torch.manual_seed(1)
    x = torch.randn(batch, 3, side, side)
    return Case(
        name="resnet50",
        model=model,
        args=(x,),
        kwargs={},
        selection=[f"resnet.encoder.stages.{i}" for i in range(4)],
        stop_layer="resnet.encoder.stages.1",
        reduce="spatial_mean",
        description=(
            "transformers ResNetForImageClassification(ResNetConfig(num_labels=1000)), random "
            f"init (seed 0), eval; input float32 {batch}x3x{side}x{side} randn (seed 1)"
        ),
    )


def _gpt2(quick: bool) -> Case:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    # --quick keeps the 12 blocks (same names and selections) but shrinks their width.
    config = (
        GPT2Config(n_embd=64, n_head=2, vocab_size=1000, n_positions=64) if quick else GPT2Config()
    )
    model = GPT2LMHeadModel(config).eval()
    batch, tokens = (1, 16) if quick else (4, 128)
    torch.manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (batch, tokens))
    small = " (--quick: n_embd=64, n_head=2, vocab 1000)" if quick else " (GPT-2 small)"
    return Case(
        name="gpt2",
        model=model,
        args=(ids,),
        kwargs={"use_cache": False},
        selection=[f"transformer.h.{i}" for i in range(config.n_layer)],
        stop_layer="transformer.h.5",
        reduce="token_mean",
        description=(
            f"transformers GPT2LMHeadModel(GPT2Config()){small}, random init (seed 0), eval, "
            f"attention '{model.config._attn_implementation}'; input ids {batch}x{tokens} randint "
            "(seed 1); every call passes use_cache=False"
        ),
    )


_BUILDERS: dict[str, Callable[[bool], Case]] = {"resnet50": _resnet50, "gpt2": _gpt2}


def build_case(name: str, *, quick: bool = False) -> Case:
    """The :class:`Case` for ``name`` (one of :data:`MODELS`)."""
    return _BUILDERS[name](quick)


def tiny_mlp(pairs: int = 25, width: int = 32) -> nn.Sequential:
    """``pairs`` x (Linear(width, width), ReLU): a model where Python overhead dominates."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(pairs):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).eval()
