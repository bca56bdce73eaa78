"""Memory worker: peak and retained RSS of one variant, in a fresh process.

Run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that every tensor buffer above 128 KiB is its
own mapping and goes back to the OS when freed: RSS then tracks live tensor memory. After
warm-up (two plain forwards, one call of the variant): base = VmRSS; reset the kernel's peak
counter (``5`` into ``/proc/self/clear_refs``); call; peak = VmHWM - base; retained = VmRSS -
base while the result is still referenced; then the result is dropped and RSS read again.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any

import hookscope as hs
from _cases import build_case, set_threads
from _sysinfo import clear_peak_rss, machine_info, rss_kib
from _trees import storage_bytes
from _variants import build_variants

__all__ = ["run_memory"]


def _payload_bytes(result: Any) -> int:
    """Bytes of the captured values in a variant's result (not the model output)."""
    if isinstance(result, tuple) and len(result) == 2:
        kept = result[1]
        if isinstance(kept, hs.Capture):
            return int(kept.nbytes)
        return storage_bytes(kept)
    return 0


def _measure_once(fn: Any) -> dict[str, float]:
    gc.collect()
    base = rss_kib()["VmRSS"]
    clear_peak_rss()
    t0 = time.perf_counter()
    result = fn()
    wall = time.perf_counter() - t0
    during = rss_kib()
    payload = _payload_bytes(result)
    del result
    gc.collect()
    after = rss_kib()["VmRSS"]
    return {
        "peak_mib": (during["VmHWM"] - base) / 1024,
        "retained_mib": (during["VmRSS"] - base) / 1024,
        "after_free_mib": (after - base) / 1024,
        "payload_mib": payload / 2**20,
        "base_mib": base / 1024,
        "wall_s": wall,
    }


def run_memory(model: str, key: str, repeats: int, *, quick: bool) -> dict[str, Any]:
    set_threads()
    case = build_case(model, quick=quick)
    plain, variant = build_variants(case, ["plain", key])
    for _ in range(2):
        plain.fn()
    variant.fn()
    runs = [_measure_once(variant.fn) for _ in range(repeats)]
    summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {
        "kind": "memory",
        "model": model,
        "key": key,
        "label": variant.label,
        "quick": quick,
        "machine": machine_info(),
        "runs": runs,
        "median": summary,
    }
