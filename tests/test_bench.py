"""The benchmark harness runs (``bench/run.py --quick``) and its untimed correctness checks
pass: hookscope's captures equal the hand-written clone floor, on HF ResNet-50 and GPT-2.
No timing is asserted: timings belong to bench/RESULTS.md, not to the test suite."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.hf
def test_quick_benchmark_runs_and_checks_pass(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("nnsight")
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run.py"), "--quick", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "RESULTS.md").read_text().startswith("# hookscope capture benchmark")
    for model in ("resnet50", "gpt2"):
        checks = json.loads((tmp_path / f"timing_{model}_tuned.json").read_text())["checks"]
        verdicts = [c for c in checks if c["ok"] is not None]
        assert verdicts, f"{model}: no pass/fail checks recorded"
        failed = [c for c in verdicts if not c["ok"]]
        assert not failed, f"{model}: {failed}"
