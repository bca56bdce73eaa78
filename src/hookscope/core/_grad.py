"""Tensor-level gradient hooks: the gradient of any intermediate tensor, or a rewrite of it."""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import torch
from torch import Tensor

from ..errors import GradientUnavailableError, UsageError
from ._edit import call_checked
from ._lifetime import HookSet

__all__ = ["GradHook", "grad_of", "on_grad"]


class GradHook:
    """A hook on one tensor's gradient, installed like every session: by a ``with`` block (or
    :meth:`open`), removed when it exits (or by :meth:`close`).

    Attributes:
        count: how many gradients have arrived.
    """

    def __init__(self, tensor: Tensor, fn: Callable[[Tensor], Tensor | None] | None) -> None:
        if not isinstance(tensor, Tensor):
            raise UsageError(f"expected a tensor, got {type(tensor).__name__}")
        if not tensor.requires_grad:
            raise GradientUnavailableError(
                f"this {tuple(tensor.shape)} tensor will never have a gradient: "
                + _why_not_requires_grad(tensor)
            )
        self._tensor, self._fn = tensor, fn
        self._grad: Tensor | None = None
        self.count = 0
        self._hooks: HookSet | None = None
        self._opened = False

    def _on_grad(self, grad: Tensor) -> Tensor | None:
        self.count += 1
        self._grad = grad.detach().clone()
        if self._fn is None:
            return None
        return call_checked(self._fn, grad, "the gradient function", grad=True, allow_none=True)

    @property
    def grad(self) -> Tensor:
        """The latest gradient that arrived (before any rewrite by ``fn``)."""
        if self._grad is None:
            if not self._opened:
                raise GradientUnavailableError(
                    "the gradient hook was never installed: use it as a context manager "
                    "(`with hs.grad_of(t) as g: ...`) or call .open() before the backward"
                )
            raise GradientUnavailableError(
                "no gradient has arrived yet: call .backward() on a loss that depends on this "
                "tensor first"
            )
        return self._grad

    def open(self) -> GradHook:
        """Install the hook (``with`` does this); pair with :meth:`close`. Idempotent."""
        if self._hooks is None:
            self._hooks = HookSet()
            self._hooks.tensor(self._tensor, self._on_grad)
            self._opened = True
        return self

    def close(self) -> None:
        """Remove the hook; idempotent. Gradients already computed are unaffected."""
        hooks, self._hooks = self._hooks, None
        if hooks is not None:
            hooks.close()

    def __enter__(self) -> GradHook:
        return self.open()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def _why_not_requires_grad(t: Tensor) -> str:
    if t.is_inference():
        return "it was made under torch.inference_mode()"
    if not (t.is_floating_point() or t.is_complex()):
        return f"it is a {t.dtype} tensor; only floating-point tensors have gradients"
    if not torch.is_grad_enabled():
        return "gradients are disabled here (torch.no_grad()); make it with gradients enabled"
    return (
        "it does not require grad: it was made under torch.no_grad(), or .detach()ed, or only "
        "from tensors that do not require grad. Make it with gradients enabled from a tensor "
        "that requires grad, or call .requires_grad_() on a leaf."
    )


def grad_of(tensor: Tensor) -> GradHook:
    """Record the gradient of any tensor (intermediate included) without ``retain_grad()``.

    Example:
        >>> import torch, hookscope as hs
        >>> x = torch.tensor(2.0, requires_grad=True)
        >>> z = x * 3
        >>> with hs.grad_of(z) as g:
        ...     (z * z).backward()
        >>> g.grad
        tensor(12.)
    """
    return GradHook(tensor, None)


def on_grad(tensor: Tensor, fn: Callable[[Tensor], Tensor | None]) -> GradHook:
    """Rewrite the gradient flowing through ``tensor``: ``fn(grad)`` returns the new gradient
    (or ``None`` to leave it). ``fn`` must return a new tensor, not modify ``grad`` in place.

    Example:
        >>> import torch, hookscope as hs
        >>> x = torch.tensor(2.0, requires_grad=True)
        >>> z = x * 3
        >>> with hs.on_grad(z, lambda g: 2 * g):
        ...     z.backward()
        >>> x.grad
        tensor(6.)
    """
    return GradHook(tensor, fn)
