"""A capture that edits nothing leaves the model's results bit-identical, swept over two dozen tiny
Hugging Face architectures (random weights from configs, built offline).

For each architecture, capturing *every* callable layer with ``grads=True, inputs=True`` must
leave the model's outputs, every parameter gradient and the gradients of float inputs exactly
as a plain run computes them: identical bits, never ``allclose``. (An older engine swapped in
stand-in copies for captured tensors, which changed memory layouts and so the results of tiny
Mixtral, ModernBERT and Wav2Vec2 models by 1e-9..7e-7.) A second test does the same for a
forward-only, ``copy="reference"`` capture of every leaf under ``torch.no_grad()``.

The oracle is plain PyTorch: a run without hooks, and plain forward pre-hooks that count how
often each layer runs (so the capture is shown to have recorded every call)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs
from zoo import layer_modules, make_loss, tree_leaves

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

Inputs = dict[str, Any]
Build = Callable[[], tuple[nn.Module, Inputs]]

BATCH, SEQ, VOCAB = 2, 8, 96


@dataclass(frozen=True)
class Arch:
    """One architecture: ``build`` returns a fresh, seeded ``(model, inputs)``; ``block`` is
    its first block-level layer, whose output gradient must be readable after backward (the
    first of these names that exists: some layouts differ between transformers releases)."""

    name: str
    build: Build
    block: tuple[str, ...]


ARCHS: dict[str, Arch] = {}


def arch(name: str, *block: str) -> Callable[[Build], Build]:
    def deco(build: Build) -> Build:
        assert name not in ARCHS, name
        ARCHS[name] = Arch(name, build, block)
        return build

    return deco


def _model(model_cls: str, config_cls: str, **config: Any) -> nn.Module:
    """``model_cls(config_cls(**config))`` with seeded random weights, in eval mode (no
    dropout); skips if this transformers lacks either class."""
    missing = [c for c in (config_cls, model_cls) if not hasattr(transformers, c)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {', '.join(missing)}")
    cfg = getattr(transformers, config_cls)(**config)
    torch.manual_seed(0)
    model: nn.Module = getattr(transformers, model_cls)(cfg)
    return model.eval()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _ids(seed: int, n: int = SEQ, low: int = 4, high: int = VOCAB) -> Tensor:
    return torch.randint(low, high, (BATCH, n), generator=_gen(seed))


def _mask(n: int = SEQ) -> Tensor:
    """All ones but the second sequence's last two tokens (padding)."""
    mask = torch.ones(BATCH, n, dtype=torch.long)
    mask[1, -2:] = 0
    return mask


def _pixels(seed: int, size: int = 32) -> Tensor:
    return torch.randn(BATCH, 3, size, size, generator=_gen(seed))


def _text(seed: int) -> Inputs:
    # (models that cache keys and values get use_cache=False in their config)
    return {"input_ids": _ids(seed), "attention_mask": _mask()}


def _seq2seq(seed: int) -> Inputs:
    return {**_text(seed), "decoder_input_ids": _ids(seed + 100, n=5)}


TINY_DECODER = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "use_cache": False,
}

TINY_BERT = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "max_position_embeddings": 64,
    "pad_token_id": 0,
}


# ---------------------------------------------------------------------------------------
# Decoder-only language models
# ---------------------------------------------------------------------------------------
@arch("mixtral", "model.layers.0")
def _mixtral() -> tuple[nn.Module, Inputs]:
    model = _model(
        "MixtralForCausalLM",
        "MixtralConfig",
        **TINY_DECODER,
        num_local_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    return model, _text(1)


@arch("llama", "model.layers.0")
def _llama() -> tuple[nn.Module, Inputs]:
    return _model("LlamaForCausalLM", "LlamaConfig", **TINY_DECODER), _text(2)


@arch("mistral", "model.layers.0")
def _mistral() -> tuple[nn.Module, Inputs]:
    model = _model("MistralForCausalLM", "MistralConfig", **TINY_DECODER, sliding_window=4)
    return model, _text(3)


@arch("qwen2", "model.layers.0")
def _qwen2() -> tuple[nn.Module, Inputs]:
    return _model("Qwen2ForCausalLM", "Qwen2Config", **TINY_DECODER), _text(4)


@arch("qwen2_moe", "model.layers.0")
def _qwen2_moe() -> tuple[nn.Module, Inputs]:
    model = _model(
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        **TINY_DECODER,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        output_router_logits=True,
    )
    return model, _text(5)


@arch("gemma2", "model.layers.0")
def _gemma2() -> tuple[nn.Module, Inputs]:
    # logit soft-capping, alternating sliding-window / global attention
    model = _model(
        "Gemma2ForCausalLM",
        "Gemma2Config",
        **TINY_DECODER,
        head_dim=8,
        sliding_window=4,
        final_logit_softcapping=30.0,
        attn_logit_softcapping=50.0,
    )
    return model, _text(25)


@arch("mamba", "backbone.layers.0")
def _mamba() -> tuple[nn.Module, Inputs]:
    # no attention: a selective scan (the slow, pure-PyTorch path on CPU)
    model = _model(
        "MambaForCausalLM",
        "MambaConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        state_size=8,
        num_hidden_layers=2,
        expand=2,
        conv_kernel=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, {"input_ids": _ids(26)}


@arch("bloom", "transformer.h.0")
def _bloom() -> tuple[nn.Module, Inputs]:
    # ALiBi position biases
    model = _model(
        "BloomForCausalLM",
        "BloomConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        n_layer=2,
        n_head=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, _text(27)


@arch("gpt2", "transformer.h.0")
def _gpt2() -> tuple[nn.Module, Inputs]:
    model = _model(
        "GPT2LMHeadModel",
        "GPT2Config",
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=64,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, _text(6)


@arch("gpt_neox", "gpt_neox.layers.0")
def _gpt_neox() -> tuple[nn.Module, Inputs]:
    model = _model(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, _text(7)


@arch("falcon", "transformer.h.0")
def _falcon() -> tuple[nn.Module, Inputs]:
    model = _model(
        "FalconForCausalLM",
        "FalconConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, _text(8)


@arch("opt", "model.decoder.layers.0")
def _opt() -> tuple[nn.Module, Inputs]:
    model = _model(
        "OPTForCausalLM",
        "OPTConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        word_embed_proj_dim=32,
        ffn_dim=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        use_cache=False,
    )
    return model, _text(9)


# ---------------------------------------------------------------------------------------
# Encoders
# ---------------------------------------------------------------------------------------
@arch("bert", "bert.encoder.layer.0")
def _bert() -> tuple[nn.Module, Inputs]:
    return _model("BertForMaskedLM", "BertConfig", **TINY_BERT), _text(10)


@arch("distilbert", "distilbert.transformer.layer.0")
def _distilbert() -> tuple[nn.Module, Inputs]:
    model = _model(
        "DistilBertForSequenceClassification",
        "DistilBertConfig",
        vocab_size=VOCAB,
        dim=32,
        n_layers=2,
        n_heads=2,
        hidden_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
    )
    return model, _text(11)


@arch("albert", "albert.encoder.albert_layer_groups.0")
def _albert() -> tuple[nn.Module, Inputs]:
    # one shared layer group run twice per forward
    model = _model("AlbertForMaskedLM", "AlbertConfig", **TINY_BERT, embedding_size=16)
    return model, _text(12)


@arch("deberta_v2", "deberta.encoder.layer.0")
def _deberta_v2() -> tuple[nn.Module, Inputs]:
    # disentangled relative-position attention
    model = _model(
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        **TINY_BERT,
        relative_attention=True,
        position_buckets=8,
        max_relative_positions=16,
        pos_att_type=["p2c", "c2p"],
    )
    return model, _text(28)


@arch("modernbert", "model.layers.0")
def _modernbert() -> tuple[nn.Module, Inputs]:
    model = _model(
        "ModernBertForMaskedLM",
        "ModernBertConfig",
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=64,
        global_attn_every_n_layers=2,
        local_attention=4,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        cls_token_id=1,
        sep_token_id=2,
    )
    return model, _text(13)


# ---------------------------------------------------------------------------------------
# Encoder-decoders
# ---------------------------------------------------------------------------------------
@arch("t5", "encoder.block.0")
def _t5() -> tuple[nn.Module, Inputs]:
    model = _model(
        "T5ForConditionalGeneration",
        "T5Config",
        vocab_size=VOCAB,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        pad_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=0,
        use_cache=False,
    )
    return model, _seq2seq(14)


@arch("bart", "model.encoder.layers.0")
def _bart() -> tuple[nn.Module, Inputs]:
    model = _model(
        "BartForConditionalGeneration",
        "BartConfig",
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=2,
        forced_eos_token_id=2,
        use_cache=False,
    )
    return model, _seq2seq(15)


@arch("whisper", "model.encoder.layers.0")
def _whisper() -> tuple[nn.Module, Inputs]:
    model = _model(
        "WhisperForConditionalGeneration",
        "WhisperConfig",
        vocab_size=VOCAB,
        num_mel_bins=16,
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        decoder_start_token_id=1,
        suppress_tokens=None,
        begin_suppress_tokens=None,
        use_cache=False,
    )
    # log-mel features: (batch, mel bins, 2 * max_source_positions frames)
    features = torch.randn(BATCH, 16, 32, generator=_gen(16))
    return model, {
        "input_features": features,
        "decoder_input_ids": _ids(116, n=5),
    }


# ---------------------------------------------------------------------------------------
# Speech, vision, multimodal
# ---------------------------------------------------------------------------------------
@arch("wav2vec2", "wav2vec2.encoder.layers.0")
def _wav2vec2() -> tuple[nn.Module, Inputs]:
    # the positional convolution is weight-normed (a parametrization: a module run on every
    # read of conv.weight)
    model = _model(
        "Wav2Vec2ForCTC",
        "Wav2Vec2Config",
        vocab_size=32,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 8),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=2,
        mask_time_prob=0.0,
        pad_token_id=0,
    )
    return model, {"input_values": torch.randn(BATCH, 400, generator=_gen(17))}


@arch("vit", "vit.layers.0", "vit.encoder.layer.0")
def _vit() -> tuple[nn.Module, Inputs]:
    model = _model(
        "ViTForImageClassification",
        "ViTConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        image_size=16,
        patch_size=4,
        num_labels=3,
    )
    return model, {"pixel_values": _pixels(18, 16)}


@arch("swin", "swin.encoder.layers.0")
def _swin() -> tuple[nn.Module, Inputs]:
    model = _model(
        "SwinForImageClassification",
        "SwinConfig",
        image_size=32,
        patch_size=4,
        embed_dim=16,
        depths=[2, 1],
        num_heads=[2, 2],
        window_size=4,
        num_labels=3,
    )
    return model, {"pixel_values": _pixels(19)}


@arch("resnet", "resnet.encoder.stages.0")
def _resnet() -> tuple[nn.Module, Inputs]:
    # bottleneck blocks end with ``hidden_state += residual`` (in place, after the hooks)
    model = _model(
        "ResNetForImageClassification",
        "ResNetConfig",
        embedding_size=16,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        layer_type="bottleneck",
        num_labels=3,
    )
    return model, {"pixel_values": _pixels(20)}


@arch("convnext", "convnext.encoder.stages.0")
def _convnext() -> tuple[nn.Module, Inputs]:
    model = _model(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        num_stages=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        image_size=32,
        num_labels=3,
    )
    return model, {"pixel_values": _pixels(21)}


@arch("mobilenet_v2", "mobilenet_v2.layer.0")
def _mobilenet_v2() -> tuple[nn.Module, Inputs]:
    model = _model(
        "MobileNetV2ForImageClassification",
        "MobileNetV2Config",
        image_size=32,
        depth_multiplier=0.25,
        num_labels=3,
    )
    return model, {"pixel_values": _pixels(22)}


@arch("clip", "text_model.encoder.layers.0")
def _clip() -> tuple[nn.Module, Inputs]:
    text = {**TINY_BERT, "bos_token_id": 1, "eos_token_id": 2}
    vision = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "image_size": 16,
        "patch_size": 4,
    }
    model = _model(
        "CLIPModel", "CLIPConfig", text_config=text, vision_config=vision, projection_dim=16
    )
    return model, {**_text(23), "pixel_values": _pixels(24, 16)}


# ---------------------------------------------------------------------------------------
# The oracle: plain runs, no hooks
# ---------------------------------------------------------------------------------------
@dataclass
class Result:
    """Clones of what one run computed: output leaves, parameter and input gradients."""

    outputs: dict[tuple[Any, ...], Tensor]
    strides: dict[tuple[Any, ...], tuple[int, ...]]
    params: dict[str, Tensor | None]
    input_grads: dict[str, Tensor | None]


def _fresh(inputs: Inputs, *, grad: bool) -> Inputs:
    """A copy of ``inputs`` per run; float tensors (pixels, audio) require grad if ``grad``."""
    out: Inputs = {}
    for k, v in inputs.items():
        if isinstance(v, Tensor):
            v = v.clone()
            if grad and v.is_floating_point():
                v.requires_grad_(True)
        out[k] = v
    return out


def _record(model: nn.Module, x: Inputs, out: Any) -> Result:
    leaves = list(tree_leaves(out))
    return Result(
        outputs={p: t.detach().clone() for p, t in leaves},
        strides={p: t.stride() for p, t in leaves},
        params={n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()},
        input_grads={
            k: None if v.grad is None else v.grad.clone()
            for k, v in x.items()
            if isinstance(v, Tensor) and v.requires_grad
        },
    )


def _plain(model: nn.Module, inputs: Inputs) -> Result:
    """Forward and backward with no hooks at all."""
    x = _fresh(inputs, grad=True)
    out = model(**x)
    make_loss(out).backward()
    result = _record(model, x, out)
    model.zero_grad(set_to_none=True)
    return result


def _plain_no_grad(model: nn.Module, inputs: Inputs) -> Result:
    x = _fresh(inputs, grad=False)
    with torch.no_grad():
        return _record(model, x, model(**x))


def _call_counts(model: nn.Module, layers: list[str], inputs: Inputs) -> dict[str, int]:
    """How often each layer runs per forward, by plain forward pre-hooks (removed after)."""
    mods = dict(model.named_modules())
    counts = dict.fromkeys(layers, 0)

    def counter(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            counts[name] += 1

        return hook

    handles = [mods[n].register_forward_pre_hook(counter(n)) for n in layers]
    try:
        model(**_fresh(inputs, grad=True))
    finally:
        for h in handles:
            h.remove()
    return counts


def _same_bits(a: Tensor | None, b: Tensor | None) -> str | None:
    """None if ``a`` and ``b`` are identical (same dtype, shape and bits), else why not."""
    if a is None or b is None:
        kinds = ["None" if t is None else "a tensor" for t in (a, b)]
        return None if a is b else f"{kinds[0]} where the plain run has {kinds[1]}"
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{a.dtype}{tuple(a.shape)} vs the reference's {b.dtype}{tuple(b.shape)}"
    if torch.equal(a, b):
        return None
    if not a.is_floating_point():
        return f"{int((a != b).sum())} of {a.numel()} elements differ"
    diff = (a.double() - b.double()).abs().nan_to_num(nan=float("inf"))
    return (
        f"{int((a != b).sum())} of {a.numel()} elements differ, max |diff| {diff.max().item():.3g}"
    )


def _differences(got: Result, want: Result, *, grads: bool) -> list[str]:
    problems: list[str] = []
    assert list(got.outputs) == list(want.outputs), "the output structure changed"
    for path, t in want.outputs.items():
        why = _same_bits(got.outputs[path], t)
        if why:
            problems.append(f"output{list(path)}: {why}")
        elif got.strides[path] != want.strides[path]:
            problems.append(
                f"output{list(path)}: strides {got.strides[path]} vs {want.strides[path]}"
            )
    if grads:
        for side, g, w in (
            ("parameter", got.params, want.params),
            ("input", got.input_grads, want.input_grads),
        ):
            assert list(g) == list(w)
            for name in w:
                why = _same_bits(g[name], w[name])
                if why:
                    problems.append(f"{side} {name}.grad: {why}")
    return problems


def _fail(problems: list[str], stable: bool, what: str) -> None:
    note = (
        "(two plain runs agree bit for bit, so the capture made the difference)"
        if stable
        else "(NB: two plain runs differ too: the model itself is not deterministic here)"
    )
    shown = "\n  ".join(problems[:12])
    more = f"\n  ... and {len(problems) - 12} more" if len(problems) > 12 else ""
    pytest.fail(f"{what} changed the model's results {note}:\n  {shown}{more}")


def _selectable(model: nn.Module) -> list[str]:
    """Every layer hookscope can select that can be called: ``hs.names`` minus containers
    without a forward of their own (ModuleList, ModuleDict, ParametrizationList, ...)."""
    callable_ = layer_modules(model)
    return [n for n in hs.names(model) if n in callable_]


# ---------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module", params=list(ARCHS), ids=str)
def built(request: pytest.FixtureRequest) -> tuple[Arch, nn.Module, Inputs]:
    """Each model is built once for both tests (they leave it as found)."""
    entry = ARCHS[request.param]
    model, inputs = entry.build()
    return entry, model, inputs


def test_capture_all_with_grads_is_bit_identical(
    built: tuple[Arch, nn.Module, Inputs],
) -> None:
    entry, model, inputs = built
    model.zero_grad(set_to_none=True)
    want = _plain(model, inputs)
    assert any(g is not None for g in want.params.values()), "no parameter got a gradient"

    layers = _selectable(model)
    block = next((b for b in entry.block if b in layers), None)
    assert block is not None, f"none of {entry.block} is a layer of {entry.name}"
    counts = _call_counts(model, layers, inputs)
    assert counts[block] >= 1, f"{block!r} did not run"

    try:
        with hs.capture(model, layers, grads=True, inputs=True) as cap:
            x = _fresh(inputs, grad=True)
            out = model(**x)
            make_loss(out).backward()
            got = _record(model, x, out)
    finally:
        model.zero_grad(set_to_none=True)

    problems = _differences(got, want, grads=True)
    if problems:
        stable = not _differences(_plain(model, inputs), want, grads=True)
        _fail(problems, stable, f"capture(every layer of {len(layers)}, grads=True, inputs=True)")

    # the capture recorded every call of every layer, and the gradients reached the blocks
    wrong = {n: (cap[n].count, counts[n]) for n in layers if cap[n].count != counts[n]}
    assert not wrong, f"capture counted (calls, plain hooks counted): {wrong}"
    grad = cap[block].grad
    grads = [t for _, t in tree_leaves(grad)]
    assert grads and all(isinstance(t, Tensor) for t in grads), f"{block}.grad: {grad!r}"
    output = dict(tree_leaves(cap[block].output))
    for path, g in tree_leaves(grad):
        assert g.shape == output[path].shape, f"{block}.grad{list(path)}: shape"
    assert isinstance(cap[block].inputs, dict)


def test_reference_capture_of_every_leaf_is_bit_identical(
    built: tuple[Arch, nn.Module, Inputs],
) -> None:
    entry, model, inputs = built
    want = _plain_no_grad(model, inputs)
    mods = layer_modules(model)
    leaves = [n for n in _selectable(model) if not list(mods[n].children())]
    with torch.no_grad():
        counts = _call_counts(model, leaves, inputs)
    assert sum(counts.values()), f"no leaf of {entry.name} ran"
    x = _fresh(inputs, grad=False)
    with torch.no_grad(), hs.capture(model, leaves, copy="reference") as cap:
        got = _record(model, x, model(**x))
    # (reading the captures may raise StaleCaptureError for outputs overwritten in place)
    problems = _differences(got, want, grads=False)
    if problems:
        stable = not _differences(_plain_no_grad(model, inputs), want, grads=False)
        _fail(problems, stable, f"capture(every leaf of {len(leaves)}, copy='reference')")
    wrong = {n: (cap[n].count, counts[n]) for n in leaves if cap[n].count != counts[n]}
    assert not wrong, f"capture counted (calls, plain hooks counted): {wrong}"
