"""``summary``: one forward, one row per module call, with operator-level FLOPs (and, with
``ops=True``, one per operation each module's own code called).

A :class:`~hookscope.look._recorder.Recorder` session (every module, hookscope's core)
keeps the stack of running calls; a dispatch-level counter (``_flops``) charges each
operator to the innermost one, so a functional matmul or ``scaled_dot_product_attention``
in a parent's ``forward`` counts in that parent. Leaf calls of a kind already seen are
charged their learned profile with the counter off (``_profiles``). The result is plain
data (``_result``); rendering lives in ``_render``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import sys
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from ..core import leaves, map_tensors, own_forward, run_eagerly, training_mode, unwrap
from ..errors import UsageError
from ._recorder import Record, Recorder, bind_names
from ._result import Summary, SummaryRow
from ._rows import build
from ._shapes import ShapeTree, Walk, format_shape, has_shape

__all__ = ["Summary", "SummaryRow", "summary"]


def summary(
    model: nn.Module,
    inputs: Any = None,
    /,
    *,
    input_size: Sequence[int] | Sequence[Sequence[int]] | None = None,
    dtypes: Sequence[torch.dtype] | None = None,
    input_device: torch.device | str | None = None,
    forward_kwargs: Mapping[str, Any] | None = None,
    depth: int | None = None,
    time: bool = False,
    train: bool = False,
    grad: bool = False,
    ops: bool = False,
) -> Summary:
    """Run one forward and describe every module call in it, with operator-level FLOPs.

    The model is called with ``inputs`` as :func:`hookscope.features` calls it: a mapping
    as keywords (``model(**inputs)``: a tokenizer's ``BatchEncoding``), a tuple as
    positional arguments (``model(*inputs)``), anything else as the one argument
    (``model(inputs)``); ``forward_kwargs`` adds keywords. Or on random inputs of
    ``input_size`` (one shape, or a list of shapes; ``dtypes`` per input, integers as zeros;
    on ``input_device``, by default the model's). Inputs are copied first, so a model that
    changes its input in place leaves yours alone. A model on the ``meta`` device gets its
    inputs moved there: nothing is allocated, shapes and FLOPs are still exact.

    The forward runs under ``torch.no_grad()`` (``grad=True`` to keep autograd on) and in
    eval mode (``train=True`` for training mode; buffers such as BatchNorm statistics are
    restored after). Each module's training flag, hooks and parameters are left as found; a
    model with lazy modules (``nn.LazyLinear``) is summarised on a copy, so it stays lazy.
    The random state of the CPU and of the CUDA devices the model and inputs use is restored
    after: dropout's draws, ``input_size``'s random inputs and the model's own ``torch.rand``
    leave a training run's random stream as it was.

    With ``ops=True`` each module call's row is followed, between its sub-calls' rows in the
    order they ran, by a row per operation its own code called (not its children's): the
    ``torch`` functions, ``F.*`` functions and tensor methods and operators that
    ``hs.names(model, ops=True, inputs=...)`` lists, named as it names them
    (``"h.0.attn::scaled_dot_product_attention"``, ``"blk::matmul#2"``, ``"::relu"`` for the
    model's own forward: paste one into ``hs.capture``), each with its output shape and the
    FLOPs of the operators it ran. Those FLOPs are already its module's: totals are the same
    as without ``ops``. Calls that returned no tensor (``x.size()``) get no row; neither does
    ``attention_weights``, which only a capture computes. The model then runs as under
    ``hs.names(ops=True)``: a ``TorchFunctionMode`` sees every call (slower; a layer whose
    native fast path refuses function modes, such as ``nn.MultiheadAttention``'s, takes its
    Python path). Without ``ops`` no mode is pushed.

    Args:
        model: the model; DataParallel / compile wrappers are seen through (a compiled model
            runs eagerly for the summary, also one whose compiled code already ran).
        inputs: the model's inputs (see above).
        input_size, dtypes, input_device: make random positional inputs instead (on
            ``input_device``; ``capture``'s ``device=`` is where captures go, a different
            thing, hence the name).
        forward_kwargs: more keyword arguments for the model's ``forward`` (``use_cache``).
        depth: fold calls nested deeper than this into their caller (totals unchanged);
            operation rows count one deeper than their module's call.
        time: also measure each call's time and peak memory (approximate: inclusive wall
            time, and bytes allocated by operators above what was live when it started).
        train: run in training mode.
        grad: keep autograd on.
        ops: also a row per operation of each module's own code (``SummaryRow.kind``
            ``"op"``).

    Returns:
        A :class:`Summary`: ``rows`` (one per module call, in execution order, shapes as
        data; with ``ops=True`` operation rows among them), totals (``total_params``,
        ``trainable_params``, ``total_flops``, ``total_macs``, ...) and ``uncounted``
        operators. ``str()`` renders a table at most 120 columns wide,
        ``to_text(max_width=None)`` the full one; the library never prints.

    Raises:
        UsageError: no inputs, or both inputs and ``input_size``, an unknown option (the
            model's own keywords go in ``forward_kwargs``), or a bad option value.
        UnsupportedModelError: a TorchScript model (PyTorch allows no Python hooks there).
        Exception: whatever the model raises, unchanged, with a note naming the call that
            failed and its input shapes, and the rows so far as ``error.summary``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 2))
        >>> s = hs.summary(model, torch.randn(3, 8))
        >>> s.total_params, s.total_flops   # 2 FLOPs per multiply-add
        (46, 240)
        >>> s.rows[1].output
        (3, 4)
        >>> ops = hs.summary(model, torch.randn(3, 8), ops=True)
        >>> [(r.name, r.flops) for r in ops.rows if r.kind == "op"]
        [('0::linear', 192), ('1::relu', 0), ('2::linear', 48)]
    """
    if not isinstance(model, nn.Module):
        raise UsageError(f"summary() needs a torch.nn.Module, got {type(model).__name__}")
    _check_options(depth, ops)
    root = unwrap(model)
    tensors = [*root.parameters(), *root.buffers()]
    # a look at the model leaves the random stream as found: dropout's draws (train=True),
    # the random inputs of input_size, a model's own torch.rand do not advance it
    with torch.random.fork_rng(
        devices=_cuda_devices(tensors, inputs, forward_kwargs, input_device)
    ):
        args, kwargs = _call(inputs, input_size, dtypes, input_device, forward_kwargs, tensors)
        held = _held(root)  # (before the forward: FSDP2 gathers whole parameters in it)
        result = _run(
            model, root, tensors, args, kwargs, time=time, train=train, grad=grad, ops=ops
        )
    if held is not None:
        result = _per_rank(result, *held)
    return result if depth is None else result.fold(depth)


def _held(root: nn.Module) -> tuple[int, int] | None:
    """What this rank holds of a sharded model's parameters, ``(count, bytes)``, or None for
    a model with no ``DTensor`` parameter or outside an initialised process group."""
    module = sys.modules.get("torch.distributed.tensor")
    dist = torch.distributed
    if module is None or not (dist.is_available() and dist.is_initialized()):
        return None
    params = list(root.parameters())
    if not any(isinstance(p, module.DTensor) for p in params):
        return None
    pieces = [p.to_local() if isinstance(p, module.DTensor) else p for p in params]
    return sum(t.numel() for t in pieces), sum(t.numel() * t.element_size() for t in pieces)


def _per_rank(result: Summary, count: int, nbytes: int) -> Summary:
    """A sharded model's summary with what this rank holds and the FLOPs of all ranks (one
    all-reduce: every rank summarises, as every rank must run the forward)."""
    dist = torch.distributed
    device = (
        torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    )
    flops = torch.tensor([result.total_flops], dtype=torch.int64, device=device)
    dist.all_reduce(flops)
    return dataclasses.replace(
        result,
        world_size=dist.get_world_size(),
        global_rank=dist.get_rank(),
        rank_params=count,
        rank_param_bytes=nbytes,
        world_flops=int(flops.item()),
    )


def _run(
    model: nn.Module,
    root: nn.Module,
    tensors: list[Tensor],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    time: bool,
    train: bool,
    grad: bool,
    ops: bool,
) -> Summary:
    """The summary's forward and its rows."""
    if any(torch.nn.parameter.is_lazy(t) for t in tensors):
        model = copy.deepcopy(model)  # initialising lazy modules would change the user's
        root = unwrap(model)
    meta = bool(tensors) and all(t.is_meta for t in tensors)
    args, kwargs = _prepare(args, kwargs, meta=meta, grad=grad)
    recorder = Recorder(model, time=time, ops=ops)
    shown = bind_names(
        root, [Walk().tree(a) for a in args], {k: Walk().tree(v) for k, v in kwargs.items()}
    )
    root_inputs = {k: v for k, v in shown.items() if has_shape(v)}
    name = type(root).__name__
    # the forward is the summary's own: the user's open sessions do not see it (own_forward)
    with own_forward(), recorder:  # refusals (TorchScript, replicas) raise here, before running
        try:
            with _borrowed(model, root, train=train, grad=grad):
                recorder.counter.start()
                try:
                    model(*args, **kwargs)
                finally:
                    recorder.counter.stop()
        except Exception as error:
            partial = build(recorder, name, root_inputs)
            _explain(error, recorder.failed if recorder.unwinding else None, recorder, partial)
            raise
    return build(recorder, name, root_inputs)


def _cuda_devices(tensors: list[Tensor], *inputs: Any) -> list[int]:
    """The CUDA devices whose random streams the summary could draw from: the model's, the
    inputs' and ``input_device`` (the last of ``inputs``); none without CUDA (fake CUDA
    tensors under a ``FakeTensorMode`` have no stream to draw from)."""
    if not torch.cuda.is_available():
        return []
    found = {t.device.index for t in tensors if t.is_cuda}
    for tree in inputs[:-1]:
        found |= {t.device.index for _, t in leaves(tree) if t.is_cuda}
    where = inputs[-1]
    if where is not None and torch.device(where).type == "cuda" and torch.cuda.is_available():
        index = torch.device(where).index
        found.add(torch.cuda.current_device() if index is None else index)
    return sorted(i for i in found if i is not None)


def _check_options(depth: Any, ops: Any) -> None:
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 0):
        raise UsageError(f"depth must be an int >= 0 or None, got {depth!r}")
    if not isinstance(ops, bool):
        raise UsageError(
            f"ops must be True or False, got {ops!r} (ops=True adds a row per operation; "
            "hs.names(model, ops=True, inputs=x) lists them)"
        )


def _call(
    inputs: Any,
    input_size: Any,
    dtypes: Sequence[torch.dtype] | None,
    input_device: torch.device | str | None,
    forward_kwargs: Mapping[str, Any] | None,
    tensors: list[Tensor],
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``(args, kwargs)`` for the model's call (``tensors``: the model's, for its device)."""
    if forward_kwargs is not None and not isinstance(forward_kwargs, Mapping):
        raise UsageError(f"forward_kwargs must be a mapping, got {type(forward_kwargs).__name__}")
    kwargs = dict(forward_kwargs or {})
    if input_size is not None:
        if inputs is not None:
            raise UsageError(
                "give the model's inputs or input_size=, not both (keyword inputs such as "
                "use_cache=False go in forward_kwargs=)"
            )
        where = input_device or (tensors[0].device if tensors else torch.device("cpu"))
        return _random_inputs(input_size, dtypes, where), kwargs
    if dtypes is not None or input_device is not None:
        raise UsageError("dtypes= and input_device= describe input_size=; pass input_size too")
    if inputs is None:
        if kwargs:
            return (), kwargs
        raise UsageError(
            "summary() runs one forward and needs the model's inputs: hs.summary(model, x), "
            "hs.summary(model, tokenizer_output), hs.summary(model, (x, mask)) or "
            "hs.summary(model, input_size=(1, 3, 224, 224))"
        )
    if isinstance(inputs, Mapping):
        clash = sorted(set(inputs) & set(kwargs))
        if clash:
            raise UsageError(f"{clash} given both in the inputs mapping and in forward_kwargs")
        return (), {**inputs, **kwargs}
    return (inputs if isinstance(inputs, tuple) else (inputs,)), kwargs


@contextlib.contextmanager
def _borrowed(model: nn.Module, root: nn.Module, *, train: bool, grad: bool) -> Iterator[None]:
    """Mode, autograd, compiled code and buffers for the summary's forward; restored after."""
    buffers = [(b, b.detach().clone()) for b in root.buffers()] if train else []
    try:
        with (
            training_mode(model, train),
            run_eagerly(model),
            contextlib.nullcontext() if grad else torch.no_grad(),
        ):
            yield
    finally:
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)


def _explain(error: Exception, failed: Record | None, rec: Recorder, partial: Summary) -> None:
    where = "before any module ran"
    if failed is not None:
        name = failed.call.name or f"the model's own forward ({partial.model})"
        shown = _arguments(rec.inputs_of(failed)) or "no tensor inputs"
        where = f"in {name!r} ({type(failed.module).__name__}) called with {shown}"
    note = (
        f"hookscope.summary: the forward failed {where}; the {len(partial.rows)} rows "
        "collected so far are in this exception's .summary"
    )
    if hasattr(error, "add_note"):
        error.add_note(note)
    with contextlib.suppress(AttributeError, TypeError):  # exceptions with __slots__
        error.summary = partial  # type: ignore[attr-defined]


def _arguments(named: Mapping[str, ShapeTree]) -> str:
    return ", ".join(f"{k}={format_shape(v, 1)}" for k, v in named.items())


def _prepare(
    args: tuple[Any, ...], kwargs: dict[str, Any], *, meta: bool, grad: bool
) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """Copies of the inputs (on ``meta`` for a meta model)."""

    def copy_(_: Any, t: Tensor) -> Tensor:
        out = t.detach().to("meta") if meta and not t.is_meta else t.detach().clone()
        return out.requires_grad_(t.requires_grad) if grad and t.is_leaf else out

    return map_tensors(copy_, args), map_tensors(copy_, kwargs)


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
