"""Where hookscope's per-site time goes: cProfile of the latency-bound tiny model.

Profiles ``calls`` forwards of the tiny MLP (50 capture sites) inside one hookscope capture
(steady state) and with a capture opened around every forward, and lists the functions with
the most own time, normalised to microseconds per site per forward. cProfile slows Python
code down several-fold, so read the split, not the absolute numbers.
"""

from __future__ import annotations

import cProfile
import pstats
from pathlib import Path
from typing import Any

import torch

import hookscope as hs
from _cases import leaf_names, set_threads, tiny_mlp

__all__ = ["run_profile"]

_TOP = 14


def _where(key: tuple[str, int, str]) -> str:
    file, line, func = key
    if file == "~":  # C builtins
        return func
    path = Path(file)
    parts = path.parts
    short = "/".join(parts[parts.index("hookscope") :]) if "hookscope" in parts else path.name
    return f"{short}:{line} {func}"


def _top(profile: cProfile.Profile, site_calls: int, *, ours: bool) -> list[dict[str, Any]]:
    """The top functions by own time (``ours``: every hookscope function instead)."""
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    chosen = [kv for kv in rows if "hookscope" in kv[0][0]] if ours else rows[:_TOP]
    return [
        {
            "function": _where(key),
            "ncalls": nc,
            "tottime_us_per_site_call": tt / site_calls * 1e6,
            "cumtime_us_per_site_call": ct / site_calls * 1e6,
            "share": tt / total,
        }
        for key, (cc, nc, tt, ct, _callers) in chosen
    ]


def run_profile(calls: int) -> dict[str, Any]:
    set_threads()
    model = tiny_mlp()
    sites = leaf_names(model)
    x = torch.randn(1, 32)
    out: dict[str, Any] = {"kind": "profile", "sites": len(sites), "calls": calls, "tables": {}}
    with torch.no_grad():
        for _ in range(20):  # warm-up outside the profile
            with hs.capture(model, sites):
                model(x)
        steady = cProfile.Profile()
        with hs.capture(model, sites):
            steady.enable()
            for _ in range(calls):
                model(x)
            steady.disable()
        percall = cProfile.Profile()
        percall.enable()
        for _ in range(calls):
            with hs.capture(model, sites):
                model(x)
        percall.disable()
    site_calls = calls * len(sites)
    for name, prof in (("steady", steady), ("percall", percall)):
        out["tables"][name] = _top(prof, site_calls, ours=False)
        out["tables"][f"{name}_hookscope"] = _top(prof, site_calls, ours=True)
    return out
