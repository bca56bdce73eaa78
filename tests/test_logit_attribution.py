"""``hs.logit_attribution`` (direct logit attribution) on Hugging Face GPT-2 and a
grouped-query Llama running their own SDPA attention, against the same attribution written
here by hand from the models' weights, each part of the stream taken with plain PyTorch hooks
(a pre-hook on the output projection, whose input is every head's output side by side), and
the identity that makes it an attribution: the parts add up to the model's own logit
(difference) when the final norm's scale is frozen. TransformerLens is the second oracle
(``tests/test_units_transformer_lens.py``)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

HEADS, HEAD_SIZE, VOCABULARY = 4, 16, 100


def _noisy(model: nn.Module) -> nn.Module:
    """Every bias and norm weight random (Hugging Face starts them at 0 and 1, which would
    hide a bias put in the wrong place)."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "ln" in name or "norm" in name:
                p.copy_(torch.rand(p.shape, generator=generator) + 0.5 * (p.dim() == 1))
    return model.eval()


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=HEADS * HEAD_SIZE, n_head=HEADS)
    config.vocab_size = VOCABULARY
    return _noisy(transformers.GPT2LMHeadModel(config))


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=HEADS * HEAD_SIZE,
        num_attention_heads=HEADS,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=VOCABULARY,
    )
    return _noisy(transformers.LlamaForCausalLM(config))


#: per model: its maker, the keywords naming its parts, its output projections, embeddings
PARTS: dict[str, dict[str, Any]] = {
    "gpt2": {
        "attention": "transformer.h.*.attn.c_proj",
        "mlps": "transformer.h.*.mlp",
        "embeddings": ["transformer.wte", "transformer.wpe"],
        "norm": "transformer.ln_f",
        "unembed": "lm_head",
    },
    "llama": {
        "attention": "model.layers.*.self_attn.o_proj",
        "mlps": "model.layers.*.mlp",
        "embeddings": "model.embed_tokens",
        "norm": "model.norm",
        "unembed": "lm_head",
    },
}
MAKERS = {"gpt2": _gpt2, "llama": _llama}
NAMES = {
    "gpt2": (
        ["transformer.h.0.attn.c_proj", "transformer.h.1.attn.c_proj"],
        ["transformer.h.0.mlp", "transformer.h.1.mlp"],
        ["transformer.wte", "transformer.wpe"],
    ),
    "llama": (
        ["model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj"],
        ["model.layers.0.mlp", "model.layers.1.mlp"],
        ["model.embed_tokens"],
    ),
}


def _inputs(pad: str) -> dict[str, Tensor]:
    ids = torch.randint(0, VOCABULARY, (3, 7), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(3, 7, dtype=torch.long)
    if pad == "left":
        mask[1, :2] = 0
        mask[2, :4] = 0
    else:
        mask[1, 5:] = 0
        mask[2, 3:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def _last(mask: Tensor) -> Tensor:
    """Each row's last real position, found by hand."""
    return torch.tensor([max(i for i in range(len(row)) if row[i]) for row in mask.tolist()])


def _by_hand(kind: str, model: nn.Module, inputs: dict[str, Tensor], at: Tensor) -> dict[str, Any]:
    """Every part of the stream at ``at`` (one position per sample), from plain hooks."""
    projections, mlps, embeddings = NAMES[kind]
    norm = PARTS[kind]["norm"]
    seen: dict[str, Tensor] = {}
    rows = torch.arange(len(at))

    def keep(name: str, inputs_: bool) -> Any:
        def hook(m: nn.Module, args: tuple[Any, ...], out: Any) -> None:
            value = args[0] if inputs_ else out
            seen[name] = value.expand(len(at), *value.shape[1:])[rows, at].detach()

        return hook

    handles = [
        model.get_submodule(n).register_forward_hook(keep(n, n in projections or n == norm))
        for n in [*projections, *mlps, *embeddings, norm]
    ]
    try:
        with torch.no_grad():
            logits = model(**inputs).logits[rows, at]
    finally:
        for h in handles:
            h.remove()
    return {"seen": seen, "logits": logits}


def _weight(proj: nn.Module) -> Tensor:
    """``(in, out)``: GPT-2's Conv1D keeps it so, nn.Linear transposed."""
    return proj.weight if type(proj).__name__ == "Conv1D" else proj.weight.T


def _expected(kind: str, model: nn.Module, inputs: dict[str, Tensor], a: int, b: int) -> Any:
    """The attribution of the logit difference a - b at each sample's last real token, by
    hand: heads through their rows of the projection's weight, then centred (GPT-2's
    LayerNorm) and divided by the final norm's scale of the forward, times its weight, dotted
    with the unembedding's rows a - b."""
    projections, mlps, embeddings = NAMES[kind]
    norm = model.get_submodule(PARTS[kind]["norm"])
    at = _last(inputs["attention_mask"])
    run = _by_hand(kind, model, inputs, at)
    seen, stream = run["seen"], run["seen"][PARTS[kind]["norm"]]
    layer_norm = kind == "gpt2"
    if layer_norm:
        scale = (stream.var(-1, unbiased=False, keepdim=True) + norm.eps).sqrt()
    else:
        scale = (stream.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon).sqrt()
    w_u = model.lm_head.weight
    direction = norm.weight * (w_u[a] - w_u[b])

    def attribute(part: Tensor) -> Tensor:
        if layer_norm:
            part = part - part.mean(-1, keepdim=True)
        return ((part / scale) * direction).sum(-1)

    values, total = [], torch.zeros_like(stream)
    for name in projections:
        proj = model.get_submodule(name)
        z, weight = seen[name].view(len(at), HEADS, HEAD_SIZE), _weight(proj)
        for h in range(HEADS):
            part = z[:, h] @ weight[h * HEAD_SIZE : (h + 1) * HEAD_SIZE]
            values.append(attribute(part))
            total += part
    for name in projections:
        bias = model.get_submodule(name).bias
        bias = torch.zeros(stream.shape[-1]) if bias is None else bias
        values.append(attribute(bias.expand_as(stream)))
        total += bias
    for name in [*mlps, *embeddings]:
        values.append(attribute(seen[name]))
        total += seen[name]
    norm_bias = getattr(norm, "bias", None)
    end = (norm_bias @ (w_u[a] - w_u[b])) if norm_bias is not None else torch.zeros(())
    values.append(end.expand(len(at)))
    torch.testing.assert_close(total, stream, rtol=0, atol=1e-5)  # the parts are the stream
    difference = run["logits"][:, a] - run["logits"][:, b]
    return torch.stack(values).detach()[..., None], difference[:, None], at


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("pad", ["left", "right"])
def test_each_head_mlp_and_embedding_equals_the_attribution_by_hand(kind: str, pad: str) -> None:
    model, inputs = MAKERS[kind](), _inputs(pad)
    assert model.config._attn_implementation == "sdpa"
    expected, difference, at = _expected(kind, model, inputs, 7, 11)
    got = hs.logit_attribution(model, inputs, (7, 11), **PARTS[kind])
    torch.testing.assert_close(got.values, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.positions, at[:, None])
    # the identity: every part's attribution adds up to the model's own logit difference
    torch.testing.assert_close(got.logits, difference, rtol=0, atol=1e-5)
    torch.testing.assert_close(got.values.sum(0), difference, rtol=0, atol=1e-5)
    projections, mlps, embeddings = NAMES[kind]
    assert got.labels[:5] == (
        *(f"{projections[0]} head {h}" for h in range(4)),
        projections[1] + " head 0",
    )
    assert got.labels[8:] == (
        *(f"{p} bias" for p in projections),
        *mlps,
        *embeddings,
        f"{PARTS[kind]['norm']} + lm_head bias",
    )
    assert got.attention == tuple(projections) and got.heads == HEADS
    torch.testing.assert_close(got.by_head[1, 2], got.of(f"{projections[1]} head 2"))
    assert got.values.abs().min() < got.values.abs().max() / 10  # parts tell apart


def test_directions_ids_per_sample_and_a_vector_over_the_vocabulary() -> None:
    """One id per sample, ids per sample and position, and a float vector over the logits:
    each equals the same readout of the logits the model gives (the identity) and of the
    pair's attribution where they coincide."""
    model, inputs = _gpt2(), _inputs("right")
    parts = PARTS["gpt2"]
    with torch.no_grad():
        logits = model(**inputs).logits
    per_sample = torch.tensor([3, 50, 99])
    got = hs.logit_attribution(model, inputs, per_sample, positions=[0, -1], **parts)
    want = logits[:, [0, 6]].gather(-1, per_sample[:, None, None].expand(3, 2, 1))[..., 0]
    torch.testing.assert_close(got.values.sum(0), want, rtol=0, atol=1e-5)
    assert got.positions.tolist() == [[0, 6]] * 3
    per_position = torch.tensor([[1, 2], [3, 4], [5, 6]])
    got = hs.logit_attribution(model, inputs, per_position, positions=[1, 2], **parts)
    want = logits[:, [1, 2]].gather(-1, per_position[..., None])[..., 0]
    torch.testing.assert_close(got.values.sum(0), want, rtol=0, atol=1e-5)
    vector = torch.zeros(VOCABULARY)
    vector[7], vector[11] = 1.0, -1.0
    by_vector = hs.logit_attribution(model, inputs, vector, **parts)
    by_pair = hs.logit_attribution(model, inputs, (7, 11), **parts)
    torch.testing.assert_close(by_vector.values, by_pair.values, rtol=0, atol=1e-6)
    every = hs.logit_attribution(model, inputs, 7, positions=None, **parts)
    assert every.values.shape == (15, 3, 7)
    torch.testing.assert_close(every.values.sum(0), logits[..., 7], rtol=0, atol=1e-5)


def _refused(model: nn.Module, inputs: Any, match: str, **changes: Any) -> None:
    keywords = {**PARTS["gpt2"], **changes}
    direction = keywords.pop("direction", (7, 11))
    with pytest.raises(hs.UsageError, match=match):
        hs.logit_attribution(model, inputs, direction, **keywords)


def test_refusals_name_the_problem() -> None:
    model, inputs = _gpt2(), _inputs("left")
    _refused(
        model, inputs, "not among attention, mlps and embeddings", embeddings="transformer.wte"
    )
    _refused(model, inputs, "not among attention, mlps and embeddings", mlps=[])
    with pytest.raises(hs.LayerNotFoundError, match=r"no scaled_dot_product_attention ran.*sdpa"):
        hs.logit_attribution(
            model, inputs, 1, **{**PARTS["gpt2"], "attention": "transformer.h.*.mlp.c_proj"}
        )
    _refused(model, inputs, "a pair", direction=(1, 2, 3))
    _refused(model, inputs, "outside the vocabulary of 100", direction=100)
    _refused(model, inputs, r"\(3,\) or \(3, 1\)", direction=torch.tensor([1, 2]))
    _refused(model, inputs, r"\(100,\) or \(3, 1, 100\)", direction=torch.ones(5))
    _refused(model, inputs, "must be a token id", direction="a")
    _refused(model, inputs, 'positions must be "last"', positions="first")
    _refused(model, inputs, "not an index of the 7 positions", positions=[7])
    _refused(model, inputs, "LayerNorm or an RMSNorm", norm="transformer.h.0.mlp.act")
    masked = {**inputs, "attention_mask": inputs["attention_mask"] * 0}
    _refused(model, masked, "no real token", attention=[])
    with torch.inference_mode():
        _refused(model, inputs, "inference_mode")
    training = _gpt2().train()  # dropout (GPT-2's default 0.1) changes the stream after the parts
    _refused(training, inputs, r"dropout is on \(call model.eval\(\)\)")
    config = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=VOCABULARY, attn_implementation="eager"
    )
    eager = transformers.GPT2LMHeadModel(config).eval()
    with pytest.raises(hs.LayerNotFoundError, match=r'attn_implementation="sdpa"'):
        hs.logit_attribution(eager, inputs, 1, **PARTS["gpt2"])


def test_the_model_left_as_found_and_its_gradients_untouched() -> None:
    model, inputs = _gpt2(), _inputs("left")
    model.lm_head.weight.grad = None
    hs.logit_attribution(model, inputs, 5, **PARTS["gpt2"])
    assert all(p.grad is None for p in model.parameters())


class Attention(nn.Module):
    """Two heads of 4 through F.scaled_dot_product_attention, then the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 2, 4).permute(2, 0, 3, 1, 4)
        z = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.out(z.transpose(1, 2).flatten(2))
        return out


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(8), nn.LayerNorm(8), Attention()
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        out: Tensor = x + self.mlp(self.ln2(x))
        return out


class Tiny(nn.Module):
    """A two-block transformer written here: not Hugging Face's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(20, 8), nn.Embedding(5, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.norm, self.head = nn.LayerNorm(8), nn.Linear(8, 20)
        _noisy(self)

    def forward(self, ids: Tensor) -> Tensor:
        x = self.embed(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        out: Tensor = self.head(self.norm(x))
        return out


TINY = {
    "attention": "blocks.*.attn.out",
    "mlps": "blocks.*.mlp",
    "embeddings": ["embed", "pos"],
    "norm": "norm",
    "unembed": "head",
}
IDS = torch.tensor([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]])


def test_a_model_written_by_hand_compiled_after_it_ran() -> None:
    """Any model whose attention calls SDPA, compiled and already run: the attribution runs it
    eagerly, equal to the uncompiled model's, and adds up to its logits (a bias on the
    unembedding too)."""
    plain = hs.logit_attribution(Tiny(), IDS, 3, positions=[-1, 1], **TINY)
    with torch.no_grad():
        logits = Tiny()(IDS)
    torch.testing.assert_close(plain.values.sum(0), logits[:, [4, 1], 3], rtol=0, atol=1e-5)
    assert plain.values.shape == (2 * 2 + 2 + 2 + 2 + 1, 2, 2) and plain.heads == 2
    compiled = torch.compile(Tiny(), backend="eager")
    with torch.no_grad():
        compiled(IDS)
    got = hs.logit_attribution(compiled, IDS, 3, positions=[-1, 1], **TINY)
    torch.testing.assert_close(got.values, plain.values, rtol=0, atol=1e-6)


def test_threads_another_session_and_a_transform() -> None:
    """Hazards of tests/test_hazards.py that apply here (its image model has no norm or
    attention): four threads attributing on one model at once, each with other inputs, see
    their own forwards only; a capture the user holds open meanwhile records them as any
    forward; inside a torch.func transform it refuses, naming it."""
    model = Tiny()
    runs = [IDS.roll(i, 1) for i in range(4)]
    alone = [hs.logit_attribution(model, ids, 3, **TINY).values for ids in runs]
    got: dict[int, Tensor] = {}

    def work(i: int) -> None:
        for _ in range(3):
            got[i] = hs.logit_attribution(model, runs[i], 3, **TINY).values

    with hs.capture(model, "norm") as outer:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    for i in range(4):
        torch.testing.assert_close(got[i], alone[i], rtol=0, atol=0)
    assert outer["norm"].count == 12  # the forwards; none of the norm applied by hand
    with pytest.raises(hs.UnsupportedModelError, match=r"inside torch\.func\.vmap"):
        torch.func.vmap(lambda ids: hs.logit_attribution(model, ids, 3, **TINY).values)(IDS[None])
