"""The one timing harness of every benchmark module: :class:`Variant` s timed in shuffled, paired
rounds (:func:`timing`), same-round ratios (:func:`paired`) and :class:`Target` s. README.md."""

from __future__ import annotations

import contextlib
import functools
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

Result = dict[str, Any]  # what a worker returns: JSON-ready
Context = Callable[[], contextlib.AbstractContextManager[Any]]
THREADS_ENV = "HOOKSCOPE_BENCH_THREADS"
#: Versions in every section's header: the library, its peers and what they run on.
_PACKAGES = ("torch", "transformers", "hookscope", "numpy", "torchlens", "nnsight", "torchinfo")
_PACKAGES += ("fvcore", "thop", "grad-cam", "captum", "zarr", "tensorboard", "ray", "torchvision")


@dataclass(frozen=True)
class Config:
    """What one benchmark run does; modules turn it into jobs."""

    quick: bool
    settings: tuple[str, ...] = ("tuned",)  # malloc settings that get a timing process each
    baseline: str | None = None  # folder holding the extracted ``hookscope_baseline``
    device: str = "cpu"  # --device: where gpu.py runs
    models: tuple[str, ...] = ()  # --models: gpu.py's cases to run (empty: all)
    rows: tuple[str, ...] = ()  # --rows: gpu.py's row groups to run (empty: all)


@dataclass(frozen=True)
class Job:
    """One worker process: ``module.work(spec)`` under malloc setting ``env`` (run.py)."""

    module: str
    name: str  # unique within the module; names the JSON file
    spec: Result
    env: str = "tuned"
    alone: bool = True  # timing jobs run alone; memory jobs (per-process RSS) may share


def timing_jobs(
    module: str,
    cfg: Config,
    budgets: Mapping[str, float],
    *,
    rounds: int = 20,
    min_rounds: int = 5,
    heavy_rounds: int = 0,
    env: str = "tuned",
    **spec: Any,
) -> list[Job]:
    """A timing process per case (``{case: seconds of rounds}``) under malloc setting ``env``:
    its :class:`Plan` (``warmup`` 1) in a full run, one round without warm-up in --quick."""
    out = []
    for case, budget in budgets.items():
        plan = {"warmup": 0, "rounds": 1, "min_rounds": min_rounds, "budget_s": 0.0}
        if not cfg.quick:
            plan.update(warmup=1, rounds=rounds, budget_s=budget, heavy_rounds=heavy_rounds)
        base = {"kind": "timing", "model": case, "quick": cfg.quick, "baseline": cfg.baseline}
        job = Job(module, "timing_" + case.replace("/", "_"), {**base, **spec, "plan": plan}, env)
        out.append(job)
    return out


class Plan(NamedTuple):
    warmup: int
    rounds: int
    min_rounds: int = 0
    budget_s: float = 0.0  # stop once min_rounds are done and the next round would overrun
    heavy_rounds: int = 0  # measured rounds that include the heavy variants (0: all)
    iters: int = 1  # calls per variant and round; the round's time is their median


@dataclass(frozen=True)
class Variant:
    """One timed call: ``fn()`` runs it and returns everything it produced (freed untimed)."""

    key: str
    label: str
    fn: Callable[[], Any]
    floor: str | None = None  # the variant it is compared with besides the case's unit
    block: str = ""  # variants sharing a block run back to back inside ``blocks[block]()``
    heavy: bool = False  # seconds per call: runs only in the first ``heavy_rounds`` rounds
    before: Callable[[], Any] | None = None  # untimed, before each call (e.g. model.train())
    iters: int | None = None  # overrides Plan.iters (a 10-step variant: 1)


def named(result: Result, case: str, title: str, about: str, **more: Any) -> Result:
    """A worker's ``result`` with what its section shows it by: case, title, what was run."""
    return {**result, "case": case, "title": title, "about": about, **more}


def inside(make: Context, fn: Callable[[], Any]) -> Callable[[], Any]:
    """A call of ``fn()`` inside a fresh ``make()``, returning what the context gave."""

    def call() -> Any:
        with make() as got:
            fn()
        return got

    return call


def map_tensors(fn: Callable[[Tensor], Any], obj: Any) -> Any:
    """``fn`` applied to every tensor of a nested module output (tuples, lists, dicts)."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, v) for v in obj)
    if isinstance(obj, Mapping):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def tensors(obj: Any) -> list[Tensor]:
    got: list[Tensor] = []
    map_tensors(got.append, obj)
    return got


def trees_equal(a: Any, b: Any) -> bool:
    """Same number of tensors, pairwise ``torch.equal``."""
    ta, tb = tensors(a), tensors(b)
    return len(ta) == len(tb) and all(torch.equal(x, y) for x, y in zip(ta, tb, strict=True))


def count_ops(fn: Callable[[], Any]) -> int:
    """How many aten operators ``fn()`` dispatches (exact and repeatable, unlike times)."""

    class Counter(TorchDispatchMode):  # type: ignore[misc]
        count = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kw: Any = None) -> Any:
            Counter.count += 1
            return func(*args, **(kw or {}))

    with Counter():
        fn()
    return Counter.count


def error_text(e: BaseException) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _steal_ticks() -> int:
    """Hypervisor steal ticks of the whole machine (0 where /proc/stat lacks them)."""
    try:
        with open("/proc/stat") as f:
            return int(f.readline().split()[8])
    except (OSError, IndexError, ValueError):
        return 0


def timed_call(fn: Callable[[], Any], sync: Callable[[], Any] = lambda: None) -> dict[str, float]:
    """Wall and process CPU time, minor faults and steal of one call; gc, ``sync()`` before it
    and dropping the result stay untimed; ``sync()`` after it is timed (a GPU's work)."""
    gc.collect()
    sync()
    f0, s0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _steal_ticks()
    c0, t0 = time.process_time(), time.perf_counter()
    result = fn()
    sync()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    f1, s1 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, _steal_ticks()
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
    """``(round, measured round)`` (negative while warming up) of ``plan``; past ``min_rounds``,
    a round starts only if one as long as the last still fits in ``budget_s``."""
    start, last = time.perf_counter(), 0.0
    for rnd in range(plan.warmup + plan.rounds):
        measured = rnd - plan.warmup
        elapsed = time.perf_counter() - start
        if plan.budget_s and measured >= plan.min_rounds and elapsed + last > plan.budget_s:
            return
        t0 = time.perf_counter()
        yield rnd, measured
        last = time.perf_counter() - t0


def timing(
    variants: list[Variant],
    plan: Plan,
    blocks: Mapping[str, Context] | None = None,
    sync: Callable[[], Any] = lambda: None,
    unit: str = "plain",
) -> Result:
    """Every variant once per round, freshly shuffled: the variants, their samples, the noise,
    and the error of any variant that raised (dropped from later rounds; the others go on)."""
    rng, samples, loads, errors = random.Random(0), [], [], {}
    start = time.perf_counter()
    gc.freeze()  # what exists now (imports, models) stays out of every call's gc.collect()
    for rnd, measured in rounds(plan):
        loads.append(os.getloadavg()[0])
        heavy = measured < plan.heavy_rounds or not plan.heavy_rounds
        live = [v for v in variants if (heavy or not v.heavy) and v.key not in errors]
        for block in _round_order(live, rng):
            with (blocks or {})[block[0].block]() if block[0].block else contextlib.nullcontext():
                for v in block:
                    try:
                        if v.before is not None:
                            v.before()
                        calls = [timed_call(v.fn, sync) for _ in range(v.iters or plan.iters)]
                    except Exception as e:
                        errors[v.key] = error_text(e)
                        continue
                    got = {k: statistics.median(c[k] for c in calls) for k in calls[0]}
                    samples.append({"key": v.key, "round": rnd, "warmup": measured < 0, **got})
    gc.unfreeze()
    noise = {"loadavg": [min(loads), max(loads)], "rounds_s": time.perf_counter() - start}
    noise["steal_ticks"] = sum(s["steal"] for s in samples if not s["warmup"])
    info = {v.key: {"label": v.label, "floor": v.floor} for v in variants}
    return {"unit": unit, "variants": info, "samples": samples, "errors": errors, "noise": noise}


class Ratio(NamedTuple):
    """Median over rounds of a same-round ratio, with its q1 and q3."""

    median: float
    q1: float
    q3: float
    n: int


@dataclass(frozen=True)
class Target:
    """One row of a targets table: ``numerator ÷ denominator`` of one case (same rounds), or
    without a denominator one of its ``values``; ``limit`` None: a row to read, not a target."""

    case: str
    numerator: str
    denominator: str | None
    limit: float | None
    note: str
    field: str = "seconds"  # the samples' measurement to divide ("cpu", "peak_mib", ...)


def per_round(samples: list[Result], key: str, field: str = "seconds") -> dict[int, float]:
    measured = (s for s in samples if s["key"] == key and not s["warmup"] and field in s)
    return {s["round"]: s[field] for s in measured}


def paired(samples: list[Result], key: str, base: str, field: str = "seconds") -> Ratio | None:
    """Per-round ``key / base`` over the rounds both ran (``base`` > 0 there)."""
    a, b = per_round(samples, key, field), per_round(samples, base, field)
    xs = [a[r] / b[r] for r in sorted(set(a) & set(b)) if b[r] > 0]
    if len(xs) < 2:
        return Ratio(xs[0], xs[0], xs[0], 1) if xs else None
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return Ratio(med, q1, q3, len(xs))


def median(samples: list[Result], key: str, field: str = "seconds") -> float | None:
    xs = list(per_round(samples, key, field).values())
    return statistics.median(xs) if xs else None


def rss_kib() -> dict[str, int]:
    """``VmRSS`` and ``VmHWM`` (peak since the last reset) of this process, in KiB."""
    text = Path("/proc/self/status").read_text()
    return {k: int(re.search(rf"{k}:\s+(\d+)", text).group(1)) for k in ("VmRSS", "VmHWM")}  # type: ignore[union-attr]


def measure_rss(fn: Callable[[], Any]) -> dict[str, float]:
    """Peak RSS during ``fn()`` and RSS retained while its result lives, over the start (MiB)."""
    gc.collect()
    base = rss_kib()["VmRSS"]
    Path("/proc/self/clear_refs").write_text("5")  # reset the kernel's peak counter (VmHWM)
    result = fn()
    during = rss_kib()
    peak, retained = (during[k] - base for k in ("VmHWM", "VmRSS"))
    del result
    return {"peak_mib": peak / 1024, "retained_mib": retained / 1024}


def peak_rss_mib() -> float:
    """The process's peak RSS so far (``ru_maxrss``), MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def source_hash(package_dir: Path) -> str:
    """sha1 of a package's ``*.py`` (the library may change while a run goes on)."""
    digest = hashlib.sha1()
    for path in sorted(package_dir.rglob("*.py")):
        digest.update(str(path.relative_to(package_dir)).encode() + path.read_bytes())
    return digest.hexdigest()[:12]


@functools.cache  # one process may run many jobs (--quick)
def machine_info() -> Result:
    import hookscope

    cpu = re.search(r"model name\s*:\s*(.*)", Path("/proc/cpuinfo").read_text())
    gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    gpu = torch.cuda.is_available() and f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
    norm = lambda name: re.sub(r"[-_.]+", "-", name).lower()  # noqa: E731 (as pip compares names)
    installed = {norm(d.name): d.version for d in importlib.metadata.distributions() if d.name}
    return {
        "cpu": cpu.group(1) if cpu else platform.processor(),
        "cpus": os.cpu_count(),
        "memory_gib": round(gib, 1),
        "platform": platform.platform(),
        "gpu": gpu or None,
        "python": sys.version.split()[0],
        "torch_threads": torch.get_num_threads(),
        "versions": {p: installed.get(norm(p), "not installed") for p in _PACKAGES},
        "hookscope_sha1": source_hash(Path(hookscope.__file__).parent),
    }
