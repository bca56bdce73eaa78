"""The report's findings: what a reader should look at first (non-finite values, dead units,
gradient norms spanning orders of magnitude, where the FLOPs go), each naming its layers with
their types and saying on how many inputs it was seen."""

from __future__ import annotations

import html
import math
from typing import Any

from ..errors import NonFiniteError
from ..look import Summary

__all__ = ["DEAD", "Finding", "by_kind", "code", "findings", "findings_html"]


def by_kind(records: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {r["layer"]: r for r in records if r["kind"] == kind}


#: When a channel is dead, in the words of the table's caption and of the finding: the
#: Monitor gives ``dead`` for the activations that can have them, and only there
#: (``diagnose/_dead.py``)
DEAD = (
    "every output at 0 for a ReLU, at a bound for ReLU6 or Hardtanh, saturated for Tanh or Sigmoid"
)


Finding = tuple[bool, str]
"""``(is a warning, html)``: what a reader should look at first."""


def code(name: str, types: dict[str, str] | None = None) -> str:
    shown = f"<code>{html.escape(name or '(model)')}</code>"
    if types is not None and name in types:
        shown += f" ({html.escape(types[name])})"
    return shown


def findings(
    shape: Summary,
    records: list[dict[str, Any]],
    nonfinite_found: list[NonFiniteError],
    n: int,
    types: dict[str, str],
) -> list[Finding]:
    found: list[Finding] = []
    for error in nonfinite_found[:3]:
        op = f" (operator <code>{html.escape(error.op)}</code>)" if error.op else ""
        found.append(
            (True, f"First non-finite value in the {error.phase}: {code(error.module)}{op}.")
        )
    acts, grads = by_kind(records, "activation"), by_kind(records, "gradient")
    bad = [
        (n_, int(r["nonfinite"])) for t in (acts, grads) for n_, r in t.items() if r["nonfinite"]
    ]
    if bad:
        where = "; ".join(f"{code(k, types)}: {c:,} values" for k, c in bad[:5])
        found.append(
            (
                True,
                f"Non-finite values (NaN/Inf) in the watched layers' outputs or gradients: "
                f"{where}.",
            )
        )
    found += _dead(acts, n, types)
    found += _gradient_span(grads, types)
    found += _flops_share(shape, types)
    if not any(warn for warn, _ in found):
        found.insert(
            0, (False, "No dead units, no non-finite values, no exploding or vanishing gradients.")
        )
    return found


def _dead(acts: dict[str, dict[str, Any]], n: int, types: dict[str, str]) -> list[Finding]:
    """From the same ``dead`` values as the statistics table (a layer that has none has no
    dead units to speak of)."""
    dead = sorted(((r["dead"], k) for k, r in acts.items() if r.get("dead", 0) > 0), reverse=True)
    if not dead:
        return []
    where = "; ".join(f"{code(k, types)}: {100 * d:.0f} % of its channels" for d, k in dead[:5])
    small = (
        f" With only {n} input(s), a unit can be silent here and active on other data: check "
        "on a larger batch before pruning."
        if n < 64
        else ""
    )
    return [
        (
            True,
            f"Dead units, channels through which no gradient passed on any of the {n} "
            f"input(s) ({DEAD}): {where}.{small}",
        )
    ]


def _gradient_span(grads: dict[str, dict[str, Any]], types: dict[str, str]) -> list[Finding]:
    norms = {k: r["norm"] for k, r in grads.items() if math.isfinite(r["norm"])}
    if not norms:
        return []
    hi, lo = max(norms, key=norms.__getitem__), min(norms, key=norms.__getitem__)
    span = math.log10(norms[hi] / norms[lo]) if norms[lo] > 0 else math.inf
    ends = f"{norms[hi]:.3g} at {code(hi, types)} to {norms[lo]:.3g} at {code(lo, types)}"
    if span >= 3 or norms[lo] < 1e-8 or norms[hi] > 1e3:
        return [
            (
                True,
                f"Gradient norms span {span:.1f} orders of magnitude: {ends} (exploding or "
                "vanishing?).",
            )
        ]
    return [(False, f"Gradient norms stay within {span:.1f} orders of magnitude: {ends}.")]


def _flops_share(shape: Summary, types: dict[str, str]) -> list[Finding]:
    leaves_ = [r for i, r in enumerate(shape.rows) if not any(c.parent == i for c in shape.rows)]
    top = sorted(leaves_, key=lambda r: r.flops, reverse=True)[:3]
    if not shape.total_flops or not top or not top[0].flops:
        return []
    share = "; ".join(
        f"{code(r.name, types)}: {_share(r.flops / shape.total_flops)}" for r in top if r.flops
    )
    return [(False, f"Layers with the largest share of the {shape.total_flops:,} FLOPs: {share}.")]


def _share(fraction: float) -> str:
    return "&lt; 1 %" if fraction < 0.005 else f"{100 * fraction:.0f} %"


def findings_html(found: list[Finding]) -> str:
    items = "".join(f'<li class="{"warn" if w else "ok"}">{t}</li>' for w, t in found)
    return f"<ul>{items}</ul>"
