"""hookscope in a Lightning ``Trainer``: :class:`HookscopeCallback` (the ``lightning`` extra).

The callback opens ``hs.Monitor`` (and, if asked, ``hs.nonfinite``) on the
``LightningModule`` when training starts and closes them when it ends or fails. The
Monitor follows the trainer's optimizers through their step hooks, so a step is a real
optimizer step: with ``accumulate_grad_batches`` its micro-batches count once, under
mixed precision the loss scaler's scale is taken out of the gradients (``scaler=``) and a
step the scaler skips is not one, and with manual optimization a step is each
``optimizer.step()`` the module makes. Validation inside ``fit`` is not part of any step.
Under the DDP strategy the statistics are reduced across ranks as ``ranks=`` says.

Records go to hookscope's ``sinks`` (written on the Monitor's thread) and, with
``loggers=True``, to the trainer's own loggers, on the training thread at each batch end:
a ``TensorBoardLogger``'s writer, a ``WandbLogger``'s run and an ``MLFlowLogger``'s run
take scalars, histograms (``histograms=``) and images as hookscope's TensorBoard, W&B and
MLflow sinks write them; any other logger (``CSVLogger``, yours) gets one ``log_metrics``
per logged step. Names are ``hookscope/{layer}/{kind}/{statistic}``; the step is the
optimizer step, counted from 0 (``trainer.global_step`` during that step's batches).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from .._extras import require

require("lightning.pytorch", "lightning", purpose="hookscope.integrations.lightning")

import lightning.pytorch as pl  # noqa: E402 - after the check that names the extra
from lightning.pytorch.loggers import MLFlowLogger, TensorBoardLogger, WandbLogger  # noqa: E402

from ..core import LayerSelector  # noqa: E402
from ..diagnose import (  # noqa: E402
    MetricsSink,
    MLflowSink,
    TensorBoardSink,
    WandbSink,
)
from ._maps import Maps  # noqa: E402
from ._training import Options, Ranks, Results, Training  # noqa: E402

__all__ = ["HookscopeCallback", "Maps"]


class HookscopeCallback(Results, pl.Callback):
    """Training-health statistics, NaN tracing and maps in ``Trainer.fit``.

    Args:
        every: log every ``every`` optimizer steps (step 0 included), as ``hs.Monitor``.
        layers: what the Monitor watches (any selector, names relative to the
            ``LightningModule``: ``"net.0"``); default its leaf layers with parameters and
            its activations.
        sinks: hookscope's sinks (``.jsonl`` / ``.csv`` paths, ``("tensorboard", dir)``,
            ``WandbSink``, ``MLflowSink``, your own), as ``hs.Monitor``'s.
        ranks: under DDP, ``"reduce"`` (every rank's statistics combined, rank 0 writes)
            or ``"each"`` (each rank writes its own, with a ``rank`` key), as ``hs.Monitor``.
        monitor: open the Monitor (``False``: only the NaN tracer or the maps).
        nonfinite: open ``hs.nonfinite`` too: ``True`` / ``"raise"`` raises
            ``NonFiniteError`` from the step that made the first NaN/Inf, naming the layer;
            ``"warn"`` warns and records it in :attr:`report`.
        loggers: also write to the trainer's loggers (on global rank 0).
        histograms: what the trainer's loggers get as histograms: none (``False``, the
            default), parameters and their gradients (``True``), activations and output
            gradients too (``"all"``); hookscope's sinks say for themselves.
        maps: a :class:`Maps`, drawn at the end of every ``maps.every``-th epoch.

    Example:
        ``trainer = L.Trainer(callbacks=[HookscopeCallback(every=10, sinks=["hs.jsonl"])])``;
        after ``trainer.fit(module, data)``, ``callback.records`` holds the records.
    """

    def __init__(
        self,
        *,
        every: int = 10,
        layers: LayerSelector | None = None,
        sinks: Iterable[Any] = (),
        ranks: Ranks = "reduce",
        monitor: bool = True,
        nonfinite: bool | str = False,
        loggers: bool = True,
        histograms: bool | str = False,
        maps: Maps | None = None,
    ) -> None:
        super().__init__()
        self._training = Training(
            Options(
                every=every,
                layers=layers,
                sinks=tuple(sinks),
                ranks=ranks,
                monitor=monitor,
                nonfinite=nonfinite,
                loggers=loggers,
                histograms=histograms,
                maps=maps,
            )
        )

    # -- the trainer's events ------------------------------------------------------------------
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Open the sessions on the module, following the trainer's optimizers."""
        opts = self._training.options
        loggers = (
            logger_sinks(trainer.loggers, opts.histograms)
            if opts.loggers and trainer.is_global_zero
            else []
        )
        scaler = getattr(trainer.precision_plugin, "scaler", None)
        self._training.open(pl_module, trainer.optimizers, scaler=scaler, loggers=loggers)

    def on_train_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        """Hand the steps read so far to the trainer's loggers."""
        self._training.drain()

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Validation is no training step: the Monitor pauses."""
        self._training.pause()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Training steps again."""
        self._training.resume()

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Draw the maps when they are due (on global rank 0)."""
        if trainer.is_global_zero:
            self._training.draw(pl_module, trainer.current_epoch, trainer.global_step)

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Close the sessions: the last step is read and written, the loggers get the rest."""
        self._training.close()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        """Close the sessions: the model is left as found."""
        self._training.close()

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Close the sessions if nothing else did."""
        self._training.close()


def logger_sinks(loggers: Sequence[Any], histograms: bool | str = False) -> list[Any]:
    """A sink per Lightning logger: TensorBoard, W&B and MLflow loggers as hookscope's sinks
    on their writer or run (left open), any other as one ``log_metrics`` per logged step."""
    sinks: list[Any] = []
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            writer = logger.experiment
            sinks.append(TensorBoardSink(writer, histograms=histograms, prefix="hookscope/"))
        elif isinstance(logger, WandbLogger):
            sinks.append(WandbSink(logger.experiment, histograms=histograms))
        elif isinstance(logger, MLFlowLogger):
            sinks.append(MLflowSink(logger.experiment, logger.run_id, histograms=histograms))
        else:
            sinks.append(MetricsSink(_log_metrics(logger)))
    return sinks


def _log_metrics(logger: Any) -> Any:
    def log(metrics: dict[str, float], step: int) -> None:
        logger.log_metrics(metrics, step=step)

    return log
