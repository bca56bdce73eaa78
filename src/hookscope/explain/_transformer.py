"""The template of the transformer maps (attention rollout, gradient-weighted relevance): maps
over a transformer's tokens, made from the attention weights of its
``F.scaled_dot_product_attention`` calls.

The model keeps its fused attention: the weights ``softmax(Q Kᵀ · scale + mask)`` and their
gradients come from ``hookscope.capture(model, "layer::attention_weights", grads=True)``
(see the operations guide), so a Hugging Face model needs no ``attn_implementation="eager"``
and no ``output_attentions=True``. The attention layers are every module whose own code calls
SDPA, found by one private forward the first time (``hookscope.names(model, ops=True)``), in
the order of the model's modules (the order Hugging Face transformers run them), or given
with ``layers=``.

A method's :meth:`AttentionMethod.combine` turns the layers' weights ``(N, heads, T, T)``
(and gradients) into a ``(N, T, T)`` matrix; the map is the row of one token: the first
(CLS) token, or the last for models whose logits are per token (decoder LMs: the logit of the
next token), or ``token=``. Images get that row without its leading tokens (CLS,
distillation, registers) on the patch grid ``(N, h, w)``, upsampled to ``(N, H, W)``; text
(token ids or embeddings) gets it over the tokens ``(N, T)``.
"""

from __future__ import annotations

import contextlib
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..core import Capture, LayerSelector, call_model, names, run_eagerly
from ..errors import UsageError
from ._base import Explanation, evaluating, with_grad
from ._layout import _token_grid
from ._path import need_grad
from ._session import Ablate, Plain
from ._targets import Resolved, Target, logits_of, resolve
from ._tokens import explained

__all__ = ["AttentionMethod"]

WEIGHTS = "::attention_weights"


class AttentionMethod:
    """Base of the transformer maps: ``Method(model)(x, targets=...) -> Explanation``.

    Args:
        model: a transformer whose attention calls ``F.scaled_dot_product_attention``
            (left as found: eval mode during the call).
        layers: its attention modules (any selector; each must call SDPA itself, e.g.
            ``"vit.encoder.layer.*.attention.attention"``); None finds them.
        token: the token whose row is the map; None: the first (CLS), or the last where the
            model's logits are per token ``(N, T, vocab)``. With per-token logits, the
            targets pick the logits of that same token (the next token's, by default).
    """

    name: ClassVar[str] = ""
    needs_grad: ClassVar[bool] = False

    def __init__(
        self, model: nn.Module, layers: LayerSelector | None = None, *, token: int | None = None
    ) -> None:
        self._session = Plain(model)  # refuses a non-module, and what no session can follow
        self.model = model
        if token is not None and (not isinstance(token, int) or isinstance(token, bool)):
            raise UsageError(f"token must be a token index (an int) or None, got {token!r}")
        self.token = token
        self._found = None if layers is None else [n + WEIGHTS for n in names(model, layers)]

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs:
        pixel values, token ids, embeddings) for ``targets`` (see ``_targets``).

        Raises:
            UsageError: bad targets; a model that runs no SDPA attention; an attention layer
                that does not run exactly once per forward.
        """
        t = explained(x)
        target = resolve(targets, t.shape[0]).to(t.device)
        if self.needs_grad:
            need_grad(type(self).__name__)
        sites = self._sites(x)
        cap = Capture(self.model, sites, grads=self.needs_grad, recompile=True, this_thread=True)
        with run_eagerly(self.model), evaluating(self._session), self._session:
            weights, grads, s, index, pos = self._forward(x, t, target, cap, sites)
            row = self.combine(weights, grads)[:, pos]
        return self._placed(row, t, index, s)

    def combine(self, weights: list[Tensor], grads: list[Tensor] | None) -> Tensor:
        """The method itself: each layer's weights ``(N, heads, T, T)`` (and their
        gradients), first layer first -> a ``(N, T, T)`` matrix."""
        raise NotImplementedError

    def _sites(self, x: Any) -> list[str]:
        if self._found is None:
            with run_eagerly(self.model), evaluating(self._session):
                listed = names(self.model, ops=True, inputs=x)
            found = [n for n in listed if _is_weights(n)]
            if not found:
                raise UsageError(
                    f"no F.scaled_dot_product_attention call ran in {type(self.model).__name__}"
                    "'s forward: attention maps are made from SDPA's attention weights. Load "
                    'Hugging Face models with attn_implementation="sdpa" (their default)'
                )
            self._found = found
        return self._found

    def _forward(
        self, x: Any, t: Tensor, target: Resolved, cap: Capture, sites: list[str]
    ) -> tuple[list[Tensor], list[Tensor] | None, Tensor, Tensor | None, int]:
        """One forward (and backward) with the weights captured."""
        grad = self.needs_grad
        with cap, torch.set_grad_enabled(grad):
            inputs, leaf, swap = _differentiable(self.model, x, t) if grad else (x, [], None)
            with swap or contextlib.nullcontext():
                out = call_model(self.model, inputs)
            (s, index), pos = self._score(out, target)
            if grad:
                torch.autograd.grad(s.sum(), leaf)
        calls = [_one(cap, n) for n in sites]
        weights = [c.output for c in calls]
        # a layer whose output never reaches the score has no gradient: zero, as autograd's
        grads = (
            [_or_zeros(c.grad, w) for c, w in zip(calls, weights, strict=True)] if grad else None
        )
        return weights, grads, s.detach(), index, pos

    def _score(self, out: Any, target: Resolved) -> tuple[tuple[Tensor, Tensor | None], int]:
        logits = getattr(out, "logits", None) if not isinstance(out, Tensor) else out
        per_token = isinstance(logits, Tensor) and logits.dim() == 3
        pos = self.token if self.token is not None else -1 if per_token else 0
        if per_token and target.fn is None:
            return target.score(logits_of(out)[:, pos]), pos
        return target.score(out), pos

    def _placed(self, row: Tensor, t: Tensor, index: Tensor | None, s: Tensor) -> Explanation:
        """The token row as a map: on the patch grid for images, over the tokens for text."""
        row = row.detach()
        if t.dim() != 4:
            return Explanation(row, row, index, s, self.name, "<attention>", row)
        size = tuple(t.shape[2:])
        grid = _token_grid(row.shape[1], size)
        if grid is None:
            raise UsageError(
                f"the attention runs over {row.shape[1]} tokens, which do not fit a patch grid "
                f"of an image of {size[0]}x{size[1]}"
            )
        prefix, (h, w) = grid
        raw = row[:, prefix:].reshape(-1, h, w)
        maps = F.interpolate(raw[:, None], size=size, mode="bilinear", align_corners=False)
        return Explanation(raw, maps[:, 0], index, s, self.name, "<attention>", row)


def _or_zeros(grad: Tensor | None, like: Tensor) -> Tensor:
    return torch.zeros_like(like) if grad is None else grad


def _is_weights(name: str) -> bool:
    return WEIGHTS in name  # also "layer::attention_weights#2": a second SDPA call


def _one(cap: Capture, name: str) -> Any:
    record = cap[name]
    if record.count != 1:
        raise UsageError(
            f"{name!r} ran {record.count} times in one forward; attention maps need each "
            "attention layer to run exactly once (pass layers= to pick them)"
        )
    return record.calls[0]


def _differentiable(model: nn.Module, x: Any, t: Tensor) -> tuple[Any, list[Tensor], Any]:
    """``(inputs, [leaf], session)``: something the backward can end at before the first
    attention layer, so that no parameter's gradient is computed: a copy of a floating-point
    input, else the output of the input embeddings (replaced by a leaf, as the session does)."""
    if t.is_floating_point():
        inputs, leaf = with_grad(x, t)
        return inputs, [leaf], None
    get = getattr(model, "get_input_embeddings", None)
    embeddings = (
        get()
        if callable(get)
        else next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    )
    if not isinstance(embeddings, nn.Module):
        raise UsageError(
            f"{type(model).__name__} takes token ids and has no nn.Embedding: give its "
            "embeddings as a floating-point input (inputs_embeds=) to differentiate"
        )
    leaves: list[Tensor] = []
    swap = Ablate(model, embeddings, "TransformerRelevance")

    def start(out: Tensor) -> Tensor:
        leaves.append(out.detach().requires_grad_(True))
        return leaves[-1]

    swap.state.change = start
    return x, leaves, swap
