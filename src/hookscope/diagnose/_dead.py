"""Dead units, per activation type: a channel is dead when no gradient passed through it, that
is when every output it gave lies where the activation's derivative is zero. The output tells
where, for the activations of ``torch.nn`` whose derivative is zero on a whole region:

========================================  ==================================================
activation                                no gradient passes where the output is
========================================  ==================================================
ReLU, Hardswish, Hardshrink, Softshrink   exactly 0 (the flat side)
ReLU6, Hardtanh                           ``min_val`` or ``max_val`` (0 or 6 for ReLU6)
Hardsigmoid                               0 or 1
Threshold (``value <= threshold``)        ``value``
Tanh                                      -1 or 1: saturated
Sigmoid                                   0 or 1: saturated
========================================  ==================================================

Tanh and sigmoid reach their bounds only in floating point: float32's ``tanh`` is exactly 1
from about 9.01 on, ``sigmoid`` from about 16.6 (float16: 4.5 and 8.3; bfloat16: 3.5 and
6.25), and torch's backward, computed from the output (``1 - y**2``, ``y * (1 - y)``), is then
exactly zero. So a tanh channel held at ``tanh(-1)`` is alive, one held at ``tanh(-100)`` is
dead. Activations whose derivative is nowhere zero on a region (GELU, SiLU, Mish, ELU, CELU,
SELU, LeakyReLU, PReLU, RReLU, Softplus, Softsign, LogSigmoid, Tanhshrink, GLU) have no dead
units, and no ``dead`` statistic; neither have other layers, or activations torch does not
ship (their derivative is unknown here).
"""

from __future__ import annotations

from torch import nn

from ._stats import Flat

__all__ = ["no_gradient_at"]

_ZERO = Flat(zero=True)


def no_gradient_at(module: nn.Module) -> Flat | None:
    """Where ``module``'s outputs pass no gradient (see the module docstring), or None when
    it has no dead units."""
    if isinstance(module, (nn.ReLU, nn.Hardswish, nn.Hardshrink, nn.Softshrink)):
        return _ZERO
    if isinstance(module, nn.Hardtanh):  # ReLU6 too
        return Flat(low=float(module.min_val), high=float(module.max_val))
    if isinstance(module, (nn.Hardsigmoid, nn.Sigmoid)):
        return Flat(low=0.0, high=1.0)
    if isinstance(module, nn.Tanh):
        return Flat(low=-1.0, high=1.0)
    if isinstance(module, nn.Threshold) and module.value <= module.threshold:
        return Flat(low=float(module.value))
    return None
