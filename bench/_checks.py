"""Untimed correctness checks: hookscope's values against the hand-written clone floor."""

from __future__ import annotations

import gc
from dataclasses import asdict, dataclass
from typing import Any

from torch import nn

import hookscope as hs
from _cases import Case
from _trees import storage_bytes, trees_equal
from _variants import Variant

__all__ = ["Check", "run_checks"]


@dataclass
class Check:
    what: str
    value: str
    ok: bool | None = None  # None: informational

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _mib(n: int) -> str:
    return f"{n} B ({n / 2**20:.1f} MiB)"


def _captured(cap: hs.Capture, names: list[str]) -> dict[str, Any]:
    """Latest output of every layer among ``names`` that ran while ``cap`` was open."""
    return {n: cap[n].output for n in names if len(cap[n])}


def _equal_names(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return [n for n in b if n in a and trees_equal(a[n], b[n])]


def _hook_count(model: nn.Module) -> int:
    return sum(
        len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks)
        for m in model.modules()
    )


class _Checker:
    def __init__(self, case: Case, variants: dict[str, Variant]) -> None:
        self.case = case
        self.v = variants
        self.out: list[Check] = []
        self.hand_sel: dict[str, Any] = {}
        self.hand_leaves: dict[str, Any] = {}
        self.overwritten: set[str] = set()

    def add(self, what: str, value: Any, ok: bool | None = None) -> None:
        self.out.append(Check(what, str(value), ok))

    def has(self, *keys: str) -> bool:
        return all(k in self.v for k in keys)

    def call(self, key: str) -> Any:
        return self.v[key].fn()

    def floors(self) -> None:
        self.hand_sel = self.call("hand_sel_clone")[1]
        self.hand_leaves = self.call("hand_leaves_clone")[1]
        n, total = len(self.hand_leaves), len(self.case.leaves)
        self.add("leaf modules that run in one forward (hand hooks)", f"{n} of {total}")
        self.add("hand every-leaf clone: bytes kept", _mib(storage_bytes(self.hand_leaves)))
        if self.has("hand_leaves_detach"):
            detached = self.call("hand_leaves_detach")[1]
            same = set(_equal_names(detached, self.hand_leaves))
            self.overwritten = set(self.hand_leaves) - same
            kinds = sorted(
                {type(dict(self.case.model.named_modules())[n]).__name__ for n in self.overwritten}
            )
            self.add(
                "leaf outputs overwritten in place later in the forward (detach() alone is wrong)",
                f"{len(self.overwritten)} of {n} ({', '.join(kinds) or 'none'})",
            )
            del detached

    def selection(self) -> None:
        if not self.has("hs_sel"):
            return
        cap = self.call("hs_sel")[1]
        got = _captured(cap, self.case.selection)
        eq = _equal_names(got, self.hand_sel)
        ok = len(eq) == len(self.hand_sel) == len(self.case.selection)
        self.add(
            "hs_sel equals the hand clone floor (torch.equal)",
            f"{len(eq)} of {len(self.hand_sel)}",
            ok,
        )

    def leaves_clone(self) -> None:
        if not self.has("hs_leaves_clone"):
            return
        cap = self.call("hs_leaves_clone")[1]
        got = _captured(cap, self.case.leaves)
        eq = _equal_names(got, self.hand_leaves)
        ok = len(eq) == len(self.hand_leaves) == len(got)
        self.add(
            "hs_leaves_clone equals the hand clone floor (torch.equal)",
            f"{len(eq)} of {len(self.hand_leaves)}",
            ok,
        )
        self.add("hs_leaves_clone: bytes kept (distinct storages)", _mib(storage_bytes(got)))
        self.add("hs_leaves_clone: Capture.nbytes", _mib(int(getattr(cap, "nbytes", -1))))

    def leaves_reference(self) -> None:
        if not self.has("hs_leaves_ref"):
            return
        cap = self.call("hs_leaves_ref")[1]
        stale: set[str] = set()
        equal = 0
        for n, want in self.hand_leaves.items():
            try:
                equal += trees_equal(cap[n].output, want)
            except hs.StaleCaptureError:
                stale.add(n)
        ok = equal + len(stale) == len(self.hand_leaves) and (
            not self.has("hand_leaves_detach") or stale == self.overwritten
        )
        self.add(
            "hs_leaves_ref: equal to the clone floor / raise StaleCaptureError on read",
            f"{equal} equal, {len(stale)} stale (expected stale: the in-place overwritten ones)",
            ok,
        )

    def reduced(self) -> None:
        if not self.has("hs_leaves_reduce", "hand_leaves_reduce"):
            return
        hand = self.call("hand_leaves_reduce")[1]
        cap = self.call("hs_leaves_reduce")[1]
        got = _captured(cap, self.case.leaves)
        eq = _equal_names(got, hand)
        ok = len(eq) == len(hand) == len(got)
        self.add(
            f"hs_leaves_reduce ({self.case.reduce}) equals the hand reduce floor",
            f"{len(eq)} of {len(hand)}",
            ok,
        )
        self.add("hs_leaves_reduce: bytes kept", _mib(storage_bytes(got)))

    def early_stop(self) -> None:
        if not self.has("hs_stop"):
            return
        name = self.case.stop_layer
        modules = dict(self.case.model.named_modules())
        ran: list[str] = []
        handles = [
            modules[n].register_forward_pre_hook(lambda m, a, n=n: ran.append(n))
            for n in self.case.leaves
        ]
        try:
            out, cap = self.call("hs_stop")
        finally:
            for h in handles:
                h.remove()
        ok = out is None and trees_equal(cap[name].output, self.hand_sel[name])
        self.add(
            f"hs_stop: output of {name} equals the hand clone floor; model output not produced",
            ok,
            ok,
        )
        self.add(
            "hs_stop: leaf modules that ran before the stop",
            f"{len(ran)} of {len(self.hand_leaves)}",
            len(ran) < len(self.hand_leaves),
        )
        if self.has("hand_stop"):
            hand = self.call("hand_stop")[1]
            self.add(
                "hand_stop: output equals the full-forward clone",
                trees_equal(hand[name], self.hand_sel[name]),
            )

    def nnsight(self) -> None:
        if self.has("nnsight_sel"):
            got = self.call("nnsight_sel")
            eq = _equal_names(got, self.hand_sel)
            self.add(
                "nnsight_sel equals the hand clone floor",
                f"{len(eq)} of {len(self.hand_sel)}",
                len(eq) == len(self.hand_sel),
            )
        if self.has("nnsight_leaves"):
            got = self.call("nnsight_leaves")
            wrong = set(self.hand_leaves) - set(_equal_names(got, self.hand_leaves))
            self.add(
                "nnsight_leaves: saved values that differ from the clone floor "
                "(aliases of tensors overwritten in place)",
                f"{len(wrong)} of {len(self.hand_leaves)}",
                wrong <= self.overwritten,
            )

    def torchlens(self) -> None:
        if not self.has("torchlens_sel"):
            return
        from _peers import torchlens_unwrap, torchlens_wrap

        torchlens_wrap()
        try:
            tracer = self.v["torchlens_sel"].fn
            trace = tracer()
            got = tracer.outputs(trace)  # type: ignore[attr-defined]
            eq = _equal_names(got, self.hand_sel)
            self.add(
                "torchlens_sel equals the hand clone floor",
                f"{len(eq)} of {len(self.hand_sel)}",
                len(eq) == len(self.hand_sel),
            )
            self.add(
                "torchlens_sel: saved_activation_memory", _mib(int(trace.saved_activation_memory))
            )
            del trace
            if self.has("torchlens_all"):
                trace = self.call("torchlens_all")
                self.add("torchlens_all: Trace.num_ops", trace.num_ops)
                self.add(
                    "torchlens_all: saved_activation_memory",
                    _mib(int(trace.saved_activation_memory)),
                )
                del trace
        finally:
            torchlens_unwrap()

    def untouched(self) -> None:
        n = _hook_count(self.case.model)
        self.add("hooks left on the benchmarked model after everything", n, n == 0)


def run_checks(case: Case, variants: dict[str, Variant]) -> list[Check]:
    """Run every check whose variants are present; each one frees its results before the next."""
    checker = _Checker(case, variants)
    steps = [
        checker.floors,
        checker.selection,
        checker.leaves_clone,
        checker.leaves_reference,
        checker.reduced,
        checker.early_stop,
        checker.nnsight,
        checker.torchlens,
        checker.untouched,
    ]
    for step in steps:
        try:
            step()
        except Exception as e:  # report and go on: one broken check must not lose the run
            checker.add(f"check {step.__name__} raised", f"{type(e).__name__}: {e}", False)
        gc.collect()
    return checker.out
