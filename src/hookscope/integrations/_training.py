"""What a trainer callback opens for one run, whatever the trainer: the Monitor and the NaN
tracer on the model, the trainer's loggers behind a :class:`~._relay.Relay`, the maps.

The callbacks (``lightning.py``, ``transformers.py``) only translate their trainer's events
into these calls: :meth:`Training.open` when training starts, :meth:`pause` and
:meth:`resume` around what is not a training step (validation, evaluation), :meth:`drain`
at batch ends, :meth:`draw` at epoch ends, :meth:`close` when training ends or fails.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

from ..core import LayerSelector
from ..diagnose import Monitor, NonFiniteReport, nonfinite
from ..errors import UsageError
from ._maps import Maps
from ._relay import Locked, Relay

__all__ = ["Options", "Training"]

Ranks = Literal["reduce", "each"]
_NONFINITE = (False, True, "raise", "warn")


@dataclass(frozen=True)
class Options:
    """A callback's arguments (see the callbacks' docstrings)."""

    every: int = 10
    layers: LayerSelector | None = None
    sinks: tuple[Any, ...] = ()
    ranks: Ranks = "reduce"
    monitor: bool = True
    nonfinite: bool | str = False
    loggers: bool = True
    histograms: bool | str = False
    maps: Maps | None = None

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise UsageError(f"every must be an int >= 1, got {self.every!r}")
        if self.ranks not in ("reduce", "each"):
            raise UsageError(f'ranks must be "reduce" or "each", got {self.ranks!r}')
        if self.nonfinite not in _NONFINITE:
            raise UsageError(
                f'nonfinite must be False, True, "raise" or "warn", got {self.nonfinite!r}'
            )
        if self.histograms not in (False, True, "all"):
            raise UsageError(f'histograms must be True, False or "all", got {self.histograms!r}')
        if self.maps is not None and not isinstance(self.maps, Maps):
            raise UsageError(f"maps must be a hookscope.integrations.Maps, got {self.maps!r}")
        if not (self.monitor or self.nonfinite or self.maps):
            raise UsageError("monitor=False, nonfinite=False and no maps: nothing to do")


class Training:
    """The sessions and sinks of one run (one ``fit`` / ``train``); a callback keeps one,
    opened again by the next run."""

    def __init__(self, options: Options) -> None:
        self.options = options
        self.monitor: Monitor | None = None
        self.report: NonFiniteReport | None = None
        self.images: dict[str, Any] = {}  # the latest maps drawn, by name
        self._sessions = contextlib.ExitStack()
        self._pause = contextlib.ExitStack()
        self._relay: Relay | None = None
        self._image_sinks: list[Any] = []
        self._open = False
        self._paused = False

    @property
    def records(self) -> list[dict[str, Any]]:
        """The Monitor's records (on rank 0 only under ``ranks="reduce"``: the others write
        none); empty before the first run."""
        return self.monitor.records if self.monitor is not None else []

    def open(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        scaler: Any = None,
        loggers: Sequence[Any] = (),
    ) -> None:
        """Open the sessions on ``model``, following ``optimizers``; ``loggers``: the
        trainer's loggers as sinks (empty on ranks that do not log)."""
        self.close()  # a run that ended without telling (an exception the trainer hides)
        opts = self.options
        self._open = True
        try:
            sinks = [Locked(s) if callable(getattr(s, "image", None)) else s for s in opts.sinks]
            self._relay = Relay(loggers) if loggers else None
            self._image_sinks = [
                s for s in [*sinks, *loggers] if callable(getattr(s, "image", None))
            ]
            self.monitor = None
            if opts.monitor:
                relayed = [self._relay] if self._relay is not None else []
                self.monitor = Monitor(
                    model,
                    opts.layers,
                    every=opts.every,
                    sinks=[*sinks, *relayed],
                    optimizer=list(optimizers),
                    ranks=opts.ranks,
                    scaler=scaler,
                )
                self._sessions.enter_context(self.monitor)
            if opts.nonfinite:
                mode: Literal["raise", "warn"] = "warn" if opts.nonfinite == "warn" else "raise"
                self.report = self._sessions.enter_context(
                    nonfinite(model, mode=mode, scaler=scaler)
                )
        except BaseException:
            self.close()
            raise

    def pause(self) -> None:
        """What runs until :meth:`resume` is not a training step (validation, evaluation)."""
        if self.monitor is not None and self._open and not self._paused:
            self._pause.enter_context(self.monitor.paused())
            self._paused = True

    def resume(self) -> None:
        """Training steps again."""
        self._paused = False
        self._pause.close()

    def log(self, **scalars: float) -> None:
        """Scalars beside the statistics of the current step (when it is logged)."""
        if self.monitor is not None and self._open:
            self.monitor.log(**scalars)

    @property
    def logging(self) -> bool:
        """Whether the current optimizer step is a logged one."""
        return self.monitor is not None and self._open and self.monitor.logging

    def drain(self) -> None:
        """Hand the steps read so far to the trainer's loggers (on this thread)."""
        if self._relay is not None:
            self._relay.drain()

    def draw(self, model: nn.Module, epoch: int, step: int) -> None:
        """At an epoch's end: draw the maps if they are due, keep them in :attr:`images` and
        send them to every sink that takes images."""
        maps = self.options.maps
        if maps is None or not self._open or not maps.due(epoch):
            return
        image = maps.render(model)
        self.images[maps.name] = image
        for sink in self._image_sinks:
            sink.image(maps.name, step, image)
            if not isinstance(sink, Locked):
                sink.flush()

    def close(self) -> None:
        """Close the sessions (the Monitor reads and writes its last step), hand the rest to
        the loggers; idempotent, and on every path."""
        if not self._open:
            return
        self._open = False
        try:
            self.resume()
            self._sessions.close()
        finally:
            relay, self._relay = self._relay, None
            if relay is not None:
                try:
                    relay.drain()
                finally:
                    relay.close_targets()


class Results:
    """What a trainer callback saw, read from its ``_training`` (both callbacks' base)."""

    _training: Training

    @property
    def records(self) -> list[dict[str, Any]]:
        """The Monitor's records of the latest run (``hs.Monitor.records``)."""
        return self._training.records

    @property
    def monitor(self) -> Monitor | None:
        """The Monitor of the latest run (None before the first, or with ``monitor=False``)."""
        return self._training.monitor

    @property
    def report(self) -> NonFiniteReport | None:
        """The NaN tracer's report of the latest run (with ``nonfinite=``)."""
        return self._training.report

    @property
    def images(self) -> dict[str, Any]:
        """The latest maps drawn, by name: RGB ``uint8`` arrays ``(H, W, 3)``."""
        return self._training.images
