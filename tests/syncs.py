"""Counting CUDA host synchronisations in a test, and on the CPU the reads that would be one."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode


@contextmanager
def syncs() -> Iterator[list[str]]:
    """The synchronising calls made inside the block, one message each."""
    seen: list[str] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield seen
        finally:
            torch.cuda.set_sync_debug_mode("default")
    seen += [str(w.message) for w in caught if "called a synchronizing" in str(w.message)]


#: Tensor methods that read values into Python (without going through an aten operator
#: on the CPU: ``tolist`` and ``numpy`` read the memory directly).
_PY_READS = ("item", "tolist", "numpy", "__bool__", "__int__", "__float__", "__index__")
#: aten operators that read values to the host, or whose output's shape depends on them: on a
#: GPU each one waits for the device. Listed here, not taken from hookscope's own
#: ``look._flops.DATA_DEPENDENT``: the oracle stays outside the code it checks.
_ATEN_READS = frozenset(
    getattr(torch.ops.aten, n)
    for n in [
        *["_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "bincount"],
        *["unique", "_unique", "_unique2", "unique_dim", "unique_consecutive"],
    ]
    if hasattr(torch.ops.aten, n)
)


class _Reads(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, seen: list[str]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.seen = seen

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket in _ATEN_READS:
            self.seen.append(f"aten.{func.overloadpacket.__name__}")
        return func(*args, **(kwargs or {}))


@contextmanager
def host_reads() -> Iterator[list[str]]:
    """What the block reads from tensors into Python, one name per read: the CPU's count of
    what :func:`syncs` sees on a GPU (an aten read, ``.item()``, ``bool(t)``, ``.tolist()``).
    Copies to another device are not seen (there is none)."""
    seen: list[str] = []
    saved = {name: getattr(torch.Tensor, name) for name in _PY_READS}

    def counting(name: str) -> Callable[..., Any]:
        real = saved[name]

        def read(*args: Any, **kwargs: Any) -> Any:
            seen.append(f"Tensor.{name}")
            return real(*args, **kwargs)

        return read

    for name in _PY_READS:
        setattr(torch.Tensor, name, counting(name))
    try:
        with _Reads(seen):
            yield seen
    finally:
        for name, real in saved.items():
            setattr(torch.Tensor, name, real)
