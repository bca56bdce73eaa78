"""Input-space methods: saliency and guided backpropagation, maps of shape ``(N, C, H, W)``.

Guided backpropagation (Springenberg et al., 2015) passes back, through every ReLU, only
positive gradients at positions where the ReLU's input was positive. hookscope applies that
rule where ReLUs are *called*, not where ``nn.ReLU`` modules sit: for the duration of the call
a ``TorchFunctionMode`` routes ``torch.relu``, ``torch.relu_``, ``F.relu`` (``inplace`` or
not), ``Tensor.relu`` and ``Tensor.relu_`` through a guided autograd function, so functional
ReLUs in a ``forward`` (DenseNet's ``F.relu(x, inplace=True)``) are guided too, and no module
is swapped. In-place calls keep their effect (the guided result is copied into the tensor).
GELU, SiLU and other smooth activations are left as they are (the guided rule is defined for
ReLU's zero region); if no ReLU runs at all, the call is refused rather than returning the
plain gradient under another name.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import FunctionInterceptor, call_model, run_eagerly
from ..errors import UsageError
from ._base import Explanation, evaluating, with_grad
from ._path import need_grad, scalable
from ._registry import MethodInfo, register
from ._session import Plain
from ._targets import Target, resolve

__all__ = ["GuidedBackprop", "InputMethod", "Saliency"]


class _GuidedReLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        positive = x > 0
        ctx.save_for_backward(positive)  # the mask, not x: an in-place caller may change x
        return x.clamp_min(0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (positive,) = ctx.saved_tensors
        out: Tensor = grad.clamp_min(0) * positive
        return out


_OUT_OF_PLACE = {torch.relu, Tensor.relu}
_IN_PLACE = {torch.relu_, Tensor.relu_, F.relu_}


class _Guide(FunctionInterceptor):
    """Routes every ReLU call through :class:`_GuidedReLU` and counts them."""

    def __init__(self) -> None:
        super().__init__()
        self.sites = 0

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        inplace = func in _IN_PLACE
        if func is F.relu:
            inplace = bool(kwargs.get("inplace", args[1] if len(args) > 1 else False))
        elif not inplace and func not in _OUT_OF_PLACE:
            return func(*args, **kwargs)
        self.sites += 1
        x = args[0]
        guided = _GuidedReLU.apply(x)  # type: ignore[no-untyped-call]
        return x.copy_(guided) if inplace else guided


class InputMethod:
    """Base of the input-space methods: ``Method(model)(x, targets=...) -> Explanation`` with
    ``raw`` and ``maps`` of the input's shape ``(N, C, H, W)``."""

    name: ClassVar[str] = ""

    def __init__(self, model: nn.Module) -> None:
        self._session = Plain(model)  # refuses a non-module, and what no session can follow
        self.model = model

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs; the
        first floating-point tensor is the image) for ``targets`` (see ``_targets``)."""
        image = scalable(x, type(self).__name__)
        target = resolve(targets, image.shape[0]).to(image.device)
        need_grad(type(self).__name__)
        inputs, leaf = with_grad(x, image)
        session = self._session
        with run_eagerly(self.model), evaluating(session), session, torch.enable_grad():
            with self._mode() as mode:
                s, index = target.score(call_model(self.model, inputs))
            self._check(mode)
            (grad,) = torch.autograd.grad(s.sum(), leaf)
        raw = self._attribute(grad.detach(), image)
        return Explanation(raw, raw, index, s.detach(), self.name, "<input>")

    def _mode(self) -> Any:
        return contextlib.nullcontext()

    def _check(self, mode: Any) -> None:
        return None

    def _attribute(self, grad: Tensor, image: Tensor) -> Tensor:
        return self.post(grad)

    def post(self, grad: Tensor) -> Tensor:
        """The map from the score's gradient w.r.t. the input: here the gradient itself
        (signed); a method that needs another map overrides it."""
        return grad


class Saliency(InputMethod):
    """Simonyan et al. (2014): the absolute gradient of the score w.r.t. the input.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> net = nn.Sequential(nn.Flatten(), nn.Linear(12, 3))
        >>> hs.Saliency(net)(torch.randn(2, 3, 2, 2), targets=1).raw.shape
        torch.Size([2, 3, 2, 2])
    """

    name = "saliency"

    def _attribute(self, grad: Tensor, image: Tensor) -> Tensor:
        return self.post(grad)

    def post(self, grad: Tensor) -> Tensor:
        """The absolute value of the score's gradient w.r.t. the input."""
        return grad.abs()


class GuidedBackprop(InputMethod):
    """Guided backpropagation (signed input gradients; see the module notes).

    Raises:
        UsageError: no ReLU ran in the forward, so there is nothing to guide.
    """

    name = "guided_backprop"

    def _mode(self) -> Any:
        return _Guide()

    def _check(self, mode: Any) -> None:
        if mode.sites == 0:
            raise UsageError(
                f"no ReLU ran in {type(self.model).__name__}'s forward, so guided "
                "backpropagation would be the plain gradient (GELU, SiLU and other smooth "
                "activations are not guided): use hs.Saliency"
            )


register(
    MethodInfo(
        "saliency",
        Saliency,
        "input",
        gradients=True,
        reference="Simonyan et al., Deep Inside Convolutional Networks, ICLR 2014",
        per_channel=True,
    )
)
register(
    MethodInfo(
        "guided_backprop",
        GuidedBackprop,
        "input",
        gradients=True,
        reference="Springenberg et al., Striving for Simplicity, ICLR 2015",
        per_channel=True,
    )
)
