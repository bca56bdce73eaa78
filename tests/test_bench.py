"""The benchmark runs: ``bench/run.py --quick --baseline HEAD`` runs every job of every module
once, on tiny inputs, in one process, and ``--device cpu --quick`` every row of the GPU pass;
a benchmark that no longer imports, or calls an API that changed, fails here. No timing is
asserted: timings belong to bench/RESULTS.md. The renderer's arithmetic is checked against
ratios worked out by hand."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import shutil
import subprocess
import sys
from typing import Any

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: Only a guard against a hang (a worker waiting forever): the run takes well under a minute
#: on an idle 2-core machine and a few on a loaded one, so load alone never reaches it.
HANG_S = 3600

SCRIPT = """
import sys
sys.argv[0] = {run!r}
sys.path.insert(0, {bench!r})
import run
run.main(["--quick", "--out", {cpu!r}, *{baseline!r}])
run.main(["--device", "cpu", "--quick", "--out", {gpu!r}])
"""


def _bench(name: str) -> Any:
    """A module of bench/, imported without leaving bench/ on the path (run.py adds it)."""
    folder = str(ROOT / "bench")
    sys.path.insert(0, folder)
    try:
        return importlib.import_module(name)
    finally:
        sys.path[:] = [p for p in sys.path if p != folder]


def _results(folder: pathlib.Path) -> list[dict[str, Any]]:
    skip = ("meta_", "targets", "gpu.json")
    return [json.loads(p.read_text()) for p in folder.glob("*.json") if not p.name.startswith(skip)]


@pytest.mark.slow
@pytest.mark.hf
def test_quick_benchmark_runs_every_job(tmp_path: pathlib.Path) -> None:
    pytest.importorskip("transformers")
    if importlib.util.find_spec("nnsight") is None:  # not imported: importing it patches
        pytest.skip("nnsight is not installed")  # torch's backward for the whole process
    run = _bench("run")
    in_git = (ROOT / ".git").exists() and shutil.which("git") is not None
    baseline = ["--baseline", "HEAD"] if in_git else []
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    script = SCRIPT.format(
        run=str(ROOT / "bench" / "run.py"),
        bench=str(ROOT / "bench"),
        cpu=str(cpu),
        gpu=str(gpu),
        baseline=baseline,
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=HANG_S, check=False
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    results = _results(cpu)
    assert {r["job"].split("_")[0] for r in results} == set(run.MODULES)
    for r in results + _results(gpu):  # every job ran, every variant in every round
        assert r.get("kind") != "error", r.get("stderr")
        assert not r.get("errors"), (r["case"], r["errors"])
        assert all(c["ok"] for c in r.get("checks", [])), (r["case"], r["checks"])
        missing = {k: why for k, why in r.get("skipped", {}).items() if "not installed" not in why}
        assert not missing, (r["case"], missing)
    targets = json.loads((cpu / "targets.json").read_text())
    for module in run.MODULES:  # each module's targets were evaluated from its results
        assert any("median" in row for row in targets[module]), module
    if baseline:
        assert any(row["denominator"] == "bl_sel" for row in targets["capture"])
        assert any(row["denominator"] == "bl" for row in targets["look"])
    report = (cpu / "RESULTS.md").read_text()
    for module in run.MODULES:
        assert f"## {_bench(module).TITLE}" in report

    rows = json.loads((gpu / "gpu.json").read_text())  # every row of every case, or why not
    gpu_module = _bench("gpu")
    assert len(rows) == len(gpu_module.TARGETS)
    for row in rows:
        assert "median" in row or "not installed" in row["verdict"], row
    assert (gpu / "gpu.md").read_text().startswith(f"## {gpu_module.TITLE}")


def test_targets_are_same_round_ratios() -> None:
    """A target is the median of per-round ratios with their quartiles, warm-up left out; a
    value target reads the case's value; a variant that did not run leaves no row, one that
    was skipped says why."""
    report = _bench("_report")

    def sample(key: str, rnd: int, seconds: float) -> dict[str, Any]:
        return {"key": key, "round": rnd, "warmup": rnd < 0, "seconds": seconds}

    plain = [sample("plain", r, s) for r, s in ((-1, 9.0), (0, 1.0), (1, 2.0), (2, 4.0))]
    hs = [sample("hs", r, s) for r, s in ((-1, 1.0), (0, 1.5), (1, 2.0), (2, 2.0))]
    cases = {"m/a": {"samples": plain + hs, "values": {"peak": 0.4}, "skipped": {"p": "gone"}}}
    row = report.evaluate(report.Target("m/a", "hs", "plain", 1.0, "hs ÷ plain"), cases)
    # per round 1.5, 1.0, 0.5: median 1.0, inclusive quartiles 0.75 and 1.25
    assert (row["median"], row["q1"], row["q3"], row["n"]) == (1.0, 0.75, 1.25, 3)
    assert row["verdict"] == "PASS"
    row = report.evaluate(report.Target("m/a", "plain", "hs", 1.0, "plain ÷ hs"), cases)
    assert row["median"] == 1.0 and row["q3"] == 1.5 and row["verdict"] == "PASS"
    row = report.evaluate(report.Target("m/a", "peak", None, 0.3, "a value"), cases)
    assert row["median"] == 0.4 and row["verdict"] == "**MISS**"
    assert report.evaluate(report.Target("m/a", "hs", "bl", 1.0, "not asked"), cases) is None
    assert report.evaluate(report.Target("m/b", "hs", "plain", 1.0, "no case"), cases) is None
    row = report.evaluate(report.Target("m/a", "hs", "p", 1.0, "skipped"), cases)
    assert row["verdict"] == "not run: `p`: gone"


def test_the_benchmark_stays_within_its_size() -> None:
    """bench/'s Python stays at 2,500 lines at most (issue 26: a benchmark that costs more to
    keep than it returns had grown to 4,000): a new case makes room in what is there."""
    lines = sum(len(p.read_text().splitlines()) for p in (ROOT / "bench").glob("*.py"))
    assert lines <= 2500, f"bench/*.py has {lines} lines; the budget is 2,500"
