"""Patching: a layers x positions sweep of the residual stream on a 4-layer GPT-2 (random
weights), hs.patching on the Hugging Face model beside TransformerLens' own helper on the same
weights converted into a HookedTransformer (as tests/test_units_transformer_lens.py does)"""

from __future__ import annotations

from typing import Any

import torch

import _harness as h
import hookscope as hs
from _harness import Config, Job, Plan, Result, Variant
from _report import Target

TITLE = "Patching: a layers x positions sweep beside TransformerLens"
VARIANTS = {
    "tl": ("TransformerLens: run_with_cache(clean) + get_act_patch_resid_pre", None),
    "hs": ("hs.patching(clean, corrupted), 16 cells a forward", "hs_1"),
    "hs_1": ("hs.patching, cells_per_forward=1 (a forward per cell, as TL)", None),
}
TARGETS = [
    Target("patching/gpt2", "hs", "tl", 1 / 3, "hs.patching ÷ get_act_patch_resid_pre"),
    Target("patching/gpt2", "hs_1", "tl", None, "one cell a forward ÷ TransformerLens"),
]


def _models(width: int) -> tuple[Any, Any]:
    """The Hugging Face GPT-2 (4 blocks, random weights) and the same in TransformerLens."""
    import transformer_lens as tl
    import transformers
    from transformer_lens.pretrained.weight_conversions import convert_gpt2_weights

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=4, n_embd=width, n_head=4, vocab_size=1000)
    ).eval()
    shape = {"d_model": width, "d_head": width // 4, "n_heads": 4, "d_mlp": 4 * width}
    shape |= {"n_layers": 4, "n_ctx": 1024, "d_vocab": 1000, "eps": hf.config.layer_norm_epsilon}
    kind = {"act_fn": "gelu_new", "normalization_type": "LN", "default_prepend_bos": False}
    cfg = tl.HookedTransformerConfig(**shape, **kind, original_architecture="GPT2LMHeadModel")
    lens = tl.HookedTransformer(cfg)
    keep = dict.fromkeys(("fold_ln", "center_writing_weights", "center_unembed"), False)
    lens.load_and_process_state_dict(convert_gpt2_weights(hf, cfg), **keep)
    return hf, lens.eval()


def work(spec: Result) -> Result:
    from transformer_lens import patching

    (width, length), layers = (32, 4) if spec["quick"] else (256, 16), ["transformer.drop"]
    hf, tl = _models(width)
    layers += [f"transformer.h.{i}" for i in range(3)]  # resid_pre of blocks 0-3
    clean = torch.randint(0, 1000, (2, length), generator=torch.Generator().manual_seed(3))
    corrupt = torch.cat([clean[:, :1], clean[:, 1:].flip(1)], 1)
    a, b = int(clean[0, -1]), int(clean[1, -1])
    metric = lambda logits: (logits[:, -1, a] - logits[:, -1, b]).mean()  # noqa: E731

    def ours(cells: int) -> Any:
        out = lambda o: metric(o.logits)  # noqa: E731
        return lambda: hs.patching(hf, clean, corrupt, out, layers, cells_per_forward=cells).values

    def theirs() -> Any:
        return patching.get_act_patch_resid_pre(tl, corrupt, tl.run_with_cache(clean)[1], metric)

    fns = {"tl": theirs, "hs": ours(16), "hs_1": ours(1)}
    with torch.no_grad():
        same = torch.allclose(fns["hs"](), theirs().float(), rtol=0, atol=1e-5)
        variants = [Variant(k, VARIANTS[k][0], fn, VARIANTS[k][1]) for k, fn in fns.items()]
        result = h.timing(variants, Plan(**spec["plan"]), unit="tl")
    about = f"GPT-2, 4 blocks {width} wide (random weights), 2 prompts of {length} tokens: "
    about += f"{4 * length} cells (resid_pre of 4 layers x {length} positions), a logit difference"
    return {
        **result,
        "case": "patching/gpt2",
        "title": "Residual stream sweep, GPT-2",
        "about": about,
        "checks": [{"what": "`hs` equals `tl` within 1e-5", "ok": same}],
    }


def jobs(cfg: Config) -> list[Job]:
    return h.timing_jobs("patching", cfg, {"gpt2": 240}, rounds=15)
