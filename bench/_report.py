"""Write RESULTS.md from the JSON the workers left in the output folder."""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from _cases import MODELS
from _stats import Paired, VariantStats, quartiles, summarise
from _variants import MEMORY_KEYS

__all__ = ["write_report"]


TIMES, DASH, MINUS = "\u00d7", "\u2013", "\u2212"

MODEL_TITLES = {"resnet50": "ResNet-50", "gpt2": "GPT-2"}
SETTING_TITLES = {"tuned": "malloc tuned", "defaults": "glibc defaults"}

FEW_LIMIT = 1.02
LEAF_LIMIT = 1.10
MEM_LIMIT = 1.10
SITE_LIMIT = 2.0
STOP_PLAIN_LIMIT = 0.75
STOP_FLOOR_LIMIT = 1.05


# -- loading -------------------------------------------------------------------------------


@dataclass
class Results:
    timing: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    stats: dict[tuple[str, str], dict[str, VariantStats]] = field(default_factory=dict)
    memory: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    latency: dict[str, Any] | None = None
    profile: dict[str, Any] | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def models(self) -> list[str]:
        return [m for m in MODELS if any(k[0] == m for k in self.timing)]

    def settings(self) -> list[str]:
        return [s for s in SETTING_TITLES if any(k[1] == s for k in self.timing)]

    def vs(self, model: str, setting: str, key: str, base: str) -> Paired | None:
        st = self.stats.get((model, setting), {}).get(key)
        if st is None:
            return None
        return st.vs_plain if base == "plain" else st.vs_floor.get(base)


def _floors_of(timing: dict[str, Any]) -> dict[str, list[str]]:
    floors = {v["key"]: list(v["floors"]) for v in timing["variants"]}
    extra = {"hand_sel_clone": [], "hand_stop": ["plain"]}
    for k, f in extra.items():
        floors.setdefault(k, f)
    return floors


def load(out: Path) -> Results:
    res = Results()
    for path in sorted(out.glob("*.json")):
        data = json.loads(path.read_text())
        kind = data.get("kind")
        if kind == "timing":
            key = (data["model"], data["setting"])
            res.timing[key] = data
            res.stats[key] = summarise(data["samples"], _floors_of(data))
        elif kind == "memory":
            res.memory[(data["model"], data["key"])] = data
        elif kind == "latency":
            res.latency = data
        elif kind == "profile":
            res.profile = data
        elif kind == "error":
            res.errors.append(data)
        elif path.name == "run_meta.json":
            res.meta = data
    return res


# -- formatting ----------------------------------------------------------------------------


def _r(x: float) -> str:
    return f"{x:.2f}"


def _paired(p: Paired | None, *, minmin: bool = True) -> str:
    if p is None:
        return f"{DASH}"
    s = f"**{_r(p.median)}** [{_r(p.q1)}{DASH}{_r(p.q3)}]"
    return s + (f", min/min {_r(p.min_min)}" if minmin else "")


def _table(header: list[str], rows: list[list[str]], align: str | None = None) -> list[str]:
    align = align or "l" + "r" * (len(header) - 1)
    marks = {"l": "---", "r": "---:"}
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(marks[a] for a in align) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]


# -- headline ------------------------------------------------------------------------------


@dataclass
class Target:
    what: str
    model: str
    values: dict[str, Paired | float | None]  # per setting (or "memory"/"latency")
    limit: float
    limit_text: str
    note: str = ""

    def median(self, v: Paired | float | None) -> float | None:
        return v.median if isinstance(v, Paired) else v

    def verdict(self) -> str:
        got = {s: self.median(v) for s, v in self.values.items() if self.median(v) is not None}
        if not got:
            return "n/a"
        fails = [s for s, m in got.items() if m is not None and m > self.limit]
        if not fails:
            return "PASS"
        if len(fails) == len(got):
            return "**MISS**"
        return "**MISS** (" + ", ".join(SETTING_TITLES.get(s, s) for s in fails) + ")"

    def cell(self, setting: str) -> str:
        v = self.values.get(setting)
        if isinstance(v, Paired):
            return _paired(v)
        return f"{DASH}" if v is None else f"**{_r(v)}**"


def _timing_targets(res: Results) -> list[Target]:
    out: list[Target] = []
    specs: list[tuple[str, str, str, float, str]] = [
        (
            "few layers: hs.capture of the selection ÷ plain forward",
            "hs_sel",
            "plain",
            FEW_LIMIT,
            "≤ 1.02",
        ),
        (
            "(reference) hand clone hooks on the selection ÷ plain",
            "hand_sel_clone",
            "plain",
            float("inf"),
            f"{DASH}",
        ),
        (
            "every leaf, clone ÷ hand every-leaf clone floor",
            "hs_leaves_clone",
            "hand_leaves_clone",
            LEAF_LIMIT,
            "≤ 1.10",
        ),
        (
            "every leaf, copy='reference' ÷ hand every-leaf clone floor",
            "hs_leaves_ref",
            "hand_leaves_clone",
            LEAF_LIMIT,
            "≤ 1.10",
        ),
        (
            "every leaf, reduce= ÷ hand every-leaf reduce floor",
            "hs_leaves_reduce",
            "hand_leaves_reduce",
            LEAF_LIMIT,
            "≤ 1.10",
        ),
        (
            "early stop (stop=True) ÷ full plain forward",
            "hs_stop",
            "plain",
            STOP_PLAIN_LIMIT,
            '≤ 0.75 ("well under")',
        ),
        (
            "early stop ÷ hand early-stop floor (same layer)",
            "hs_stop",
            "hand_stop",
            STOP_FLOOR_LIMIT,
            "≤ 1.05",
        ),
    ]
    for model in res.models():
        for what, key, base, limit, text in specs:
            values = {s: res.vs(model, s, key, base) for s in res.settings()}
            out.append(Target(what, model, values, limit, text))  # type: ignore[arg-type]
    return out


def _memory_peak(res: Results, model: str, key: str) -> float | None:
    m = res.memory.get((model, key))
    return None if m is None else float(m["median"]["peak_mib"])


def _memory_targets(res: Results) -> list[Target]:
    out = []
    for model in [m for m in MODELS if (m, "plain") in res.memory]:
        plain, red = _memory_peak(res, model, "plain"), _memory_peak(res, model, "hs_leaves_reduce")
        ratio = red / plain if plain and red is not None else None
        what = "memory: every leaf with reduce= — peak RSS ÷ plain forward's peak"
        out.append(Target(what, model, {"memory": ratio}, MEM_LIMIT, "≤ 1.10"))
    return out


@dataclass
class SiteCost:
    per_site_us: tuple[float, float, float]  # q1, median, q3 over rounds
    per_forward_us: float
    from_minima_us: float  # (fastest variant block - fastest plain block) / sites


def site_costs(lat: dict[str, Any]) -> dict[str, SiteCost]:
    """Per-site cost of every latency variant against the plain forward of the same round."""
    sites = lat["sites"]
    by: dict[str, dict[int, float]] = {}
    for s in lat["samples"]:
        if not s["warmup"]:
            by.setdefault(s["key"], {})[s["round"]] = s["seconds"]
    plain = by["plain"]
    out = {}
    for key, rounds in by.items():
        diffs = [(rounds[r] - plain[r]) / sites * 1e6 for r in rounds if r in plain]
        minima = (min(rounds.values()) - min(plain.values())) / sites * 1e6
        out[key] = SiteCost(quartiles(diffs), statistics.median(rounds.values()) * 1e6, minima)
    return out


def _latency_targets(res: Results) -> list[Target]:
    if res.latency is None:
        return []
    c = site_costs(res.latency)
    noop, clone = c["raw_noop"], c["raw_clone"]
    out = []
    for key, mode in (("hs_clone", "clone"), ("hs_ref", "reference")):
        ratio = c[key].per_site_us[1] / noop.per_site_us[1] if noop.per_site_us[1] > 0 else None
        note = (
            f"(from minima {c[key].from_minima_us / noop.from_minima_us:.2f}; "
            f"÷ raw clone hook {c[key].per_site_us[1] / clone.per_site_us[1]:.2f})"
        )
        what = f"per-site cost, tiny MLP, hs.capture copy='{mode}' ÷ raw no-op hook"
        out.append(Target(what, "tiny MLP", {"latency": ratio}, SITE_LIMIT, "≤ 2", note))
    return out


def headline(res: Results) -> tuple[list[str], list[Target]]:
    targets = _timing_targets(res) + _memory_targets(res) + _latency_targets(res)
    settings = res.settings()
    header = [
        "target",
        "model",
        *(f"{SETTING_TITLES[s]}: {TIMES} [q1{DASH}q3]" for s in settings),
        "other",
        "limit",
        "verdict",
    ]
    rows = []
    for t in targets:
        cells = [t.cell(s) for s in settings]
        other = next((t.cell(k) for k in ("memory", "latency") if k in t.values), f"{DASH}")
        other = f"{other} {t.note}".strip()
        verdict = f"{DASH}" if t.limit == float("inf") else t.verdict()
        rows.append(
            [t.what, MODEL_TITLES.get(t.model, t.model), *cells, other, t.limit_text, verdict]
        )
    return _table(header, rows, "ll" + "r" * (len(header) - 3) + "l"), targets


# -- misses, explained with the data at hand -------------------------------------------------


def _explain_timing(res: Results, t: Target, key: str, base: str) -> str:
    parts = []
    for s, v in t.values.items():
        st = res.stats.get((t.model, s), {})
        if not isinstance(v, Paired) or key not in st or base not in st:
            continue
        a, b = st[key], st[base]
        extra_ms = a.median_ms - b.median_ms
        parts.append(
            f"{SETTING_TITLES[s]}: {a.median_ms:.0f} vs {b.median_ms:.0f} ms median "
            f"({extra_ms:+.0f} ms), minor faults per call {a.faults_median:.0f} vs "
            f"{b.faults_median:.0f}"
        )
    return "; ".join(parts)


def misses(res: Results, targets: list[Target]) -> list[str]:
    lines = ["## Missed targets", ""]
    keys = {
        "few layers": ("hs_sel", "plain"),
        "every leaf, clone": ("hs_leaves_clone", "hand_leaves_clone"),
        "every leaf, copy='reference'": ("hs_leaves_ref", "hand_leaves_clone"),
        "every leaf, reduce=": ("hs_leaves_reduce", "hand_leaves_reduce"),
        "early stop (stop=True)": ("hs_stop", "plain"),
        "early stop ÷ hand": ("hs_stop", "hand_stop"),
    }
    missed = [t for t in targets if t.limit != float("inf") and "MISS" in t.verdict()]
    if not missed:
        return [*lines, "None: every target above is met in this run.", ""]
    for t in missed:
        detail = ""
        for prefix, (key, base) in keys.items():
            if t.what.startswith(prefix):
                detail = _explain_timing(res, t, key, base)
                break
        values = ", ".join(
            f"{SETTING_TITLES.get(s, s)} {_r(t.median(v))}"
            for s, v in t.values.items()
            if t.median(v) is not None  # type: ignore[arg-type]
        )
        lines.append(
            f"* **{MODEL_TITLES.get(t.model, t.model)} — {t.what}**: {values} "
            f"against {t.limit_text}." + (f" Data: {detail}." if detail else "")
        )
    lines += ["", 'See "Why" below for the causes found in this run.', ""]
    return lines


# -- detail sections -----------------------------------------------------------------------


def _faults(x: float) -> str:
    return f"{x / 1000:.0f}k" if x >= 10000 else f"{x:.0f}"


def timing_table(res: Results, model: str, setting: str) -> list[str]:
    data = res.timing[(model, setting)]
    stats = res.stats[(model, setting)]
    header = [
        "variant",
        "what is timed",
        "median ms",
        f"q1{DASH}q3 ms",
        "min ms",
        "first call ms",
        "faults/call",
        f"{TIMES} plain, paired [q1{DASH}q3]",
        "min/min",
        f"vs floor, paired [q1{DASH}q3]",
    ]
    rows = []
    for v in data["variants"]:
        st = stats.get(v["key"])
        if st is None:
            continue
        floors = (
            "; ".join(f"{_paired(p, minmin=False)} {TIMES} `{f}`" for f, p in st.vs_floor.items())
            or f"{DASH}"
        )
        rows.append(
            [
                f"`{v['key']}`",
                v["label"],
                f"{st.median_ms:.0f}",
                f"{st.q1_ms:.0f}{DASH}{st.q3_ms:.0f}",
                f"{st.min_ms:.0f}",
                f"{st.first_ms:.0f}" if st.first_ms else f"{DASH}",
                _faults(st.faults_median),
                _paired(st.vs_plain, minmin=False),
                _r(st.vs_plain.min_min) if st.vs_plain else f"{DASH}",
                floors,
            ]
        )
    ex = data["extras"]
    plain = stats.get("plain")
    n = sorted({s.n for s in stats.values()})
    lines = _table(header, rows, "ll" + "r" * 8)
    lines.append(
        f"* Measured rounds per variant: {n[0]}{DASH}{n[-1]} (+{data['plan']['warmup']} "
        f"warm-up); rounds {ex.get('rounds_phase_s', ex.get('measured_phase_s', 0)):.0f} s; "
        f"checks {ex.get('checks_s', 0):.0f} s."
    )
    if plain:
        lines.append(
            f"* Plain forward: min {plain.min_ms:.0f}, median {plain.median_ms:.0f}, "
            f"max {plain.max_ms:.0f} ms."
        )
    steal = sum(s.steal_ticks for s in stats.values())
    loads = ex.get("loadavg_1min", [])
    load = (
        f"; 1-minute load average at round starts: {min(loads):.1f}{DASH}{max(loads):.1f}"
        if loads
        else ""
    )
    lines.append(
        f"* Hypervisor steal during measured calls: {steal} ticks (10 ms of one CPU each){load}."
    )
    if ex.get("torchlens_wrap_s"):
        w, u = ex["torchlens_wrap_s"], ex["torchlens_unwrap_s"]
        lines.append(
            "* torchlens `wrap_torch()` / `unwrap_torch()` between groups (never timed): "
            f"median {statistics.median(w) * 1e3:.0f} / {statistics.median(u) * 1e3:.0f} ms."
        )
    lines.append("")
    return lines


def checks_list(res: Results, model: str) -> list[str]:
    lines = []
    for setting in res.settings():
        data = res.timing.get((model, setting))
        if not data:
            continue
        lines.append(
            f"Checks, {SETTING_TITLES[setting]} process (untimed, after the timed rounds):"
        )
        lines.append("")
        for c in data["checks"]:
            mark = {True: "ok", False: "**FAILED**", None: "info"}[c["ok"]]
            lines.append(f"* [{mark}] {c['what']}: **{c['value']}**")
        lines.append("")
    return lines


def latency_section(res: Results) -> list[str]:
    lat = res.latency
    if lat is None:
        return []
    c = site_costs(lat)
    n = len({s["round"] for s in lat["samples"] if not s["warmup"]})
    lines = [
        "## Latency-bound case: per-site cost of a capture",
        "",
        f"Model: {lat['model']}; each sample is {lat['calls_per_sample']} forwards under no_grad "
        f"(time per forward = block / {lat['calls_per_sample']}); {n} measured rounds, variants "
        f"shuffled per round. Per-site cost = (variant {MINUS} plain of the same round) / sites, "
        f"median [q1{DASH}q3] over rounds. Steady state: hooks / capture installed once around the "
        "block. Per "
        "call: registered and removed around every forward (setup and teardown included).",
        "",
    ]
    pairs = {
        "hs_clone": ("raw_noop", "raw_clone"),
        "hs_ref": ("raw_noop", "raw_clone"),
        "hs_clone_percall": ("raw_noop_percall", "raw_clone_percall"),
        "hs_ref_percall": ("raw_noop_percall", "raw_clone_percall"),
    }
    header = [
        "variant",
        "what",
        "µs per forward",
        f"µs per site per call, paired [q1{DASH}q3]",
        "same, from minima",
        "÷ raw no-op (minima)",
        "÷ raw clone (minima)",
    ]
    rows = []
    for key, label in lat["labels"].items():
        sc = c[key]
        q1, med, q3 = sc.per_site_us
        noop, clone = pairs.get(key, (None, None))
        ratios = [
            f"{_r(med / c[b].per_site_us[1])} ({_r(sc.from_minima_us / c[b].from_minima_us)})"
            if b
            else DASH
            for b in (noop, clone)
        ]
        cost = DASH if key == "plain" else f"{med:.2f} [{q1:.2f}{DASH}{q3:.2f}]"
        minima = DASH if key == "plain" else f"{sc.from_minima_us:.2f}"
        row = [f"`{key}`", label, f"{sc.per_forward_us:.0f}", cost, minima, *ratios]
        rows.append(row)
    lines += _table(header, rows, "llrrrrr")
    lines.append(
        "Per-call rows divide by the per-call raw rows (both include registration). "
        f'"From minima" = (fastest block of the variant {MINUS} fastest plain block) / sites, '
        "the estimator least hurt by bursts of load from other tenants."
    )
    lines.append("")
    return lines


def _profile_rows(table: list[dict[str, Any]], limit: int) -> list[list[str]]:
    return [
        [
            f"`{r['function']}`",
            str(r["ncalls"]),
            f"{r['tottime_us_per_site_call']:.2f}",
            f"{r['cumtime_us_per_site_call']:.2f}",
            f"{r['share'] * 100:.0f}%",
        ]
        for r in table[:limit]
    ]


def profile_section(res: Results) -> list[str]:
    prof = res.profile
    if prof is None:
        return []
    lines = [
        "## Where hookscope's per-site time goes (cProfile, tiny MLP)",
        "",
        f"{prof['calls']} forwards {TIMES} {prof['sites']} sites, hookscope copy='clone'. Own "
        "time (tottime) and cumulative time per site per forward; share = of all own time in "
        "the profile. cProfile inflates Python code several-fold, so read the split, not the "
        "absolute numbers. For each mode: the top functions overall, then hookscope's own.",
        "",
    ]
    header = ["function", "calls", "own µs/site-call", "cum µs/site-call", "share of own time"]
    for name, title in (
        ("steady", "Steady state (one capture around all forwards)"),
        ("percall", "Per call (`with hs.capture` around every forward)"),
    ):
        lines += [f"{title}, top functions:", ""]
        lines += _table(header, _profile_rows(prof["tables"][name], 10))
        ours = prof["tables"].get(f"{name}_hookscope", [])
        if ours:
            lines += [f"{title}, hookscope functions:", ""]
            lines += _table(header, _profile_rows(ours, 16))
    return lines


def memory_section(res: Results) -> list[str]:
    if not res.memory:
        return []
    lines = [
        "## Memory (fresh process per variant, RSS)",
        "",
        f"Peak = VmHWM {MINUS} baseline after resetting the kernel's peak counter; "
        f"retained = VmRSS {MINUS} "
        "baseline while the result is alive; payload = captured bytes (hookscope: its "
        "`Capture.nbytes`; hand: distinct storages); "
        f"after free = RSS {MINUS} baseline once dropped. "
        "`MALLOC_MMAP_THRESHOLD_=131072`, median of the repeats. In reference mode "
        "`Capture.nbytes` counts a storage once per captured output that aliases it (in "
        "ResNet-50, outputs overwritten in place share storage with later ones), so it exceeds "
        "the distinct bytes; the retained RSS is the real cost.",
        "",
    ]
    header = [
        "model",
        "variant",
        "peak over base MiB",
        f"{TIMES} plain peak",
        "retained MiB",
        "payload MiB",
        "after free MiB",
    ]
    rows = []
    order = {k: i for i, k in enumerate(MEMORY_KEYS)}
    for model, key in sorted(
        res.memory, key=lambda mk: (MODELS.index(mk[0]), order.get(mk[1], 99))
    ):
        med = res.memory[(model, key)]["median"]
        plain = _memory_peak(res, model, "plain")
        ratio = _r(med["peak_mib"] / plain) if plain else f"{DASH}"
        rows.append(
            [
                MODEL_TITLES.get(model, model),
                f"`{key}`",
                f"{med['peak_mib']:.0f}",
                ratio,
                f"{med['retained_mib']:.0f}",
                f"{med['payload_mib']:.1f}",
                f"{med['after_free_mib']:.0f}",
            ]
        )
    lines += _table(header, rows, "llrrrrr")
    return lines


def allocator_section(res: Results) -> list[str]:
    keys = [
        "plain",
        "hand_leaves_clone",
        "hs_leaves_clone",
        "hs_leaves_ref",
        "hand_leaves_reduce",
        "hs_leaves_reduce",
    ]
    rows = []
    for model in res.models():
        for key in keys:
            row = [MODEL_TITLES.get(model, model), f"`{key}`"]
            for s in res.settings():
                st = res.stats.get((model, s), {}).get(key)
                row += (
                    [f"{DASH}", f"{DASH}"]
                    if st is None
                    else [f"{st.median_ms:.0f}", _faults(st.faults_median)]
                )
            rows.append(row)
    header = ["model", "variant"]
    for s in res.settings():
        header += [f"{SETTING_TITLES[s]}: median ms", "faults/call"]
    tuned = res.meta.get("malloc_settings", {}).get("tuned", {})
    setting = ", ".join(f"`{k}={v}`" for k, v in tuned.items())
    return [
        "## Allocator control",
        "",
        "Keeping every activation costs fresh memory, and on CPU the cost of fresh memory is "
        "minor page faults, whose number depends on glibc's heap state (peers-RESULTS measured "
        f"the same every-leaf variant at 1.0{TIMES} and 1.3{TIMES} from allocator state alone). "
        "Each model "
        f"therefore ran in two timing processes: **malloc tuned** ({setting}: freed memory stays "
        "resident, so after warm-up calls reuse pages and fault ~0 times; this isolates what the "
        "library itself costs) with every variant and the peers, and **glibc defaults** "
        "(no MALLOC_* "
        "variables: what users get, faults included) with the hookscope and hand-written variants. "
        "Minor page faults are counted for every call (`getrusage`), so a ratio can be read next "
        "to the faults that drove it. Both processes interleave variants in a shuffled order per "
        "round, so heap state left by one variant falls on all others alike; with glibc "
        "defaults a call's faults still depend on its predecessor (more after the 1-GB "
        "every-leaf variants), and with few rounds one variant can draw those predecessors more "
        "often than its floor: each sample's predecessor and faults are in the JSON.",
        "",
        *_table(header, rows, "ll" + "r" * (len(header) - 2)),
    ]


def _source_hashes(res: Results) -> str:
    runs = [*res.timing.values(), *res.memory.values(), res.latency or {}]
    hashes = {r["machine"]["hookscope_source"]["sha1"] for r in runs if "machine" in r}
    return ", ".join(sorted(hashes)) + (" (changed during the run)" if len(hashes) > 1 else "")


def header_section(res: Results) -> list[str]:
    any_timing = next(iter(res.timing.values()), None)
    m = any_timing["machine"] if any_timing else {}
    v = m.get("versions", {})
    vers = ", ".join(f"{k} {x}" for k, x in v.items())
    meta = res.meta
    lines = [
        "# hookscope capture benchmark",
        "",
        f"Command: `{meta.get('command', 'python bench/run.py')}` — "
        f"run started {meta.get('started', '?')}, "
        f"took {meta.get('total_s', 0) / 60:.1f} min end to end.",
        "",
        f"Machine: {m.get('cpu', '?')}, {m.get('logical_cpus', '?')} logical CPUs, "
        f"{m.get('memory_gib', '?')} GiB RAM, "
        f"CUDA available: {m.get('cuda_available', '?')}; {m.get('platform', '?')}; torch threads "
        f"{m.get('torch_threads', '?')} (interop {m.get('torch_interop_threads', '?')}). "
        "A shared VM: see the noise lines under each table.",
        "",
        f"Versions: python {m.get('python', '?')}, {vers}; hookscope source sha1 "
        f"{_source_hashes(res)} (hash of `src/hookscope/*.py` as imported by each worker).",
        "",
    ]
    if meta.get("quick"):
        lines += [
            "**--quick smoke run: tiny inputs, 2 rounds. These numbers are not measurements.**",
            "",
        ]
    for model in res.models():
        data = next(res.timing[k] for k in res.timing if k[0] == model)
        c = data["case"]
        lines.append(
            f"* **{MODEL_TITLES.get(model, model)}**: {c['description']}; "
            f"{c['params_m']} M parameters, {c['leaves']} leaf modules; "
            f"selection {', '.join(c['selection'][:2])}, ..., {c['selection'][-1]} "
            f"({len(c['selection'])}); early stop at `{c['stop_layer']}`; reduce `{c['reduce']}`."
        )
    lines.append("")
    if res.errors:
        lines += ["**Worker failures in this run:**", ""]
        lines += [
            f"* `{' '.join(e['args'])}`:\n\n```\n{e['stderr'][-1500:]}\n```" for e in res.errors
        ]
        lines.append("")
    return lines


HOW_TO_READ = f"""\
**How to read.** {TIMES} = median over measured rounds of (variant time / baseline time in the same
round, same process, same model and input); in brackets its q1{DASH}q3, i.e. the resolution.
min/min = fastest variant call / fastest baseline call. Ratios within a few percent of 1.0 are
not resolved on this shared 2-core VM; treat a verdict whose q1{DASH}q3 straddles its limit as
noise-bound. Each "measured" column is one timing process (see "Allocator control").
"""

METHOD = """\
## Method

* **Timing** (`_timing.py`): one process per (model, malloc setting); `torch.set_num_threads(2)`,
  eval mode, fixed seeds; forward-only variants under `torch.no_grad()`. Each round calls every
  variant once in a freshly shuffled order; warm-up rounds are discarded. `gc.collect()` runs
  untimed before every call and the call's result (model output plus captured values) is dropped
  untimed after it. Wall time is `time.perf_counter()` around the single call. A time budget
  per process may end its rounds early (never below its minimum round count); one warm-up
  round (every variant's first call) is discarded.
* **Hand-written floors** register their forward hooks at the start of each call and remove them
  at its end, as a library must, and store `out.detach().clone()` (the correct floor),
  `out.detach()` (a speed floor that is wrong for outputs overwritten in place), or the same
  reduction hookscope applies. hookscope runs as `with hs.capture(model, layers, ...): model(x)`,
  capture construction included. Early stop: hookscope `stop=True` on one layer; the hand floor's
  hook stores the clone and raises a private exception caught around the forward.
* **Peers** each get a `copy.deepcopy` of the model: nnsight replaces `forward` on every module it
  wraps, torchlens traces its own copy. nnsight: `NNsight(copy).trace(x)` with `.output.save()` on
  the selected modules (every-leaf: the leaves that run, in execution order, as nnsight requires);
  saves alias live tensors. torchlens 2.x: `torchlens.trace(copy, x, save=tl.module(a) | ...)`
  for the selection and its default (every op saved) for the every-leaf comparison. torchlens
  wraps torch globally, so its variants run as one block per round between `wrap_torch()` and
  `unwrap_torch()` (never timed); everything else runs with torch unwrapped. Peers run only in
  the malloc-tuned process, torchlens only in its first measured rounds (its calls take
  seconds), so the fast variants get more rounds; its ratios pair with those rounds only.
* **Checks** (untimed) compare hookscope's captured tensors with the hand clone floor using
  `torch.equal`, verify reference-mode staleness detection against the outputs that are really
  overwritten in place, that early stop skipped the rest of the forward, and that no hook is left
  on the model.
* **Memory** (`_memory.py`): one fresh process per (model, variant), see its section.
* **Latency** (`_latency.py`) and **profile** (`_profile.py`): the tiny MLP, malloc tuned.
* Raw samples (every call with its round, position, predecessor, faults and steal) are in
  `bench/_out/full/*.json`.
"""


def _why(res: Results, targets: list[Target]) -> list[str]:
    """The causes this run's data can show, written out from the numbers."""
    lines = ["## Why (from this run's data)", ""]
    lat = res.latency
    if lat is not None:
        c = site_costs(lat)
        own_clone = c["hs_clone"].per_site_us[1] - c["raw_clone"].per_site_us[1]
        own_ref = c["hs_ref"].per_site_us[1] - c["raw_noop"].per_site_us[1]
        clone_cost = c["raw_clone"].per_site_us[1] - c["raw_noop"].per_site_us[1]
        noop = c["raw_noop"].per_site_us[1]
        lines.append(
            f"* **hookscope's own cost per site per call** (tiny MLP, steady state, paired "
            f"medians): {own_clone:.1f} µs over a raw clone hook in clone mode, {own_ref:.1f} µs "
            f"over a raw no-op hook in reference mode (from minima: "
            f"{c['hs_clone'].from_minima_us - c['raw_clone'].from_minima_us:.1f} and "
            f"{c['hs_ref'].from_minima_us - c['raw_noop'].from_minima_us:.1f} µs)."
        )
        lines.append(
            f"* **The clone itself** costs {clone_cost:.1f} µs per site here "
            f"({clone_cost / noop:.1f}{TIMES} a raw no-op hook's {noop:.1f} µs), so copy='clone' "
            f"cannot be within 2{TIMES} a *no-op* hook whatever the library does; its fair "
            'floor is the raw clone hook (column "÷ raw clone").'
        )
        for model in res.models():
            data = next(res.timing[k] for k in res.timing if k[0] == model)
            plain = res.stats[next(k for k in res.timing if k[0] == model)].get("plain")
            n = data["case"]["leaves"]
            if plain:
                ms = max(own_clone, own_ref) * n / 1e3
                lines.append(
                    f"* On {MODEL_TITLES[model]}, {n} sites {TIMES} that overhead is about "
                    f"{ms:.1f} ms per forward, {ms / plain.median_ms * 100:.2f}% of its "
                    f"{plain.median_ms:.0f} ms plain forward: far below this machine's timing "
                    "resolution, so every-leaf ratios measure memory traffic (clone copies, page "
                    "faults), not hook overhead."
                )

    def noise_bound(t: Target) -> bool:
        failed = [v for v in t.values.values() if isinstance(v, Paired) and v.median > t.limit]
        return bool(failed) and all(v.min_min <= t.limit for v in failed)

    noisy = [t for t in targets if t.limit != float("inf") and noise_bound(t)]
    for t in noisy:
        cells = "; ".join(
            f"{SETTING_TITLES[s]} median {_r(v.median)} [{_r(v.q1)}{DASH}{_r(v.q3)}], min/min "
            f"{_r(v.min_min)}"
            for s, v in t.values.items()
            if isinstance(v, Paired)
        )
        lines.append(
            f"* **{MODEL_TITLES.get(t.model, t.model)}, {t.what}**: missed on the median, but "
            f"where it missed its min/min is within {t.limit_text} ({cells}): read it next to "
            "the noise lines of that process (load average, steal)."
        )
    prof = res.profile
    if prof and prof["tables"].get("steady_hookscope"):
        top = prof["tables"]["steady_hookscope"][:4]
        names = ", ".join(
            f"`{r['function'].split(' ')[-1]}` {r['tottime_us_per_site_call']:.1f}" for r in top
        )
        lines.append(
            f"* **Hot path** (cProfile, steady state, own µs per site-call under the profiler): "
            f"{names}; see the profile tables above."
        )
    lines.append("")
    return lines


def write_report(out: Path, results_md: Path) -> None:
    res = load(out)
    head, targets = headline(res)
    lines = header_section(res)
    lines += ['## Targets (DESIGN.md "Performance")', "", HOW_TO_READ, *head]
    lines += misses(res, targets)
    lines += latency_section(res)
    lines += profile_section(res)
    lines += memory_section(res)
    lines += allocator_section(res)
    lines += _why(res, targets)
    for model in res.models():
        lines += [f"## {MODEL_TITLES.get(model, model)}: every variant", ""]
        for setting in res.settings():
            if (model, setting) in res.timing:
                lines += [f"### {SETTING_TITLES[setting]}", ""]
                lines += timing_table(res, model, setting)
        lines += checks_list(res, model)
    lines.append(METHOD)
    results_md.parent.mkdir(parents=True, exist_ok=True)
    results_md.write_text("\n".join(lines))
    _write_summary_json(res, targets, out)


def _write_summary_json(res: Results, targets: list[Target], out: Path) -> None:
    summary: dict[str, Any] = {
        "stats": {
            f"{m}/{s}": {k: v.as_dict() for k, v in st.items()} for (m, s), st in res.stats.items()
        },
        "targets": [
            {
                "what": t.what,
                "model": t.model,
                "limit": t.limit,
                "verdict": t.verdict(),
                "values": {
                    s: (v.as_dict() if isinstance(v, Paired) else v) for s, v in t.values.items()
                },
            }
            for t in targets
            if t.limit != float("inf")
        ],
    }
    if res.latency:
        summary["site_costs"] = {k: v.__dict__ for k, v in site_costs(res.latency).items()}
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
