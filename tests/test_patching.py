"""``hs.patching``: layers x positions sweeps against a loop of plain forward hooks, one forward
per cell; batching cells changes nothing; every refusal. (TransformerLens' own helpers are the
oracle on GPT-2 in ``tests/test_units_transformer_lens.py``.)"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from torch import Tensor, nn

import hookscope as hs


class Tokens(nn.Module):
    """(N, T) token ids -> (N, T, V) logits through two mixing layers (positions interact)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.mix = nn.Linear(8, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
        self.head = nn.Linear(8, 11)

    def forward(self, ids: Tensor, scale: Tensor | None = None) -> Tensor:
        h = self.embed(ids)
        h = self.mix(h) + h.cumsum(1)  # each position sees the ones before it
        h = self.block(h)
        return self.head(h if scale is None else h * scale)


LAYERS = ["embed", "mix", "block"]


def _model() -> Tokens:
    torch.manual_seed(0)
    return Tokens().eval()


def _ids(seed: int) -> Tensor:
    return torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(seed))


def _metric(logits: Tensor) -> Tensor:
    return (logits[:, -1, 2] - logits[:, -1, 7]).mean()


def _by_hand(model: nn.Module, clean: Tensor, corrupt: Tensor, positions: list[int]) -> Tensor:
    """One forward per cell, a plain forward hook replacing one position of one layer."""
    kept: dict[str, Tensor] = {}
    handles = [
        model.get_submodule(n).register_forward_hook(
            lambda m, a, out, n=n: kept.__setitem__(n, out.detach())
        )
        for n in LAYERS
    ]
    with torch.no_grad():
        model(clean)
    for handle in handles:
        handle.remove()
    rows = []
    for name in LAYERS:
        row = []
        for p in positions:

            def hook(m: nn.Module, a: Any, out: Tensor, name: str = name, p: int = p) -> Tensor:
                out = out.clone()
                out[:, p] = kept[name][:, p]
                return out

            handle = model.get_submodule(name).register_forward_hook(hook)
            with torch.no_grad():
                row.append(_metric(model(corrupt)))
            handle.remove()
        rows.append(torch.stack(row))
    return torch.stack(rows)


@pytest.mark.parametrize("cells", [1, 4, 100])
def test_a_sweep_equals_one_hooked_forward_per_cell(cells: int) -> None:
    model = _model()
    clean, corrupt = _ids(1), _ids(2)
    got = hs.patching(model, clean, corrupt, _metric, LAYERS, cells_per_forward=cells)
    expected = _by_hand(model, clean, corrupt, list(range(5)))
    assert got.layers == tuple(LAYERS) and got.positions == (0, 1, 2, 3, 4)
    torch.testing.assert_close(got.values, expected, rtol=1e-5, atol=1e-6)
    assert expected.max() - expected.min() > 1e-2  # the cells differ
    assert got.at("mix", 3) == pytest.approx(float(expected[1, 3]), abs=1e-6)


def test_chosen_positions_a_clean_batch_of_one_and_keyword_inputs() -> None:
    model = _model()
    clean, corrupt = _ids(1)[:1], _ids(2)
    got = hs.patching(
        model,
        {"ids": clean},
        {"ids": corrupt},
        _metric,
        LAYERS,
        positions=[-1, 1],
        cells_per_forward=3,
    )
    expected = _by_hand(model, clean.expand(3, 5), corrupt, [4, 1])
    assert got.positions == (4, 1)
    torch.testing.assert_close(got.values, expected, rtol=1e-5, atol=1e-6)


def test_positional_inputs_reach_the_model_repeated_per_cell() -> None:
    """A tuple is the model's positional arguments; every tensor in it is repeated per cell
    (a per-sample scale too), a 0-d tensor is passed as it is."""
    model = _model()
    scale = torch.tensor([[[1.0]], [[2.0]], [[3.0]]])
    clean, corrupt = (_ids(1), scale), (_ids(2), scale)
    got = hs.patching(model, clean, corrupt, _metric, ["block"], cells_per_forward=2)
    one = hs.patching(model, clean, corrupt, _metric, ["block"], cells_per_forward=1)
    torch.testing.assert_close(got.values, one.values, rtol=1e-5, atol=1e-6)


class Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.shared(self.shared(x))


class Pair(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return x, x


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda m, x: hs.patching(m, x, x, _metric, LAYERS, positions=[0, 0]), "twice"),
        (lambda m, x: hs.patching(m, x, x, _metric, LAYERS, positions=[5]), "not an index"),
        (lambda m, x: hs.patching(m, x, x, _metric, LAYERS, positions="last"), "list of ints"),
        (lambda m, x: hs.patching(m, x, x, _metric, LAYERS, cells_per_forward=0), "at least 1"),
        (lambda m, x: hs.patching(m, x, x, _metric, LAYERS, cells_per_forward=True), "int"),
        (lambda m, x: hs.patching(m, x, x, "logits", LAYERS), "metric must be a function"),
        (lambda m, x: hs.patching(m, x, x, lambda out: out[:, -1, 0], LAYERS), "one number"),
        (lambda m, x: hs.patching(m, x, [x], _metric, LAYERS), "not list"),
        (lambda m, x: hs.patching(m, x[:2], x, _metric, LAYERS), "batch is 2"),
        (lambda m, x: hs.patching(m, x, x, _metric, ["head", "nope"]), "nope"),
    ],
)
def test_bad_arguments_are_refused_naming_the_fix(call: Any, message: str) -> None:
    with pytest.raises((hs.UsageError, hs.LayerNotFoundError), match=message):
        call(_model(), _ids(1))


def test_a_layer_that_runs_twice_or_returns_a_tuple_is_refused() -> None:
    x = torch.ones(2, 3, 4)
    with pytest.raises(hs.UsageError, match="ran 2 times"):
        hs.patching(Twice(), x, x, lambda out: out.sum(), ["shared"])
    model = nn.Sequential(Pair())
    with pytest.raises(hs.UsageError, match="returned tuple"):
        hs.patching(model, x, x, lambda out: out[0].sum(), ["0"])


def test_runs_of_different_lengths_are_refused() -> None:
    model = _model()
    with pytest.raises(hs.UsageError, match="same length"):
        hs.patching(model, _ids(1), _ids(2)[:, :4], _metric, LAYERS)


# -- attribution patching ------------------------------------------------------------------------


def _attribution_by_hand(model: nn.Module, clean: Tensor, corrupt: Tensor) -> Tensor:
    """The formula with plain hooks and torch.autograd.grad: metric(corrupt) + sum over the
    batch and features of d metric / d activation x (clean - corrupt activation)."""
    acts: dict[str, Tensor] = {}

    def keep(name: str) -> Any:
        def hook(m: nn.Module, a: Any, out: Tensor) -> Tensor:
            acts[name] = out if out.requires_grad else out.detach().requires_grad_()
            return acts[name]

        return hook

    handles = [model.get_submodule(n).register_forward_hook(keep(n)) for n in LAYERS]
    with torch.no_grad():
        model(clean)
        clean_acts = {n: t.detach() for n, t in acts.items()}
    score = _metric(model(corrupt))
    for handle in handles:
        handle.remove()
    grads = torch.autograd.grad(score, [acts[n] for n in LAYERS])
    rows = [(g * (clean_acts[n] - acts[n].detach())).sum((0, 2)) for n, g in zip(LAYERS, grads)]
    return score.detach() + torch.stack(rows)


def test_attribution_patching_equals_the_formula_by_hand_and_leaves_grads_alone() -> None:
    model = _model()
    clean, corrupt = _ids(1), _ids(2)
    got = hs.attribution_patching(model, clean, corrupt, _metric, LAYERS)
    for p in model.parameters():
        assert p.grad is None  # torch.autograd.grad: nothing accumulated
    expected = _attribution_by_hand(model, clean, corrupt)
    torch.testing.assert_close(got.values, expected, rtol=1e-5, atol=1e-6)
    assert got.layers == tuple(LAYERS) and got.positions == (0, 1, 2, 3, 4)
    exact = hs.patching(model, clean, corrupt, _metric, LAYERS)
    assert not torch.allclose(got.values, exact.values, atol=1e-4)  # an estimate, not exact


def test_attribution_patching_is_exact_where_the_model_is_linear_after_the_layer() -> None:
    """Patching the input of the last linear layer with a linear metric: the first-order
    estimate is the exact patch (hs.patching, one forward per cell)."""
    model = _model()
    clean, corrupt = _ids(1), _ids(2)
    got = hs.attribution_patching(model, clean, corrupt, _metric, ["block"], positions=[-1, 0])
    exact = hs.patching(model, clean, corrupt, _metric, ["block"], positions=[-1, 0])
    torch.testing.assert_close(got.values, exact.values, rtol=1e-5, atol=1e-5)
    assert got.positions == (4, 0)


def test_attribution_patching_refuses_a_metric_without_a_gradient() -> None:
    model = _model()
    with pytest.raises(hs.UsageError, match="0-d tensor computed from the output"):
        hs.attribution_patching(model, _ids(1), _ids(2), lambda out: 1.0, LAYERS)


def test_a_sweep_over_heads_needs_sdpa_shaped_layers() -> None:
    model = _model()
    with pytest.raises(hs.UsageError, match=r"with heads=True each layer is an SDPA call"):
        hs.patching(model, _ids(1), _ids(2), _metric, LAYERS, heads=True)
    with pytest.raises(hs.UsageError, match="heads must be True or False"):
        hs.patching(model, _ids(1), _ids(2), _metric, LAYERS, heads=[0])  # type: ignore[arg-type]
    grid = hs.patching(model, _ids(1), _ids(2), _metric, ["block"], positions=[0])
    with pytest.raises(hs.UsageError, match="this grid's heads are"):
        grid.at("block", 0, head=1)
    with pytest.raises(hs.UsageError, match="not in this grid"):
        grid.at("block", 3)


# -- attribution patching over heads -------------------------------------------------------------


class Attention(nn.Module):
    """Causal self-attention through SDPA: 4 heads of size 2, then the output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.out = nn.Linear(8, 8)

    def forward(self, h: Tensor) -> Tensor:
        n, t, _ = h.shape
        q, k, v = self.qkv(h).view(n, t, 3, 4, 2).permute(2, 0, 3, 1, 4)
        z = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out: Tensor = self.out(z.transpose(1, 2).reshape(n, t, 8))
        return out


class Heads(nn.Module):
    """(N, T) token ids -> (N, T, V) logits: one attention layer on the residual stream, and
    the logits linear in the heads' outputs (no norm, no MLP after the attention)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.attn = Attention()
        self.head = nn.Linear(8, 11)

    def forward(self, ids: Tensor) -> Tensor:
        h = self.embed(ids)
        out: Tensor = self.head(h + self.attn(h))
        return out


Z = ["attn::scaled_dot_product_attention"]


def _heads_model() -> Heads:
    torch.manual_seed(0)
    return Heads().eval()


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=50)
    config._attn_implementation = "sdpa"
    return transformers.GPT2LMHeadModel(config).eval()


def _gpt2_metric(out: Any) -> Tensor:
    return _metric(out.logits)


def _heads_attribution_by_hand(model: nn.Module, clean: Tensor, corrupt: Tensor) -> Tensor:
    """The formula with plain hooks and torch.autograd.grad: each block's output projection
    gets every head's SDPA output side by side, (N, T, H * d); its gradient at the corrupted
    run times (clean - corrupted), summed over the batch and the head size, per position and
    head, plus the corrupted metric."""
    projections = [model.get_submodule(f"transformer.h.{i}.attn.c_proj") for i in range(2)]
    acts: list[Tensor] = []
    handles = [p.register_forward_pre_hook(lambda m, a: acts.append(a[0])) for p in projections]
    try:
        with torch.no_grad():
            model(clean)
        clean_acts = [a.detach() for a in acts]
        acts.clear()
        score = _gpt2_metric(model(corrupt))
    finally:
        for handle in handles:
            handle.remove()
    grads = torch.autograd.grad(score, acts)
    rows = []
    for grad, now, then in zip(grads, acts, clean_acts, strict=True):
        change = (grad * (then - now.detach())).unflatten(2, (4, 8))  # (N, T, heads, d)
        rows.append(change.sum((0, 3)))  # (T, heads)
    return score.detach() + torch.stack(rows)


@pytest.mark.hf
def test_attribution_patching_over_heads_equals_the_formula_by_hand_on_gpt2() -> None:
    model = _gpt2()
    assert model.config._attn_implementation == "sdpa"
    clean = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    corrupt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    z = [f"transformer.h.{i}.attn::scaled_dot_product_attention" for i in range(2)]
    got = hs.attribution_patching(model, clean, corrupt, _gpt2_metric, z, heads=True)
    for p in model.parameters():
        assert p.grad is None
    expected = _heads_attribution_by_hand(model, clean, corrupt)
    assert got.values.shape == expected.shape == (2, 5, 4)
    assert got.layers == tuple(z) and got.positions == tuple(range(5)) and got.heads == (0, 1, 2, 3)
    torch.testing.assert_close(got.values, expected, rtol=0, atol=1e-5)
    assert (expected - expected.mean()).abs().max() > 100 * 1e-5  # the cells differ
    assert got.at(z[1], 3, 2) == pytest.approx(float(expected[1, 3, 2]), abs=1e-5)
    # the same cells as hs.patching(heads=True), and an estimate of them, not their values
    exact = hs.patching(model, clean, corrupt, _gpt2_metric, z, heads=True)
    assert (exact.layers, exact.positions, exact.heads) == (got.layers, got.positions, got.heads)
    assert not torch.allclose(got.values, exact.values, atol=1e-4)


@pytest.mark.parametrize("batch", [3, 1])
def test_attribution_patching_over_heads_is_exact_where_the_model_is_linear_after_sdpa(
    batch: int,
) -> None:
    """The logits are linear in the SDPA output and the metric linear in the logits: the
    first-order estimate of each (position, head) cell is hs.patching(heads=True)'s exact
    value (a clean batch of one is broadcast over the corrupted batch by both)."""
    model = _heads_model()
    clean, corrupt = _ids(1)[:batch], _ids(2)
    got = hs.attribution_patching(model, clean, corrupt, _metric, Z, heads=True)
    exact = hs.patching(model, clean, corrupt, _metric, Z, heads=True, cells_per_forward=7)
    assert got.values.shape == (1, 5, 4) and got.heads == (0, 1, 2, 3)
    torch.testing.assert_close(got.values, exact.values, rtol=1e-5, atol=1e-5)
    assert exact.values.max() - exact.values.min() > 1e-2  # the cells differ
    some = hs.attribution_patching(model, clean, corrupt, _metric, Z, positions=[-1, 1], heads=True)
    assert some.positions == (4, 1)
    torch.testing.assert_close(some.values, got.values[:, [4, 1]], rtol=1e-5, atol=1e-6)
    assert some.at(Z[0], 4, 3) == pytest.approx(exact.at(Z[0], 4, 3), abs=1e-5)


# -- attention patterns ---------------------------------------------------------------------------

W = ["attn::attention_weights"]


def _patterns_by_hand(model: Heads, clean: Tensor, corrupt: Tensor, heads: list[int]) -> Tensor:
    """Heads' forward written out (causal softmax(q kᵀ / √d) @ v), one per cell: the corrupted
    run with the clean patterns of ``heads`` at one query position, every position in turn,
    the output recomputed from the patched patterns. ``(positions, len(heads))``, or
    ``(positions,)`` when ``heads`` is every head patched at once (``[-1]``)."""

    def run(ids: Tensor, pattern: Any = None) -> tuple[Tensor, Tensor]:
        h = model.embed(ids)
        n, t, _ = h.shape
        q, k, v = model.attn.qkv(h).view(n, t, 3, 4, 2).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-2, -1)) / 2**0.5
        causal = torch.ones(t, t, dtype=torch.bool).tril()
        p = scores.masked_fill(~causal, -torch.inf).softmax(-1)  # (N, H, Tq, Tk)
        if pattern is not None:
            p = pattern(p)
        z = (p @ v).transpose(1, 2).reshape(n, t, 8)
        return model.head(h + model.attn.out(z)), p

    with torch.no_grad():
        _, kept = run(clean)
        rows = []
        for position in range(clean.shape[1]):
            row = []
            for head in heads:
                chosen = slice(None) if head == -1 else head

                def patched(p: Tensor, pos: int = position, at: Any = chosen) -> Tensor:
                    p = p.clone()
                    p[:, at, pos] = kept[:, at, pos]
                    return p

                row.append(_metric(run(corrupt, patched)[0]))
            rows.append(torch.stack(row))
    return torch.stack(rows)


def test_patching_patterns_equals_patterns_patched_by_hand() -> None:
    """Each cell writes one head's clean attention pattern at one query position into the
    corrupted run, and the head's output follows it (the SDPA call is computed explicitly
    with the patched weights): equal to the attention written out by hand. TransformerLens'
    get_act_patch_attn_head_pattern_by_pos is the other oracle (test_units_transformer_lens)."""
    model = _heads_model()
    clean, corrupt = _ids(1), _ids(2)
    got = hs.patching(model, clean, corrupt, _metric, W, heads=True, cells_per_forward=6)
    expected = _patterns_by_hand(model, clean, corrupt, [0, 1, 2, 3])
    assert got.values.shape == (1, 5, 4) and got.heads == (0, 1, 2, 3)
    torch.testing.assert_close(got.values[0], expected, rtol=1e-5, atol=1e-6)
    for axis in (0, 1):  # patching the next position, or the next head, would fail
        assert (expected - expected.roll(1, axis)).abs().max() > 1e-3
    assert got.at(W[0], 3, 2) == pytest.approx(float(expected[3, 2]), abs=1e-6)


def test_without_heads_an_sdpa_call_or_its_weights_is_patched_at_a_position_in_every_head() -> None:
    """heads=False on an SDPA call or its attention weights: the positions are their axis 2
    (axis 1 is the heads), every head patched at once. The SDPA output at a position in every
    head is what the output projection reads there, so the grid is the attention layer's."""
    model = _heads_model()
    clean, corrupt = _ids(1), _ids(2)
    z = hs.patching(model, clean, corrupt, _metric, Z, cells_per_forward=3)
    layer = hs.patching(model, clean, corrupt, _metric, ["attn"])
    assert z.values.shape == (1, 5) and z.positions == (0, 1, 2, 3, 4)
    torch.testing.assert_close(z.values, layer.values, rtol=1e-5, atol=1e-6)
    patterns = hs.patching(model, clean, corrupt, _metric, W, positions=[-1, 1])
    expected = _patterns_by_hand(model, clean, corrupt, [-1])[[4, 1], 0]
    torch.testing.assert_close(patterns.values[0], expected, rtol=1e-5, atol=1e-6)
    both = hs.attribution_patching(model, clean, corrupt, _metric, Z + W)
    assert both.values.shape == (2, 5)  # each layer's own position axis
    exact = hs.patching(model, clean, corrupt, _metric, Z)
    torch.testing.assert_close(both.values[:1], exact.values, rtol=1e-5, atol=1e-5)


def test_attribution_patching_over_patterns_is_exact_where_the_model_is_linear_after_them() -> None:
    """The logits are linear in the patterns (for the corrupted run's values) and the metric
    linear in the logits: the first-order estimate over the attention weights is
    hs.patching's exact sweep."""
    model = _heads_model()
    clean, corrupt = _ids(1), _ids(2)
    got = hs.attribution_patching(model, clean, corrupt, _metric, W, heads=True)
    exact = hs.patching(model, clean, corrupt, _metric, W, heads=True)
    assert got.values.shape == (1, 5, 4)
    torch.testing.assert_close(got.values, exact.values, rtol=1e-5, atol=1e-5)


def _llama() -> nn.Module:
    """Grouped-query attention: 4 query heads of 8, 2 key/value heads."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        vocab_size=50,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.hf
def test_attribution_patching_over_projection_heads_equals_the_formula_by_hand() -> None:
    """heads=True on v_proj (2 key/value heads of 8 side by side, from the config): each
    cell is grad x (clean - corrupted) summed over the batch and the head's 8 columns at one
    position, with plain hooks and torch.autograd.grad; q_proj has the 4 query heads."""
    model = _llama()
    clean = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    corrupt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    site = "model.layers.0.self_attn.v_proj"
    got = hs.attribution_patching(model, clean, corrupt, _gpt2_metric, [site], heads=True)
    kept: list[Tensor] = []
    handle = model.get_submodule(site).register_forward_hook(
        lambda m, a, out: kept.append(out if out.requires_grad else out.requires_grad_())
    )
    try:
        with torch.no_grad():
            model(clean)
        score = _gpt2_metric(model(corrupt))
    finally:
        handle.remove()
    (grad,) = torch.autograd.grad(score, [kept[1]])
    change = (grad * (kept[0] - kept[1].detach())).unflatten(2, (2, 8))  # (N, T, heads, d)
    expected = score.detach() + change.sum((0, 3))
    assert got.values.shape == (1, 5, 2) and got.heads == (0, 1)
    torch.testing.assert_close(got.values[0], expected, rtol=0, atol=1e-5)
    assert (expected - expected.roll(1, 1)).abs().max() > 1e-4  # the heads differ
    queries = ["model.layers.0.self_attn.q_proj"]
    by_query = hs.patching(model, clean, corrupt, _gpt2_metric, queries, heads=True)
    assert by_query.values.shape == (1, 5, 4) and by_query.heads == (0, 1, 2, 3)
    with pytest.raises(hs.UsageError, match="as many heads as the first"):
        hs.patching(model, clean, corrupt, _gpt2_metric, [*queries, site], heads=True)


@pytest.mark.hf
def test_a_sweep_over_gpt_neox_fused_heads_patches_each_heads_query_key_and_value() -> None:
    """GPT-NeoX's query_key_value holds [q_h | k_h | v_h] head after head (its own
    view(..., H, 3 d)): a cell patches head h's 3 d columns at one position, as a plain
    forward hook does, one forward per cell."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPTNeoXConfig(
        num_hidden_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=50,
    )
    model = transformers.GPTNeoXForCausalLM(config).eval()
    clean = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    corrupt = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(2))
    site = "gpt_neox.layers.0.attention.query_key_value"
    got = hs.patching(model, clean, corrupt, _gpt2_metric, [site], positions=[-1, 1], heads=True)
    module = model.get_submodule(site)
    kept: list[Tensor] = []
    handle = module.register_forward_hook(lambda m, a, out: kept.append(out))
    with torch.no_grad():
        model(clean)
    handle.remove()
    expected = torch.zeros(2, 4)
    for i, p in enumerate((4, 1)):
        for h in range(4):
            columns = slice(h * 24, (h + 1) * 24)  # 3 x head size 8

            def patch(m: nn.Module, a: Any, out: Tensor, p: int = p, c: slice = columns) -> Tensor:
                out = out.clone()
                out[:, p, c] = kept[0][:, p, c]
                return out

            handle = module.register_forward_hook(patch)
            with torch.no_grad():
                expected[i, h] = _gpt2_metric(model(corrupt))
            handle.remove()
    assert got.values.shape == (1, 2, 4) and got.heads == (0, 1, 2, 3)
    torch.testing.assert_close(got.values[0], expected, rtol=1e-5, atol=1e-6)
    assert (expected - expected.roll(1, 1)).abs().max() > 1e-4  # the heads differ


@pytest.mark.hf
def test_a_sweep_over_the_heads_of_gpt2s_fused_projection_is_refused() -> None:
    """c_attn's heads= takes each head's query, key and value columns, three blocks apart:
    not one head's columns side by side, which a cell of the sweep patches."""
    model = _gpt2()
    ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(1))
    with pytest.raises(hs.UsageError, match="do not lie side by side"):
        hs.patching(model, ids, ids, _gpt2_metric, ["transformer.h.0.attn.c_attn"], heads=True)


@pytest.mark.parametrize("sweep", [hs.patching, hs.attribution_patching])
def test_a_sweep_over_heads_refuses_layers_that_are_not_sdpa_calls(sweep: Any) -> None:
    model = _model()
    with pytest.raises(hs.UsageError, match=r"with heads=True each layer is an SDPA call"):
        sweep(model, _ids(1), _ids(2), _metric, LAYERS, heads=True)
    with pytest.raises(hs.UsageError, match="heads must be True or False"):
        sweep(model, _ids(1), _ids(2), _metric, Z, heads=1)


def test_attribution_over_heads_refuses_inference_mode_and_runs_compiled_models_eagerly() -> None:
    model = _heads_model()
    clean, corrupt = _ids(1), _ids(2)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        compiled(corrupt)
    ran = hs.attribution_patching(compiled, clean, corrupt, _metric, Z, heads=True)
    with torch.inference_mode(), pytest.raises(hs.UsageError, match="takes gradients"):
        hs.attribution_patching(model, clean, corrupt, _metric, Z, heads=True)
    plain = hs.attribution_patching(model, clean, corrupt, _metric, Z, heads=True)
    with torch.no_grad():  # the caller's no_grad does not stop the backward
        quiet = hs.attribution_patching(model, clean, corrupt, _metric, Z, heads=True)
    for other in (quiet, ran):
        torch.testing.assert_close(other.values, plain.values, rtol=1e-5, atol=1e-6)


class _Midway(nn.Module):
    """The model's head, which first runs ``during()`` when called on thread ``main``."""

    def __init__(self, head: nn.Module, main: int, during: Any) -> None:
        super().__init__()
        self.head, self.main, self.during = head, main, during

    def forward(self, h: Tensor) -> Tensor:
        if threading.get_ident() == self.main:
            self.during()
        out: Tensor = self.head(h)
        return out


@pytest.mark.parametrize("heads", [False, True])
@pytest.mark.parametrize("sweep", [hs.patching, hs.attribution_patching])
def test_another_threads_forward_during_a_sweep_runs_unedited(sweep: Any, heads: bool) -> None:
    """The sweep's edits (and captures) are its own thread's: a forward another thread runs on
    the same model in the middle of each of the sweep's forwards is the plain model's (a
    sweep over heads too, whose sites are operations)."""
    model: nn.Module = _heads_model() if heads else _model()
    clean, corrupt = _ids(1), _ids(2)
    with torch.no_grad():
        plain = model(corrupt)
    seen: list[Tensor] = []

    def other() -> None:
        with torch.no_grad():
            seen.append(model(corrupt))

    def during() -> None:
        worker = threading.Thread(target=other)
        worker.start()
        worker.join()

    model.head = _Midway(model.head, threading.get_ident(), during)
    if heads:
        sweep(model, clean, corrupt, _metric, Z, heads=True, positions=[-1])
    else:
        sweep(model, clean, corrupt, _metric, LAYERS)
    assert len(seen) == 2  # one in the clean run, one in the corrupted one
    for out in seen:
        assert torch.equal(out, plain)
