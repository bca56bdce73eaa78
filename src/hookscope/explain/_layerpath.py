"""The template of the layer path methods (layer integrated gradients, layer conductance):
attributions for every value of a layer's output, as Captum returns them, and a map that sums
them over the layer's channels (over each token's features for text).

A method fills :meth:`LayerPath._attribute`, which runs its forwards and returns the
attributions in the layer output's own layout; the template owns the options (``_path``),
targets, eval mode, the layer's layout (``_layout``, or ``_tokens`` for token ids) and the
:class:`~._base.Explanation`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from ..core import LayerSelector, call_model, run_eagerly
from ._base import Context, Explanation, LayerMethod, evaluating
from ._layout import Grid
from ._path import Path, need_grad
from ._targets import Resolved, Target, resolve
from ._tokens import explained, is_table, is_tokens, token_grid

__all__ = ["LayerPath", "Scored"]

#: ``(attributions, scores, class indices, convergence delta)`` of one batch
Scored = tuple[Tensor, Tensor, Tensor | None, Tensor | None]


class LayerPath(LayerMethod):
    """Base of the layer path methods: ``Method(model, layers, ...)(x, targets=...)``.

    Args:
        model: the model (left as found: eval mode during the call, restored after).
        layers: the layer whose output is attributed (any selector matching one module).
        baselines: the input's baseline, as in :class:`~hookscope.IntegratedGradients`
            (token ids for a text model's ids).
        n_steps, method, internal_batch_size, return_convergence_delta: as in
            :class:`~hookscope.IntegratedGradients`, named as Captum names them.
        reshape: the layer's output as maps ``(N, C, h, w)`` where its type and shapes do not
            say where the channels are (see :class:`~hookscope.explain.LayerMethod`).
    """

    relu = False
    needs_grad = True

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        baselines: float | Tensor | None = None,
        n_steps: int = 50,
        method: str = "gausslegendre",
        internal_batch_size: int | None = None,
        return_convergence_delta: bool = False,
        reshape: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        super().__init__(model, layers, reshape=reshape)
        self.path = Path(baselines, n_steps, method, internal_batch_size, return_convergence_delta)

    def __call__(self, x: Any, targets: Target = None) -> Explanation:
        """Explain a batch ``x`` (a tensor, or a tuple / mapping of the model's inputs: its
        first floating-point tensor, else its token ids ``(N, T)``) for ``targets``.

        Raises:
            UsageError: bad targets or baselines; a layer that does not run exactly once or
                does not influence the target; a layout neither its type nor shapes decide.
        """
        image = explained(x)
        target = resolve(targets, image.shape[0]).to(image.device)
        need_grad(type(self).__name__)
        base = self.path.baseline(image)
        with run_eagerly(self.model), evaluating(self._tap):
            attr, s, index, delta = self._attribute(x, image, base, target)
        if is_table(image):  # no positions to place a map on: the attributions themselves
            return Explanation(attr, attr, index, s, self.name, self.layer, attr, delta)
        tokens = is_tokens(x, image)
        grid = self._layout(tuple(attr.shape), image, tokens)
        raw = grid.place(attr).sum(1)
        if tokens:
            exp = Explanation(raw[:, 0], raw[:, 0], index, s, self.name, self.layer)
        else:
            ctx = Context(raw, None, index, s, x, image, target, grid)
            exp = self._explanation(raw, ctx)
        return dataclasses.replace(exp, attributions=attr, delta=delta)

    def _attribute(self, x: Any, image: Tensor, base: Tensor, target: Resolved) -> Scored:
        """The method's forwards: attributions of the layer's output and the scores."""
        raise NotImplementedError

    def _layout(self, shape: tuple[int, ...], image: Tensor, tokens: bool) -> Grid:
        if tokens:
            return token_grid(shape, self.layer, image.shape[1], self.reshape)
        return self._grid(shape, image)

    def _at(self, inputs: Any, target: Resolved) -> tuple[Tensor, Any, Tensor, Tensor | None]:
        """One forward with the layer watched: ``(output, gradient edge, scores, classes)``."""
        tap = self._tap
        tap.state.values = True
        try:
            with tap:
                out = call_model(self.model, inputs)
        except BaseException:
            tap.state.seen = []  # what it holds keeps the forward's graph alive
            raise
        act, edge, _ = tap.take()
        s, index = target.score(out)
        assert act is not None  # values=True
        return act, edge, s, index

    def _no_grad_at(self, inputs: Any, target: Resolved) -> tuple[Tensor, Tensor, Tensor | None]:
        """The layer's output and the scores of one forward without gradients."""
        with torch.no_grad():
            act, _, s, index = self._at(inputs, target)
        return act, s.detach(), index
