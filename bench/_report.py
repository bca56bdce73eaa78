"""The one renderer: RESULTS.md (or gpu.md) from the workers' JSON and each module's
:class:`~_harness.Target` s; every result is rendered the same way, whatever its module."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from _harness import Ratio, Result, Target, median, paired

DASH = "\u2013"
#: Measurements a sample may carry: (column, scale), in the variant table's order.
FIELDS = {
    "seconds": ("median ms", 1e3),
    "site_us": ("µs per site", 1.0),
    "minflt": ("faults/call", 1.0),
    "peak_mib": ("peak MiB", 1.0),
    "retained_mib": ("retained MiB", 1.0),
}


def merge(results: Iterable[Result]) -> dict[str, Result]:
    """Results by case; several processes of one case (one memory process per variant) merge."""
    out: dict[str, Result] = {}
    for r in results:
        m = out.setdefault(r["case"], {**r, "samples": [], "variants": {}, "values": {}})
        m["samples"] = m["samples"] + r.get("samples", [])
        for key in ("variants", "values", "errors", "skipped"):
            m[key] = {**m.get(key, {}), **r.get(key, {})}
    return out


def evaluate(t: Target, cases: dict[str, Result]) -> Result | None:
    """The target's row as data, or None where its case or variants did not run (a module
    left out by --only, a peer the run did not ask for, the baseline without --baseline)."""
    if (r := cases.get(t.case)) is None:
        return None
    row: Result = {**asdict(t), "title": r.get("title", t.case)}
    if t.denominator is None:
        value = r.get("values", {}).get(t.numerator)
        got = Ratio(value, value, value, 1) if isinstance(value, (int, float)) else None
    else:
        for key in (t.numerator, t.denominator):
            if why := r.get("skipped", {}).get(key) or r.get("errors", {}).get(key):
                return {**row, "verdict": f"not run: `{key}`: {why}"}
        got = paired(r["samples"], t.numerator, t.denominator, t.field)
    if got is None:
        return None
    verdict = "" if t.limit is None else "PASS" if got.median <= t.limit else "**MISS**"
    return {**row, **got._asdict(), "verdict": verdict}


def number(x: Any, field: str = "") -> str:
    if not isinstance(x, float) or field == "minflt":
        return f"{x:,.0f}" if isinstance(x, (int, float)) else str(x)
    return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}" if abs(x) >= 10 else f"{x:.2f}"


def cell(r: Ratio | None) -> str:
    spread = f" [{r.q1:.2f}{DASH}{r.q3:.2f}]" if r and r.n > 1 else ""
    return f"**{r.median:.2f}**{spread}" if r else DASH


def table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table: first two columns left-aligned, the rest right-aligned."""
    marks = ["---" if i < 2 else "---:" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(marks) + "|"]
    return [*lines, *("| " + " | ".join(c.replace("|", "\\|") for c in r) + " |" for r in rows), ""]


def targets_table(rows: list[Result]) -> list[str]:
    body = []
    for row in rows:
        den, field = row["denominator"], row["field"]
        what = f"`{row['numerator']}`" + (f" ÷ `{den}`" if den else "")
        what += f" ({field})" if field != "seconds" else ""
        value = cell(Ratio(row["median"], row["q1"], row["q3"], row["n"])) if "n" in row else DASH
        limit = DASH if row["limit"] is None else f"≤ {row['limit']:.2f}"
        body.append([row["note"], row["title"], what, value, limit, row["verdict"]])
    return table(["target", "case", "measured", f"value [q1{DASH}q3]", "limit", "verdict"], body)


def case_section(r: Result) -> list[str]:
    """A case's variants (medians, ÷ the case's unit, ÷ each one's floor), values and notes."""
    lines, s, unit = [f"### {r.get('title', r['case'])}", ""], r["samples"], r.get("unit", "plain")
    lines += [r["about"], ""] if r.get("about") else []
    fields = [f for f in FIELDS if any(f in x for x in s)]
    if r["variants"]:
        rows = []
        for key, v in r["variants"].items():
            got = {f: median(s, key, f) for f in fields}
            cells = [DASH if x is None else number(x * FIELDS[f][1], f) for f, x in got.items()]
            base = (fields or ["seconds"])[0]
            vs = f"{cell(paired(s, key, v['floor'], base))} `{v['floor']}`" if v["floor"] else DASH
            rows.append([f"`{key}`", v["label"], *cells, cell(paired(s, key, unit, base)), vs])
        header = ["variant", "what is timed", *(FIELDS[f][0] for f in fields), f"÷ `{unit}`"]
        if not any(v["label"] for v in r["variants"].values()):  # gpu.py's: README.md's rows
            header, rows = header[:1] + header[2:], [row[:1] + row[2:] for row in rows]
        lines += table([*header, "÷ floor"], rows)
    if r["values"]:
        lines += table(["measure", "value"], [[k, number(v)] for k, v in r["values"].items()])
    if noise := r.get("noise"):
        n, (lo, hi) = len({x["round"] for x in s if not x["warmup"]}), noise["loadavg"]
        lines.append(
            f"* {n} measured rounds in {noise['rounds_s']:.0f} s; load average "
            f"{lo:.1f}{DASH}{hi:.1f}; steal {noise['steal_ticks']} ticks (10 ms each)."
        )
    lines += [f"* `{k}` not run: {why}" for k, why in r.get("skipped", {}).items()]
    lines += [f"* **`{k}` failed**: {why}" for k, why in r.get("errors", {}).items()]
    if checks := r.get("checks"):
        bad = [c["what"] for c in checks if not c["ok"]]
        said = f"**FAILED**: {'; '.join(bad)}" if bad else "all ok"
        lines.append(f"* checks ({'; '.join(c['what'] for c in checks)}): {said}.")
    return [*lines, ""] if lines[-1] else lines


def run_lines(meta: Result, machine: Result) -> list[str]:
    """Command, machine, versions and baseline of the run that made a section."""
    versions = ", ".join(f"{k} {v}" for k, v in machine.get("versions", {}).items())
    where = machine.get("gpu") or f"{machine.get('cpu', '?')}, {machine.get('cpus', '?')} CPUs"
    lines = [
        f"Command: `{meta.get('command', '?')}`, started {meta.get('started', '?')}, "
        f"{meta.get('total_s', 0) / 60:.1f} min. Machine: {where}, "
        f"{machine.get('memory_gib', '?')} GiB; {machine.get('platform', '?')}; torch threads "
        f"{machine.get('torch_threads', '?')}. Versions: python {machine.get('python', '?')}, "
        f"{versions}; hookscope source sha1 {machine.get('hookscope_sha1', '?')}.",
        "",
    ]
    if bl := meta.get("baseline"):
        got = bl.get("error") or f"commit {bl['commit'][:12]}, source sha1 {bl['sha1']}"
        lines += [f"Baseline `{bl['rev']}`: {got}.", ""]
    quick = "**--quick smoke run: tiny inputs, few rounds. Not measurements.**"
    return lines + ([quick, ""] if meta.get("quick") else [])


def section(
    title: str, targets: list[Target], results: list[Result], meta: Result
) -> tuple[list[Result], list[str]]:
    """(the evaluated targets, the markdown section) of one module's results."""
    cases = merge(r for r in results if r.get("kind") != "error")
    rows = [row for t in targets if (row := evaluate(t, cases)) is not None]
    machine = next((r["machine"] for r in cases.values() if "machine" in r), {})
    lines = [f"## {title}", "", *run_lines(meta, machine)]
    failed = [r for r in results if r.get("kind") == "error"]
    lines += [
        f"**Worker failed** `{r['job']}`:\n\n```\n{r['stderr'][-1500:]}\n```\n" for r in failed
    ]
    lines += targets_table(rows) if rows else []
    return rows, lines + [line for r in cases.values() for line in case_section(r)]


def splice(old: str, title: str, new: list[str]) -> str:
    """``old`` with the sections whose heading starts like ``title`` (up to its first colon)
    replaced by ``new`` where the first of them was, or ``new`` appended."""
    start, kept, at, skipping = "## " + title.split(":")[0], [], None, False
    for line in old.splitlines():
        if line.startswith("## "):
            skipping = line.startswith(start)
            at = len(kept) if skipping and at is None else at
        if not skipping:
            kept.append(line)
    at = len(kept) if at is None else at
    gap = [""] if at and kept[at - 1] else []
    return "\n".join([*kept[:at], *gap, *new, *kept[at:], ""])
