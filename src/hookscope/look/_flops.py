"""Count FLOPs at the operator level, as the forward runs.

A ``TorchDispatchMode`` sees every aten operator a forward executes, whoever calls it: layers,
functional calls in a parent's ``forward`` (``q @ k.T``), fused kernels. Formulas live in
``_formulas``. Each operator is charged to a :class:`Tally`, the one the summary's recorder
points the counter at (the innermost module call running).

The mode can be *muted* for a stretch of the forward (:meth:`Counter.mute`): the operators
then run without any Python call. The recorder does this for module calls whose operators it
already knows (``_profiles``).

A ``DTensor``'s operators (tensor parallelism, FSDP2) are counted as this rank runs them, on its
local pieces: a column-parallel layer's FLOPs are its share of the layer's.

Convention (PyTorch's): one multiply-accumulate is 2 FLOPs; only matrix products,
convolutions and attention are counted. Operators that do arithmetic but have no formula
(elementwise ops, norms, softmax, pooling) are reported with their call counts, never counted
as zero silently; operators that do no arithmetic (views, copies, creation, indexing) are not.
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..core import DispatchInterceptor, _torch
from ..core._torch import dispatch_has_composite
from ._formulas import FORMULAS, nested_flops

__all__ = ["DATA_DEPENDENT", "FREE_OPS", "Counter", "Tally"]

aten = torch.ops.aten

#: Operators that do no arithmetic: creation, copies, layout, indexing, concatenation,
#: random numbers. Views are recognised from their schema.
_FREE = """
    _to_copy clone copy copy_ contiguous detach alias lift_fresh lift_fresh_copy _unsafe_view
    empty empty_like empty_strided new_empty new_empty_strided new_zeros new_ones new_full
    zeros zeros_like ones ones_like full full_like fill fill_ zero_ scalar_tensor arange
    linspace triu_indices tril_indices rand randn randint randperm normal_ uniform_ bernoulli_
    cat stack split split_with_sizes unsafe_split chunk unbind repeat tile flip roll narrow
    constant_pad_nd pad tril triu index index_select gather embedding slice_scatter
    select_scatter masked_fill masked_fill_ where resize_ set_ _local_scalar_dense item
    eq ne lt le gt ge logical_not logical_and logical_or argmax argmin any all nonzero sort topk
    _nested_tensor_size _nested_tensor_strides _nested_tensor_storage_offsets
"""
FREE_OPS = frozenset(getattr(aten, n) for n in _FREE.split() if hasattr(aten, n))
#: Namespaces of operators that move data between ranks or mark time: communication (the
#: all-reduces of tensor parallelism, FSDP2's all-gathers and its copies in and out of their
#: buffers) and the profiler's ranges, not arithmetic a FLOP count is missing
_FREE_NAMESPACES = frozenset(
    {"c10d", "c10d_functional", "_c10d_functional", "_c10d_functional_autograd", "fsdp", "profiler"}
)

#: Operators that read tensor values into Python (``.item()``, ``bool()``) or whose output
#: shape depends on values: code running them may take a different path for other values.
_DATA = """
    _local_scalar_dense item is_nonzero equal nonzero masked_select unique _unique _unique2
    unique_dim unique_consecutive unique_dim_consecutive repeat_interleave bincount
    _pack_padded_sequence
"""
DATA_DEPENDENT = frozenset(getattr(aten, n) for n in _DATA.split() if hasattr(aten, n))


class Tally:
    """What the operators charged to one module call did."""

    __slots__ = ("data_dependent", "flops", "ops", "uncounted")

    def __init__(self) -> None:
        self.flops = 0
        self.ops = 0  # operators charged (Python calls of the counter)
        self.uncounted: dict[str, int] = {}
        self.data_dependent = False

    def add_uncounted(self, name: str, n: int = 1) -> None:
        self.uncounted[name] = self.uncounted.get(name, 0) + n


@dataclass(frozen=True)
class _Op:
    formula: Callable[..., int] | None
    composite: bool  # has a decomposition into other operators
    uncounted: str | None  # its name if it does arithmetic but has no formula
    allocates: bool  # returns new tensors (not a view, not in place)
    data_dependent: bool
    name: str


def _has_nested(args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    return any(isinstance(x, Tensor) and x.is_nested for x in (*args, *kwargs.values()))


@functools.lru_cache(maxsize=1024)  # per tuple of types: a model's operators come with a few
def _distributed(types: Any) -> bool:
    """Whether an operator's tensor types include ``DTensor`` (tensor parallelism, FSDP2) or
    another tensor subclass of ``torch.distributed`` (an all-reduce in flight): the counter
    lets the subclass run it, and counts the operators it runs on this rank's own tensors,
    so that a sharded layer's FLOPs are the rank's share, not the whole layer's."""
    return any(getattr(t, "__module__", "").startswith("torch.distributed.") for t in types)


def _fake(args: Any) -> bool:
    """Whether an operator runs on fake tensors (shapes only: they have a ``fake_mode``)."""
    return any(hasattr(a, "fake_mode") for a in args if isinstance(a, Tensor))


class Counter(DispatchInterceptor):
    """Charges every operator that runs while active to ``self.target`` (a :class:`Tally`).

    ``on_alloc``, if given, gets the bytes of every tensor an operator allocates (``+n``) and,
    when that tensor is freed, ``-n``: enough for an approximate peak of live memory.
    """

    def __init__(self, target: Tally, on_alloc: Callable[[int], None] | None = None) -> None:
        super().__init__()
        self.target = target
        self._on_alloc = on_alloc
        self._ops: dict[Any, _Op] = {}  # what is known of each operator overload
        self._active = False  # pushed and not muted
        #: a DTensor may come (torch.distributed.tensor is imported); one came (its sharding
        #: propagation runs operators on fake tensors, which are not this rank's work); the
        #: summary itself runs on fake tensors
        self._dtensors = self._sharded = self._fake = False

    # -- dispatch ---------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # DTensor runs the operator on this rank's pieces, which come back here (the types of
        # plain tensors' operators are an empty tuple)
        if self._dtensors and types and _distributed(types):
            self._sharded = True
            return NotImplemented
        if self._sharded and not self._fake and _fake(args):  # DTensor's sharding propagation
            return func(*args, **(kwargs or {}))
        kwargs = kwargs or {}
        op = self._ops.get(func) or self._learn(func)
        target = self.target
        target.ops += 1
        if op.composite and not _has_nested(args, kwargs):
            # Composite operators (linear, matmul, einsum, sdpa) reach a dispatch mode whole
            # when autograd is off (inference_mode): run their decomposition under this mode
            # so the operators they are made of are counted, as FlopCounterMode does.
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        out = func(*args, **kwargs)
        if op.data_dependent:
            target.data_dependent = True
        if op.formula is not None or (op.composite and op.uncounted is not None):
            self._count(target, op, func, args, kwargs, out)
        elif op.uncounted is not None:
            target.add_uncounted(op.uncounted)
        if self._on_alloc is not None and op.allocates:
            self._track(out)
        return out

    def _count(self, target: Tally, op: _Op, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        nested = _has_nested(args, kwargs)
        try:
            if nested:
                flops = nested_flops(func.overloadpacket, args, kwargs)
            elif op.formula is None:
                flops = None  # a composite operator that had no decomposition
            else:
                flops = int(op.formula(*args, **kwargs, out_val=out))
        except Exception as e:  # a formula that does not fit these arguments: say so and why
            target.add_uncounted(f"{op.name} (its FLOP formula raised {_short(e)})")
            return
        if flops is None:
            target.add_uncounted(op.name + (" (nested)" if nested else ""))
        else:
            target.flops += flops

    def _learn(self, func: Any) -> _Op:
        packet = func.overloadpacket
        formula = FORMULAS.get(packet)
        free = func.is_view or packet in FREE_OPS or func.namespace in _FREE_NAMESPACES
        composite = formula is None and dispatch_has_composite(func)
        name = f"aten.{packet.__name__}"
        op = _Op(
            formula=formula,
            composite=composite,
            uncounted=None if formula is not None or free else name,
            allocates=not func.is_view and not _torch.is_mutable(func),
            data_dependent=packet in DATA_DEPENDENT,
            name=name,
        )
        self._ops[func] = op
        return op

    def _track(self, out: Any) -> None:
        assert self._on_alloc is not None
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, Tensor) and not t.is_nested:
                n = t.untyped_storage().nbytes()
                self._on_alloc(n)
                weakref.finalize(t, self._on_alloc, -n)

    # -- on / off ---------------------------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Pushed and not muted: operators reach :meth:`__torch_dispatch__`."""
        return self._active

    def start(self) -> None:
        """Push the mode (``with counter`` does this)."""
        self._dtensors = "torch.distributed.tensor" in sys.modules  # (else no tensor is one)
        if self._dtensors:
            get, key = _torch.need(
                "torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)"
            )
            self._fake = get(key) is not None
        self._push()

    def _push(self) -> None:
        self.__enter__()
        self._active = True

    def stop(self) -> None:
        """Pop the mode if it is active; safe after a mute that was never undone."""
        if self._active:
            self._active = False
            self.__exit__(None, None, None)

    def mute(self) -> bool:
        """Pop the mode while it is the innermost one; True if it did (undo with
        :meth:`unmute`). Another mode pushed inside the forward keeps this one on."""
        if not self._active or _current_mode() is not self:
            return False
        self.stop()
        return True

    def unmute(self) -> None:
        if not self._active:
            self._push()  # (inside the forward start ran for: what it learned still holds)


def _short(error: Exception) -> str:
    """``TypeName: message`` of an error, its message's first line cut to 80 characters."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    text = text if len(text) <= 80 else text[:77] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def _current_mode() -> Any:
    """The innermost dispatch mode (a private torch helper: without it, never mute)."""
    return _torch.current_dispatch_mode()
