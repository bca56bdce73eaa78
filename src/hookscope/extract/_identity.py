"""What a store remembers of the run that made it, so that a resume with another model or other
inputs is refused: a fingerprint of the model's weights and a probe of its first input."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..core import unwrap

__all__ = ["fingerprint", "probe"]

#: Weights of the position-sensitive sum: frac(i * golden ratio), the same on every device.
_GOLDEN = 0.6180339887498949
_SLICE = 1 << 22  # elements per step: bounds the float64 temporaries (32 MiB)


def fingerprint(model: nn.Module) -> str:
    """A hash of the parameters' and buffers' names, shapes, dtypes and values.

    Values enter through three sums per tensor (of ``x``, of ``x²`` and of ``x`` weighted by a
    fixed pseudo-random weight per position, so a permutation of the values changes it),
    computed in float64 on the tensor's device and read with one host transfer for the whole
    model. Sums are rounded to 10 significant digits: the same weights give the same
    fingerprint even where a device sums in another order. Wrappers (``torch.compile``,
    DataParallel) are seen through, so a compiled model resumes its eager twin's store.
    """
    root = unwrap(model)
    tensors = [(n, t) for n, t in root.state_dict(keep_vars=True).items() if isinstance(t, Tensor)]
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    valued = [t for _, t in tensors if t.numel() and not t.is_meta]
    if valued:
        device = valued[0].device
        with torch.no_grad():
            sums = torch.cat([_sums(t).to(device) for t in valued])
        values = sums.tolist()  # the one read from the device
        h.update(repr([float(f"{v:.10g}") for v in values]).encode())
    return h.hexdigest()[:16]


def _sums(t: Tensor) -> Tensor:
    flat = (torch.view_as_real(t) if t.is_complex() else t).detach().reshape(-1)
    total = torch.zeros(3, dtype=torch.float64, device=flat.device)
    for start in range(0, flat.numel(), _SLICE):
        x = flat[start : start + _SLICE].to(torch.float64)
        w = torch.arange(start + 1, start + 1 + x.numel(), dtype=torch.float64, device=x.device)
        w = torch.frac(w * _GOLDEN)
        total += torch.stack([x.sum(), torch.dot(x, x), torch.dot(x, w)])
    return total


def probe(first: Any) -> str | None:
    """A digest of one sample's model input (a tensor or a mapping of them): its dtype, shape
    and bytes. It changes with the transform, the image size, the tokenizer or the order."""
    if first is None:
        return None
    items = sorted(first.items()) if isinstance(first, Mapping) else [("", first)]
    h = hashlib.sha256()
    shapes = []
    for key, value in items:
        if isinstance(value, Tensor):
            t = value.detach().cpu().contiguous()
            shapes.append(f"{key}{'=' if key else ''}{str(t.dtype).replace('torch.', '')}"
                          f"{list(t.shape)}")  # fmt: skip
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}:{value!r};".encode())
    return f"{' '.join(shapes)} {h.hexdigest()[:12]}".strip()
