"""The benchmark harness runs (``bench/run.py --quick``) and its untimed correctness checks
pass: hookscope's captures equal the hand-written clone floor on HF ResNet-50 and GPT-2, and
reference mode flags exactly the outputs overwritten in place; hs.summary counts parameters
once and FLOPs within 1% of the analytic count (GPT-2, a Llama on meta); hs.nonfinite sees
every forward and backward of a clean training step and finds nothing; hs.GradCAM's map
equals the hand-written autograd floor's and hs.ScoreCAM's equals pytorch-grad-cam's; the
feature store equals a hand-written loop's .npy files. With ``--baseline HEAD`` the committed
library is timed beside the working tree's (its captures are checked the same way). No
timing is asserted: timings belong to bench/RESULTS.md, not to the test suite."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
import warnings
from importlib.util import find_spec
from typing import Any

import pytest
import torch
from torch import nn

import hookscope as hs

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.hf
def test_quick_benchmark_runs_and_checks_pass(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    if importlib.util.find_spec("nnsight") is None:  # not imported: importing it patches
        pytest.skip("nnsight is not installed")  # torch's backward for the whole process
    in_git = (ROOT / ".git").exists() and shutil.which("git") is not None
    baseline = ["--baseline", "HEAD"] if in_git else []
    command = [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path)]
    done = subprocess.run(
        [*command, *baseline],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = (tmp_path / "RESULTS.md").read_text()
    assert report.startswith("# hookscope benchmark")
    assert "Worker failures" not in report, report
    for model in ("resnet50", "gpt2"):
        run = json.loads((tmp_path / f"capture_timing_{model}_tuned.json").read_text())
        verdicts = {c["what"]: c["ok"] for c in run["checks"] if c["ok"] is not None}
        assert not [what for what, ok in verdicts.items() if not ok], run["checks"]
        checked = " ".join(verdicts)
        for key in ("hs_sel", "hs_leaves_clone", "hs_leaves_ref", "hs_leaves_reduce", "hs_stop"):
            assert f"`{key}`" in checked, f"{model}: no check of {key}"
        if baseline:
            assert run["baseline_error"] is None
            assert "`bl_leaves_clone`" in checked
            assert "new ÷ baseline" in report
    for model in ("resnet50", "gpt2", "llama"):  # bench/look.py: hs.summary and its peers
        run = json.loads((tmp_path / f"look_timing_{model}.json").read_text())
        assert run["checks"] and all(c["ok"] for c in run["checks"]), run["checks"]
        assert run["flops"]["hookscope"]["flops"], run["flops"]
    assert "## Look: summary" in report
    for model in ("resnet50", "gpt2"):  # bench/diagnose.py: nonfinite and Monitor in training
        run = json.loads((tmp_path / f"diagnose_timing_{model}.json").read_text())
        assert run["checks_ok"], run
    assert "## Diagnose: training-step overhead" in report
    for case in ("resnet50", "shapes"):  # bench/explain.py: Grad-CAM and Score-CAM with peers
        run = json.loads((tmp_path / f"explain_timing_{case}.json").read_text())
        assert run["checks"] and all(c["ok"] for c in run["checks"]), run["checks"]
    assert "## Explain: CAM cost" in report
    for model in ("resnet50", "minilm"):  # bench/extract.py: the store against a hand loop
        run = json.loads((tmp_path / f"extract_timing_{model}.json").read_text())
        assert run["checks"] and all(c["ok"] for c in run["checks"]), run["checks"]
    assert "## Extract: throughput and memory" in report
    run = json.loads((tmp_path / "ops_timing_gpt2.json").read_text())  # bench/ops.py
    assert run["checks"] and not [c for c in run["checks"] if c["ok"] is False], run["checks"]
    assert "## Ops: operations inside the forward, GPT-2" in report


def _gpu_module() -> Any:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import gpu
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return gpu


def test_sync_counter_names_the_innermost_hookscope_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """bench/gpu.py's counter on a CPU, CUDA's part stood in for: a warning carrying CUDA's
    sync message, raised in the model's forward, counts once and is attributed to the
    hookscope call that ran the forward; the same forward called directly has no hookscope
    frame; the debug mode is switched on and back off around each count."""
    gpu = _gpu_module()
    modes: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)

    class Syncs(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
            warnings.warn("something else", UserWarning, stacklevel=1)  # not counted
            return x * 2

    model = nn.Sequential(Syncs(), nn.Linear(3, 2))
    x = torch.ones(1, 3)
    frames, got = gpu.count(lambda: hs.features(model, x, ["1"]), cuda=True)
    assert len(frames) == 1 and frames[0].startswith("hookscope/core/"), frames
    assert " in " in frames[0] and got["1"].shape == (1, 2)
    direct, _ = gpu.count(lambda: model(x), cuda=True)
    assert direct == [""]
    assert modes == ["warn", "default", "warn", "default"]
    assert gpu.count(lambda: 7, cuda=False) == (None, 7)  # on a CPU nothing is counted


@pytest.mark.slow
@pytest.mark.hf
def test_device_benchmark_runs_every_row_once_on_cpu(tmp_path: pathlib.Path) -> None:
    """``bench/run.py --device cpu --quick`` (what the GPU run does, on tiny models): every
    case's every row comes back measured (or skipped because its peer is not installed
    here), hookscope's values equal the hand-written floors', every synchronisation entry
    point runs, and both outputs (gpu.md, gpu.json) are written."""
    pytest.importorskip("transformers")
    gpu = _gpu_module()
    command = [sys.executable, str(ROOT / "bench" / "run.py"), "--device", "cpu", "--quick"]
    done = subprocess.run(
        [*command, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads((tmp_path / "gpu.json").read_text())
    assert summary["failures"] == []
    cases = gpu.CASES.items()
    want = {(c, f"{a}/{b}") for c, groups in cases for g, a, b in gpu.ROWS if g in groups}
    rows = {(r["case"], r["ratio"]): r for r in summary["rows"]}
    assert set(rows) == want
    missing = {f"skipped: {m} not installed" for m in gpu.NEEDS.values() if not find_spec(m)}
    for row in rows.values():
        if "note" in row:  # only a peer that is really missing here may be skipped
            assert row["note"] in missing, row
        else:
            assert row["median"] > 0 and row["num_ms"] > 0 and row["den_ms"] > 0, row
    assert len(summary["checks"]) == len(gpu.CASES)
    for case, checks in summary["checks"].items():
        assert len(checks) >= 2 and all(c["ok"] for c in checks), (case, checks)
    syncs = summary["syncs"]
    assert {r["model"] for r in syncs} == {"cnn", "gpt2"}
    assert [r for r in syncs if "error" in r] == []
    assert len(syncs) == 32 + 30  # GradCAM and Saliency on the CNN only
    assert all(r["call"] is None for r in syncs)  # no CUDA: not counted, not zero
    report = (tmp_path / "gpu.md").read_text()
    assert "## GPU: hookscope on" in report and "host synchronisations per call" in report
