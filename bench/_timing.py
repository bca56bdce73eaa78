"""Timing worker: one process per (model, malloc setting), all variants interleaved.

Each round calls every variant once, in a freshly shuffled order (the torchlens variants as
one block, between ``wrap_torch`` and ``unwrap_torch``). ``gc.collect()`` runs untimed before
every call and the call's result is dropped untimed after it. Each sample keeps its wall
time, the minor page faults and hypervisor steal ticks during the call, its position in the
round and the variant before it.
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from _cases import Case, build_case, set_threads
from _checks import run_checks
from _sysinfo import machine_info, minor_faults, steal_ticks
from _variants import CORE_KEYS, PEER_KEYS, Variant, build_variants

__all__ = ["Plan", "run_timing"]


@dataclass(frozen=True)
class Plan:
    warmup: int
    rounds: int
    min_rounds: int
    budget_s: float  # rounds phase (warm-up included) ends by then, once min_rounds are done
    heavy_rounds: int = 0  # measured rounds that include the torchlens block (0 = all)


def _timed(fn: Callable[[], Any]) -> dict[str, float]:
    gc.collect()
    f0, s0 = minor_faults(), steal_ticks()
    t0 = time.perf_counter()
    result = fn()
    t1 = time.perf_counter()
    f1, s1 = minor_faults(), steal_ticks()
    del result
    return {"seconds": t1 - t0, "minflt": f1 - f0, "steal": s1 - s0}


def _round_blocks(variants: list[Variant], rng: random.Random) -> list[list[Variant]]:
    """This round's order: main variants shuffled, the torchlens block at a random place."""
    blocks = [[v] for v in variants if v.group == "main"]
    rng.shuffle(blocks)
    tl = [v for v in variants if v.group == "torchlens"]
    if tl:
        rng.shuffle(tl)
        blocks.insert(rng.randint(0, len(blocks)), tl)
    return blocks


def _run_block(block: list[Variant], extras: dict[str, list[float]]) -> list[dict[str, Any]]:
    wrapped = block[0].group == "torchlens"
    if wrapped:
        from _peers import torchlens_unwrap, torchlens_wrap

        t0 = time.perf_counter()
        torchlens_wrap()
        extras["torchlens_wrap_s"].append(time.perf_counter() - t0)
    try:
        return [{"key": v.key, **_timed(v.fn)} for v in block]
    finally:
        if wrapped:
            t0 = time.perf_counter()
            torchlens_unwrap()
            extras["torchlens_unwrap_s"].append(time.perf_counter() - t0)


def run_rounds(
    variants: list[Variant], plan: Plan, seed: int = 0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Interleaved, shuffled rounds; returns the samples and side measurements.

    Stops early once ``plan.min_rounds`` are measured and another round would end past
    ``plan.budget_s`` (counted from the first warm-up round; 0 = no budget). The torchlens
    block (seconds per call) runs only in the first ``plan.heavy_rounds`` measured rounds, so
    the fast variants get more rounds within the budget.
    """
    rng = random.Random(seed)
    samples: list[dict[str, Any]] = []
    extras: dict[str, Any] = {"torchlens_wrap_s": [], "torchlens_unwrap_s": [], "loadavg_1min": []}
    start = time.perf_counter()
    round_s: list[float] = []
    for rnd in range(plan.warmup + plan.rounds):
        warm = rnd < plan.warmup
        elapsed = time.perf_counter() - start
        next_end = elapsed + (round_s[-1] if round_s else 0.0)
        measured = rnd - plan.warmup
        if not warm and measured >= plan.min_rounds and plan.budget_s and next_end > plan.budget_s:
            break
        extras["loadavg_1min"].append(os.getloadavg()[0])
        first, prev, t0 = len(samples), None, time.perf_counter()
        heavy = warm or not plan.heavy_rounds or measured < plan.heavy_rounds
        active = [v for v in variants if heavy or v.group != "torchlens"]
        for block in _round_blocks(active, rng):
            for s in _run_block(block, extras):
                s.update(round=rnd, warmup=warm, pos=len(samples) - first, prev=prev)
                samples.append(s)
                prev = s["key"]
        round_s.append(time.perf_counter() - t0)
    extras["rounds_phase_s"] = time.perf_counter() - start
    return samples, extras


def _case_info(case: Case) -> dict[str, Any]:
    return {
        "description": case.description,
        "params_m": round(case.n_params / 1e6, 2),
        "leaves": len(case.leaves),
        "selection": case.selection,
        "stop_layer": case.stop_layer,
        "reduce": case.reduce,
    }


def run_timing(model: str, setting: str, plan: Plan, *, peers: str, quick: bool) -> dict[str, Any]:
    """Build the case, time every variant, run the checks; a JSON-ready dict."""
    set_threads()
    t0 = time.perf_counter()
    case = build_case(model, quick=quick)
    keys = CORE_KEYS + tuple(k for k in PEER_KEYS if peers == "all" or k.startswith(peers))
    variants = build_variants(case, keys)
    setup_s = time.perf_counter() - t0
    samples, extras = run_rounds(variants, plan)
    t1 = time.perf_counter()
    checks = run_checks(case, {v.key: v for v in variants})
    extras.update(setup_s=setup_s, checks_s=time.perf_counter() - t1)
    return {
        "kind": "timing",
        "model": model,
        "setting": setting,
        "quick": quick,
        "plan": plan.__dict__,
        "machine": machine_info(),
        "case": _case_info(case),
        "variants": [
            {"key": v.key, "label": v.label, "group": v.group, "floors": list(v.floors)}
            for v in variants
        ],
        "samples": samples,
        "extras": extras,
        "checks": [c.as_dict() for c in checks],
    }
