"""Feature extraction: one call (:func:`features`) or a module (:class:`FeatureExtractor`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..errors import CaptureError
from ._capture import Capture
from ._lifetime import training_mode
from ._naming import Layers
from ._records import LayerRecord
from ._types import CopyMode, LayerSelector, Reduce

__all__ = ["FeatureExtractor", "features"]


def call_model(model: nn.Module, inputs: Any) -> Any:
    """``model(**inputs)`` for a mapping, ``model(*inputs)`` for a tuple, else ``model(inputs)``."""
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def _one_value(record: LayerRecord) -> Any:
    if record.count == 0:
        raise CaptureError(
            f"layer {record.name!r} ({record.module_type}) did not run during the forward, so "
            "it has no features: check that the model's forward reaches it for these inputs"
        )
    if record.count > 1:
        raise CaptureError(
            f"layer {record.name!r} ran {record.count} times in one forward; features() "
            "returns one value per layer. Use hookscope.capture() to get every call."
        )
    return record.calls[0].output


def features(
    model: nn.Module,
    inputs: Any,
    layers: LayerSelector,
    *,
    reduce: Reduce | None = None,
    capture_device: torch.device | str | None = None,
    train: bool = False,
    stop: bool = True,
    recompile: bool = True,
) -> dict[str, Any]:
    """The outputs of ``layers`` for ``inputs``, computed as cheaply as possible.

    Runs under ``torch.no_grad()``, in eval mode (each module's flag is restored after), and
    by default stops the forward as soon as every selected layer has run. Safe to call from
    several threads on one model at once (each call sees its own forward only).

    Args:
        model: the model (wrappers are seen through).
        inputs: a tensor (``model(x)``), a tuple of positional arguments, or a mapping of
            keyword arguments (e.g. a tokenizer's output).
        layers: any layer selector (see :func:`capture`).
        reduce: reduce each feature at capture time (``"spatial_mean"``, ``"token_mean"``,
            ``"batch_mean"`` or a function; see :data:`hookscope.Reduce`). ``"token_mean"``
            averages the tokens the inputs' ``attention_mask`` keeps, as :func:`extract` does:
            the same inputs give the same rows.
        capture_device: move features there (e.g. ``"cpu"`` from CUDA).
        train: run in training mode instead of eval mode.
        stop: end the forward once every selected layer has run (default). A layer that
            would run again after that point (a reused module) is then not seen; with
            ``stop=False`` the whole forward runs and such a layer raises CaptureError.
        recompile: a ``torch.compile``d model that already ran runs eagerly for this call
            (the default: the forward is this function's own); ``False`` raises
            CompiledModelError instead, as sessions around your code do.

    Returns:
        ``{layer name: output}`` in selection order; outputs keep their structure.

    Raises:
        CaptureError: a selected layer did not run, or ran more than once.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> hs.features(model, torch.ones(2, 3), ["0"])["0"].shape
        torch.Size([2, 4])
    """
    cap = Capture(
        model,
        layers,
        stop=stop,
        reduce=reduce,
        capture_device=capture_device,
        recompile=recompile,
        this_thread=True,
    )
    with training_mode(model, train), torch.no_grad(), cap:
        call_model(model, inputs)
    return {name: _one_value(record) for name, record in cap.records.items()}


class FeatureExtractor(nn.Module):
    """Wrap a model so that calling it returns ``{layer name: output}``.

    Unlike :func:`features` it neither disables gradients nor changes the training mode, and
    values stay attached to the autograd graph, so it fits in a training pipeline (feature
    losses, fine-tuning a backbone). Hooks exist only during each call. The forward stops
    after the last selected layer unless ``stop=False``.

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> backbone = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 1))
        >>> extractor = hs.FeatureExtractor(backbone, ["0", "1"])
        >>> sorted(extractor(torch.ones(2, 3)))
        ['0', '1']
    """

    def __init__(
        self,
        model: nn.Module,
        layers: LayerSelector,
        *,
        copy: CopyMode = "clone",
        reduce: Reduce | None = None,
        stop: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.layers = list(Layers(model).sites(layers))  # fail now, not at the first call
        self._options: dict[str, Any] = {"copy": copy, "reduce": reduce, "stop": stop}

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Run the wrapped model on ``args`` and ``kwargs`` as given.

        Returns:
            ``{layer name: output}`` for the selected layers (the latest call of a layer that
            ran more than once), attached to the autograd graph. The model's own output is
            not returned: with ``stop=True`` (the default) it is never computed.
        """
        cap = Capture(self.model, self.layers, detach=False, this_thread=True, **self._options)
        with cap:
            self.model(*args, **kwargs)
        return {name: _one_value(record) for name, record in cap.records.items()}
