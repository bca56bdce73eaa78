"""Errors raised by hookscope.

Every error is a :class:`HookscopeError` and also subclasses the built-in a caller would catch
for the same kind of problem, so ``except LookupError`` keeps working::

    HookscopeError (Exception)
    ├── UsageError (ValueError, TypeError)    an argument hookscope cannot use (caught early)
    ├── LayerNotFoundError (KeyError)         a selector or a record key matched no layer
    ├── CaptureError (RuntimeError)           a captured value cannot be returned
    │   ├── GradientUnavailableError          the gradient cannot exist, or never arrived
    │   └── StaleCaptureError                 a by-reference capture was modified in place
    ├── CaptureBudgetError (MemoryError)      storing the next tensor would exceed max_bytes
    ├── EditError (ValueError)                an edit would change shape/dtype, or is ambiguous
    ├── CompiledModelError (RuntimeError)     hooks would be silently ignored by torch.compile
    ├── UnsupportedModelError (RuntimeError)  the model runs in a way hookscope cannot follow
    ├── TorchCompatError (RuntimeError)       this torch lacks an internal hookscope relies on
    └── NonFiniteError (FloatingPointError, RuntimeError)
                                              a NaN/Inf appeared (hs.nonfinite names its source)

Failures raised by the user's model or callbacks are never wrapped: they propagate unchanged,
with a note (``add_note``) naming the layer hookscope was handling when it happened.
"""

from __future__ import annotations

__all__ = [
    "CaptureBudgetError",
    "CaptureError",
    "CompiledModelError",
    "EditError",
    "GradientUnavailableError",
    "HookscopeError",
    "LayerNotFoundError",
    "NonFiniteError",
    "StaleCaptureError",
    "TorchCompatError",
    "UnsupportedModelError",
    "UsageError",
]


class HookscopeError(Exception):
    """Base class of every error hookscope raises itself."""


class UsageError(HookscopeError, ValueError, TypeError):
    """An argument has a type or value hookscope cannot use; raised before anything runs."""


class LayerNotFoundError(HookscopeError, KeyError):
    """A layer selector, or a key into a capture, matched no module of the model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class CaptureError(HookscopeError, RuntimeError):
    """A captured value was asked for that hookscope cannot return."""


class GradientUnavailableError(CaptureError):
    """A gradient was asked for that cannot exist, or has not been computed."""


class StaleCaptureError(CaptureError):
    """A tensor captured with ``copy="reference"`` was modified in place after capture."""


class CaptureBudgetError(HookscopeError, MemoryError):
    """Storing the next captured tensor would exceed the capture's ``max_bytes``."""


class EditError(HookscopeError, ValueError):
    """An edit is ambiguous or would change a tensor's shape, dtype or device."""


class CompiledModelError(HookscopeError, RuntimeError):
    """The model was compiled and already ran, so new hooks would be silently ignored."""


class UnsupportedModelError(HookscopeError, RuntimeError):
    """The model runs in a way hookscope cannot follow correctly (e.g. several replicas)."""


class TorchCompatError(HookscopeError, RuntimeError):
    """This PyTorch lacks a private internal hookscope relies on (see ``core/_torch.py``)."""


class NonFiniteError(HookscopeError, FloatingPointError, RuntimeError):
    """A NaN or Inf appeared in a forward or backward watched by :func:`hookscope.nonfinite`,
    or in the gradients :func:`hookscope.clip_grad_norm` was asked to clip.

    A ``RuntimeError`` too, as torch raises for the same finding
    (``clip_grad_norm_(error_if_nonfinite=True)``, ``detect_anomaly``), so code written for
    torch's error catches this one.

    Attributes:
        phase: ``"forward"`` or ``"backward"``.
        module: the producing module's dotted name (``""`` for the model's own forward),
            ``"<input>"`` when the value came in with the inputs, ``"<loss>"`` when it came in
            as the gradient of the model's outputs.
        call: which call of that module (1-based), or None.
        op: the operator that produced it (e.g. ``"aten.div"``), or None if not found.
        stats: ``{"inputs": {...}, "outputs": {...}}`` of finite/non-finite statistics.
        rank: under sharded training (FSDP2), the rank whose values held it first (the same
            error is raised on every rank); None otherwise.
        step: which forward or backward of the :func:`hookscope.nonfinite` session (1-based),
            or None.
    """

    def __init__(
        self,
        message: str,
        *,
        phase: str,
        module: str,
        call: int | None = None,
        op: str | None = None,
        stats: dict[str, object] | None = None,
        rank: int | None = None,
        step: int | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.step = step
        self.phase = phase
        self.module = module
        self.call = call
        self.op = op
        self.stats = stats if stats is not None else {}
