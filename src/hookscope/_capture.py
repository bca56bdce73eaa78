"""``capture``: record the inputs, outputs and gradients of selected layers, per call."""

from __future__ import annotations

import functools
import inspect
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

from . import _tree
from ._lifetime import HookSet
from ._records import Call, LayerRecord
from ._session import Session
from ._types import CopyMode, Inputs, Keep, LayerSelector, Path, Reduce, ReduceFn
from .errors import CaptureBudgetError

__all__ = [
    "Capture",
    "StopForward",
    "bind_inputs",
    "capture",
    "signature_of",
    "unbind_inputs",
    "why_no_grad",
]

_REDUCERS: dict[str, ReduceFn] = {
    "spatial_mean": lambda t: t.mean(dim=tuple(range(2, t.ndim))) if t.ndim > 2 else t,
    "token_mean": lambda t: t.mean(dim=1) if t.ndim > 2 else t,
    "batch_mean": lambda t: t.mean(dim=0) if t.ndim > 0 else t,
}


class StopForward(BaseException):
    """Raised by the last needed hook to end the forward early; caught by its own capture.

    A BaseException, like KeyboardInterrupt, so ``except Exception`` in model code cannot
    swallow it.
    """

    def __init__(self, owner: object) -> None:
        super().__init__("hookscope stopped the forward early (stop=True)")
        self.owner = owner


def why_no_grad() -> str:
    """Why a tensor produced right now cannot have a gradient."""
    if torch.is_inference_mode_enabled():
        return "the forward ran under torch.inference_mode()"
    if not torch.is_grad_enabled():
        return "the forward ran with gradients disabled (torch.no_grad())"
    return (
        "nothing upstream of it requires grad (the inputs have requires_grad=False and no "
        "parameter before this point requires grad)"
    )


def bind_inputs(
    sig: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> Inputs:
    """Name a call's arguments after ``forward``'s parameters (``arg0``... if unbindable)."""
    if sig is not None:
        try:
            return dict(sig.bind(*args, **kwargs).arguments)
        except TypeError:
            pass
    return {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}


def unbind_inputs(
    sig: inspect.Signature | None, args: tuple[Any, ...], kwargs: dict[str, Any], new: Inputs
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the same call with the named arguments replaced by ``new``."""
    if sig is not None:
        try:
            bound = sig.bind(*args, **kwargs)
        except TypeError:
            pass
        else:
            bound.arguments.update(new)
            return bound.args, bound.kwargs
    new_args = tuple(new.get(f"arg{i}", a) for i, a in enumerate(args))
    return new_args, {k: new.get(k, v) for k, v in kwargs.items()}


def signature_of(module: nn.Module) -> inspect.Signature | None:
    try:
        return inspect.signature(module.forward)
    except (TypeError, ValueError):
        return None


class _Site:
    """Per-layer state of one capture."""

    __slots__ = ("done_in", "module", "name", "open_calls", "record", "signature", "used_in")

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.record = LayerRecord(name, type(module).__name__)
        self.signature: inspect.Signature | None = None  # set in open() when inputs are needed
        self.open_calls: list[Call] = []  # calls whose forward is running (stack: recursion)
        self.used_in = -2  # the last pass in which this layer started a call
        self.done_in = -2  # the last pass in which it finished one (for stop=True)


class Capture(Session):
    """Record selected layers' outputs (and inputs, gradients) for every call.

    Use as a context manager; hooks exist only inside the ``with`` block and are removed on
    every exit path. Records stay readable afterwards.

    Args:
        model: the model; DataParallel / DDP / torch.compile wrappers are seen through.
        layers: names, globs (``"encoder.layer.*.output"``; ``*`` stays within a dotted
            segment, ``**`` crosses dots), compiled regexes (full match), module types,
            module objects, predicates, or a list mixing them.
        inputs: also record each call's inputs, bound to ``forward``'s parameter names.
        grads: also record gradients w.r.t. outputs and inputs (taken with tensor hooks).
        copy: ``"clone"`` (default) stores detached copies; ``"reference"`` stores the live
            tensors (no copy) and raises StaleCaptureError on read if they were changed
            in place later.
        device: move captured tensors there (CUDA -> CPU goes to pinned memory, non-blocking).
        reduce: applied to each captured tensor at capture time: ``"spatial_mean"``
            (N, C, ...) -> (N, C), ``"token_mean"`` (N, T, D) -> (N, D), ``"batch_mean"``,
            or any function.
        keep: which calls to keep: ``"pass"`` (default: every call of the latest forward),
            ``"all"``, ``"last"``, or an int N (ring of the last N calls).
        max_bytes: raise CaptureBudgetError before the stored bytes would exceed this.
        stop: end the forward as soon as every selected layer has run (in execution order);
            the ``with`` block then exits quietly.
        detach: ``False`` keeps captured values attached to the autograd graph (a
            differentiable clone), e.g. for feature losses in training.
        recompile: allow hooking a ``torch.compile``d model that already ran, by
            recompiling it (otherwise CompiledModelError).

    ``cap["layer"]`` is then a :class:`LayerRecord`.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
        >>> with hs.capture(model, "0") as cap:
        ...     _ = model(torch.ones(2, 3))
        >>> cap["0"].output.shape
        torch.Size([2, 4])
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        inputs: bool = False,
        grads: bool = False,
        copy: CopyMode = "clone",
        device: torch.device | str | None = None,
        reduce: Reduce | None = None,
        keep: Keep = "pass",
        max_bytes: int | None = None,
        stop: bool = False,
        detach: bool = True,
        recompile: bool = False,
    ) -> None:
        _check_options(copy, keep, max_bytes, reduce, stop, grads)
        super().__init__(model, recompile=recompile)
        self._sites = {n: _Site(n, m) for n, m in self._layers.select(layers).items()}
        self.records: dict[str, LayerRecord] = {n: s.record for n, s in self._sites.items()}
        self._inputs, self._grads, self._copy, self._keep = inputs, grads, copy, keep
        self._ring = 1 if keep == "last" else keep if isinstance(keep, int) else None
        self._device = torch.device(device) if device is not None else None
        self._reduce = _REDUCERS[reduce] if isinstance(reduce, str) else reduce
        self._max_bytes, self._stop = max_bytes, stop
        self._detach = detach
        self.nbytes = 0
        self._pass = -1
        self._remaining = len(self._sites)  # layers still to run in this pass (stop=True)
        self._used: list[_Site] = []  # layers that ran in this pass: only they need resetting
        self._last_done: str | None = None

    # -- lifetime -----------------------------------------------------------------------
    def _install(self, hooks: HookSet) -> None:
        for site in self._sites.values():
            if self._inputs or self._grads:
                site.signature = signature_of(site.module)
                pre = functools.partial(self._on_input, site)
                hooks.forward_pre(site.module, pre, with_kwargs=True)
            hooks.forward(site.module, functools.partial(self._on_output, site))

    def open(self) -> Capture:
        """Install the hooks (``with`` does this); pair with :meth:`close`."""
        opened: Capture = super().open()
        return opened

    def close(self) -> None:
        """Remove every hook this capture added. Idempotent; records stay readable."""
        try:
            super().close()
        finally:
            for site in self._sites.values():
                site.open_calls.clear()

    def __enter__(self) -> Capture:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> bool:
        self.close()
        if isinstance(ev, StopForward) and ev.owner is self:
            return True
        if isinstance(ev, Exception) and hasattr(ev, "add_note"):
            done = f"'{self._last_done}'" if self._last_done else "none"
            ev.add_note(
                f"hookscope: raised inside a capture; last captured layer to finish: {done}"
            )
        return False

    # -- reading ------------------------------------------------------------------------
    def __getitem__(self, name: str) -> LayerRecord:
        key = self._layers.aliases.get(name, name)
        if key not in self.records:
            raise KeyError(f"{name!r} is not one of this capture's layers: {list(self.records)}")
        return self.records[key]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self._layers.aliases.get(name, name) in self.records

    def __iter__(self) -> Any:
        return iter(self.records)

    def __len__(self) -> int:
        return len(self.records)

    def keys(self) -> list[str]:
        return list(self.records)

    def __repr__(self) -> str:
        calls = sum(len(r) for r in self.records.values())
        state = "open" if self._hooks is not None else "closed"
        return (
            f"Capture({len(self.records)} layers, {calls} calls kept, "
            f"{self.nbytes / 2**20:.1f} MiB, {state})"
        )

    # -- hooks --------------------------------------------------------------------------
    def _new_pass(self) -> None:
        # Runs once per forward: touch only the layers the last pass used, not every site.
        self._pass += 1
        self._remaining = len(self._sites)
        for site in self._used:
            site.open_calls.clear()  # left over only if that forward raised
            if self._keep == "pass":
                self._evict(site.record, len(site.record.calls))
        self._used.clear()

    def _new_call(self, site: _Site) -> Call:
        if site.used_in != self._pass:
            site.used_in = self._pass
            self._used.append(site)
        limit = self._ring
        if limit is not None and len(site.record.calls) >= limit:  # make room first, so the
            self._evict(site.record, len(site.record.calls) - limit + 1)  # budget sees it
        return Call(site.name, -1, self._pass)  # index set when the call finishes

    def _on_input(
        self, site: _Site, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        call = self._new_call(site)
        site.open_calls.append(call)
        bound = bind_inputs(site.signature, args, kwargs)
        if self._inputs:
            call._inputs = _tree.map_tensors(
                lambda p, t: self._store(call, ("input", *p), t), bound
            )
        if not self._grads:
            return None
        call._grad_inputs = {}
        # Hook a stand-in of each input (grad_alias) so the gradient is the one flowing
        # through this layer only, not the input's total gradient (skip connections too).
        if not self._inputs:
            call._input_skeleton = _tree.map_tensors(
                lambda p, t: t.new_empty(t.shape, device="meta"), bound
            )
        aliased = _tree.map_tensors(lambda p, t: self._alias(call, p, t, "input"), bound)
        return unbind_inputs(site.signature, args, kwargs, aliased)

    def _alias(self, call: Call, where: Path, t: Tensor, side: str) -> Tensor:
        alias = grad_alias(t) if t.requires_grad else t
        grads = call._grads if side == "output" else call._grad_inputs
        self._hook_grad(call, alias, (side, *where), grads)
        return alias

    def _on_output(self, site: _Site, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        call = site.open_calls.pop() if site.open_calls else self._new_call(site)
        call.index = site.record.count
        site.record.count += 1
        if type(output) is Tensor:  # the common case, without the tree walk
            call._output = self._store(call, ("output",), output)
        else:
            store = self._store
            call._output = _tree.map_tensors(lambda p, t: store(call, ("output", *p), t), output)
        new_output = None
        if self._grads:
            call._grads = {}
            new_output = _tree.map_tensors(lambda p, t: self._alias(call, p, t, "output"), output)
        self._add(site.record, call)
        self._last_done = site.name
        if self._stop and site.done_in != self._pass:
            site.done_in = self._pass
            self._remaining -= 1
            if not self._remaining:
                raise StopForward(self)
        return new_output

    def _hook_grad(self, call: Call, t: Tensor, key: Path, into: dict[Path, Tensor] | None) -> None:
        assert into is not None
        assert self._hooks is not None
        if call._why_no_grad is None:
            call._why_no_grad = {}
        if not _can_have_grad(t):
            call._why_no_grad[key] = (
                f"it is a {t.dtype} tensor; only floating-point tensors have gradients"
            )
        elif not t.requires_grad:
            call._why_no_grad[key] = why_no_grad()
        else:

            def on_grad(grad: Tensor) -> None:
                into[key] = self._store(call, ("grad", *key), grad, check_version=False)

            self._hooks.tensor(t, on_grad)

    # -- storage ------------------------------------------------------------------------
    def _store(self, call: Call, path: Path, t: Tensor, *, check_version: bool = True) -> Tensor:
        # detach() only matters for tensors on the autograd graph (and costs ~0.6 us)
        src = t.detach() if t.requires_grad and (self._detach or path[0] == "grad") else t
        if self._reduce is not None:
            value = self._reduce(src)
            if self._copy == "clone" and _shares_storage(value, src):
                value = value.clone()
            self._charge(call, path, value)
        else:
            self._charge(call, path, src)  # before copying: the budget is never exceeded
            if self._copy == "reference" or (
                self._device is not None and self._device != src.device  # the move copies
            ):
                value = src
            else:
                value = src.clone()
        if self._device is not None and value.device != self._device:
            value = _move(value, self._device)
            if value.is_pinned() and src.is_cuda:
                call._sync = torch.cuda.Event()  # type: ignore[no-untyped-call]
                call._sync.record()
        if check_version and value is src:  # stored by reference: remember its version
            if call._refs is None:
                call._refs = []
            call._refs.append((src, src._version, path))
        return value

    def _charge(self, call: Call, path: Path, value: Tensor) -> None:
        # not `value.nbytes`: dynamo cannot trace it with symbolic shapes (torch.compile)
        nbytes = value.numel() * value.element_size()
        if self._max_bytes is not None and self.nbytes + nbytes > self._max_bytes:
            raise CaptureBudgetError(
                f"capturing {call.layer!r} {path[0]}{_tree.path_str(path[1:])} "
                f"({nbytes / 2**20:.2f} MiB) would exceed max_bytes={self._max_bytes} "
                f"({self.nbytes / 2**20:.2f} MiB already held). Capture fewer layers, pass "
                "reduce= (e.g. 'spatial_mean'), keep='last' or a smaller ring (keep=N), "
                "or raise max_bytes."
            )
        self.nbytes += nbytes
        call.nbytes += nbytes

    def _add(self, record: LayerRecord, call: Call) -> None:
        record.calls.append(call)
        limit = self._ring
        if limit is not None and len(record.calls) > limit:  # nested calls of one module
            self._evict(record, len(record.calls) - limit)

    def _evict(self, record: LayerRecord, n: int) -> None:
        for call in record.calls[:n]:
            self.nbytes -= call.nbytes
        del record.calls[:n]


def grad_alias(t: Tensor) -> Tensor:
    """A stand-in for ``t`` at a layer boundary, so that a hook on it sees only the gradient
    crossing that boundary: for an input, the part flowing through the layer (not through a
    skip connection); for an output, the part coming from downstream (not from the layer's
    own internal uses of it), like a full backward hook's ``grad_input`` / ``grad_output``.

    It is a copy, not a view: an in-place op on a view (``F.relu(x, inplace=True)``)
    re-routes autograd around the view's node, so a hook there would never fire.
    """
    return t.clone()


def _can_have_grad(t: Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (e.g. some subclasses)
        return False


def _move(t: Tensor, device: torch.device) -> Tensor:
    """Copy to ``device``; from CUDA to CPU into pinned memory without blocking."""
    if t.is_cuda and device.type == "cpu":
        out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        return out.copy_(t, non_blocking=True)
    return t.to(device, copy=True)


def _check_options(
    copy: str, keep: Keep, max_bytes: int | None, reduce: Reduce | None, stop: bool, grads: bool
) -> None:
    if copy not in ("clone", "reference"):
        raise ValueError(f"copy={copy!r}: use 'clone' (safe default) or 'reference'")
    if not (keep in ("pass", "all", "last") or (isinstance(keep, int) and keep >= 1)):
        raise ValueError(f"keep={keep!r}: use 'pass', 'all', 'last' or a positive int (ring size)")
    if max_bytes is not None and max_bytes <= 0:
        raise ValueError(f"max_bytes={max_bytes!r} must be a positive number of bytes")
    if isinstance(reduce, str) and reduce not in _REDUCERS:
        raise ValueError(f"reduce={reduce!r}: use one of {sorted(_REDUCERS)} or a function")
    if reduce is not None and not isinstance(reduce, str) and not callable(reduce):
        raise TypeError(f"reduce must be a name or a function Tensor -> Tensor, not {reduce!r}")
    if stop and grads:
        raise ValueError(
            "stop=True ends the forward early, so no loss exists to take gradients of: "
            "use grads=True without stop=True"
        )


#: ``hookscope.capture(model, layers, ...)`` builds a :class:`Capture`.
capture = Capture
