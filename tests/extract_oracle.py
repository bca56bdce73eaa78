"""The extraction tests' small CNN, and their oracle: plain forward hooks copying outputs."""

from __future__ import annotations

import os
import signal
import time
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn


def cnn() -> nn.Module:
    """conv -> ReLU -> conv -> ReLU -> pool -> flatten -> linear, seeded; ``"1"`` is a map,
    ``"6"`` the logits. Ray workers import it from here by name (the tests put this folder on
    their path), as they would a factory from a user's module."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 3),
    )


def mlp(samples: int = 200) -> tuple[nn.Module, Tensor]:
    """Linear -> ReLU -> Linear, seeded, and its samples: the SIGKILL tests', built alike in
    the children they kill and in the test's process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Linear(16, 4))
    return model, torch.randn(samples, 6, generator=torch.Generator().manual_seed(3))


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


# -- unit="token" -----------------------------------------------------------------------------

WORDS = [f"w{i}" for i in range(40)]


def word_tokenizer(*, bos: bool = False, padding_side: str = "right") -> Any:
    """A word-level Hugging Face tokenizer, offline: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2,
    ``<unk>`` 3, then ``w0``.. ``w39``. Like GPT-2's it adds no special token to a text; with
    ``bos`` it puts ``<bos>`` first, as Llama's does."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3}
    vocab.update({w: i + 4 for i, w in enumerate(WORDS)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 1)]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side=padding_side,
    )


def texts(n: int, seed: int = 0, longest: int = 20) -> list[str]:
    """``n`` texts of 1 to ``longest`` words."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (n,), generator=g).tolist()
    return [
        " ".join(WORDS[int(i)] for i in torch.randint(0, 40, (k,), generator=g)) for k in lengths
    ]


def tiny_lm(kind: str) -> nn.Module:
    """A small GPT-2 or Llama with random weights (seeded), the word tokenizer's vocabulary."""
    from transformers import GPT2Config, GPT2Model, LlamaConfig, LlamaModel

    torch.manual_seed(0)
    ids = {"vocab_size": 44, "bos_token_id": 1, "eos_token_id": 2}
    if kind == "gpt2":
        return GPT2Model(GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, **ids)).eval()
    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        **ids,
    )
    return LlamaModel(config).eval()


def hand_tokens(
    model: nn.Module,
    batches: list[dict[str, Tensor]],
    names: list[str],
    keep: Any = None,
) -> dict[str, Tensor]:
    """Plain forward hooks over ``batches``: each named module's output (its input, for a
    name ``"module<"``) at the tokens ``keep(batch)`` selects (default: the attention mask),
    ``hidden[mask]``, concatenated; and ``sample``, ``position``, ``token_id`` by loops."""
    modules = dict(model.named_modules())
    out: dict[str, list[Tensor]] = {n: [] for n in (*names, "sample", "position", "token_id")}
    seen: dict[str, Tensor] = {}
    first = 0
    for batch in batches:
        handles = [
            modules[n[:-1]].register_forward_pre_hook(partial(_seen_input, seen, n))
            if n.endswith("<")
            else modules[n].register_forward_hook(partial(_seen_output, seen, n))
            for n in names
        ]
        try:
            with torch.no_grad():
                model(**batch)
        finally:
            for h in handles:
                h.remove()
        mask = (keep or (lambda b: b["attention_mask"].bool()))(batch)
        for n in names:
            out[n].append(seen[n][mask])
        for i, row in enumerate(batch["attention_mask"].tolist()):
            position = -1
            for j, real in enumerate(row):
                position += real
                if mask[i, j]:
                    out["sample"].append(torch.tensor([first + i]))
                    out["position"].append(torch.tensor([position]))
                    out["token_id"].append(batch["input_ids"][i, j : j + 1])
        first += len(batch["attention_mask"])
    return {n: torch.cat(v) for n, v in out.items()}


def _seen_input(seen: dict[str, Tensor], name: str, module: nn.Module, args: Any) -> None:
    seen[name] = args[0]


def _seen_output(seen: dict[str, Tensor], name: str, module: nn.Module, a: Any, o: Any) -> None:
    seen[name] = o[0] if isinstance(o, tuple) else o


class TokenModel(nn.Module):
    """input_ids (+ attention_mask) -> per-token rows; ``pool`` one row per sample."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 8)
        self.mix = nn.Linear(8, 8)
        self.pool = nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: Any = None) -> torch.Tensor:
        h = self.mix(self.emb(input_ids)).cumsum(1)  # causal: a token sees those before it
        return self.pool(h.mean(1))


def token_items() -> list[dict[str, torch.Tensor]]:
    """120 samples of 1 to 40 tokens."""
    g = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 41, (120,), generator=g).tolist()
    return [{"input_ids": torch.randint(0, 50, (k,), generator=g)} for k in lengths]


# -- the SIGKILL tests' children ------------------------------------------------------------------
# Run in a child process forked from the tests' forkserver (tests/zygote.py), which imports
# this module rather than the test's own (test_extract_tokens.py imports transformers).


def _die_at(module: nn.Module, kill_at: int, delay: float) -> None:
    """The test's own hook on ``module``: the process kills itself with SIGKILL at forward
    ``kill_at`` (1 is the first; 0: never), and sleeps ``delay`` seconds after each forward."""
    calls = [0]

    def hook(module: nn.Module, args: Any, output: Any) -> None:
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(delay)

    module.register_forward_hook(hook)


def killed_mlp_run(out: str, kill_at: int, delay: float, resume: bool) -> None:
    """test_extract.py's extraction of :func:`mlp`, dying at forward ``kill_at``."""
    import hookscope as hs

    model, x = mlp()
    _die_at(model[0], kill_at, delay)
    hs.extract(model, x, ["0", "1"], out=out, batch_size=10, chunk=20, resume=resume)


def killed_token_run(
    out: str, kill_at: int, delay: float, resume: bool, kwargs: dict[str, Any]
) -> None:
    """test_extract_tokens.py's extraction of :class:`TokenModel`, dying at forward
    ``kill_at``."""
    import hookscope as hs

    torch.manual_seed(0)
    model = TokenModel()
    _die_at(model.emb, kill_at, delay)
    hs.extract(model, token_items(), ["mix", "emb"], out=out, resume=resume, **kwargs)
