"""Summaries of timing samples: medians, quartiles, paired per-round ratios, min/min."""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Paired", "VariantStats", "paired", "paired_diff", "quartiles", "summarise"]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    """(q1, median, q3); a single value repeats itself."""
    if len(xs) == 1:
        return xs[0], xs[0], xs[0]
    q1, med, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    return q1, med, q3


@dataclass(frozen=True)
class Paired:
    """Ratio of a variant to a baseline: median over rounds of the same-round ratio."""

    median: float
    q1: float
    q3: float
    min_min: float  # fastest variant call / fastest baseline call
    rounds: int

    def as_dict(self) -> dict[str, float]:
        return self.__dict__.copy()


def _per_round(samples: list[dict[str, Any]], key: str) -> dict[int, float]:
    return {s["round"]: s["seconds"] for s in samples if s["key"] == key and not s["warmup"]}


def paired(samples: list[dict[str, Any]], key: str, base: str) -> Paired | None:
    """Same-round ratios ``key / base`` over the measured rounds where both ran."""
    a, b = _per_round(samples, key), _per_round(samples, base)
    rounds = sorted(set(a) & set(b))
    if not rounds:
        return None
    q1, med, q3 = quartiles([a[r] / b[r] for r in rounds])
    return Paired(med, q1, q3, min(a.values()) / min(b.values()), len(rounds))


def paired_diff(
    samples: list[dict[str, Any]], key: str, base: str
) -> tuple[float, float, float] | None:
    """(q1, median, q3) of same-round differences ``key - base`` in seconds."""
    a, b = _per_round(samples, key), _per_round(samples, base)
    rounds = sorted(set(a) & set(b))
    return quartiles([a[r] - b[r] for r in rounds]) if rounds else None


@dataclass
class VariantStats:
    key: str
    n: int
    median_ms: float
    q1_ms: float
    q3_ms: float
    min_ms: float
    max_ms: float
    first_ms: float | None
    faults_median: float
    steal_ticks: int
    vs_plain: Paired | None
    vs_floor: dict[str, Paired] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k not in ("vs_plain", "vs_floor")}
        d["vs_plain"] = self.vs_plain.as_dict() if self.vs_plain else None
        d["vs_floor"] = {k: p.as_dict() for k, p in self.vs_floor.items()}
        return d


def summarise(
    samples: list[dict[str, Any]], floors: dict[str, list[str]], base: str = "plain"
) -> dict[str, VariantStats]:
    """Per-variant statistics over the measured rounds (``floors``: key -> floor keys)."""
    by_key: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for s in samples:
        by_key[s["key"]].append(s)
    out: dict[str, VariantStats] = {}
    for key, ss in by_key.items():
        measured = [s for s in ss if not s["warmup"]]
        if not measured:
            continue
        ms = [s["seconds"] * 1e3 for s in measured]
        q1, med, q3 = quartiles(ms)
        first = [s["seconds"] * 1e3 for s in ss if s["warmup"] and s["round"] == 0]
        stats = VariantStats(
            key=key,
            n=len(ms),
            median_ms=med,
            q1_ms=q1,
            q3_ms=q3,
            min_ms=min(ms),
            max_ms=max(ms),
            first_ms=first[0] if first else None,
            faults_median=statistics.median(s.get("minflt", 0) for s in measured),
            steal_ticks=sum(s.get("steal", 0) for s in measured),
            vs_plain=paired(samples, key, base),
        )
        for floor in floors.get(key, []):
            p = paired(samples, key, floor)
            if p is not None:
                stats.vs_floor[floor] = p
        out[key] = stats
    return out
