"""Units as sites: ``positions=``, ``heads=`` and ``neurons=`` of ``hs.capture`` and ``hs.edit``
on Hugging Face GPT-2 and a grouped-query Llama, both running their own SDPA attention, against
eager attention written here by hand from the models' weights (the attention layer's inputs
taken with plain PyTorch hooks), and edits against plain PyTorch hooks on the output
projection, whose input is every head's output side by side."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.hf

HEADS, HEAD_SIZE = 4, 16


def _gpt2() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=HEADS * HEAD_SIZE, n_head=HEADS)
    config.vocab_size = 100
    return transformers.GPT2LMHeadModel(config).eval()


def _llama() -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=HEADS * HEAD_SIZE,
        num_attention_heads=HEADS,
        num_key_value_heads=2,  # grouped-query attention: two query heads per key/value head
        intermediate_size=128,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(config).eval()


MODELS = {
    "gpt2": (_gpt2, "transformer.h.{}.attn", "c_proj"),
    "llama": (_llama, "model.layers.{}.self_attn", "o_proj"),
}


def _inputs(pad: str) -> dict[str, Tensor]:
    ids = torch.randint(0, 100, (3, 7), generator=torch.Generator().manual_seed(1))
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


def _module(model: nn.Module, name: str) -> nn.Module:
    return model.get_submodule(name)


def _attention_inputs(model: nn.Module, attention: str, inputs: dict[str, Tensor]) -> Any:
    """The attention layer's hidden states and keyword arguments, with a plain pre-hook."""
    seen: dict[str, Any] = {}

    def pre(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        seen["x"] = args[0] if args else kwargs["hidden_states"]
        seen["kwargs"] = kwargs

    handle = _module(model, attention).register_forward_pre_hook(pre, with_kwargs=True)
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        handle.remove()
    return seen["x"], seen["kwargs"]


def _rotate_half(t: Tensor) -> Tensor:
    first, second = t.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def _eager(model: nn.Module, kind: str, layer: int, inputs: dict[str, Tensor]) -> tuple[Any, Any]:
    """``(P, Z)``: attention probabilities ``(N, H, T, T)`` and each head's output
    ``(N, H, T, d)``, computed by hand from the layer's weights (causal and padding masks)."""
    attention = MODELS[kind][1].format(layer)
    x, kwargs = _attention_inputs(model, attention, inputs)
    attn = _module(model, attention)
    n, t, _ = x.shape
    with torch.no_grad():
        if kind == "gpt2":
            q, k, v = attn.c_attn(x).split(HEADS * HEAD_SIZE, dim=2)
            kv_heads = HEADS
        else:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
            kv_heads = 2
        q = q.view(n, t, HEADS, HEAD_SIZE).transpose(1, 2)
        k = k.view(n, t, kv_heads, HEAD_SIZE).transpose(1, 2)
        v = v.view(n, t, kv_heads, HEAD_SIZE).transpose(1, 2)
        if kind == "llama":  # rotary embeddings, the angles the model gave the layer
            cos, sin = (a.unsqueeze(1) for a in kwargs["position_embeddings"])
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            k = k.repeat_interleave(HEADS // kv_heads, dim=1)  # query head h reads h // 2
            v = v.repeat_interleave(HEADS // kv_heads, dim=1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(HEAD_SIZE)
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        allowed = causal[None, None] & inputs["attention_mask"].bool()[:, None, None, :]
        probs = scores.masked_fill(~allowed, float("-inf")).softmax(dim=-1)
        return probs, probs @ v


def _at(t: Tensor, axis: int, index: Tensor) -> Tensor:
    """``t`` at one position per sample along ``axis`` (kept as size 1), by hand."""
    return torch.stack(
        [t[i].select(axis - 1, int(p)).unsqueeze(axis - 1) for i, p in enumerate(index)]
    )


# -- capture -------------------------------------------------------------------------------------
@pytest.mark.parametrize("pad", ["left", "right"])
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_heads_at_the_last_real_token_equal_eager_attention_by_hand(kind: str, pad: str) -> None:
    make, attention, _ = MODELS[kind]
    model, inputs = make(), _inputs(pad)
    assert model.config._attn_implementation == "sdpa"
    sites = [f"{attention.format(1)}::scaled_dot_product_attention"]
    sites.append(f"{attention.format(1)}::attention_weights")
    with torch.no_grad(), hs.capture(model, sites, heads=[3, 1], positions="last") as cap:
        model(**inputs)
    probs, z = _eager(model, kind, 1, inputs)
    last = _last(inputs["attention_mask"])
    got_z = cap[sites[0]].output
    got_p = cap[sites[1]].output
    assert got_z.shape == (3, 2, 1, HEAD_SIZE) and got_p.shape == (3, 2, 1, 7)
    torch.testing.assert_close(got_z, _at(z[:, [3, 1]], 2, last), rtol=0, atol=1e-5)
    torch.testing.assert_close(got_p, _at(probs[:, [3, 1]], 2, last), rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_heads_and_positions_by_index_equal_eager_attention_by_hand(kind: str) -> None:
    make, attention, _ = MODELS[kind]
    model, inputs = make(), _inputs("right")
    inputs["attention_mask"] = torch.ones_like(inputs["attention_mask"])
    site = f"{attention.format(0)}::scaled_dot_product_attention"
    with torch.no_grad(), hs.capture(model, site, heads=2, positions=[0, -1, 3]) as cap:
        model(**inputs)
    _, z = _eager(model, kind, 0, inputs)
    torch.testing.assert_close(cap[site].output, z[:, [2]][:, :, [0, 6, 3]], rtol=0, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True], ids=["enable_gqa", "repeated_keys"])
def test_the_key_and_value_a_query_head_reads_under_grouped_query_attention(masked: bool) -> None:
    """heads= on an SDPA call's inputs: the query at query head 3, key and value at the
    key/value head it reads (3 // 2 = 1), whichever layout transformers gives the key (without
    a mask it passes 2 key heads and enable_gqa=True, with one it repeats them to 4)."""
    model, inputs = _llama(), _inputs("left")
    if not masked:
        del inputs["attention_mask"]
    site = "model.layers.0.self_attn::scaled_dot_product_attention"
    with torch.no_grad(), hs.capture(model, site, heads=[3], inputs=True) as cap:
        model(**inputs)
    with torch.no_grad(), hs.capture(model, site, inputs=True) as full:
        model(**inputs)
    query, key = full[site].inputs["query"], full[site].inputs["key"]
    assert key.size(1) == (4 if masked else 2)
    kv = 3 if masked else 1
    torch.testing.assert_close(cap[site].inputs["query"], query[:, [3]], rtol=0, atol=0)
    torch.testing.assert_close(cap[site].inputs["key"], key[:, [kv]], rtol=0, atol=0)
    value = full[site].inputs["value"]
    torch.testing.assert_close(cap[site].inputs["value"], value[:, [kv]], rtol=0, atol=0)


def test_neurons_and_positions_of_a_layer_and_of_its_gradient() -> None:
    model, inputs = _gpt2(), _inputs("left")
    seen: list[Tensor] = []
    grads: list[Tensor] = []

    def keep(module: nn.Module, args: Any, out: Tensor) -> None:
        seen.append(out.detach())
        out.register_hook(grads.append)

    handle = model.transformer.h[0].mlp.register_forward_hook(keep)  # the reference run
    try:
        model(**inputs).logits.pow(2).sum().backward()
    finally:
        handle.remove()
    site = "transformer.h.0.mlp"
    try:
        with hs.capture(model, site, neurons=[5, -1], positions="last", grads=True) as cap:
            model(**inputs).logits.pow(2).sum().backward()
    finally:
        model.zero_grad()
    last = _last(inputs["attention_mask"])
    assert cap[site].output.shape == cap[site].grad.shape == (3, 1, 2)
    torch.testing.assert_close(
        cap[site].output, _at(seen[0][..., [5, 63]], 1, last), rtol=0, atol=0
    )
    torch.testing.assert_close(cap[site].grad, _at(grads[0][..., [5, 63]], 1, last), rtol=0, atol=0)


# -- edits ---------------------------------------------------------------------------------------
def _by_hand(
    model: nn.Module, kind: str, layer: int, change: Any, inputs: dict[str, Tensor]
) -> Tensor:
    """Logits with ``change(x)`` applied to the output projection's input ``(N, T, H·d)``
    (every head's output side by side), by a plain pre-hook."""
    _, attention, projection = MODELS[kind]
    proj = _module(model, f"{attention.format(layer)}.{projection}")
    handle = proj.register_forward_pre_hook(lambda m, args: (change(args[0].clone()),))
    try:
        with torch.no_grad():
            return model(**inputs).logits
    finally:
        handle.remove()


def _head_columns(head: int) -> slice:
    return slice(head * HEAD_SIZE, (head + 1) * HEAD_SIZE)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_ablating_a_head_at_the_last_real_token_changes_only_its_columns(kind: str) -> None:
    make, attention, _ = MODELS[kind]
    model, inputs = make(), _inputs("left")
    last = _last(inputs["attention_mask"])
    site = f"{attention.format(1)}::scaled_dot_product_attention"
    with torch.no_grad(), hs.edit(model, {site: hs.ablate()}, heads=[3], positions="last"):
        got = model(**inputs).logits

    def zero(x: Tensor) -> Tensor:
        for i, p in enumerate(last.tolist()):
            x[i, p, _head_columns(3)] = 0
        return x

    torch.testing.assert_close(got, _by_hand(model, kind, 1, zero, inputs), rtol=0, atol=1e-5)
    with torch.no_grad():
        plain = model(**inputs).logits
    assert not torch.allclose(got, plain)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_patching_heads_of_a_clean_run_into_a_corrupted_one(kind: str) -> None:
    make, attention, projection = MODELS[kind]
    model, clean = make(), _inputs("right")
    corrupt = {**clean, "input_ids": clean["input_ids"].flip(1)}
    site = f"{attention.format(0)}::scaled_dot_product_attention"
    with torch.no_grad(), hs.capture(model, site, heads=[0, 2], positions="last") as cap:
        model(**clean)
    with torch.no_grad(), hs.edit(model, {site: hs.patch(cap)}, heads=[0, 2], positions="last"):
        got = model(**corrupt).logits
    seen: list[Tensor] = []
    proj = _module(model, f"{attention.format(0)}.{projection}")
    handle = proj.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            model(**clean)
    finally:
        handle.remove()
    last = _last(clean["attention_mask"])

    def patched(x: Tensor) -> Tensor:
        for i, p in enumerate(last.tolist()):
            for head in (0, 2):
                x[i, p, _head_columns(head)] = seen[0][i, p, _head_columns(head)]
        return x

    torch.testing.assert_close(got, _by_hand(model, kind, 0, patched, corrupt), rtol=0, atol=1e-5)


def test_knocking_out_a_heads_attention_weights_zeroes_its_output() -> None:
    model, inputs = _llama(), _inputs("left")
    site = "model.layers.1.self_attn::attention_weights"
    with torch.no_grad(), hs.edit(model, {site: hs.ablate()}, heads=[1]):
        got = model(**inputs).logits

    def zero(x: Tensor) -> Tensor:
        x[..., _head_columns(1)] = 0
        return x

    torch.testing.assert_close(got, _by_hand(model, "llama", 1, zero, inputs), rtol=0, atol=1e-5)


def test_an_edit_of_some_neurons_at_some_positions() -> None:
    model, inputs = _gpt2(), _inputs("right")
    mlp = model.transformer.h[0].mlp
    with (
        torch.no_grad(),
        hs.edit(model, {"transformer.h.0.mlp": hs.scale(3.0)}, neurons=[3, 7], positions=[0, -2]),
    ):
        got = model(**inputs).logits

    def by_hand(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        out = out.clone()
        for p in (0, 5):
            out[:, p, [3, 7]] *= 3.0
        return out

    handle = mlp.register_forward_hook(by_hand)
    try:
        with torch.no_grad():
            expected = model(**inputs).logits
    finally:
        handle.remove()
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


# -- what is refused -------------------------------------------------------------------------------
def test_units_a_site_does_not_have_are_refused_naming_the_sites_that_do() -> None:
    model = _gpt2()
    with pytest.raises(hs.UsageError, match=r"no head axis.*scaled_dot_product_attention"):
        hs.capture(model, "transformer.h.0.mlp", heads=[1])
    with pytest.raises(hs.UsageError, match="not neurons"):
        hs.capture(model, "transformer.h.0.attn::attention_weights", neurons=[1])
    with pytest.raises(hs.UsageError, match="no head axis"):
        hs.edit(model, {"transformer.h.0.mlp": hs.ablate()}, heads=0)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"positions": "first"}, "'last'"),
        ({"heads": [1, 1]}, "twice"),
        ({"neurons": []}, "non-empty"),
        ({"heads": "1"}, "int or a list"),
        ({"positions": [True]}, "list of ints"),
    ],
)
def test_bad_units_are_refused_before_anything_is_hooked(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(hs.UsageError, match=message):
        hs.capture(_gpt2(), "transformer.h.0.attn::attention_weights", **options)


def test_positions_with_a_mean_over_every_token_are_refused() -> None:
    with pytest.raises(hs.UsageError, match="give one of them"):
        hs.capture(_gpt2(), "transformer.h.0.mlp", positions="last", reduce="token_mean")


def test_an_index_out_of_range_is_named_with_the_sites_size() -> None:
    model, inputs = _gpt2(), _inputs("left")
    site = "transformer.h.0.attn::scaled_dot_product_attention"
    with pytest.raises(hs.UsageError, match=r"\[9\] out of range for its 4 heads"):
        with torch.no_grad(), hs.capture(model, site, heads=[1, 9]):
            model(**inputs)


class TwoDimensional(nn.Module):
    """A linear layer's output (N, D) and an SDPA call without a batch axis (H, T, d)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: Tensor) -> Tensor:
        heads = self.linear(x).view(2, -1, 4)  # (2 heads, 3 positions, 4): no batch axis
        return torch.nn.functional.scaled_dot_product_attention(heads, heads, heads)


@pytest.mark.parametrize(
    ("site", "options", "shape"),
    [
        ("linear", {"positions": [0]}, r"\(3, 8\)"),
        ("linear", {"positions": "last"}, r"\(3, 8\)"),
        ("::scaled_dot_product_attention", {"heads": [1]}, r"\(2, 3, 4\)"),
        ("::scaled_dot_product_attention", {"neurons": [1]}, r"\(2, 3, 4\)"),
    ],
)
def test_a_tensor_without_the_axes_of_its_sites_layout_is_refused(
    site: str, options: dict[str, Any], shape: str
) -> None:
    """Units are never taken from another axis: positions of an output (N, D) would be its
    features, heads of an SDPA call without a batch axis its positions."""
    model = TwoDimensional()
    with pytest.raises(hs.UsageError, match=f"its tensor {shape} does not have the axes"):
        with torch.no_grad(), hs.capture(model, site, **options):
            model(torch.randn(3, 8))


def test_neurons_of_an_output_without_positions() -> None:
    model, x = TwoDimensional(), torch.randn(3, 8)
    with torch.no_grad(), hs.capture(model, "linear", neurons=[5, 1]) as cap:
        model(x)
        torch.testing.assert_close(cap["linear"].output, model.linear(x)[:, [5, 1]])


class Prefixed(nn.Module):
    """A learned token put before the text (as ViT's class token): its layers have one
    position more than the attention_mask has columns."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.prefix = nn.Embedding(100, 8), nn.Parameter(torch.zeros(1, 1, 8))
        self.linear = nn.Linear(8, 8)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        x = self.embed(input_ids)
        x = torch.cat([self.prefix.expand(x.size(0), 1, 8), x], dim=1)
        return self.linear(x) * torch.cat([attention_mask[:, :1], attention_mask], 1)[..., None]


def test_last_of_a_layer_called_after_a_forward_is_its_last_position() -> None:
    """A layer called by itself after a padded forward has no mask: "last" is its last
    position, not the previous forward's last real tokens."""
    model, inputs = _gpt2(), _inputs("right")
    mlp, x = model.transformer.h[0].mlp, torch.randn(3, 7, 64)
    site = "transformer.h.0.mlp"
    with torch.no_grad(), hs.capture(model, site, positions="last", keep="all") as cap:
        model(**inputs)
        mlp(x)
    with torch.no_grad():
        torch.testing.assert_close(cap[site].calls[1].output, mlp(x)[:, -1:], rtol=0, atol=0)
        with hs.edit(model, {site: hs.ablate()}, positions="last"):
            model(**inputs)
            edited = mlp(x)
        expected = mlp(x)
    expected[:, -1] = 0
    torch.testing.assert_close(edited, expected, rtol=0, atol=0)


def test_last_with_a_mask_that_does_not_fit_the_site_is_refused() -> None:
    model, inputs = Prefixed(), _inputs("right")
    with pytest.raises(hs.UsageError, match=r"attention_mask is \(3, 7\).*3 samples of 8"):
        with torch.no_grad(), hs.capture(model, "linear", positions="last"):
            model(**inputs)


def test_last_of_a_sample_without_a_real_token_is_refused() -> None:
    model, inputs = _gpt2(), _inputs("right")
    inputs["attention_mask"][2] = 0
    with pytest.raises(hs.UsageError, match="keeps none of this call's positions"):
        with torch.no_grad(), hs.capture(model, "transformer.h.0.mlp", positions="last"):
            model(**inputs)


def test_edits_of_inputs_gradients_or_shapes_are_refused_with_units() -> None:
    model = _gpt2()
    for edit in (hs.ablate(on="input"), hs.scale(2.0, on="grad")):
        with pytest.raises(hs.UsageError, match="narrow edits of outputs"):
            hs.edit(model, {"transformer.h.0.mlp": edit}, positions=[0])


def test_an_edit_returning_another_shape_than_its_units_is_refused() -> None:
    model, inputs = _gpt2(), _inputs("left")
    with pytest.raises(hs.EditError, match=r"selected units \(3, 1, 64\)"):
        with (
            torch.no_grad(),
            hs.edit(model, {"transformer.h.0.mlp": lambda t: t[:, :, :3]}, positions=-1),
        ):
            model(**inputs)


# -- a declared layout ---------------------------------------------------------------------------
class HandAttention(nn.Module):
    """Attention written by hand (no SDPA call): 4 heads of size 4."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(16, 48), nn.Linear(16, 16)

    def probabilities(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n, t, _ = x.shape
        q, k, v = self.qkv(x).view(n, t, 3, 4, 4).permute(2, 0, 3, 1, 4)
        return torch.softmax(q @ k.transpose(-1, -2) / 2, dim=-1), v

    def forward(self, x: Tensor) -> Tensor:
        p, v = self.probabilities(x)
        return self.out((p @ v).transpose(1, 2).flatten(2))


def test_a_declared_layout_narrows_attention_written_by_hand() -> None:
    torch.manual_seed(0)
    model, x = HandAttention(), torch.randn(2, 5, 16)
    layout = {"::softmax": "batch heads positions keys"}
    with (
        torch.no_grad(),
        hs.capture(model, "::softmax", heads=[2], positions=-1, layout=layout) as cap,
    ):
        model(x)
    with torch.no_grad():
        p, v = model.probabilities(x)
        torch.testing.assert_close(cap["::softmax"].output, p[:, [2]][:, :, [4]], rtol=0, atol=0)
        with hs.edit(model, {"::softmax": hs.ablate()}, heads=2, layout=layout):
            got = model(x)
        keep = torch.tensor([1.0, 1.0, 0.0, 1.0])[:, None, None]
        expected = model.out(((p * keep) @ v).transpose(1, 2).flatten(2))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ({"::softmax": "heads batch positions keys"}, "batch first"),
        ({"::softmax": "batch heads heads keys"}, "each named once"),
        ({"out": "batch positions neurons"}, "matches none of the selected sites"),
    ],
)
def test_a_bad_layout_is_refused(layout: dict[str, str], message: str) -> None:
    with pytest.raises(hs.UsageError, match=message):
        hs.capture(HandAttention(), "::softmax", heads=[1], layout=layout)


# -- heads of attention projections, from the config ---------------------------------------------
def test_query_key_and_value_projections_by_head_from_the_config() -> None:
    """Llama's config: 4 query heads, 2 key/value heads of 16. Query heads 3 and 0 are columns
    48-63 and 0-15 of q_proj; they read key/value heads 1 and 0 of k_proj and v_proj."""
    model, inputs = _llama(), _inputs("left")
    seen: dict[str, Tensor] = {}
    attn = model.model.layers[0].self_attn
    handles = [
        getattr(attn, p).register_forward_hook(
            lambda m, a, out, p=p: seen.__setitem__(p, out.detach())
        )
        for p in ("q_proj", "k_proj", "v_proj")
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    site = "model.layers.0.self_attn.{}"
    with (
        torch.no_grad(),
        hs.capture(model, site.format("[qkv]_proj"), heads=[3, 0], positions="last") as cap,
    ):
        model(**inputs)
    last = _last(inputs["attention_mask"])
    cols = {"q_proj": [*range(48, 64), *range(16)], "k_proj": list(range(32))}
    cols["v_proj"] = cols["k_proj"]
    for p, columns in cols.items():
        got = cap[site.format(p)].output
        torch.testing.assert_close(got, _at(seen[p][..., columns], 1, last), rtol=0, atol=0)
    with torch.no_grad(), hs.edit(model, {site.format("k_proj"): hs.ablate()}, heads=3):
        edited = model(**inputs).logits

    def zero(module: nn.Module, args: Any, out: Tensor) -> Tensor:
        out = out.clone()
        out[..., 16:32] = 0  # key/value head 1, which query heads 2 and 3 read
        return out

    handle = attn.k_proj.register_forward_hook(zero)
    try:
        with torch.no_grad():
            expected = model(**inputs).logits
    finally:
        handle.remove()
    torch.testing.assert_close(edited, expected, rtol=0, atol=0)


def test_heads_of_a_layer_that_is_no_attention_projection_are_refused() -> None:
    model = _llama()
    with pytest.raises(hs.UsageError, match=r"no head axis.*q_proj"):
        hs.capture(model, "model.layers.0.mlp.up_proj", heads=[1])
    with pytest.raises(hs.UsageError, match="side by side"):
        hs.capture(model, "model.layers.0.self_attn.q_proj", heads=[1], neurons=[0])


# -- generation ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_the_last_real_token_at_each_decoding_step_equals_a_forward_over_the_prefix(
    kind: str,
) -> None:
    """Under generate() with a KV cache each step's call covers the mask's last column:
    positions="last" is the new token; its head output and pattern equal those of the last
    token of eager attention computed by hand over the whole prefix (left padding, the
    positions generate gives each token). The GQA Llama's decoding steps are the calls
    transformers packs (see test_the_query_key_and_value_of_a_packed_decoding_step)."""
    make, attention, _ = MODELS[kind]
    model, inputs = make(), _inputs("left")
    z_site = f"{attention.format(1)}::scaled_dot_product_attention"
    p_site = f"{attention.format(1)}::attention_weights"
    with (
        torch.no_grad(),
        hs.capture(model, [z_site, p_site], heads=[1], positions="last", keep="all") as cap,
    ):
        out = model.generate(**inputs, max_new_tokens=3, do_sample=False, pad_token_id=0)
    assert len(cap[z_site].calls) == len(cap[p_site].calls) == 3
    for step, (z_call, p_call) in enumerate(zip(cap[z_site].calls, cap[p_site].calls)):
        length = 7 + step
        mask = torch.cat([inputs["attention_mask"], torch.ones(3, step, dtype=torch.long)], 1)
        prefix = {"input_ids": out[:, :length], "attention_mask": mask}
        prefix["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)
        probs, z = _eager(model, kind, 1, prefix)
        assert z_call.output.shape == (3, 1, 1, HEAD_SIZE)
        assert p_call.output.shape == (3, 1, 1, length)
        torch.testing.assert_close(z_call.output, z[:, [1], -1:], rtol=0, atol=1e-5)
        torch.testing.assert_close(p_call.output, probs[:, [1], -1:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_ablating_a_head_at_each_decoding_step_equals_zeroing_its_columns(kind: str) -> None:
    """An edit under generate(): head 1 ablated at the last real token of every step (the
    prefill's last column under left padding, then each new token) equals zeroing its
    columns of the output projection's input by a plain pre-hook, step by step."""
    make, attention, projection = MODELS[kind]
    model, inputs = make(), _inputs("left")
    site = f"{attention.format(1)}::scaled_dot_product_attention"
    run = {"max_new_tokens": 3, "do_sample": False, "pad_token_id": 0}
    run |= {"output_scores": True, "return_dict_in_generate": True}
    with torch.no_grad(), hs.edit(model, {site: hs.ablate()}, heads=[1], positions="last"):
        got = model.generate(**inputs, **run).scores

    def zero(module: nn.Module, args: tuple[Tensor, ...]) -> tuple[Tensor]:
        x = args[0].clone()
        x[:, -1, _head_columns(1)] = 0
        return (x,)

    proj = _module(model, f"{attention.format(1)}.{projection}")
    handle = proj.register_forward_pre_hook(zero)
    try:
        with torch.no_grad():
            expected = model.generate(**inputs, **run).scores
    finally:
        handle.remove()
    with torch.no_grad():
        plain = model.generate(**inputs, **run).scores
    assert len(got) == len(expected) == 3
    for step, (g, e, p) in enumerate(zip(got, expected, plain, strict=True)):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-5, msg=f"step {step}")
        assert not torch.allclose(g, p), f"step {step}: the edit changed nothing"


def test_the_query_key_and_value_of_a_packed_decoding_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """To decode one token with grouped-query attention and a mask, transformers packs the
    query (N, H, 1, d) into (N, H/g, g, d) (query head k·g + r is row r of key/value head k)
    for one SDPA call: heads=[3] still means query head 3, and key/value head 3 // 2 = 1.
    The oracle: the call's own arguments, recorded by a plain wrapper of the function."""
    model, inputs = _llama(), _inputs("left")
    seen: list[dict[str, Tensor]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def record(query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        seen.append({"query": query, "key": key, "value": value})
        return sdpa(query, key, value, *args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", record)
    site = "model.layers.0.self_attn::scaled_dot_product_attention"
    with torch.no_grad(), hs.capture(model, site, heads=[3], inputs=True, keep="all") as cap:
        model.generate(**inputs, max_new_tokens=2, do_sample=False, pad_token_id=0)
    step = seen[2]  # layer 0 of the first decoding step (the prefill called layers 0 and 1)
    assert step["query"].shape == (3, 2, 2, HEAD_SIZE), "transformers did not pack this call"
    query = step["query"].reshape(3, HEADS, 1, HEAD_SIZE)  # unpacked by hand
    call = cap[site].calls[1]
    torch.testing.assert_close(call.inputs["query"], query[:, [3]], rtol=0, atol=0)
    torch.testing.assert_close(call.inputs["key"], step["key"][:, [1]], rtol=0, atol=0)
    torch.testing.assert_close(call.inputs["value"], step["value"][:, [1]], rtol=0, atol=0)
    assert call.output.shape == (3, 1, 1, HEAD_SIZE)
