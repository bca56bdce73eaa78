"""Direct logit attribution: how much each attention head, each MLP and the embeddings write
along a logit direction, through the final norm with its scale frozen at the full forward's
(TransformerLens 3.x's ``logit_attrs`` of ``get_full_resid_decomposition``, on the unmodified
model).

Each head's part of the residual stream is its output before the output projection (the SDPA
call's ``(N, H, T, d)``: TransformerLens' ``hook_z``) through its slice of that projection;
the projection's bias is a part of its own. With the final norm's scale frozen, the norm is
linear in the stream, so the parts' attributions add up to the model's own logit (difference).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..core import Layers, LayerSelector, capture, keep_mask, run_eagerly
from ..errors import LayerNotFoundError, UsageError
from ._lens import _frozen, _module, _norm_bias, _norm_kind, _ours
from ._patching import _positions as _grid
from ._patching import _run

#: what a direction reads from a ``(..., vocabulary)`` tensor: ``(...)``
Readout = Callable[[Tensor], Tensor]
SDPA = "scaled_dot_product_attention"


@dataclass(frozen=True)
class LogitAttribution:
    """What :func:`logit_attribution` found: ``values[k]`` is what component ``labels[k]``
    writes along the direction, per sample and position; ``values.sum(0)`` is ``logits``.

    Components, in order: each head of each attention layer (``"<projection> head <h>"``),
    each output projection's bias (``"<projection> bias"``), each MLP, each embedding, and
    the final norm's and the unembedding's biases (``"<norm> + <unembed> bias"``).

    Attributes:
        values: ``(components, batch, positions)``.
        labels: each component's name.
        logits: ``(batch, positions)``: the model's own logit (difference, or the vector's
            product with the logits) there, through its final norm and unembedding.
        positions: ``(batch, positions)``: the positions read in each sample.
        attention: the output projections, in selection order.
        heads: the number of heads of each.
    """

    values: Tensor
    labels: tuple[str, ...]
    logits: Tensor
    positions: Tensor
    attention: tuple[str, ...]
    heads: int

    @property
    def by_head(self) -> Tensor:
        """The heads' values: ``(len(attention), heads, batch, positions)``."""
        return self.values[: len(self.attention) * self.heads].reshape(
            len(self.attention), self.heads, *self.values.shape[1:]
        )

    def of(self, label: str) -> Tensor:
        """One component's values, ``(batch, positions)``."""
        if label not in self.labels:
            raise UsageError(f"no component {label!r}; the components are {list(self.labels)}")
        return self.values[self.labels.index(label)]


def logit_attribution(
    model: nn.Module,
    inputs: Any,
    direction: Any,
    *,
    attention: LayerSelector,
    mlps: LayerSelector,
    embeddings: LayerSelector,
    norm: str,
    unembed: str,
    positions: int | Sequence[int] | str | None = "last",
) -> LogitAttribution:
    """Direct logit attribution: what each attention head, each MLP and each embedding
    writes into the residual stream, read along a logit direction through the final norm
    with its scale frozen at the full forward's (TransformerLens' ``logit_attrs``).

    One forward (under ``torch.no_grad()``) records each output projection's input and the
    SDPA call of the module that owns it (each head's output ``(N, H, T, d)``), each MLP's and
    embedding's output and the final norm's input. Each head's part of the stream is its
    output through its slice of the output projection; the projection's bias is its own
    component (TransformerLens adds all of them into one ``bias`` row). Every part is then
    centred (for a LayerNorm) and divided by the final norm's scale of that forward, times
    the norm's weight, and read along the direction through the unembedding's weight; the
    final norm's and the unembedding's biases are the last component. The parts must add up
    to the final norm's input (checked): the values then add up to the model's own logit
    (difference). Call ``model.eval()`` first: dropout breaks the sum. The norm, the
    projections and the unembedding are applied after the forward with their ``forward``,
    so hooks and sessions open on the model see the one forward only.

    Args:
        model: the model (its forward runs once).
        inputs: a tensor (``model(x)``), a dict (``model(**x)``) or a tuple (``model(*x)``).
        direction: what to attribute: a token id (its logit), ids per sample ``(batch,)`` or
            per sample and position ``(batch, positions)``, a pair ``(a, b)`` of those (the
            logit difference ``a - b``), or a float vector over the vocabulary,
            ``(vocabulary,)`` or ``(batch, positions, vocabulary)`` (its product with the
            logits).
        attention: the attention layers' output projections, each of whose input is every
            head's output side by side, owned by the module that calls SDPA: for a Hugging
            Face GPT-2 ``"transformer.h.*.attn.c_proj"``, for Llama
            ``"model.layers.*.self_attn.o_proj"``.
        mlps: the MLPs, whose outputs are added to the stream (``"transformer.h.*.mlp"``);
            ``[]`` for none.
        embeddings: the modules whose outputs start the stream, ``(batch or 1, positions,
            width)`` or ``(positions, width)``: GPT-2's ``["transformer.wte",
            "transformer.wpe"]``, Llama's ``"model.embed_tokens"``.
        norm: the final norm's name (a LayerNorm or an RMSNorm).
        unembed: the unembedding module's name (``"lm_head"``); linear.
        positions: ``"last"`` (default: each sample's last real token, from the inputs'
            ``attention_mask``; without one, the last position), an index or a list of
            indices (negative from the end), or None for every position.

    Returns:
        A :class:`LogitAttribution`: ``values`` of shape ``(components, batch, positions)``.

    Raises:
        UsageError: bad arguments; a module that does not run once per forward, an output
            projection whose input is not its owner's SDPA output side by side, parts that
            do not add up to the final norm's input (a part of the stream not named, or
            dropout), a call under ``torch.inference_mode()``.
    """
    if torch.is_inference_mode_enabled():
        raise UsageError(
            "logit_attribution reads the unembedding's weight through autograd, which "
            "torch.inference_mode() turns off: call it outside (torch.no_grad() is fine)"
        )
    layers = Layers(model)
    projections = list(layers.select(attention)) if _given(attention) else []
    sites = {p: f"{p.rpartition('.')[0]}::{SDPA}" for p in projections}
    mlp_names = list(layers.select(mlps)) if _given(mlps) else []
    embedding_names = list(layers.select(embeddings)) if _given(embeddings) else []
    norm_module = _module(model, norm, "norm")
    centred, eps = _norm_kind(norm_module, norm)
    normed, head = _ours(norm_module), _ours(_module(model, unembed, "unembed"))
    out, inp = _record(
        model, inputs, [*sites.values(), *mlp_names, *embedding_names], [*projections, norm]
    )
    final = _first_tensor(_once(inp, norm).inputs, norm)
    at = _positions(positions, inputs, final)
    take = _taker(at)
    stream = take(final)  # (N, P, D)
    readout = _readout(direction, head, stream)
    u = _unembedding_direction(head, readout, stream)
    with torch.no_grad():
        bias = _norm_bias(normed, stream)

        def attribute(parts: Tensor) -> Tensor:  # (..., N, P, D) -> (..., N, P)
            linear = _frozen(normed, parts, stream, centred, eps, bias) - bias
            return (linear * u).sum(-1)

        modules = {p: _ours(layers.modules[p]) for p in projections}
        total = torch.zeros_like(stream)  # the parts' sum, to check
        heads, own = _attention(modules, sites, out, inp, take, attribute, total)
        rest = []
        for name in [*mlp_names, *embedding_names]:
            part = take(_stream_part(_once(out, name).output, name, final))
            rest.append(attribute(part))
            total += part
        _check_sum(total, stream)
        end = readout(head(bias.expand_as(stream)))  # the norm's bias, the unembedding's
        logits = readout(head(normed(stream)))
    n_heads = heads[0].shape[0] if heads else 0
    labels = [f"{p} head {h}" for p in projections for h in range(n_heads)]
    labels += [f"{p} bias" for p in projections] + mlp_names + embedding_names
    labels.append(f"{norm} + {unembed} bias")
    values = torch.cat([*heads, torch.stack([*own, *rest, end])])
    return LogitAttribution(values, tuple(labels), logits, at, tuple(projections), n_heads)


def _attention(
    projections: Mapping[str, Callable[[Tensor], Tensor]],
    sites: Mapping[str, str],
    out: Any,
    inp: Any,
    take: Callable[[Tensor], Tensor],
    attribute: Callable[[Tensor], Tensor],
    total: Tensor,
) -> tuple[list[Tensor], list[Tensor]]:
    """Per attention layer: its heads' values ``(H, N, P)`` and its bias's ``(N, P)``; their
    parts of the stream are added to ``total``."""
    heads: list[Tensor] = []
    own: list[Tensor] = []
    for name, site in sites.items():
        z = _once(out, site).output
        given = _first_tensor(_once(inp, name).inputs, name)
        parts, bias = _head_parts(projections[name], name, site, z, given, take)
        if heads and parts.shape[0] != heads[0].shape[0]:
            raise UsageError(
                f"logit_attribution: {site!r} has {parts.shape[0]} heads, the first "
                f"attention layer {heads[0].shape[0]}"
            )
        heads.append(attribute(parts))
        own.append(attribute(bias.expand_as(parts[0])))
        total += parts.sum(0) + bias
    return heads, own


def _record(model: nn.Module, inputs: Any, outputs: list[str], given: list[str]) -> tuple[Any, Any]:
    """One forward: the outputs of ``outputs`` and the inputs of ``given``."""
    try:
        with (
            run_eagerly(model),
            torch.no_grad(),
            capture(model, outputs, recompile=True, this_thread=True) as out,
            capture(model, given, inputs=True, recompile=True, this_thread=True) as inp,
        ):
            _run(model, inputs)
    except LayerNotFoundError as e:
        if f"::{SDPA}" not in str(e):
            raise
        raise LayerNotFoundError(
            f"logit_attribution: {e.args[0]} Each output projection of attention= must belong "
            "to the module that calls F.scaled_dot_product_attention (Hugging Face: "
            'attn_implementation="sdpa", the default)'
        ) from None
    return out, inp


def _given(selector: LayerSelector) -> bool:
    return not (isinstance(selector, (list, tuple)) and not selector)


def _once(cap: Any, name: str) -> Any:
    """The one call of ``name`` in the forward."""
    record = cap[name]
    if record.count != 1:
        raise UsageError(
            f"logit_attribution: {name!r} ran {record.count} times in the forward; each part "
            "of the residual stream must run once"
        )
    return record.calls[0]


def _first_tensor(bound: Any, name: str) -> Tensor:
    values = bound.values() if isinstance(bound, Mapping) else [bound]
    found = next((v for v in values if isinstance(v, Tensor)), None)
    if not isinstance(found, Tensor) or found.dim() != 3:
        what = tuple(found.shape) if isinstance(found, Tensor) else type(bound).__name__
        raise UsageError(
            f"logit_attribution: the input of {name!r} is {what}; it must be one tensor "
            "(batch, positions, width)"
        )
    return found


def _positions(positions: Any, inputs: Any, final: Tensor) -> Tensor:
    """``(N, P)``: the positions read in each sample."""
    n, t = final.shape[:2]
    if positions is None:
        return torch.arange(t, device=final.device).expand(n, t)
    if isinstance(positions, str):
        if positions != "last":
            raise UsageError(
                f'positions must be "last", an int, a list of ints or None, not {positions!r}'
            )
        return _last(inputs, n, t, final.device)
    listed = (
        [positions] if isinstance(positions, int) and not isinstance(positions, bool) else positions
    )
    grid = _grid(listed, t)
    return torch.tensor(grid, device=final.device).expand(n, len(grid))


def _last(inputs: Any, n: int, t: int, device: torch.device) -> Tensor:
    """Each sample's last real token, from the inputs' attention mask (else position t - 1)."""
    mask = keep_mask(inputs)
    if mask is None:
        return torch.full((n, 1), t - 1, device=device)
    if tuple(mask.shape) != (n, t):
        raise UsageError(
            f'positions="last": the attention mask is {tuple(mask.shape)}, the stream '
            f"({n}, {t}): give the mask of these inputs, or positions by index"
        )
    mask = mask.to(device)
    if not bool(mask.any(1).all()):
        raise UsageError('positions="last": a sample of the attention mask has no real token')
    return (t - 1 - mask.flip(1).int().argmax(1))[:, None]


def _taker(at: Tensor) -> Callable[[Tensor], Tensor]:
    """``x (N or 1, T, ...) -> (N, P, ...)`` at each sample's positions."""
    rows = torch.arange(at.shape[0], device=at.device)[:, None]

    def take(x: Tensor) -> Tensor:
        x = x.expand(at.shape[0], *x.shape[1:])
        return x[rows.to(x.device), at.to(x.device)]

    return take


def _readout(direction: Any, head: Callable[[Tensor], Tensor], stream: Tensor) -> Readout:
    """The direction as a linear function of the logits ``(N, P, V) -> (N, P)``."""
    n, p = stream.shape[:2]
    with torch.no_grad():
        vocabulary = head(stream[:1, :1]).shape[-1]
    if isinstance(direction, tuple):
        if len(direction) != 2:
            raise UsageError(
                f"direction: a tuple is a pair (a, b) of token ids (the logit difference "
                f"a - b), not {len(direction)} items"
            )
        a, b = (_ids(d, n, p, vocabulary, stream.device) for d in direction)
        return lambda y: y.gather(-1, a).squeeze(-1) - y.gather(-1, b).squeeze(-1)
    if isinstance(direction, Tensor) and direction.is_floating_point():
        if direction.shape not in ((vocabulary,), (n, p, vocabulary)):
            raise UsageError(
                f"direction: a float vector over the vocabulary must be ({vocabulary},) or "
                f"({n}, {p}, {vocabulary}), not {tuple(direction.shape)}"
            )
        v = direction.to(stream.device)
        return lambda y: (y * v.to(y.dtype)).sum(-1)
    ids = _ids(direction, n, p, vocabulary, stream.device)
    return lambda y: y.gather(-1, ids).squeeze(-1)


def _ids(given: Any, n: int, p: int, vocabulary: int, device: torch.device) -> Tensor:
    """Token ids as ``(N, P, 1)``, from an id, ``(N,)`` or ``(N, P)``."""
    if isinstance(given, (bool, str, bytes)) or not isinstance(given, (int, Sequence, Tensor)):
        raise UsageError(
            "direction must be a token id, ids per sample, a pair (a, b) of those, or a float "
            f"vector over the vocabulary, not {given!r}"
        )
    try:
        ids = torch.as_tensor(given, device=device)
    except (TypeError, ValueError, RuntimeError):
        raise UsageError(f"direction: {given!r} is not token ids") from None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise UsageError(f"direction: token ids must be integers, not {ids.dtype}")
    if ids.dim() == 1:
        ids = ids[:, None]
    if (
        ids.dim() > 2
        or (ids.dim() and ids.shape[0] != n)
        or (ids.dim() == 2 and ids.shape[1] not in (1, p))
    ):
        raise UsageError(
            f"direction: token ids must be one id, ({n},) or ({n}, {p}) (batch, positions), "
            f"not {tuple(ids.shape)}"
        )
    if bool(((ids < 0) | (ids >= vocabulary)).any()):
        raise UsageError(f"direction: a token id is outside the vocabulary of {vocabulary}")
    return ids.long().expand(n, p)[..., None]


def _unembedding_direction(
    head: Callable[[Tensor], Tensor], readout: Readout, stream: Tensor
) -> Tensor:
    """``(N, P, D)``: the gradient of the readout of the unembedding with respect to its
    input: the direction each sample and position reads (its weight's rows, for ids)."""
    x = torch.zeros_like(stream).requires_grad_()
    with torch.enable_grad():
        score = readout(head(x)).sum()
    if not score.requires_grad:
        raise UsageError("logit_attribution: the unembedding's output does not depend on its input")
    (u,) = torch.autograd.grad(score, x)
    return u


def _head_parts(
    proj: Callable[[Tensor], Tensor],
    name: str,
    site: str,
    z: Any,
    given: Tensor,
    take: Callable[[Tensor], Tensor],
) -> tuple[Tensor, Tensor]:
    """Each head's part of the stream ``(H, N, P, D)`` (its output through its slice of the
    output projection) and the projection's bias ``(D,)``."""
    if not isinstance(z, Tensor) or z.dim() != 4:
        raise UsageError(
            f"logit_attribution: {site!r} returned {type(z).__name__}, not (N, H, T, d)"
        )
    side = z.transpose(1, 2)  # (N, T, H, d)
    flat = side.flatten(2)
    if given.shape != flat.shape or not torch.allclose(
        given, flat.to(given.dtype), rtol=1e-5, atol=1e-6
    ):
        raise UsageError(
            f"logit_attribution: the input of {name!r} {tuple(given.shape)} is not the heads of "
            f"{site!r} {tuple(z.shape)} side by side: name each attention layer's output "
            "projection, owned by the module that calls SDPA"
        )
    chosen = take(side.to(given.dtype))  # (N, P, H, d)
    bias = proj(chosen.new_zeros(1, flat.shape[-1]))[0]
    parts = []
    for h in range(chosen.shape[2]):
        alone = torch.zeros_like(chosen)
        alone[:, :, h] = chosen[:, :, h]
        parts.append(proj(alone.flatten(2)) - bias)
    return torch.stack(parts), bias


def _stream_part(value: Any, name: str, final: Tensor) -> Tensor:
    """A part of the stream as ``(N or 1, T, D)`` (a positional embedding may lack the
    batch axis)."""
    if isinstance(value, Tensor) and value.shape == final.shape[1:]:
        value = value[None]
    if (
        not isinstance(value, Tensor)
        or value.shape[1:] != final.shape[1:]
        or value.shape[0] not in (1, final.shape[0])
    ):
        what = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise UsageError(
            f"logit_attribution: {name!r} returned {what}; a part of the residual stream "
            f"must be shaped as the final norm's input {tuple(final.shape)}"
        )
    return value


def _check_sum(total: Tensor, stream: Tensor) -> None:
    """The parts must add up to the stream the final norm reads."""
    tol = max(1e-4, 64 * torch.finfo(stream.dtype).eps) * (1 + float(stream.abs().max()))
    off = float((total - stream).abs().max())
    if off > tol:
        raise UsageError(
            f"logit_attribution: the parts add up to {off:.3g} away from the final norm's "
            "input: a part of the residual stream is not among attention, mlps and "
            "embeddings, the model scales it, or dropout is on (call model.eval())"
        )
