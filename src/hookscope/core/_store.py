"""How a capture stores what it sees, decided once per session, and its byte budget.

:class:`Store` turns a live tensor into the value a record keeps (a detached copy, the tensor
itself, a reduction, a copy on another device). With ``max_bytes`` it also keeps a running
total, charged *before* copying (so the budget is never exceeded) and refunded when calls are
evicted or gradients replaced. Without a budget no total is kept per call: the bytes held are
summed from the kept calls when asked (``Capture.nbytes``).
"""

from __future__ import annotations

import numbers
import threading
from typing import Any

import torch
from torch import Tensor

from ..errors import CaptureBudgetError, CaptureError, UsageError
from . import _torch, _tree
from ._reduce import check_reduce, keep_mask, reduce_tensor
from ._steps import Spans
from ._types import CopyMode, Keep, Path, Reduce
from ._units import MaskNote, Narrow

__all__ = ["Store", "Where", "check_options", "describe"]


class Store:
    """A capture's storage policy and byte account.

    ``keep(t, where)`` returns ``(value, tag)`` (see :meth:`_keep`); ``keep_grad`` does the
    same for a gradient (always detached).
    """

    def __init__(
        self,
        *,
        copy: CopyMode,
        device: torch.device | None,
        reduce: Reduce | None,
        detach: bool,
        max_bytes: int | None,
        narrow: dict[str, Narrow] | None = None,
        masks: MaskNote | None = None,
    ) -> None:
        self.counting = max_bytes is not None  # a running total, for the budget only
        self.nbytes = 0
        self.closed = False  # set when the owning session closes
        self._max = max_bytes
        self._device = device
        self._reference = copy == "reference"
        self._detach = detach
        self._reduce = reduce
        #: ``reduce="token_mean"`` needs each forward's token mask (per thread: each thread's
        #: forward has its own inputs), noted by the capture (:meth:`note_inputs`)
        self.reduces_tokens = reduce == "token_mean"
        self._mask = threading.local()
        #: ``positions=`` / ``heads=`` / ``neurons=``: per site, the units kept of its output
        #: (and of the gradient w.r.t. it), before any reduction (``_units``)
        self._narrow = narrow or {}
        self.masks = masks  # the forward's mask, for positions="last" (noted by the capture)
        #: per pass, the token positions its forward covered (``Call.positions``)
        self.spans: Spans | None = None
        plain = not self._narrow and reduce is None and device is None and max_bytes is None
        plain = plain and detach
        #: the policy, decided once: ``keep(t, where) -> (value, tag)``
        self.keep = (
            (self._keep_reference if copy == "reference" else self._keep_clone)
            if plain
            else self._keep
        )

    # -- storing ----------------------------------------------------------------------------
    # The two hot paths, for the default policy (no reduce, device or budget).
    def _keep_clone(self, t: Tensor, where: Where) -> tuple[Tensor, Any]:
        return (t.detach() if t.requires_grad else t).clone(), None

    def _keep_reference(self, t: Tensor, where: Where) -> tuple[Tensor, Any]:
        src = t.detach() if t.requires_grad else t
        try:
            return src, _version(src)
        except RuntimeError:  # an inference tensor has no version counter: copy it instead
            return src.clone(), None

    def keep_grad(self, t: Tensor, where: Where) -> tuple[Tensor, Any]:
        """:meth:`keep` for a gradient: detached whatever ``detach=`` says."""
        return self._keep(t, where, grad=True)

    def _keep(self, t: Tensor, where: Where, grad: bool = False) -> tuple[Tensor, Any]:
        """The value to keep for ``t`` and a tag: ``None``; the live tensor's version (an
        int: the value *is* the live tensor, check it on read); or a CUDA event to wait for
        (the value is a non-blocking copy into pinned memory)."""
        src = t.detach() if t.requires_grad and (self._detach or grad) else t
        if self._narrow:
            src = self._narrowed(src, where)
        if self._reduce is not None:
            value = self._reduced(src, where)
            self.charge(value, where)
            return self._moved(value) if self._device is not None else (value, None)
        self.charge(src, where)  # before copying: the budget is never exceeded
        if self._device is not None and src.device != self._device:
            return self._moved(src)  # the move is the copy
        if self._reference and not src.is_inference():  # inference tensors have no
            return src, _version(src)  # version counter: they are copied instead
        return src.clone(), None

    def _moved(self, t: Tensor) -> tuple[Tensor, Any]:
        assert self._device is not None
        if t.device == self._device:
            return t, None
        if t.is_cuda and self._device.type == "cpu":  # pinned, non-blocking: wait on read
            out = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            out.copy_(t, non_blocking=True)
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return out, event
        return t.to(self._device, copy=True), None

    @property
    def transforms(self) -> bool:
        """Whether stored values differ from the tensors seen (a reduction or narrowing)."""
        return self._reduce is not None or bool(self._narrow)

    def _narrowed(self, src: Tensor, where: Where) -> Tensor:
        """The selected units of an output (or of the gradient w.r.t. it), a copy: integer
        tensors (token ids, masks) are kept as they are, as reductions keep them."""
        layer, path = where
        narrow = self._narrow.get(layer)
        output = path[:1] == ("output",) or path[:2] == ("grad", "output")
        if narrow is None or not output or not (src.is_floating_point() or src.is_complex()):
            return src
        return narrow.take(src)  # a new tensor (index_select, gather): no view of src

    def note_inputs(self, inputs: dict[str, Any]) -> None:
        """The inputs of the forward starting on this thread (its token mask, for
        ``reduce="token_mean"``)."""
        self._mask.value = keep_mask(inputs)

    def _reduced(self, src: Tensor, where: Where) -> Tensor:
        assert self._reduce is not None
        value = reduce_tensor(self._reduce, src, getattr(self._mask, "value", None))
        if isinstance(value, numbers.Number):
            value = torch.tensor(value, device=src.device)
        if not isinstance(value, Tensor):
            raise CaptureError(
                f"reduce= returned {type(value).__name__} for {describe(where)}; it must "
                "return a tensor (or a Python number)"
            )
        # a view (e.g. t[:, 0]) would follow later changes; so would ``src`` itself (a kept
        # tensor's reduction), also where its storage cannot be read (the in-flight
        # all-reduce a row-parallel layer hands on under tensor parallelism)
        if value is src or _shares_storage(value, src):
            value = value.clone()
        return value.detach() if self._detach and value.requires_grad else value

    # -- accounting (with a budget only) ----------------------------------------------------------
    def charge(self, value: Tensor, where: Where) -> None:
        if not self.counting:
            return
        nbytes = value.nbytes
        if self._max is not None and self.nbytes + nbytes > self._max:
            raise CaptureBudgetError(
                f"capturing {describe(where)} ({nbytes / 2**20:.2f} MiB) would exceed "
                f"max_bytes={self._max} ({self.nbytes / 2**20:.2f} MiB already held). Capture "
                "fewer layers, pass reduce= (e.g. 'spatial_mean'), keep='last' or a smaller "
                "ring (keep=N), or raise max_bytes."
            )
        self.nbytes += nbytes

    def refund(self, nbytes: int) -> None:
        if self.counting:
            self.nbytes -= nbytes


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    try:
        return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    except RuntimeError:  # tensors without storage (e.g. some subclasses)
        return False


def check_options(
    copy: Any, keep: Keep, max_bytes: Any, reduce: Reduce | None, stop: bool, grads: bool
) -> None:
    """Refuse bad capture options before anything is hooked."""
    if copy not in ("clone", "reference"):
        raise UsageError(f"copy={copy!r}: use 'clone' (safe default) or 'reference'")
    ring = isinstance(keep, int) and not isinstance(keep, bool) and keep >= 1
    if not (ring or (isinstance(keep, str) and keep in ("pass", "all", "last"))):
        raise UsageError(
            f"keep={keep!r}: use 'pass', 'all', 'last' or a positive int N (a ring of N calls)"
        )
    if max_bytes is not None and (
        isinstance(max_bytes, bool) or not isinstance(max_bytes, numbers.Real) or max_bytes <= 0
    ):
        raise UsageError(
            f"max_bytes={max_bytes!r} must be a positive number of bytes (e.g. 2**30), not "
            f"{type(max_bytes).__name__}"
        )
    check_reduce(reduce)
    if stop and grads:
        raise UsageError(
            "stop=True ends the forward early, so no loss exists to take gradients of: "
            "use grads=True without stop=True"
        )


_version = _torch.version

#: Where a value comes from, for messages: (layer name, path such as ("output", 0)).
Where = tuple[str, Path]


def describe(where: Where) -> str:
    """``'layer' output[0]``."""
    layer, path = where
    return f"{layer!r} {path[0]}{_tree.path_str(path[1:])}"
