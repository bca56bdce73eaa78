"""Latency-bound case: per-site cost of a hook call when Python overhead dominates.

A tiny MLP (25 x Linear(32, 32) + ReLU = 50 leaf modules, batch 1) runs ``calls`` forwards
per sample under no_grad. Two families of variants:

* steady state: hooks (or one hookscope capture) installed once around the whole block of
  forwards, so the per-forward cost is the hook calls themselves;
* per call: hooks registered and removed (``with hs.capture``) around every single forward,
  i.e. including setup and teardown.

Per-site cost = (variant time per forward - plain time per forward, same round) / 50.
"""

from __future__ import annotations

import gc
import random
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

import hookscope as hs
from _cases import leaf_names, set_threads, tiny_mlp
from _sysinfo import machine_info

__all__ = ["LATENCY_LABELS", "run_latency"]

Hook = Callable[[nn.Module, Any, Any], None]

LATENCY_LABELS = {
    "plain": "model(x), no hooks",
    "raw_noop": "raw register_forward_hook on every site, hook does nothing",
    "raw_clone": "raw register_forward_hook on every site, stores out.detach().clone() in a dict",
    "hs_clone": "hs.capture(model, sites) (copy='clone')",
    "hs_ref": "hs.capture(model, sites, copy='reference')",
    "raw_noop_percall": "raw no-op hooks registered and removed around every forward",
    "raw_clone_percall": "raw clone hooks registered and removed around every forward",
    "hs_clone_percall": "`with hs.capture(model, sites):` around every forward",
    "hs_ref_percall": "`with hs.capture(model, sites, copy='reference'):` around every forward",
}


def _noop_hook(name: str, store: dict[str, Any]) -> Hook:
    def hook(module: nn.Module, args: Any, out: Any) -> None:
        return None

    return hook


def _clone_hook(name: str, store: dict[str, Any]) -> Hook:
    def hook(module: nn.Module, args: Any, out: Tensor) -> None:
        store[name] = out.detach().clone()

    return hook


def _raw_hooks(
    model: nn.Module, sites: list[str], make: Callable[[str, dict[str, Any]], Hook]
) -> tuple[dict[str, Any], Callable[[], None]]:
    modules = dict(model.named_modules())
    store: dict[str, Any] = {}
    handles = [modules[n].register_forward_hook(make(n, store)) for n in sites]

    def remove() -> None:
        for h in handles:
            h.remove()

    return store, remove


def _block(model: nn.Module, x: Tensor, sites: list[str], key: str, calls: int) -> Any:
    """Run ``calls`` forwards the way variant ``key`` does; return what it kept."""
    kept: Any = None
    if key == "plain":
        for _ in range(calls):
            kept = model(x)
    elif key in ("raw_noop", "raw_clone"):
        kept, remove = _raw_hooks(model, sites, _noop_hook if key == "raw_noop" else _clone_hook)
        try:
            for _ in range(calls):
                model(x)
        finally:
            remove()
    elif key in ("hs_clone", "hs_ref"):
        copy = "clone" if key == "hs_clone" else "reference"
        with hs.capture(model, sites, copy=copy) as kept:
            for _ in range(calls):
                model(x)
    elif key in ("raw_noop_percall", "raw_clone_percall"):
        make = _noop_hook if key == "raw_noop_percall" else _clone_hook
        for _ in range(calls):
            kept, remove = _raw_hooks(model, sites, make)
            try:
                model(x)
            finally:
                remove()
    elif key in ("hs_clone_percall", "hs_ref_percall"):
        copy = "clone" if key == "hs_clone_percall" else "reference"
        for _ in range(calls):
            with hs.capture(model, sites, copy=copy) as kept:
                model(x)
    else:
        raise ValueError(key)
    return kept


def run_latency(rounds: int, warmup: int, calls: int) -> dict[str, Any]:
    """Interleaved shuffled rounds; each sample is the mean time of one forward in a block."""
    set_threads()
    model = tiny_mlp()
    sites = leaf_names(model)
    x = torch.randn(1, 32)
    keys = list(LATENCY_LABELS)
    rng = random.Random(0)
    samples: list[dict[str, Any]] = []
    with torch.no_grad():
        for rnd in range(warmup + rounds):
            rng.shuffle(keys)
            for pos, key in enumerate(keys):
                gc.collect()
                t0 = time.perf_counter()
                kept = _block(model, x, sites, key, calls)
                dt = time.perf_counter() - t0
                del kept
                samples.append(
                    {
                        "key": key,
                        "round": rnd,
                        "warmup": rnd < warmup,
                        "pos": pos,
                        "seconds": dt / calls,
                    }
                )
    return {
        "kind": "latency",
        "machine": machine_info(),
        "model": f"tiny MLP: 25 x (Linear(32, 32), ReLU), batch 1, {len(sites)} capture sites",
        "sites": len(sites),
        "calls_per_sample": calls,
        "labels": LATENCY_LABELS,
        "samples": samples,
    }
