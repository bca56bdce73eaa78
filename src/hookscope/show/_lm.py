"""What the command line's ``patching`` and ``lens`` commands need of a Hugging Face causal
language model saved in a directory with its tokenizer: the prompts as token ids and token
strings, the blocks (whose outputs are the residual stream), the final norm and the
unembedding, and the standalone page that shows a grid or a lens."""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._version import __version__
from ..core import names
from ..errors import UsageError
from ..explain import Patching, patching
from . import _html
from ._load import prepare, tokenizer_of
from ._models import load_model

__all__ = [
    "blocks",
    "encode",
    "final_norm",
    "load_lm",
    "one_token",
    "sdpa_sites",
    "sweep",
    "unembedding",
    "write_page",
]

SDPA = "::scaled_dot_product_attention"


def load_lm(spec: str, hf_class: str | None) -> tuple[nn.Module, Any]:
    """The model (``AutoModelForCausalLM`` unless ``hf_class``) and its tokenizer."""
    if not Path(spec).is_dir():
        raise UsageError(
            f"{spec!r} is not a directory: this command needs a Hugging Face causal language "
            "model saved with its tokenizer (model.save_pretrained(DIR) and "
            "tokenizer.save_pretrained(DIR))"
        )
    model = load_model(spec, hf_class=hf_class or "AutoModelForCausalLM")
    return model, tokenizer_of(Path(spec), "tokenizing the prompts")


def encode(tokenizer: Any, text: str) -> tuple[Tensor, list[str]]:
    """One prompt's ids ``(1, T)`` and each token as text (the columns' labels)."""
    ids = tokenizer(text, return_tensors="pt")["input_ids"]
    if ids.shape[1] == 0:
        raise UsageError(f"the prompt {text!r} has no token")
    return ids, [str(tokenizer.decode([int(i)])) for i in ids[0]]


def one_token(tokenizer: Any, text: str, flag: str) -> int:
    """The id of ``text``, which must be one token (with its leading space, as in ' Paris')."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise UsageError(
            f"{flag} {text!r} is {len(ids)} tokens for this tokenizer; give one token "
            "(with its leading space where the word follows another, e.g. ' Paris')"
        )
    return int(ids[0])


def blocks(model: nn.Module) -> list[str]:
    """The blocks: the entries of the ``nn.ModuleList`` holding ``config.num_hidden_layers``
    modules (``transformer.h.*``, ``model.layers.*``)."""
    n = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and n and len(module) == n:
            return [f"{name}.{i}" for i in range(n)]
    raise UsageError(
        "found no list of the model's blocks (an nn.ModuleList of config.num_hidden_layers "
        "modules): name the layers with --layer (see `hookscope names`)"
    )


def sdpa_sites(model: nn.Module, ids: Tensor) -> list[str]:
    """The model's ``scaled_dot_product_attention`` calls, as operation sites, in order."""
    found = [n for n in names(model, ops=True, inputs=ids) if n.endswith(SDPA)]
    if not found:
        raise UsageError(
            "--heads: the model calls no scaled_dot_product_attention (load it with "
            "attn_implementation='sdpa', the default), or name the sites with --layer"
        )
    return found


def unembedding(model: nn.Module) -> str:
    """The name of the module that the model's ``get_output_embeddings()`` returns."""
    head = getattr(model, "get_output_embeddings", lambda: None)()
    name = next((n for n, m in model.named_modules() if head is not None and m is head), None)
    if name is None:
        raise UsageError("this model has no output embedding (lm_head): load it with its LM head")
    return str(name)


def final_norm(model: nn.Module, layers: Sequence[str]) -> str:
    """The last norm (a class named ``...Norm``) outside the blocks: the final norm."""
    inside = tuple(f"{layer}." for layer in layers)
    norms = [
        name
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Norm") and not name.startswith(inside)
    ]
    if not norms:
        raise UsageError("found no final norm outside the blocks: name it with --norm")
    return str(norms[-1])


def logit_difference(answer: int, wrong: int) -> Any:
    """The metric: logit of ``answer`` minus that of ``wrong`` at the last position."""

    def metric(out: Any) -> Tensor:
        logits: Tensor = out.logits[:, -1]
        return (logits[:, answer] - logits[:, wrong]).mean()

    return metric


def score(model: nn.Module, ids: Tensor, metric: Any) -> float:
    with torch.no_grad():
        return float(metric(model(ids)))


def sweep(
    model: nn.Module, tokenizer: Any, o: dict[str, Any]
) -> tuple[Patching, dict[str, float], str, list[str]]:
    """``hookscope patching``'s grid (its options ``o``), the metric of the clean and
    corrupted runs, what the metric is, and the clean prompt's tokens."""
    (clean, tokens), (corrupted, _) = (
        encode(tokenizer, o["clean"]),
        encode(tokenizer, o["corrupted"]),
    )
    model, (clean, corrupted) = prepare(model, (clean, corrupted), device=o["device"], dtype=None)
    if clean.shape != corrupted.shape:
        raise UsageError(
            f"--clean is {clean.shape[1]} tokens and --corrupted {corrupted.shape[1]}: patching "
            "compares the same positions, give prompts of as many tokens"
        )
    answer, wrong = (
        one_token(tokenizer, o["answer"], "--answer"),
        one_token(tokenizer, o["wrong"], "--wrong"),
    )
    metric = logit_difference(answer, wrong)
    layers = list(o["layers"]) or (sdpa_sites(model, clean) if o["heads"] else blocks(model))
    cells = o["cells_per_forward"]
    grid = patching(
        model, clean, corrupted, metric, layers, heads=o["heads"], cells_per_forward=cells
    )
    runs = {"clean": score(model, clean, metric), "corrupted": score(model, corrupted, metric)}
    what = f"logit({o['answer']!r}) - logit({o['wrong']!r}) at the last position"
    if o["normalized"]:  # 0: the corrupted run's metric, 1: the clean run's
        gap = runs["clean"] - runs["corrupted"]
        if gap == 0:
            raise UsageError("--normalized: the clean and corrupted runs score the same")
        grid = dataclasses.replace(grid, values=(grid.values - runs["corrupted"]) / gap)
        what = f"({what} - corrupted) / (clean - corrupted)"
    return grid, runs, what, tokens


def write_page(out: str, title: str, section: tuple[str, str, str]) -> Path:
    """A page holding one section, written whole or not at all."""
    path = Path(out)
    if path.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"--out must be an .html file, got {out!r}")
    stamp = f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}"
    text = _html.page(
        title, f"hookscope {__version__} · torch {torch.__version__} · {stamp}", [section]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)
    return path
