"""Shared benchmark helpers: worker setup, interleaved paired timing, RSS, machine info, markdown.

Capability modules (``capture.py``, ...) build on these; ``run.py`` drives them.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.metadata
import os
import platform
import random
import re
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

THREADS_ENV = "HOOKSCOPE_BENCH_THREADS"
SETTINGS = {"tuned": "malloc tuned", "defaults": "glibc defaults"}
DASH = "\u2013"
_PACKAGES = ("torch", "transformers", "hookscope", "torchlens", "nnsight", "numpy")


@dataclass(frozen=True)
class Config:
    """What one benchmark run does; capability modules turn it into jobs."""

    quick: bool
    out: Path
    settings: tuple[str, ...]  # malloc settings that get a timing process each
    baseline: str | None = None  # folder holding the extracted ``hookscope_baseline``
    device: str | None = None  # --device: run gpu.py there instead of the CPU modules
    models: tuple[str, ...] = ()  # --models: gpu.py's cases to run (empty: all)
    rows: tuple[str, ...] = ()  # --rows: gpu.py's row groups to run (empty: all)


@dataclass(frozen=True)
class Job:
    """One worker process: ``module.work(spec)`` under malloc setting ``env``."""

    module: str
    name: str  # unique within the module; names the JSON file
    spec: dict[str, Any]
    env: str  # a key of run.MALLOC_ENV
    alone: bool = True  # timing jobs run alone; memory jobs (per-process RSS) may share


def timing_jobs(
    module: str, cfg: Config, budgets: dict[str, float], *, rounds: int = 20, min_rounds: int = 5
) -> list[Job]:
    """One malloc-tuned timing process per case (``{case: seconds of rounds}``): one warm-up
    round, then ``rounds`` (two with ``--quick``, no budget), never fewer than ``min_rounds``."""
    out = []
    for model, budget in budgets.items():
        plan = {"warmup": 1, "rounds": 2 if cfg.quick else rounds, "min_rounds": min_rounds,
                "budget_s": 0 if cfg.quick else budget}  # fmt: skip
        spec = {"kind": "timing", "model": model, "quick": cfg.quick, "plan": plan}
        out.append(Job(module, f"timing_{model}", spec, "tuned"))
    return out


class _OpCounter(TorchDispatchMode):  # type: ignore[misc]
    """Counts every aten operator dispatched while active (views included: each costs a
    Python dispatch, and on a GPU most others a kernel launch)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn: Callable[[], Any]) -> int:
    """How many aten operators ``fn()`` dispatches (exact and repeatable, unlike times)."""
    with _OpCounter() as counter:
        fn()
    return counter.count


def set_threads() -> None:
    """Pin torch's thread pools to 2 (the machine's cores), or $HOOKSCOPE_BENCH_THREADS."""
    threads = int(os.environ.get(THREADS_ENV, "2"))
    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # already set in this process
        torch.set_num_interop_threads(threads)


# -- nested module outputs (tensors inside tuples, lists, dicts) ---------------------------


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensors(obj: Any) -> list[Tensor]:
    if isinstance(obj, Tensor):
        return [obj]
    if isinstance(obj, Mapping):
        obj = list(obj.values())
    return [t for v in obj for t in tensors(v)] if isinstance(obj, (tuple, list)) else []


def trees_equal(a: Any, b: Any) -> bool:
    """Same number of tensors, pairwise ``torch.equal``."""
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


# -- timing ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plan:
    warmup: int
    rounds: int
    min_rounds: int = 0
    budget_s: float = 0.0  # stop once min_rounds are done and the next round would overrun
    heavy_rounds: int = 0  # measured rounds that include the heavy variants (0: all)


@dataclass(frozen=True)
class Variant:
    """One timed call: ``fn()`` runs it and returns everything it produced."""

    key: str
    label: str
    fn: Callable[[], Any]
    floor: str | None = None  # the variant it is compared with besides plain
    block: str = ""  # variants sharing a block run back to back inside ``blocks[block]()``
    heavy: bool = False  # seconds per call: runs only in the first ``heavy_rounds`` rounds


def _steal_ticks() -> int:
    """Hypervisor steal ticks of the whole machine (0 where /proc/stat lacks them)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def timed_call(fn: Callable[[], Any]) -> dict[str, float]:
    """Wall time, CPU time of the process (all its threads: less disturbed than wall time when
    other tenants load the machine), minor faults and steal of one call; gc and dropping the
    result stay untimed."""
    gc.collect()
    f0, s0 = _minor_faults(), _steal_ticks()
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    f1, s1 = _minor_faults(), _steal_ticks()
    del result
    return {"seconds": seconds, "cpu": cpu, "minflt": f1 - f0, "steal": s1 - s0}


def _round_order(variants: list[Variant], rng: random.Random) -> list[list[Variant]]:
    """Shuffled singletons, plus each block shuffled inside and placed at a random spot."""
    order = [[v] for v in variants if not v.block]
    rng.shuffle(order)
    for name in sorted({v.block for v in variants if v.block}):
        block = [v for v in variants if v.block == name]
        rng.shuffle(block)
        order.insert(rng.randint(0, len(order)), block)
    return order


def rounds(plan: Plan) -> Iterator[tuple[int, int]]:
    """``(round, measured round)`` (negative while warming up) for every round of ``plan``;
    once ``min_rounds`` are measured, a round starts only if a round as long as the last one
    still fits in ``budget_s``."""
    start, last = time.perf_counter(), 0.0
    for rnd in range(plan.warmup + plan.rounds):
        measured = rnd - plan.warmup
        elapsed = time.perf_counter() - start
        if plan.budget_s and measured >= plan.min_rounds and elapsed + last > plan.budget_s:
            return
        t0 = time.perf_counter()
        yield rnd, measured
        last = time.perf_counter() - t0


def run_rounds(
    variants: list[Variant],
    plan: Plan,
    blocks: Mapping[str, Callable[[], contextlib.AbstractContextManager[Any]]],
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Every variant once per round, freshly shuffled; returns the samples and noise data.

    Paired rounds are what make ratios meaningful on a noisy machine: a burst of load from
    another tenant hits the variant and its baseline of the same round alike.
    """
    rng = random.Random(0)
    samples: list[dict[str, Any]] = []
    loads: list[float] = []
    start = time.perf_counter()
    for rnd, measured in rounds(plan):
        loads.append(os.getloadavg()[0])
        heavy = measured < plan.heavy_rounds or not plan.heavy_rounds
        for block in _round_order([v for v in variants if heavy or not v.heavy], rng):
            with blocks[block[0].block]() if block[0].block else contextlib.nullcontext():
                for v in block:
                    sample = {"key": v.key, "round": rnd, "warmup": measured < 0}
                    samples.append({**sample, **timed_call(v.fn)})
    noise = {"loadavg": [min(loads), max(loads)], "rounds_s": time.perf_counter() - start}
    noise["steal_ticks"] = sum(s["steal"] for s in samples if not s["warmup"])
    return samples, noise


# -- statistics ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Ratio:
    """Median over rounds of a same-round ratio, with its q1 and q3."""

    median: float
    q1: float
    q3: float
    n: int

    def cell(self) -> str:
        spread = f" [{self.q1:.2f}{DASH}{self.q3:.2f}]" if self.n > 1 else ""
        return f"**{self.median:.2f}**{spread}"


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


def ratio(a: dict[int, float], b: dict[int, float]) -> Ratio | None:
    """Per-round ``a / b`` over the rounds both have (``b`` > 0 there)."""
    xs = [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r] > 0]
    if not xs:
        return None
    q1, med, q3 = quartiles(xs)
    return Ratio(med, q1, q3, len(xs))


def per_round(samples: list[dict[str, Any]], key: str, what: str = "seconds") -> dict[int, float]:
    return {s["round"]: s[what] for s in samples if s["key"] == key and not s["warmup"]}


def paired(samples: list[dict[str, Any]], key: str, base: str | None) -> Ratio | None:
    return ratio(per_round(samples, key), per_round(samples, base)) if base else None


def median(samples: list[dict[str, Any]], key: str, what: str = "seconds") -> float | None:
    xs = list(per_round(samples, key, what).values())
    return statistics.median(xs) if xs else None


# -- memory ----------------------------------------------------------------------------------


def _rss_kib() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak since the last reset) of this process, in KiB."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]


def measure_rss(fn: Callable[[], Any]) -> dict[str, float]:
    """Peak RSS during ``fn()`` and RSS retained while its result lives, over the start (MiB)."""
    gc.collect()
    base = _rss_kib()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # reset the kernel's peak counter (VmHWM)
    result = fn()
    during = _rss_kib()
    del result
    return {
        "peak_mib": (during["VmHWM"] - base) / 1024,
        "retained_mib": (during["VmRSS"] - base) / 1024,
    }


# -- machine and versions ----------------------------------------------------------------------


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def source_hash(package_dir: Path) -> str:
    """sha1 of a package's ``*.py`` (the library may change while a run goes on)."""
    digest = hashlib.sha1()
    for path in sorted(package_dir.rglob("*.py")):
        digest.update(str(path.relative_to(package_dir)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


def machine_info() -> dict[str, Any]:
    import hookscope

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    return {
        "cpu": cpu.group(1) if cpu else platform.processor(),
        "cpus": os.cpu_count(),
        "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads(),
        "versions": {p: _version(p) for p in _PACKAGES},
        "hookscope_sha1": source_hash(Path(hookscope.__file__).parent),
    }


# -- report ----------------------------------------------------------------------------------


@dataclass
class Target:
    """One row of the targets table: a ratio per column, checked against ``limit``."""

    what: str
    model: str
    cells: dict[str, Ratio | None] = field(default_factory=dict)  # column -> value
    limit: float = float("inf")

    def verdict(self) -> str:
        got = {c: r.median for c, r in self.cells.items() if r is not None}
        missed = [c for c, m in got.items() if m > self.limit]
        if not got or not missed:
            return "PASS" if got else "n/a"
        return "**MISS**" + (f" ({', '.join(missed)})" if len(got) > 1 else "")


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: first two columns left-aligned, the rest right-aligned."""
    marks = ["---" if i < 2 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    return [*lines, *("| " + " | ".join(r) + " |" for r in rows), ""]
