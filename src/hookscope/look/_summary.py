"""``summary``: one forward, one row per module call, with operator-level FLOPs.

Module pre/post hooks (through the core's :class:`HookSet`) keep a stack of the calls that are
running; a dispatch-level counter (``_flops``) charges each operator to the innermost one, so
a functional matmul or ``scaled_dot_product_attention`` in a parent's ``forward`` counts in
that parent. The result is plain data (``_result``); rendering lives in ``_render``.
"""

from __future__ import annotations

import contextlib
import time as _time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import HookSet, leaves, map_tensors, run_eagerly, training_mode, unwrap
from ..core._bind import Binder
from ..core._naming import is_called
from ..errors import UsageError
from ._flops import Counter
from ._result import Summary, SummaryRow, argument_shapes, shapes

__all__ = ["Summary", "SummaryRow", "summary"]


@dataclass
class _Module:
    """What the rows of one module share, worked out once per summary."""

    name: str
    type: str
    params: int
    params_total: int
    trainable: str
    binder: Binder
    calls: int = 0


@dataclass
class _Frame:
    """A call that is running."""

    row: SummaryRow
    index: int
    module: nn.Module
    start: float
    live: int  # bytes live when the call started (time=True)
    peak: int
    returned: bool = False


def _trainable(params: list[nn.Parameter]) -> str:
    flags = {p.requires_grad for p in params}
    if not flags:
        return "-"
    return "partial" if len(flags) == 2 else "yes" if True in flags else "no"


def _module_info(name: str, module: nn.Module) -> _Module:
    params = list(module.parameters())
    return _Module(
        name=name,
        type=type(module).__name__,
        params=sum(p.numel() for p in module.parameters(recurse=False)),
        params_total=sum(p.numel() for p in params),
        trainable=_trainable(params),
        binder=Binder(module),
    )


class _Recorder:
    """Rows in execution order, the stack of running calls, and the counter's callbacks."""

    def __init__(self, root: nn.Module, *, time: bool) -> None:
        self.modules = {id(m): _module_info(n, m) for n, m in root.named_modules() if is_called(m)}
        self.rows: list[SummaryRow] = []
        self._infos: list[_Module] = []  # per row
        self.stack: list[_Frame] = []
        self.time = time
        self.live = 0
        self.outside = SummaryRow(name="", type="", depth=-1)  # operators run outside every module
        self.failed: SummaryRow | None = None
        self.unwinding = False

    def hook(self, root: nn.Module, hooks: HookSet) -> None:
        for module in root.modules():
            if id(module) in self.modules:
                hooks.forward_pre(module, self.pre, with_kwargs=True)
                hooks.forward(module, self.returned)
                hooks.forward(module, self.post, always_call=True)

    def pre(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        info = self.modules[id(module)]
        info.calls += 1
        row = SummaryRow(
            name=info.name,
            type=info.type,
            depth=len(self.stack),
            parent=self.stack[-1].index if self.stack else None,
            call=info.calls,
            inputs=argument_shapes(info.binder.bind(args, kwargs)),
            params=info.params,
            params_total=info.params_total,
            trainable=info.trainable,
        )
        self.rows.append(row)
        self._infos.append(info)
        start = _time.perf_counter() if self.time else 0.0
        self.stack.append(_Frame(row, len(self.rows) - 1, module, start, self.live, self.live))

    def returned(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Runs only when the forward returned (``post`` runs after it, or alone if not)."""
        if self.stack and self.stack[-1].module is module:
            self.stack[-1].returned = True

    def post(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        """Runs after every call, also one that raised (``always_call``): closes it."""
        while self.stack and self.stack[-1].module is not module:  # never expected
            self._close(None, raised=True)
        if self.stack:
            self._close(output, raised=not self.stack[-1].returned)

    def _close(self, output: Any, *, raised: bool) -> None:
        frame = self.stack.pop()
        row = frame.row
        row.raised = raised
        if raised and not self.unwinding:
            self.failed = row  # the innermost call of the error now unwinding
        self.unwinding = raised
        if not raised:
            tensors = [t for _, t in leaves(output)]
            row.output = shapes(output)
            row.dtype = str(tensors[0].dtype).removeprefix("torch.") if tensors else None
            row.output_bytes = sum(t.numel() * t.element_size() for t in tensors)
            if self.time and any(t.is_cuda for t in tensors):
                torch.cuda.synchronize()
        row.flops_total += row.flops  # sub-calls added theirs when they closed
        if self.time:
            row.time_ms = (_time.perf_counter() - frame.start) * 1e3
            row.peak_bytes = frame.peak - frame.live
        if self.stack:
            caller = self.stack[-1]
            caller.row.flops_total += row.flops_total
            caller.peak = max(caller.peak, frame.peak)

    def op(self, flops: int, uncounted: str | None) -> None:
        row = self.stack[-1].row if self.stack else self.outside
        row.flops += flops
        if uncounted is not None:
            row.uncounted[uncounted] = row.uncounted.get(uncounted, 0) + 1

    def alloc(self, nbytes: int) -> None:
        self.live += nbytes
        if self.stack and self.live > self.stack[-1].peak:
            self.stack[-1].peak = self.live

    def result(self, model: nn.Module, inputs: dict[str, str]) -> Summary:
        """The summary of what ran; calls still open (the forward raised) end as raised."""
        while self.stack:
            self._close(None, raised=True)
        for row, info in zip(self.rows, self._infos, strict=True):
            row.calls = info.calls
        callers = {r.parent for r in self.rows}
        uncounted: dict[str, int] = {}
        for row in [*self.rows, self.outside]:
            for op, n in row.uncounted.items():
                uncounted[op] = uncounted.get(op, 0) + n
        params = list(model.parameters())
        return Summary(
            model=type(model).__name__,
            rows=self.rows,
            total_params=sum(p.numel() for p in params),
            trainable_params=sum(p.numel() for p in params if p.requires_grad),
            param_bytes=sum(p.numel() * p.element_size() for p in params),
            output_bytes=sum(r.output_bytes for i, r in enumerate(self.rows) if i not in callers),
            total_flops=sum(r.flops for r in self.rows) + self.outside.flops,
            uncounted=dict(sorted(uncounted.items(), key=lambda kv: (-kv[1], kv[0]))),
            inputs=inputs,
        )


def summary(
    model: nn.Module,
    *args: Any,
    input_size: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    device: torch.device | str | None = None,
    depth: int | None = None,
    time: bool = False,
    train: bool = False,
    grad: bool = False,
    **kwargs: Any,
) -> Summary:
    """Run one forward and describe every module call in it, with operator-level FLOPs.

    The model is called as ``model(*args, **kwargs)`` (a single mapping whose keys are
    ``forward``'s parameters, such as a tokenizer's output, is passed as keywords), or on
    random inputs of ``input_size`` (one shape, or a list of shapes; ``dtypes`` per input,
    integers as zeros; on ``device``, by default the model's). Inputs are copied first, so a
    model that changes its input in place leaves yours alone. A model on the ``meta`` device
    gets its inputs moved there: nothing is allocated, shapes and FLOPs are still exact.

    The forward runs under ``torch.no_grad()`` (``grad=True`` to keep autograd on) and in
    eval mode (``train=True`` for training mode; buffers such as BatchNorm statistics are
    restored after). Each module's training flag, hooks and parameters are left as found.

    Args:
        model: the model; DataParallel / compile wrappers are seen through (a compiled model
            runs eagerly for the summary).
        *args, **kwargs: the model's inputs.
        input_size, dtypes, device: make random positional inputs instead (keyword inputs
            are still passed on).
        depth: fold calls nested deeper than this into their caller (totals unchanged).
        time: also measure each call's time and peak memory (approximate: inclusive wall
            time, and bytes allocated by operators above what was live when it started).
        train: run in training mode.
        grad: keep autograd on.

    Returns:
        A :class:`Summary`: ``rows`` (one per module call, in execution order), totals
        (``total_params``, ``trainable_params``, ``total_flops``, ``total_macs``, ...) and
        ``uncounted`` operators. ``str()`` renders a table; the library never prints.

    Raises:
        UsageError: no inputs, or both inputs and ``input_size``, or a bad option.
        Exception: whatever the model raises, unchanged, with a note naming the call that
            failed and its input shapes, and the rows so far as ``error.summary``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> s = hs.summary(model, torch.randn(3, 8))
        >>> s.total_params, s.total_flops   # 2 FLOPs per multiply-add
        (46, 240)
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"summary() needs a torch.nn.Module, got {type(model).__name__}")
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise UsageError(f"depth must be an int >= 0 or None, got {depth!r}")
    root = unwrap(model)
    if input_size is not None:
        if args:
            raise UsageError(
                "give the model's positional inputs or input_size=, not both (keyword inputs "
                "such as use_cache=False can go with input_size=)"
            )
        args = _random_inputs(input_size, dtypes, device or _device(root))
    elif dtypes is not None or device is not None:
        raise UsageError("dtypes= and device= describe input_size=; pass input_size too")
    elif not args and not kwargs:
        raise UsageError(
            "summary() runs one forward and needs the model's inputs: hs.summary(model, x), "
            "hs.summary(model, **tokenizer_output), or "
            "hs.summary(model, input_size=(1, 3, 224, 224))"
        )
    args, kwargs = _prepare(root, args, kwargs, grad=grad)
    recorder = _Recorder(root, time=time)
    root_inputs = argument_shapes(Binder(root).bind(args, kwargs))
    try:
        with _borrowed(model, root, train=train, grad=grad) as hooks:
            recorder.hook(root, hooks)
            with Counter(recorder.op, recorder.alloc if time else None):
                model(*args, **kwargs)
    except Exception as error:
        partial = recorder.result(root, root_inputs)
        _explain(error, recorder.failed if recorder.unwinding else None, partial)
        raise
    result = recorder.result(root, root_inputs)
    return result if depth is None else result.fold(depth)


@contextlib.contextmanager
def _borrowed(model: nn.Module, root: nn.Module, *, train: bool, grad: bool) -> Iterator[HookSet]:
    """Hooks, mode, autograd and buffers for the summary's forward; all restored after."""
    buffers = [(b, b.detach().clone()) for b in root.buffers()] if train else []
    hooks = HookSet()
    try:
        with (
            training_mode(model, train),
            run_eagerly(model),
            contextlib.nullcontext() if grad else torch.no_grad(),
        ):
            yield hooks
    finally:
        hooks.close()
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _explain(error: Exception, failed: SummaryRow | None, partial: Summary) -> None:
    where = "before any module ran"
    if failed is not None:
        name = failed.name or f"the model's own forward ({partial.model})"
        shown = ", ".join(f"{k}={v}" for k, v in failed.inputs.items()) or "no tensor inputs"
        where = f"in {name!r} ({failed.type}) called with {shown}"
    note = (
        f"hookscope.summary: the forward failed {where}; the {len(partial.rows)} rows "
        "collected so far are in this exception's .summary"
    )
    if hasattr(error, "add_note"):
        error.add_note(note)
    with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__
        error.summary = partial  # type: ignore[attr-defined]


def _device(root: nn.Module) -> torch.device:
    for t in (*root.parameters(), *root.buffers()):
        return t.device
    return torch.device("cpu")


def _on_meta(root: nn.Module) -> bool:
    tensors = [*root.parameters(), *root.buffers()]
    return bool(tensors) and all(t.is_meta for t in tensors)


def _prepare(
    root: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], *, grad: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the inputs (on ``meta`` for a meta model); a mapping of forward's keywords
    given as the only positional argument becomes keywords."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping) and args[0]:
        params = Binder(root).parameters()
        mapping = args[0]
        if params is not None and all(isinstance(k, str) and k in params for k in mapping):
            args, kwargs = tuple[Any, ...](), dict(mapping)
    meta = _on_meta(root)

    def copy(_: Any, t: Tensor) -> Tensor:
        out = t.detach().to("meta") if meta and not t.is_meta else t.detach().clone()
        return out.requires_grad_(t.requires_grad) if grad and t.is_leaf else out

    return map_tensors(copy, args), map_tensors(copy, kwargs)


def _random_inputs(
    input_size: Any, dtypes: Sequence[torch.dtype] | None, device: torch.device | str
) -> tuple[Tensor, ...]:
    if _is_shape(input_size):
        sizes = [tuple(input_size)]
    elif isinstance(input_size, Sequence) and input_size and all(map(_is_shape, input_size)):
        sizes = [tuple(s) for s in input_size]
    else:
        raise UsageError(
            f"input_size must be a shape like (1, 3, 224, 224) or a list of shapes, got "
            f"{input_size!r}"
        )
    dtypes = list(dtypes) if dtypes is not None else [torch.float32] * len(sizes)
    if len(dtypes) != len(sizes) or not all(isinstance(d, torch.dtype) for d in dtypes):
        raise UsageError(
            f"dtypes must list one torch.dtype per input ({len(sizes)}), got {dtypes!r}"
        )
    return tuple(
        torch.randn(s, dtype=d, device=device)
        if d.is_floating_point or d.is_complex
        else torch.zeros(s, dtype=d, device=device)
        for s, d in zip(sizes, dtypes, strict=True)
    )


def _is_shape(obj: Any) -> bool:
    return isinstance(obj, Sequence) and all(
        isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in obj
    )
