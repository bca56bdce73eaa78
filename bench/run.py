"""hookscope benchmarks: ``python bench/run.py`` (``--quick`` for a smoke run); see README.md.

Runs every capability module's worker processes, then writes RESULTS.md from their JSON.
"""

from __future__ import annotations

import argparse
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _common as common  # noqa: E402
import gpu  # noqa: E402
from _common import DASH, SETTINGS, Config, Job, Target  # noqa: E402

#: Capability modules. Each has ``jobs(cfg) -> list[Job]``, ``work(spec) -> dict`` (run in a
#: worker process) and ``report(results, meta) -> (targets, markdown lines)``.
MODULES = ("capture", "look", "diagnose", "explain", "extract", "ops")

#: What ``--device`` runs instead (on a GPU, or once on tiny models with --quick on the CPU).
DEVICE_MODULE = "gpu"

#: Worker environments (see README.md, "Allocator"). Timing runs once per malloc setting.
MALLOC_ENV: dict[str, dict[str, str]] = {
    # Freed memory stays in the heap (no trim below 16 GiB, no mmap below glibc's 32 MiB
    # ceiling), so calls after warm-up reuse resident pages: the library's own cost, isolated.
    "tuned": {"MALLOC_TRIM_THRESHOLD_": str(16 * 2**30), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)},
    "defaults": {},  # what users get, page faults included
    # Every buffer above 128 KiB is its own mapping, returned when freed: RSS tracks tensors.
    "memory": {"MALLOC_MMAP_THRESHOLD_": "131072"},
}
BASELINE_DIR = HERE / "_out" / "baseline"


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)


# -- baseline ----------------------------------------------------------------------------------


def _git(*args: str) -> bytes:
    return subprocess.run(["git", *args], cwd=HERE.parent, capture_output=True, check=True).stdout


def extract_baseline(rev: str) -> dict[str, Any]:
    """``src/hookscope`` at ``rev`` as package ``hookscope_baseline`` under bench/_out/baseline.

    Renaming the folder is enough because the package imports itself only relatively; an
    absolute ``import hookscope`` would mix in the code under test, so it is refused.
    """
    info: dict[str, Any] = {"rev": rev, "path": str(BASELINE_DIR)}
    try:
        info["commit"] = _git("rev-parse", "--verify", f"{rev}^{{commit}}").decode().strip()
        archive = _git("archive", "--format=tar", info["commit"], "src/hookscope")
    except (OSError, subprocess.CalledProcessError) as e:
        why = getattr(e, "stderr", b"").decode().strip() or e
        return {**info, "error": f"git could not read {rev!r}: {why}"}
    shutil.rmtree(BASELINE_DIR, ignore_errors=True)
    package = BASELINE_DIR / "hookscope_baseline"
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        for member in tar.getmembers():
            if member.isfile() and member.name.startswith("src/hookscope/"):
                target = package / member.name.removeprefix("src/hookscope/")
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_bytes(tar.extractfile(member).read())  # type: ignore[union-attr]
    absolute = re.compile(r"^\s*(from|import)\s+hookscope\b", re.MULTILINE)
    bad = [p.name for p in package.rglob("*.py") if absolute.search(p.read_text())]
    if bad:
        shutil.rmtree(BASELINE_DIR)
        return {**info, "error": f"absolute imports of hookscope in {bad}; cannot rename"}
    return {**info, "sha1": common.source_hash(package)}


# -- orchestration -----------------------------------------------------------------------------


def _env(name: str, quick: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **MALLOC_ENV[name])
    if quick:  # --quick runs two processes at a time: one torch thread each
        env[common.THREADS_ENV] = "1"
    return env


def run_jobs(jobs: list[Job], cfg: Config, parallel: int, t0: float) -> None:
    """Run worker processes, ``parallel`` at a time (the next starts as soon as any one ends);
    a failure leaves an error record."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            path = cfg.out / f"{job.module}_{job.name}.json"
            log = (cfg.out / f"{job.module}_{job.name}.log").open("w")
            cmd = [sys.executable, __file__, "--worker", job.module, "--json", str(path)]
            cmd += ["--spec", json.dumps(job.spec)]
            proc = subprocess.Popen(cmd, env=_env(job.env, cfg.quick), stderr=log, text=True)
            running.append((job, path, log, proc, time.perf_counter()))
        while not (ended := [r for r in running if r[3].poll() is not None]):
            time.sleep(0.05)
        for item in ended:
            running.remove(item)
            job, path, log, proc, start = item
            log.close()
            took = f"({time.perf_counter() - start:.0f} s) {job.module} {job.name}"
            if proc.returncode:
                tail = Path(log.name).read_text()[-3000:]
                path.write_text(json.dumps({"kind": "error", "job": job.name, "stderr": tail}))
                _log(f"FAILED {took}\n{tail}", t0)
            else:
                _log(f"done {took}", t0)


def _meta_path(out: Path, only: str | None) -> Path:
    return out / (f"run_meta_{only}.json" if only else "run_meta.json")


def run_all(
    cfg: Config, argv: Sequence[str], baseline: dict[str, Any] | None, only: str | None = None
) -> None:
    t0, started = time.perf_counter(), time.strftime("%Y-%m-%d %H:%M")
    cfg.out.mkdir(parents=True, exist_ok=True)
    modules, prefix = ((only,), f"{only}_") if only else (MODULES, "")
    for old in [*cfg.out.glob(f"{prefix}*.json"), *cfg.out.glob(f"{prefix}*.log")]:
        old.unlink()
    jobs = [j for m in modules for j in importlib.import_module(m).jobs(cfg)]
    # Timing processes run alone (2 threads, 2 cores) except in --quick (two at a time, one
    # thread each, all jobs in one queue); memory figures are per process, so memory
    # processes may share the machine.
    if cfg.quick:
        run_jobs(jobs, cfg, 2, t0)
    else:
        run_jobs([j for j in jobs if j.alone], cfg, 1, t0)
        run_jobs([j for j in jobs if not j.alone], cfg, 2, t0)
    meta = {
        "command": " ".join(["python bench/run.py", *argv]),
        "started": started,
        "total_s": time.perf_counter() - t0,
        "quick": cfg.quick,
        "malloc_env": MALLOC_ENV,
        "baseline": baseline,
    }
    _meta_path(cfg.out, only).write_text(json.dumps(meta, indent=1))


# -- report ------------------------------------------------------------------------------------


def _header(meta: dict[str, Any], results: list[dict[str, Any]]) -> list[str]:
    m = next((r["machine"] for r in results if "machine" in r), {})
    versions = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items())
    hashes = sorted({r["machine"]["hookscope_sha1"] for r in results if "machine" in r})
    changed = " (changed during the run)" if len(hashes) > 1 else ""
    lines = [
        "# hookscope benchmark",
        "",
        f"Command: `{meta.get('command', '?')}`, started {meta.get('started', '?')}, "
        f"{meta.get('total_s', 0) / 60:.1f} min.",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('cpus', '?')} CPUs, {m.get('memory_gib', '?')} "
        f"GiB; {m.get('platform', '?')}; torch threads {m.get('torch_threads', '?')}.",
        "",
        f"Versions: python {m.get('python', '?')}, {versions}; hookscope source sha1 "
        f"{', '.join(hashes)}{changed}.",
        "",
    ]
    if bl := meta.get("baseline"):
        got = (
            bl.get("error") or f"commit {bl.get('commit', '?')[:12]}, source sha1 {bl.get('sha1')}"
        )
        failed = sorted({r["baseline_error"] for r in results if r.get("baseline_error")})
        got += "".join(f"; **could not be imported**: {e}" for e in failed)
        lines += [f"Baseline `{bl['rev']}`: {got}.", ""]
    if meta.get("quick"):
        lines += ["**--quick smoke run: tiny inputs, few rounds. Not measurements.**", ""]
    return lines


def _targets_table(targets: list[Target]) -> list[str]:
    columns = list(dict.fromkeys(c for t in targets for c in t.cells))
    header = [
        "target",
        "model",
        *(c if c != "other" else "memory / latency / other" for c in columns),
    ]
    rows = [
        [t.what, t.model]
        + [t.cells[c].cell() if t.cells.get(c) else DASH for c in columns]  # type: ignore[union-attr]
        + [f"≤ {t.limit:.2f}", t.verdict()]
        for t in targets
    ]
    return [
        "## Targets",
        "",
        "Ratio = median over measured rounds of (variant ÷ baseline of the same round, same "
        f"process), [q1{DASH}q3]. Memory: medians of fresh processes. Method: bench/README.md.",
        "",
        *common.table([*header, "limit", "verdict"], rows),
    ]


def _allocator(meta: dict[str, Any]) -> list[str]:
    env = meta.get("malloc_env", MALLOC_ENV)
    shown = {k: ", ".join(f"`{n}={v}`" for n, v in e.items()) or "none" for k, e in env.items()}
    return [
        "## Allocator and noise",
        "",
        f"MALLOC_* variables: {SETTINGS['tuned']} {shown['tuned']}; {SETTINGS['defaults']} "
        f"{shown['defaults']}; memory processes {shown['memory']} (why: bench/README.md). Load "
        "average and hypervisor steal per timing process are under its table; a ratio whose "
        f"q1{DASH}q3 straddles its limit is not resolved on this machine.",
        "",
    ]


def splice(old: str, module: str, new: list[str]) -> str:
    """``old`` RESULTS.md with ``module``'s sections (headed ``## Module: ...``) replaced by
    ``new``, or ``new`` put before the allocator notes if it had none."""
    kept: list[str] = []
    at, skipping = None, False
    for line in old.splitlines():
        if line.startswith("## "):
            skipping = line.startswith(f"## {module.capitalize()}:")
            at = len(kept) if skipping and at is None else at
        if not skipping:
            kept.append(line)
    if at is None:
        at = next((i for i, x in enumerate(kept) if x.startswith("## Allocator")), len(kept))
    return "\n".join([*kept[:at], *new, *kept[at:], ""])


def write_report(out: Path, results_md: Path, only: str | None = None) -> None:
    """RESULTS.md from the JSON in ``out``; with ``only``, that module's sections replace
    its old ones in the existing RESULTS.md and everything else is kept."""
    meta_path = _meta_path(out, only)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    targets: list[Target] = []
    everything: list[dict[str, Any]] = []
    sections: list[str] = []
    for name in (only,) if only else MODULES:
        results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{name}_*.json"))]
        everything += results
        got, lines = importlib.import_module(name).report(
            [r for r in results if r["kind"] != "error"], meta
        )
        targets += got
        sections += lines
    failures = [
        f"* `{r['job']}`:\n\n```\n{r['stderr'][-1500:]}\n```\n"
        for r in everything
        if r["kind"] == "error"
    ]
    failed = ["**Worker failures:**", "", *failures] if failures else []
    results_md.parent.mkdir(parents=True, exist_ok=True)
    if only and results_md.exists():  # the other sections stay as their own run left them
        title = f"## {only.capitalize()}: targets (run on its own; the header is the other run's)"
        new = [title, "", *_header(meta, everything)[2:], *failed, *_targets_table(targets)[2:]]
        results_md.write_text(splice(results_md.read_text(), only, new + sections))
        return
    lines = _header(meta, everything) + failed
    lines += _targets_table(targets) + sections + _allocator(meta)
    results_md.write_text("\n".join(lines))


# -- entry -------------------------------------------------------------------------------------


def run_worker(module: str, spec: str, json_path: str) -> None:
    result = importlib.import_module(module).work(json.loads(spec))
    result["machine"] = common.machine_info()
    Path(json_path).write_text(json.dumps(result, indent=1, default=str))


def _names(*allowed: Any) -> Any:
    """An argparse type: comma-separated names, each one of ``allowed``."""
    known = [n for group in allowed for n in group]

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(n.strip() for n in text.split(",") if n.strip())
        if bad := [n for n in names if n not in known]:
            raise argparse.ArgumentTypeError(f"unknown {bad}; choose from {', '.join(known)}")
        return names

    return parse


DEVICE_HELP = (
    "run bench/gpu.py on this device instead of the CPU modules (hookscope beside floors and "
    "peers, and host synchronisations): writes gpu.md and gpu.json in the output folder "
    "(default bench/_out/DEVICE[-quick])"
)
MODELS_HELP = "with --device: comma-separated models or cases (resnet50, gpt2/bf16, cnn, ...)"
ROWS_HELP = "with --device: comma-separated row groups (capture, edit, ..., extract, syncs)"
WAIT_HELP = "first wait up to S seconds for the 1-minute load average to fall below 0.5"
ONLY_HELP = "run one capability module; its sections replace its old ones in RESULTS.md"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="smoke run: tiny inputs, few rounds")
    p.add_argument("--out", help="folder for the JSON and logs (default bench/_out/full|quick)")
    p.add_argument("--report-only", action="store_true", help="rewrite RESULTS.md from the JSON")
    p.add_argument("--wait-quiet", type=float, default=0.0, metavar="S", help=WAIT_HELP)
    p.add_argument("--baseline", metavar="REV", help="also time src/hookscope at git REV")
    p.add_argument("--only", choices=MODULES, help=ONLY_HELP)
    p.add_argument("--device", choices=("cuda", "cpu"), help=DEVICE_HELP)
    p.add_argument("--models", type=_names(gpu.MODELS, gpu.CASES), default=(), help=MODELS_HELP)
    p.add_argument("--rows", type=_names(gpu.GROUPS), default=(), help=ROWS_HELP)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--json", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.device and (args.baseline or args.only):
        p.error("--baseline and --only apply to the CPU modules, not to --device")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    if args.worker:
        run_worker(args.worker, args.spec, args.json)
        return
    if args.device:
        run_device(args, argv)
        return
    out = Path(args.out) if args.out else HERE / "_out" / ("quick" if args.quick else "full")
    # Only a full run into the default folder replaces the committed bench/RESULTS.md.
    results_md = out / "RESULTS.md" if args.quick or args.out else HERE / "RESULTS.md"
    if not args.report_only:
        deadline = time.monotonic() + args.wait_quiet
        while os.getloadavg()[0] >= 0.5 and time.monotonic() < deadline:
            time.sleep(10)
        baseline = extract_baseline(args.baseline) if args.baseline else None
        path = baseline and not baseline.get("error") and str(BASELINE_DIR)
        settings = ("tuned",) if args.quick else tuple(SETTINGS)
        run_all(Config(args.quick, out, settings, path or None), argv, baseline, args.only)
    write_report(out, results_md, args.only)
    print(f"wrote {results_md}", file=sys.stderr)


def run_device(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """``--device``: gpu.py's jobs one at a time (two at a time with --quick), then gpu.md
    (the section for RESULTS.md) and gpu.json (its rows) in the output folder."""
    name = args.device + ("-quick" if args.quick else "")
    out = Path(args.out) if args.out else HERE / "_out" / name
    if not args.report_only:
        cfg = Config(args.quick, out, (), None, args.device, args.models, args.rows)
        run_all(cfg, argv, None, DEVICE_MODULE)
    results = [json.loads(p.read_text()) for p in sorted(out.glob(f"{DEVICE_MODULE}_*.json"))]
    meta_path = _meta_path(out, DEVICE_MODULE)
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
    summary, lines = importlib.import_module(DEVICE_MODULE).summarize(results, meta)
    (out / "gpu.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "gpu.md").write_text("\n".join(lines))
    print(f"wrote {out / 'gpu.md'} and {out / 'gpu.json'}", file=sys.stderr)


if __name__ == "__main__":
    main()
