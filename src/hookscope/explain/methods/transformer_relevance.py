"""Gradient-weighted relevance of transformer tokens (Chefer, Gur & Wolf, 2021): the
attention weights weighted by their gradients, positive part, averaged over heads,
accumulated through the layers with the residual identity."""

from __future__ import annotations

import torch
from torch import Tensor

from .._registry import MethodInfo, register
from .._transformer import AttentionMethod


class TransformerRelevance(AttentionMethod):
    """``R = I``, then for each layer, first to last, ``R = R + Ā R`` with
    ``Ā = mean_heads(max(0, dS/dA ⊙ A))``.

    The rule over attention weights ``A`` and their gradients of Chefer, Gur & Wolf,
    *Transformer Interpretability Beyond Attention Visualization* (CVPR 2021), in the form of
    their *Generic Attention-model Explainability for Interpreting Bi-Modal and
    Encoder-Decoder Transformers* (ICCV 2021, Eqs. 5-6, self-attention), which weights the
    attention map itself rather than its LRP relevance. One backward, ended at the input (or
    at the output of the input embeddings for token ids): no parameter's gradient.

    Args:
        model, layers, token: see :class:`~hookscope.explain.AttentionMethod`.

    Example:
        >>> import torch, hookscope as hs
        >>> from transformers import BertConfig, BertForSequenceClassification
        >>> bert = BertForSequenceClassification(BertConfig(hidden_size=32, num_hidden_layers=2,
        ...     num_attention_heads=2, intermediate_size=64, vocab_size=100))
        >>> ids = torch.randint(0, 100, (2, 7))
        >>> hs.TransformerRelevance(bert)({"input_ids": ids}, targets=1).maps.shape  # per token
        torch.Size([2, 7])
    """

    name = "transformer_relevance"
    needs_grad = True

    def combine(self, weights: list[Tensor], grads: list[Tensor] | None) -> Tensor:
        """Each layer's gradient-weighted attention, positive part, mean over heads, added
        to the relevance times itself."""
        assert grads is not None  # needs_grad
        n, _, t, _ = weights[0].shape
        r = torch.eye(t, dtype=weights[0].dtype, device=weights[0].device).expand(n, t, t)
        for a, g in zip(weights, grads, strict=True):
            cam = (g * a).clamp_min(0).mean(1)
            r = r + cam @ r
        return r


register(
    MethodInfo(
        "transformer_relevance",
        TransformerRelevance,
        "attention",
        gradients=True,
        reference="Chefer, Gur & Wolf, Transformer Interpretability Beyond Attention "
        "Visualization, CVPR 2021 (the gradient-weighted rule of their ICCV 2021 follow-up)",
    )
)
