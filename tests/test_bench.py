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

import json
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.hf
def test_quick_benchmark_runs_and_checks_pass(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("nnsight")
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
