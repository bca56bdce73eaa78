"""Every timed variant: the plain forward, hand-written hook floors, hookscope, and peers.

A variant is a zero-argument callable that runs one forward of the case's model with some
capture around it and returns everything it produced (model output and captured values), so
the timing loop can drop the result outside the timed region. Hand-written hooks are
registered at the start of each call and removed at its end, as a capture library must.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

import hookscope as hs
from _cases import Case
from _trees import map_tensors

__all__ = [
    "ALL_KEYS",
    "CORE_KEYS",
    "MEMORY_KEYS",
    "PEER_KEYS",
    "Variant",
    "build_variants",
    "hand_capture",
    "hand_reducer",
    "hs_capture",
    "run_order",
]

#: Variants that need only torch, the model and hookscope (run in every timing process).
CORE_KEYS = (
    "plain",
    "hand_sel_clone",
    "hs_sel",
    "hand_leaves_detach",
    "hand_leaves_clone",
    "hs_leaves_clone",
    "hs_leaves_ref",
    "hand_leaves_reduce",
    "hs_leaves_reduce",
    "hand_stop",
    "hs_stop",
)
#: Peer tools, on deep copies of the model (run in the main timing process only).
PEER_KEYS = ("nnsight_sel", "nnsight_leaves", "torchlens_sel", "torchlens_all")
ALL_KEYS = CORE_KEYS + PEER_KEYS
#: Variants measured for memory, each in a fresh process.
MEMORY_KEYS = (
    "plain",
    "hand_sel_clone",
    "hs_sel",
    "hand_leaves_clone",
    "hs_leaves_clone",
    "hs_leaves_ref",
    "hand_leaves_reduce",
    "hs_leaves_reduce",
)


@dataclass(frozen=True)
class Variant:
    """One timed call.

    Attributes:
        key: short id used in the JSON and the tables.
        label: what exactly is timed.
        fn: runs one call, returns everything it produced.
        group: ``"torchlens"`` for variants that need torch wrapped by torchlens (they run
            as one block per round between ``wrap_torch`` and ``unwrap_torch``).
        floors: keys of the variants this one is also compared with (paired, same round).
    """

    key: str
    label: str
    fn: Callable[[], Any]
    group: str = "main"
    floors: tuple[str, ...] = ()


class _StopHere(Exception):
    """Raised by the hand-written early-stop hook; caught by :func:`hand_capture`."""


def hand_capture(
    model: nn.Module,
    names: list[str],
    store: Callable[[Tensor], Any],
    call: Callable[[], Any],
    *,
    stop_after: str | None = None,
) -> tuple[Any, dict[str, Any]]:
    """The floor: plain forward hooks storing ``store(output)`` per name, under no_grad.

    Hooks are registered here and removed before returning. With ``stop_after`` the hook on
    that layer raises to end the forward once it has stored its value.
    """
    modules = dict(model.named_modules())
    kept: dict[str, Any] = {}

    def make_hook(name: str) -> Callable[[nn.Module, Any, Any], None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            kept[name] = map_tensors(store, output)
            if name == stop_after:
                raise _StopHere

        return hook

    handles = [modules[n].register_forward_hook(make_hook(n)) for n in names]
    out = None
    try:
        with torch.no_grad():
            out = call()
    except _StopHere:
        pass
    finally:
        for handle in handles:
            handle.remove()
    return out, kept


def hs_capture(case: Case, names: list[str], **options: Any) -> tuple[Any, hs.Capture]:
    """``with hs.capture(model, names, **options): model(x)`` under no_grad."""
    out = None
    with torch.no_grad(), hs.capture(case.model, names, **options) as cap:
        out = case.forward()
    return out, cap


def _detach(t: Tensor) -> Tensor:
    return t.detach()


def _clone(t: Tensor) -> Tensor:
    return t.detach().clone()


def hand_reducer(kind: str) -> Callable[[Tensor], Tensor]:
    """The hand-written equivalent of hookscope's named ``reduce=`` (copies like it does)."""
    dims: Callable[[Tensor], tuple[int, ...]]
    if kind == "spatial_mean":
        dims = lambda t: tuple(range(2, t.ndim))  # noqa: E731
    elif kind == "token_mean":
        dims = lambda t: (1,)  # noqa: E731
    else:
        raise ValueError(f"no hand reducer for {kind!r}")

    def reduce(t: Tensor) -> Tensor:
        t = t.detach()
        return t.mean(dim=dims(t)) if t.ndim > 2 else t.clone()

    return reduce


def run_order(case: Case, names: list[str]) -> list[str]:
    """The names among ``names`` whose modules run in a forward, in the order they finish."""
    seen: list[str] = []
    modules = dict(case.model.named_modules())
    handles = [modules[n].register_forward_hook(lambda m, a, o, n=n: seen.append(n)) for n in names]
    try:
        with torch.no_grad():
            case.forward()
    finally:
        for handle in handles:
            handle.remove()
    return list(dict.fromkeys(seen))


# -- builders ------------------------------------------------------------------------------


class _Builder:
    """Builds the variants of one case, sharing the peers' model copies between them."""

    def __init__(self, case: Case) -> None:
        self.case = case
        self._copies: dict[str, nn.Module] = {}

    def copy_for(self, tool: str) -> nn.Module:
        if tool not in self._copies:
            self._copies[tool] = copy.deepcopy(self.case.model)
        return self._copies[tool]

    def build(self, key: str) -> Variant:
        return getattr(self, f"_{key}")()  # type: ignore[no-any-return]

    # plain and hand-written floors
    def _plain(self) -> Variant:
        c = self.case

        def plain() -> Any:
            with torch.no_grad():
                return c.forward()

        return Variant("plain", "model(x) under no_grad", plain)

    def _hand(self, key: str, label: str, names: list[str], store: Callable[..., Any]) -> Variant:
        c = self.case
        return Variant(key, label, lambda: hand_capture(c.model, names, store, c.forward))

    def _hand_sel_clone(self) -> Variant:
        n = len(self.case.selection)
        label = f"hand forward hooks on the {n} selected modules, store out.detach().clone()"
        return self._hand("hand_sel_clone", label, self.case.selection, _clone)

    def _hand_leaves_detach(self) -> Variant:
        label = (
            f"hand hooks on all {len(self.case.leaves)} leaf modules, store out.detach() "
            "(speed floor only: wrong where a later op writes in place)"
        )
        return self._hand("hand_leaves_detach", label, self.case.leaves, _detach)

    def _hand_leaves_clone(self) -> Variant:
        label = (
            f"hand hooks on all {len(self.case.leaves)} leaf modules, store out.detach().clone()"
        )
        return self._hand("hand_leaves_clone", label, self.case.leaves, _clone)

    def _hand_leaves_reduce(self) -> Variant:
        r = self.case.reduce
        label = (
            f"hand hooks on all {len(self.case.leaves)} leaf modules, store the {r} of the output"
        )
        return self._hand("hand_leaves_reduce", label, self.case.leaves, hand_reducer(r))

    def _hand_stop(self) -> Variant:
        c = self.case
        label = f"hand hook on {c.stop_layer}: store clone, raise to end the forward there"

        def stop() -> Any:
            return hand_capture(c.model, [c.stop_layer], _clone, c.forward, stop_after=c.stop_layer)

        return Variant("hand_stop", label, stop)

    # hookscope
    def _hs(
        self, key: str, label: str, names: list[str], floors: tuple[str, ...], **options: Any
    ) -> Variant:
        c = self.case
        return Variant(key, label, lambda: hs_capture(c, names, **options), floors=floors)

    def _hs_sel(self) -> Variant:
        label = f"hs.capture(model, [{len(self.case.selection)} selected modules])"
        return self._hs("hs_sel", label, self.case.selection, ("hand_sel_clone",))

    def _hs_leaves_clone(self) -> Variant:
        label = f"hs.capture(model, [all {len(self.case.leaves)} leaves]) (copy='clone')"
        return self._hs("hs_leaves_clone", label, self.case.leaves, ("hand_leaves_clone",))

    def _hs_leaves_ref(self) -> Variant:
        label = f"hs.capture(model, [all {len(self.case.leaves)} leaves], copy='reference')"
        floors = ("hand_leaves_clone", "hand_leaves_detach")
        return self._hs("hs_leaves_ref", label, self.case.leaves, floors, copy="reference")

    def _hs_leaves_reduce(self) -> Variant:
        r = self.case.reduce
        label = f"hs.capture(model, [all {len(self.case.leaves)} leaves], reduce='{r}')"
        return self._hs(
            "hs_leaves_reduce", label, self.case.leaves, ("hand_leaves_reduce",), reduce=r
        )

    def _hs_stop(self) -> Variant:
        label = f"hs.capture(model, ['{self.case.stop_layer}'], stop=True)"
        return self._hs("hs_stop", label, [self.case.stop_layer], ("hand_stop",), stop=True)

    # peers
    def _nnsight_sel(self) -> Variant:
        from _peers import NnsightSaver

        saver = NnsightSaver(self.case, self.copy_for("nnsight"), self.case.selection)
        n = len(self.case.selection)
        label = f"NNsight(copy).trace(x): .output.save() of the {n} selected modules"
        return Variant("nnsight_sel", label, saver, floors=("hs_sel",))

    def _nnsight_leaves(self) -> Variant:
        from _peers import NnsightSaver

        ran = run_order(self.case, self.case.leaves)
        saver = NnsightSaver(self.case, self.copy_for("nnsight"), ran)
        label = (
            f"NNsight(copy).trace(x): .output.save() of the {len(ran)} leaves that run, "
            "in execution order (saves alias live tensors, no copy)"
        )
        return Variant("nnsight_leaves", label, saver, floors=("hs_leaves_ref",))

    def _torchlens_sel(self) -> Variant:
        from _peers import TorchlensTracer

        tracer = TorchlensTracer(self.case, self.copy_for("torchlens"), self.case.selection)
        n = len(self.case.selection)
        label = f"torchlens.trace(copy, x, save=tl.module(a) | tl.module(b) | ...): {n} modules"
        return Variant("torchlens_sel", label, tracer, group="torchlens", floors=("hs_sel",))

    def _torchlens_all(self) -> Variant:
        from _peers import TorchlensTracer

        tracer = TorchlensTracer(self.case, self.copy_for("torchlens"), None)
        label = (
            "torchlens.trace(copy, x): every op's output saved (its default; all leaves and more)"
        )
        return Variant(
            "torchlens_all", label, tracer, group="torchlens", floors=("hs_leaves_clone",)
        )


def build_variants(case: Case, keys: tuple[str, ...] | list[str]) -> list[Variant]:
    """The variants named by ``keys``, in that order."""
    builder = _Builder(case)
    return [builder.build(k) for k in keys]
