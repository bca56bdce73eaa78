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

_SLICE = 1 << 20  # elements per weighted sum
#: values per step of a sum on the CPU: under torch's grain size (32,768), so that each step
#: runs on this thread alone, its float64 copy in the cache (see :func:`_sums`)
_PIECE = (1 << 15) - 1


def fingerprint(model: nn.Module) -> str:
    """A hash of the parameters' and buffers' names, shapes, dtypes and values.

    Values enter through weighted sums: each run of up to 2**20 values of a tensor, dotted
    with fixed pseudo-random weights (``frac(i * golden ratio)``, one per position), so that a
    change of values, or a permutation of them, changes the result. That costs one read of the
    weights, on their device (as a plain sum would; MPS, which has no float64, on the CPU);
    the sums are read with one host transfer for the whole model and rounded to 7
    significant digits. They are accumulated in float64: a float32 sum of 2**20 values
    depends on how many threads add it up (the order of the additions), which changed the
    fingerprint of the same weights between a process with 1 torch thread and one with 2 and
    refused the resume. Wrappers
    (``torch.compile``, DataParallel) are seen through, so a compiled model resumes its eager
    twin's store.
    """
    root = unwrap(model)
    tensors = [(n, t) for n, t in root.state_dict(keep_vars=True).items() if isinstance(t, Tensor)]
    h = hashlib.sha256()
    for name, t in tensors:
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
    valued = [t.detach() for _, t in tensors if t.numel() and not t.is_meta]
    if valued:
        device = valued[0].device
        weights: dict[torch.device, Tensor] = {}
        with torch.no_grad():
            sums = torch.cat([_sums(t, weights).to(device) for t in valued])
        values = sums.tolist()  # the one read from the device
        h.update(repr([float(f"{v:.7g}") for v in values]).encode())
    return h.hexdigest()[:16]


def _sums(t: Tensor, weights: dict[torch.device, Tensor]) -> Tensor:
    """One weighted sum per run of ``_SLICE`` values of ``t`` (as float32, summed in float64).

    On the CPU each run is summed in pieces under torch's grain size, each on this thread:
    one float64 product into a buffer that stays in the cache, and its sum. Summing a run as
    a whole (its float64 copy, then ``torch.dot``) made two parallel operations of 8 MiB a
    run, each waiting at its end for torch's other threads: 1.0-4.0 s for GPT-2 small's
    weights on a busy 2-core machine (2-6% of extracting 65,536 tokens of its ``h.1``), where
    the pieces take 0.2-0.8 s. The sums differ from a whole run's only in the order of
    float64 additions (about 1e-14 of the value, far below the 7 digits kept)."""
    flat = (torch.view_as_real(t) if t.is_complex() else t).reshape(-1)
    if flat.device.type == "mps":  # no float64 there
        flat = flat.cpu()
    device = flat.device
    need = min(_SLICE, flat.numel())  # a prefix of the 2**20 weights: the same values, and a
    if device not in weights or len(weights[device]) < need:  # small model pays little
        i = torch.arange(1, need + 1, dtype=torch.float64, device=device)
        # in place: the same values as torch.frac(i * ...), with less fresh memory
        weights[device] = i.mul_(0.6180339887498949).frac_().float().double()
    w = weights[device]
    runs = [flat[i : i + _SLICE] for i in range(0, flat.numel(), _SLICE)]
    if device.type != "cpu":
        # float32 values (as before), then float64 sums: the same in every thread count
        return torch.stack([torch.dot(x.float().double(), w[: len(x)]) for x in runs])
    buffer = torch.empty(min(_PIECE, need), dtype=torch.float64)
    return torch.stack([_run_sum(x, w, buffer) for x in runs])


def _run_sum(run: Tensor, w: Tensor, buffer: Tensor) -> Tensor:
    """``run``'s values as float32 dotted with ``w``, in float64, piece by piece (see
    :func:`_sums`)."""
    parts = []
    for a in range(0, len(run), _PIECE):
        x = run[a : a + _PIECE].float()
        product = torch.mul(x, w[a : a + len(x)], out=buffer[: len(x)])  # exact in float64
        parts.append(product.sum())
    return torch.stack(parts).sum()


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
            shapes.append(
                f"{key}{'=' if key else ''}{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
            )
            h.update(f"{key}:{t.dtype}:{tuple(t.shape)};".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(f"{key}:{value!r};".encode())
    return f"{' '.join(shapes)} {h.hexdigest()[:12]}".strip()
