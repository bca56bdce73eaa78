"""The logit lens: each layer's residual stream read out through the model's final norm and
unembedding: the norm applied as it is (TransformerLens 3.x's ``accumulated_resid(
apply_ln=True)`` at the unembedding), or with its scale frozen at the full forward's (its
``apply_ln_to_stack``, the convention of direct logit attribution)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..core import (
    Binder,
    LayerSelector,
    capture,
    keep_mask,
    last_positions,
    run_eagerly,
    unwrap,
)
from ..errors import UsageError
from ._patching import _run


@dataclass(frozen=True)
class Lens:
    """What :func:`logit_lens` read: ``logits[i]`` is ``layers[i]``'s residual stream through
    the final norm and the unembedding.

    Attributes:
        logits: ``(len(layers), batch, len(positions), vocabulary)``.
        layers: the layers, canonical names in selection order.
        positions: the positions read (non-negative), sample 0's with ``positions="last"``.
        index: ``(batch, len(positions))``, the position each column of ``logits`` read in
            each sample: ``positions`` on every row, but with ``positions="last"`` (each
            sample's last real token). None in a lens built by hand: ``positions``.
    """

    logits: Tensor
    layers: tuple[str, ...]
    positions: tuple[int, ...]
    index: Tensor | None = None

    def to_text(
        self,
        tokenizer: Any = None,
        *,
        tokens: Sequence[str] | None = None,
        k: int = 1,
        sample: int = 0,
    ) -> str:
        """A plain-text table of one sample: a row per layer, a column per position, the ``k``
        likeliest tokens with their probabilities (``tokenizer``: a Hugging Face tokenizer or
        a function of a token id; ``tokens``: one label per position of the input)."""
        from ._tables import lens_text

        at = self.positions
        if self.index is not None and 0 <= sample < self.index.shape[0]:
            at = tuple(int(p) for p in self.index[sample])  # "last": this sample's own
        return lens_text(
            self.logits,
            self.layers,
            at,
            tokenizer=tokenizer,
            tokens=tokens,
            k=k,
            sample=sample,
        )


def logit_lens(
    model: nn.Module,
    inputs: Any,
    layers: LayerSelector,
    *,
    norm: str,
    unembed: str,
    positions: int | Sequence[int] | Literal["last"] | None = None,
    scale: Literal["own", "frozen"] = "own",
) -> Lens:
    """The logit lens: what each layer's residual stream would predict if the model stopped
    there.

    One forward records each layer's output (the residual stream, ``(batch, positions,
    width)``); each is put through the final norm and the unembedding module. With
    ``scale="own"`` the norm runs as it is, on each stream's own statistics (TransformerLens
    3.x's ``accumulated_resid(apply_ln=True)`` followed by the unembedding). With
    ``scale="frozen"`` every stream is divided by the final norm's scale of that forward (per
    sample and position), centred first for a LayerNorm, then the norm's weight and bias are
    applied (TransformerLens' ``apply_ln_to_stack``): the convention that makes the parts of
    the stream add up, as direct logit attribution needs. Either way the last layer's row is
    the model's own logits when the last layer is the stream the norm reads.

    Args:
        model: the model (its forward runs once, under ``torch.no_grad()``).
        inputs: a tensor (``model(x)``), a dict (``model(**x)``) or a tuple (``model(*x)``).
        layers: the layers whose outputs are the residual stream: for a Hugging Face GPT-2,
            ``"transformer.drop"`` (before block 0) and ``"transformer.h.{i}"``.
        norm: the final norm's name (``"transformer.ln_f"``, ``"model.norm"``).
        unembed: the unembedding module's name (``"lm_head"``).
        positions: read only these positions, as ``hookscope.capture(positions=)`` takes
            them (and checked by it): an index, a list of them (negative from the end), or
            ``"last"``, each sample's last real token (the last its ``attention_mask``
            keeps, left or right padding); default every position.
        scale: ``"own"`` or ``"frozen"``, see above (``"frozen"`` needs a LayerNorm or an
            RMSNorm).

    Returns:
        A :class:`Lens`: ``logits`` of shape ``(layers, batch, positions, vocabulary)``
        (one position with an int or ``"last"``).

    Raises:
        UsageError: a layer whose output is not a tensor of the final norm's input's shape,
            positions that ``hookscope.capture`` refuses (out of range, ``"first"``, twice,
            an empty list; ``"last"`` with a mask that does not fit), a frozen scale for a
            norm that is neither a LayerNorm nor an RMSNorm.
    """
    if scale not in ("own", "frozen"):
        raise UsageError(f"scale must be 'own' or 'frozen', not {scale!r}")
    module = _module(model, norm, "norm")
    head = _module(model, unembed, "unembed")
    kind = _norm_kind(module, norm) if scale == "frozen" else None
    with (
        run_eagerly(model),
        torch.no_grad(),
        # the capture narrows the streams to the positions, with its own checks and meaning
        capture(model, layers, positions=positions, recompile=True, this_thread=True) as streams,
        capture(model, norm, inputs=True, recompile=True, this_thread=True) as n,
    ):
        _run(model, inputs)
    names = tuple(streams.records)
    bound = n[norm].inputs  # its arguments by name: the first tensor is the stream
    values = bound.values() if isinstance(bound, Mapping) else [bound]
    full = next((v for v in values if isinstance(v, Tensor)), None)
    if not isinstance(full, Tensor) or full.dim() < 2:
        raise UsageError(f"logit_lens: the input of {norm!r} is not one tensor: {type(bound)}")
    index = _index(model, inputs, positions, full)
    # the positions (axis 1) the capture kept, whatever axes follow them
    spread = index.view(*index.shape, *(1,) * (full.dim() - 2))
    final = full.gather(1, spread.expand(-1, -1, *full.shape[2:]))
    rows = []
    with torch.no_grad():
        apply, unembedding = _ours(module), _ours(head)
        bias = _norm_bias(apply, final)  # once: the same for every layer
        for name in names:
            r = streams[name].output
            if not isinstance(r, Tensor) or r.shape != final.shape:
                shape = tuple(r.shape) if isinstance(r, Tensor) else type(r)
                raise UsageError(
                    f"logit_lens: {name!r} returned {shape} at the positions read, the final "
                    f"norm's input {tuple(final.shape)}: choose layers whose output is the "
                    "residual stream"
                )
            normed = apply(r) if kind is None else _frozen(apply, r, final, *kind, bias)
            rows.append(unembedding(normed))
    return Lens(torch.stack(rows), names, tuple(int(p) for p in index[0]), index)


def _index(model: nn.Module, inputs: Any, positions: Any, full: Tensor) -> Tensor:
    """``(batch, k)``: the positions of ``full`` (the final norm's input) that the capture
    kept of each stream, which already checked them: ``"last"`` from the mask the capture
    read (the model's ``attention_mask``, its arguments bound by name), else the indices."""
    n, length = full.shape[:2]
    steps = torch.arange(length, device=full.device).expand(n, length)
    if positions is None:
        return steps
    if positions != "last":
        listed = [positions] if isinstance(positions, int) else positions
        return steps[:, [p % length for p in listed]]
    if isinstance(inputs, Mapping):
        bound = Binder(unwrap(model)).bind((), dict(inputs))
    else:
        bound = Binder(unwrap(model)).bind(inputs if isinstance(inputs, tuple) else (inputs,), {})
    # the capture's own reading of the mask (its window of the call's last positions)
    return last_positions(keep_mask(bound), n, length, full.device)[:, None]


def _frozen(
    module: Callable[[Tensor], Tensor],
    r: Tensor,
    final: Tensor,
    centred: bool,
    eps: float,
    bias: Tensor,
) -> Tensor:
    """The norm of ``r`` with the scale it had on ``final``: ``r`` (centred for a LayerNorm)
    divided by that scale, then the norm's affine part (its own scale of the result undone;
    ``bias``: :func:`_norm_bias`)."""
    v = (r - r.mean(-1, keepdim=True) if centred else r) / _scale(final, centred, eps)
    out: Tensor = (module(v) - bias) * _scale(v, centred, eps) + bias
    return out


def _norm_bias(module: Callable[[Tensor], Tensor], like: Tensor) -> Tensor:
    """What the norm adds to a stream shaped as ``like``'s last axis: its bias, or 0."""
    return module(like.new_zeros(1, 1, like.shape[-1]))


def _ours(module: nn.Module) -> Callable[[Tensor], Tensor]:
    """``module``'s forward, not its ``__call__``: what a lens computes with the model's
    modules after the forward is none of the model's calls, so no hook (the user's, another
    session's, an edit's) sees or changes it."""
    forward: Callable[[Tensor], Tensor] = module.forward
    return forward


def _module(model: nn.Module, name: str, what: str) -> nn.Module:
    if not isinstance(name, str):
        raise UsageError(f"{what} must be a module's name, not {name!r}")
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise UsageError(f"{what}: the model has no module {name!r}") from None


def _norm_kind(module: nn.Module, name: str) -> tuple[bool, float]:
    """(centred: a LayerNorm, eps) of the final norm."""
    kind = type(module).__name__
    if isinstance(module, nn.LayerNorm) or kind.endswith("LayerNorm"):
        centred = True
    elif kind.endswith("RMSNorm"):
        centred = False
    else:
        raise UsageError(
            f"logit_lens: {name!r} is a {kind}; the final norm must be a LayerNorm or an "
            "RMSNorm (its scale is frozen at the forward's)"
        )
    eps = getattr(module, "eps", None)
    eps = getattr(module, "variance_epsilon", None) if eps is None else eps
    weight = getattr(module, "weight", None)
    dtype = weight.dtype if isinstance(weight, Tensor) else torch.float32
    return centred, float(torch.finfo(dtype).eps if eps is None else eps)


def _scale(x: Tensor, centred: bool, eps: float) -> Tensor:
    if centred:
        return (x.var(-1, unbiased=False, keepdim=True) + eps).sqrt()
    return (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()
