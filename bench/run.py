"""hookscope benchmarks: ``python bench/run.py`` (``--quick`` for a smoke run); see README.md."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _harness as h  # noqa: E402
import _report  # noqa: E402
import gpu  # noqa: E402
from _harness import Config, Job  # noqa: E402

#: Modules of the CPU run. Each has ``TITLE``, ``TARGETS``, ``jobs(cfg) -> list[Job]`` and
#: ``work(spec) -> dict`` (run in a worker process); gpu.py is what ``--device`` runs instead.
MODULES = ("capture", "look", "diagnose", "explain", "extract", "ops")
#: Worker environments (README.md, "Allocator"): freed memory stays resident (the library's
#: own cost, isolated), what users get, every buffer above 128 KiB its own mapping (for RSS).
MALLOC_ENV: dict[str, dict[str, str]] = {
    "tuned": {"MALLOC_TRIM_THRESHOLD_": str(16 * 2**30), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)},
    "defaults": {},
    "memory": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
BASELINE_DIR = HERE / "_out" / "baseline"
INTRO = """# hookscope benchmark

Each section is one module's latest run. Ratio = median over measured rounds of (variant ÷
baseline of the same round, same process) [q1-q3]; a ratio whose q1-q3 straddles its limit is
not resolved on that machine. Method, cases, variants, allocator settings: bench/README.md.
"""


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, check=True).stdout


def extract_baseline(rev: str) -> dict[str, Any]:
    """``src/hookscope`` at ``rev`` as package ``hookscope_baseline`` (README.md, "Baseline")."""
    info: dict[str, Any] = {"rev": rev, "path": str(BASELINE_DIR)}
    try:
        info["commit"] = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
        archive = _git("archive", "--prefix=hookscope_baseline/", f"{info['commit']}:src/hookscope")
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"").decode().strip() or e
        return {**info, "error": f"git could not read {rev!r}: {why}"}
    shutil.rmtree(BASELINE_DIR, ignore_errors=True)
    package = BASELINE_DIR / "hookscope_baseline"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:  # src/hookscope/'s files, renamed
        tar.extractall(BASELINE_DIR, filter="data")
    absolute = re.compile(r"^\s*(from|import)\s+hookscope\b", re.MULTILINE)
    if bad := [p.name for p in package.rglob("*.py") if absolute.search(p.read_text())]:
        shutil.rmtree(BASELINE_DIR)
        return {**info, "error": f"absolute imports of hookscope in {bad}; cannot rename"}
    return {**info, "sha1": h.source_hash(package)}


def run_worker(module: str, spec: dict[str, Any], path: Path) -> None:
    """One job: its result, with the machine it ran on, as JSON at ``path``. Torch's threads
    are pinned to 2, the machine's cores, or $HOOKSCOPE_BENCH_THREADS (on a GPU only where it
    asks); warnings (transformers', peers') are not results."""
    if module != "gpu" or os.environ.get(h.THREADS_ENV):
        threads = int(os.environ.get(h.THREADS_ENV, "2"))
        torch.set_num_threads(threads)
        with contextlib.suppress(RuntimeError):  # already set in this process
            torch.set_num_interop_threads(threads)
    warnings.simplefilter("ignore")
    result = importlib.import_module(module).work(spec)
    result["machine"] = h.machine_info()
    path.write_text(json.dumps({**result, "job": path.stem, "spec": spec}, indent=1, default=str))


def _env(name: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", **MALLOC_ENV[name]}


def _failed(path: Path, job: Job, stderr: str, t0: float) -> None:
    path.write_text(json.dumps({"kind": "error", "job": job.name, "stderr": stderr[-3000:]}))
    _log(f"FAILED {job.module} {job.name}\n{stderr[-3000:]}", t0)


def run_jobs(jobs: list[Job], out: Path, parallel: int, t0: float) -> None:
    """Each job in a worker process of its own, ``parallel`` at a time, or with ``parallel`` 0
    all in this process (the smoke run: one import of torch and transformers). A failure
    leaves an error record."""
    pending, running = list(jobs), []
    while pending and not parallel:
        job, start = pending.pop(0), time.perf_counter()
        path = out / f"{job.module}_{job.name}.json"
        try:
            run_worker(job.module, job.spec, path)
            _log(f"done ({time.perf_counter() - start:.0f} s) {job.module} {job.name}", t0)
        except Exception:
            _failed(path, job, traceback.format_exc(), t0)
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            path = out / f"{job.module}_{job.name}.json"
            log = path.with_suffix(".log").open("w")
            cmd = [sys.executable, __file__, "--worker", job.module, "--json", str(path)]
            cmd += ["--spec", json.dumps(job.spec)]
            proc = subprocess.Popen(cmd, env=_env(job.env), stderr=log, text=True)
            running.append((job, path, log, proc, time.perf_counter()))
        while not (ended := [r for r in running if r[3].poll() is not None]):
            time.sleep(0.05)
        for item in ended:
            running.remove(item)
            job, path, log, proc, start = item
            log.close()
            if proc.returncode:
                _failed(path, job, Path(log.name).read_text(), t0)
            else:
                _log(f"done ({time.perf_counter() - start:.0f} s) {job.module} {job.name}", t0)


def run_all(cfg: Config, modules: Sequence[str], out: Path, meta: dict[str, Any]) -> None:
    t0 = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    for module in modules:
        for old in [*out.glob(f"{module}_*.json"), *out.glob(f"{module}_*.log")]:
            old.unlink()
    jobs = [j for m in modules for j in importlib.import_module(m).jobs(cfg)]
    for i, job in enumerate(jobs):
        job.spec["order"] = i
    # Timing processes run alone (2 threads, 2 cores); memory figures are per process, so
    # memory processes may share the machine. --quick: one torch thread, as two threads of a
    # process on a busy machine can wait on each other a hundredfold.
    if cfg.quick:
        os.environ[h.THREADS_ENV] = "1"
        run_jobs(jobs, out, 0, t0)
    else:
        run_jobs([j for j in jobs if j.alone], out, 1, t0)
        run_jobs([j for j in jobs if not j.alone], out, 2, t0)
    meta["total_s"] = time.perf_counter() - t0
    for module in modules:
        (out / f"meta_{module}.json").write_text(json.dumps(meta, indent=1))


def render(out: Path, module: str) -> tuple[list[dict[str, Any]], list[str]]:
    """(evaluated targets, markdown section) of ``module`` from the JSON in ``out``."""
    results = [json.loads(p.read_text()) for p in out.glob(f"{module}_*.json")]
    results.sort(key=lambda r: r.get("spec", {}).get("order", -1))
    meta_path = out / f"meta_{module}.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    mod = importlib.import_module(module)
    return _report.section(mod.TITLE, mod.TARGETS, results, meta)


def write_report(out: Path, results_md: Path, modules: Sequence[str], splice: bool) -> None:
    """RESULTS.md, and targets.json beside the workers' JSON; with ``splice``, each module's
    section replaces its old one in the existing RESULTS.md and the rest is kept."""
    text = results_md.read_text() if splice and results_md.exists() else INTRO
    targets = {}
    for module in modules:
        targets[module], lines = render(out, module)
        text = _report.splice(text, importlib.import_module(module).TITLE, lines)
    results_md.parent.mkdir(parents=True, exist_ok=True)
    results_md.write_text(text.rstrip("\n") + "\n")
    (out / "targets.json").write_text(json.dumps(targets, indent=1))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """The options; README.md says more about each."""
    p = argparse.ArgumentParser(description=__doc__)
    add = p.add_argument
    add("--quick", action="store_true", help="smoke run: tiny inputs, one round, one process")
    add("--out", help="folder for the JSON, logs and RESULTS.md (default: bench/_out/...)")
    add("--report-only", action="store_true", help="render RESULTS.md from the JSON in --out")
    add("--wait-quiet", type=float, default=0.0, metavar="S", help="wait for a quiet machine")
    add("--baseline", metavar="REV", help="also time src/hookscope at git REV, same rounds")
    add("--only", choices=MODULES, help="one module; its section replaces its old one")
    add("--device", choices=("cuda", "cpu"), help="run gpu.py there: gpu.md and gpu.json")
    picks, cases = {"nargs": "+", "default": (), "metavar": "NAME"}, (*gpu.MODELS, *gpu.CASES)
    add("--models", choices=cases, help="with --device: models or cases to run", **picks)
    add("--rows", choices=gpu.GROUPS, help="with --device: row groups to run", **picks)
    for hidden in ("--worker", "--spec", "--json"):
        add(hidden, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device and (args.baseline or args.only):
        p.error("--baseline and --only apply to the CPU modules, not to --device")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker, json.loads(args.spec), Path(args.json))
        return
    name = "-".join(filter(None, [args.device, "quick" if args.quick else ""])) or "full"
    out = Path(args.out) if args.out else HERE / "_out" / name
    modules = ("gpu",) if args.device else (args.only,) if args.only else MODULES
    if not args.report_only:
        deadline = time.monotonic() + args.wait_quiet
        while os.getloadavg()[0] >= 0.5 and time.monotonic() < deadline:
            time.sleep(10)
        baseline = extract_baseline(args.baseline) if args.baseline else None
        path = (baseline and not baseline.get("error") and str(BASELINE_DIR)) or None
        settings = ("tuned",) if args.quick else ("tuned", "defaults")
        picked = tuple(args.models), tuple(args.rows)
        cfg = Config(args.quick, settings, path, args.device or "cpu", *picked)
        meta = {
            "command": " ".join(["python bench/run.py", *argv]),
            "quick": args.quick,
            "started": time.strftime("%Y-%m-%d %H:%M"),
            "baseline": baseline,
        }
        run_all(cfg, modules, out, meta)
    if args.device:  # gpu.md: the section to paste into RESULTS.md; gpu.json: its rows
        rows, lines = render(out, "gpu")
        (out / "gpu.md").write_text("\n".join(lines))
        (out / "gpu.json").write_text(json.dumps(rows, indent=1))
        print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}", file=sys.stderr)
        return
    # Only a full run into the default folder replaces the committed bench/RESULTS.md.
    results_md = out / "RESULTS.md" if args.quick or args.out else HERE / "RESULTS.md"
    write_report(out, results_md, modules, splice=bool(args.only))
    print(f"wrote {results_md}", file=sys.stderr)


if __name__ == "__main__":
    main()
