"""hookscope capture benchmark: ``python bench/run.py`` (``--quick`` for a smoke run).

Runs, each in its own process:

1. timing, per model, with malloc tuned so freed memory stays resident (all variants, peers
   included) and again with glibc's defaults (hookscope and hand-written variants only);
2. the latency-bound tiny model (per-site cost of a hook call);
3. memory, a fresh process per (model, variant);

then writes raw JSON under ``bench/_out/`` and the tables to ``bench/RESULTS.md``
(``--quick``: everything under ``bench/_out/quick/``, RESULTS.md included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _cases import MODELS, THREADS_ENV  # noqa: E402

#: Timing processes run with one of these malloc settings (see RESULTS.md, "Allocator").
MALLOC_SETTINGS: dict[str, dict[str, str]] = {
    # Freed memory stays in the heap: no trimming (16 GiB threshold) and no mmap below
    # 32 MiB (glibc's ceiling for this knob), so repeated calls reuse resident pages.
    "tuned": {"MALLOC_TRIM_THRESHOLD_": str(16 * 2**30), "MALLOC_MMAP_THRESHOLD_": str(32 * 2**20)},
    # glibc's defaults (dynamic mmap threshold, trimming): what users get.
    "defaults": {},
}
#: Memory processes: every buffer above 128 KiB is its own mapping, so RSS tracks tensors.
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}

_MEMORY_KEYS_QUICK = ("plain", "hs_leaves_reduce")


@dataclass(frozen=True)
class Config:
    quick: bool
    out: Path
    results_md: Path
    warmup: int
    rounds: int
    min_rounds: int
    heavy_rounds: int  # measured rounds that include torchlens (seconds per call)
    budget_s: dict[str, float]  # per "model/setting": seconds for the rounds phase
    latency: tuple[int, int, int]  # rounds, warmup, calls per sample
    memory_repeats: int
    settings: tuple[str, ...]


def make_config(args: argparse.Namespace) -> Config:
    out = Path(args.out) if args.out else HERE / "_out" / ("quick" if args.quick else "full")
    if args.quick:
        return Config(
            quick=True,
            out=out,
            results_md=out / "RESULTS.md",
            warmup=1,
            rounds=2,
            min_rounds=2,
            heavy_rounds=0,
            budget_s={},
            latency=(3, 1, 20),
            memory_repeats=1,
            settings=("tuned",),
        )
    # Seconds for each timing process's rounds (warm-up included); a process stops early
    # once it has min_rounds measured rounds and another round would overrun its budget.
    budgets = {
        "resnet50/tuned": 220.0,
        "gpt2/tuned": 280.0,
        "resnet50/defaults": 110.0,
        "gpt2/defaults": 170.0,
    }
    return Config(
        quick=False,
        out=out,
        results_md=HERE / "RESULTS.md",
        warmup=1,
        rounds=20,
        min_rounds=5,
        heavy_rounds=5,
        budget_s=budgets,
        latency=(30, 3, 100),
        memory_repeats=2,
        settings=tuple(MALLOC_SETTINGS),
    )


# -- orchestration -----------------------------------------------------------------------


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error", **extra)
    return env


def _log(msg: str, t0: float) -> None:
    print(f"[{time.perf_counter() - t0:7.1f} s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True)
class Job:
    """One worker process: its arguments, malloc environment and JSON output."""

    args: list[str]
    env: dict[str, str]
    json_path: Path

    def command(self) -> list[str]:
        script = str(Path(__file__).resolve())
        return [sys.executable, script, "--worker", *self.args, "--json", str(self.json_path)]


def run_jobs(jobs: list[Job], parallel: int, t0: float) -> None:
    """Run worker processes, ``parallel`` at a time; a failure leaves an error record."""
    pending = list(jobs)
    running: list[tuple[Job, subprocess.Popen[str], float]] = []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            proc = subprocess.Popen(
                job.command(),
                env=job.env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            running.append((job, proc, time.perf_counter()))
        job, proc, start = running.pop(0)
        _out, err = proc.communicate()
        took = time.perf_counter() - start
        if proc.returncode != 0:
            tail = err[-3000:]
            record = {"kind": "error", "args": job.args, "stderr": tail}
            job.json_path.write_text(json.dumps(record))
            _log(f"FAILED ({took:.0f} s): {' '.join(job.args)}\n{tail}", t0)
        else:
            _log(f"done ({took:.0f} s): {' '.join(job.args)}", t0)


def _env_for(cfg: Config, extra: dict[str, str]) -> dict[str, str]:
    # --quick runs two processes at a time; one torch thread each keeps them off each other.
    return _env({**extra, THREADS_ENV: "1"} if cfg.quick else extra)


def timing_jobs(cfg: Config) -> list[Job]:
    jobs = []
    quick = ["--quick"] if cfg.quick else []
    for model in MODELS:
        for setting in cfg.settings:
            args = ["timing", "--model", model, "--setting", setting, *quick]
            args += ["--budget", str(cfg.budget_s.get(f"{model}/{setting}", 0.0))]
            args += ["--rounds", str(cfg.rounds), "--warmup", str(cfg.warmup)]
            args += ["--min-rounds", str(cfg.min_rounds), "--heavy-rounds", str(cfg.heavy_rounds)]
            if setting == "tuned":  # --quick skips torchlens (seconds per trace even when tiny)
                args += ["--peers", "nnsight" if cfg.quick else "all"]
            path = cfg.out / f"timing_{model}_{setting}.json"
            jobs.append(Job(args, _env_for(cfg, MALLOC_SETTINGS[setting]), path))
    rounds, warmup, calls = cfg.latency
    tuned = _env_for(cfg, MALLOC_SETTINGS["tuned"])
    latency = ["latency", "--rounds", str(rounds), "--warmup", str(warmup), "--calls", str(calls)]
    jobs.append(Job(latency, tuned, cfg.out / "latency.json"))
    jobs.append(
        Job(["profile", "--calls", str(max(calls, 20) * 3)], tuned, cfg.out / "profile.json")
    )
    return jobs


def memory_jobs(cfg: Config) -> list[Job]:
    from _variants import MEMORY_KEYS

    jobs = []
    quick = ["--quick"] if cfg.quick else []
    for model in MODELS:
        for key in _MEMORY_KEYS_QUICK if cfg.quick else MEMORY_KEYS:
            args = ["memory", "--model", model, "--variant", key, *quick]
            args += ["--repeats", str(cfg.memory_repeats)]
            path = cfg.out / f"memory_{model}_{key}.json"
            jobs.append(Job(args, _env_for(cfg, MEMORY_ENV), path))
    return jobs


def run_all(cfg: Config) -> None:
    t0 = time.perf_counter()
    cfg.out.mkdir(parents=True, exist_ok=True)
    for old in cfg.out.glob("*.json"):
        old.unlink()
    started = time.time()
    # Timing processes run alone (2 threads on 2 cores), except in a --quick smoke run.
    # Memory figures are per process (RSS), so two memory processes may share the machine.
    run_jobs(timing_jobs(cfg), 2 if cfg.quick else 1, t0)
    run_jobs(memory_jobs(cfg), 2, t0)
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M", time.localtime(started)),
        "total_s": time.perf_counter() - t0,
        "quick": cfg.quick,
        "command": "python bench/run.py" + (" --quick" if cfg.quick else ""),
        "malloc_settings": MALLOC_SETTINGS,
        "memory_env": MEMORY_ENV,
    }
    (cfg.out / "run_meta.json").write_text(json.dumps(meta, indent=1))
    from _report import write_report

    write_report(cfg.out, cfg.results_md)
    _log(f"wrote {cfg.results_md}", t0)


# -- worker side ---------------------------------------------------------------------------


def run_worker(args: argparse.Namespace) -> None:
    if args.worker == "timing":
        from _timing import Plan, run_timing

        plan = Plan(args.warmup, args.rounds, args.min_rounds, args.budget, args.heavy_rounds)
        result = run_timing(args.model, args.setting, plan, peers=args.peers, quick=args.quick)
    elif args.worker == "latency":
        from _latency import run_latency

        result = run_latency(args.rounds, args.warmup, args.calls)
    elif args.worker == "profile":
        from _profile import run_profile

        result = run_profile(args.calls)
    elif args.worker == "memory":
        from _memory import run_memory

        result = run_memory(args.model, args.variant, args.repeats, quick=args.quick)
    else:
        raise SystemExit(f"unknown worker {args.worker!r}")
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--quick", action="store_true", help="smoke run: tiny inputs, few rounds (< 2 min)"
    )
    p.add_argument(
        "--out", help="folder for the JSON (default bench/_out/full or bench/_out/quick)"
    )
    p.add_argument(
        "--report-only", action="store_true", help="rewrite RESULTS.md from existing JSON"
    )
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for the 1-minute load average to fall below 0.5",
    )
    # worker-only options (the orchestrator passes them to its child processes)
    p.add_argument(
        "--worker", choices=["timing", "latency", "profile", "memory"], help=argparse.SUPPRESS
    )
    p.add_argument("--json", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--setting", help=argparse.SUPPRESS)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument(
        "--peers", choices=["none", "nnsight", "all"], default="none", help=argparse.SUPPRESS
    )
    p.add_argument("--rounds", type=int, default=10, help=argparse.SUPPRESS)
    p.add_argument("--warmup", type=int, default=2, help=argparse.SUPPRESS)
    p.add_argument("--min-rounds", type=int, default=5, help=argparse.SUPPRESS)
    p.add_argument("--budget", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--heavy-rounds", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--calls", type=int, default=100, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=2, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _wait_quiet(limit_s: float) -> None:
    deadline = time.monotonic() + limit_s
    while os.getloadavg()[0] >= 0.5 and time.monotonic() < deadline:
        time.sleep(10)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.worker:
        run_worker(args)
        return
    cfg = make_config(args)
    if args.report_only:
        from _report import write_report

        write_report(cfg.out, cfg.results_md)
        return
    _wait_quiet(args.wait_quiet)
    run_all(cfg)


if __name__ == "__main__":
    main()
