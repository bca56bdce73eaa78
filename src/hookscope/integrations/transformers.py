"""hookscope in Hugging Face's ``Trainer``: :class:`HookscopeCallback` (the ``transformers``
extra).

The callback opens ``hs.Monitor`` (and, if asked, ``hs.nonfinite``) on the trainer's model
when training begins and closes them when it ends. The Monitor follows the trainer's
optimizer (the torch optimizer inside accelerate's wrapper) through its step hooks: with
``gradient_accumulation_steps`` a step's micro-batches count once, under fp16 the loss
scaler's scale is taken out of the gradients and a step the scaler skips is not one.
Evaluation between steps is not part of any step.

**Clipping.** The Trainer clips with ``max_grad_norm`` (1.0 by default) before any callback
sees the gradients, so nothing can say afterwards what it clipped. With ``clip=True`` the
callback does that clipping itself with ``hs.clip_grad_norm`` (the same arithmetic as
``torch.nn.utils.clip_grad_norm_``, which the Trainer calls): it sets ``max_grad_norm`` to
0 while training runs (restored at the end) and clips at ``on_pre_optimizer_step``. On logged
steps it records ``grad_norm`` (before clipping, what the Trainer logs), ``grad_norm_clipped``
(after) and ``clip_coef`` (the factor, 1 when nothing was clipped) beside the statistics, and
keeps each :class:`~hookscope.ClipReport` (per-layer norms and factors) in
:attr:`HookscopeCallback.clip_reports`; other steps clip with torch's function, which reads
nothing on the host. Under FSDP or DeepSpeed, whose clipping is their own, the Trainer keeps
clipping and nothing is reported.

Records go to hookscope's ``sinks`` and, with ``loggers=True``, to the trackers the Trainer
reports to (``report_to``) on the main process: the W&B run (``wandb.run``) and the MLflow
run (``mlflow.active_run()``) the Trainer's own callbacks started, and for ``"tensorboard"``
a writer of the callback's in the Trainer's log folder (``hookscope`` inside it). Names are
``hookscope/{layer}/{kind}/{statistic}``; the step is the optimizer step counted from 0
(``state.global_step`` during that step's micro-batches; the Trainer logs its loss of that
step at ``global_step + 1``). Other integrations of ``report_to`` get nothing.

Unlike Lightning, the Trainer tells callbacks nothing when training fails: after an
exception, call :meth:`HookscopeCallback.close` (or use the callback as a context manager)
to take the hooks off the model.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from .._extras import require

require("transformers", "transformers", purpose="hookscope.integrations.transformers")

from transformers import (  # noqa: E402 - after the check that names the extra
    TrainerCallback,
    TrainerControl,
    TrainerState,
    TrainingArguments,
)

from ..core import LayerSelector  # noqa: E402
from ..diagnose import (  # noqa: E402
    ClipReport,
    MLflowSink,
    TensorBoardSink,
    WandbSink,
    clip_grad_norm,
)
from ._maps import Maps  # noqa: E402
from ._training import Options, Ranks, Results, Training  # noqa: E402

__all__ = ["HookscopeCallback", "Maps"]


class HookscopeCallback(Results, TrainerCallback):
    """Training-health statistics, clipping reports, NaN tracing and maps in
    ``Trainer.train``.

    Args:
        every: log every ``every`` optimizer steps (step 0 included), as ``hs.Monitor``.
        layers: what the Monitor watches (any selector); default the model's leaf layers
            with parameters and its activations.
        sinks: hookscope's sinks (``.jsonl`` / ``.csv`` paths, ``("tensorboard", dir)``,
            ``WandbSink``, ``MLflowSink``, your own), as ``hs.Monitor``'s.
        ranks: across processes, ``"reduce"`` (every rank's statistics combined, rank 0
            writes) or ``"each"``, as ``hs.Monitor``.
        monitor: open the Monitor (``False``: only the NaN tracer, clipping or the maps).
        nonfinite: open ``hs.nonfinite`` too (``True`` / ``"raise"``, or ``"warn"``).
        loggers: also write to the trackers of ``report_to`` (W&B, MLflow, TensorBoard).
        histograms: what those trackers get as histograms: none (``False``, the default),
            parameters and their gradients (``True``), activations too (``"all"``).
        clip: do the Trainer's ``max_grad_norm`` clipping with ``hs.clip_grad_norm`` and
            report it (see the module docstring).
        maps: a :class:`Maps`, drawn at the end of every ``maps.every``-th epoch.

    Example:
        ``Trainer(model, args, train_dataset=data, callbacks=[HookscopeCallback(every=10)])``;
        after ``trainer.train()``, ``callback.records`` holds the records.
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
        clip: bool = True,
        maps: Maps | None = None,
    ) -> None:
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
        self.clip = bool(clip)
        #: ``(step, report)`` of each logged step's clipping (with ``clip=True``)
        self.clip_reports: list[tuple[int, ClipReport]] = []
        self._max_norm: float | None = None  # the Trainer's, while the callback clips
        self._args: TrainingArguments | None = None
        self._epoch = -1

    def close(self) -> None:
        """Close the sessions and give the Trainer its clipping back (idempotent): after an
        exception in ``trainer.train()``, which the Trainer tells no callback about."""
        try:
            self._training.close()
        finally:
            if self._args is not None and self._max_norm is not None:
                self._args.max_grad_norm = self._max_norm
            self._args, self._max_norm = None, None

    def __enter__(self) -> HookscopeCallback:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    # -- the trainer's events ------------------------------------------------------------------
    def on_train_begin(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ) -> None:
        """Open the sessions on the model, following the optimizer; take over clipping."""
        if model is None or optimizer is None:
            raise RuntimeError("the Trainer gave its callbacks no model or no optimizer")
        opts = self._training.options
        loggers = (
            report_sinks(args, opts.histograms)
            if opts.loggers and state.is_world_process_zero
            else []
        )
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper holds it
        scaler = getattr(optimizer, "scaler", None)
        self._training.open(model, [inner], scaler=scaler, loggers=loggers)
        self._epoch = -1
        self.clip_reports = []
        self._take_clipping(args)

    def _take_clipping(self, args: TrainingArguments) -> None:
        if not self.clip or not args.max_grad_norm or args.max_grad_norm <= 0:
            return
        if args.fsdp or args.deepspeed:
            warnings.warn(
                "HookscopeCallback(clip=True) leaves clipping to FSDP / DeepSpeed, whose "
                "clipping of sharded gradients is their own: no clipping is reported. Pass "
                "clip=False to silence this.",
                stacklevel=3,
            )
            return
        self._args, self._max_norm = args, float(args.max_grad_norm)
        args.max_grad_norm = 0.0

    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Count the epochs (``state.epoch`` is a fraction)."""
        self._epoch += 1

    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """A step's micro-batches: the Monitor counts them."""
        self._training.resume()

    def on_pre_optimizer_step(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Clip as the Trainer would have, and on logged steps report it."""
        if self._max_norm is None or model is None:
            return
        if not self._training.logging:
            torch.nn.utils.clip_grad_norm_(model.parameters(), self._max_norm)
            return
        report = clip_grad_norm(model, self._max_norm)
        step = self._training.monitor.count if self._training.monitor is not None else 0
        self.clip_reports.append((step, report))
        coef = min(report.clipped.values(), default=1.0)
        self._training.log(
            grad_norm=report.total_norm,
            grad_norm_clipped=report.total_norm_after,
            clip_coef=coef,
        )

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The optimizer stepped: until the next step, nothing counts (evaluation, saving);
        the steps read so far go to the trackers."""
        self._training.pause()
        self._training.drain()

    def on_epoch_end(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        model: torch.nn.Module | None = None,
        **kwargs: Any,
    ) -> None:
        """Draw the maps when they are due (on the main process)."""
        if model is not None and state.is_world_process_zero:
            self._training.draw(model, self._epoch, state.global_step)

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Close the sessions (the last step is read and written) and restore clipping."""
        self.close()


def report_sinks(args: TrainingArguments, histograms: bool | str = False) -> list[Any]:
    """Sinks for the trackers of ``args.report_to`` that hookscope writes to: the active W&B
    run and MLflow run (left open), and a TensorBoard writer in the Trainer's log folder."""
    wanted = set(args.report_to or [])
    sinks: list[Any] = []
    if "wandb" in wanted:
        run = require("wandb", "wandb", purpose="logging to W&B").run
        if run is not None:
            sinks.append(WandbSink(run, histograms=histograms))
    if "mlflow" in wanted:
        mlflow = require("mlflow", "mlflow", purpose="logging to MLflow")
        active = mlflow.active_run()
        if active is not None:
            uri = mlflow.get_tracking_uri()
            sinks.append(MLflowSink(uri, active.info.run_id, histograms=histograms))
    if "tensorboard" in wanted:
        folder = (
            os.environ.get("TENSORBOARD_LOGGING_DIR")
            or getattr(args, "logging_dir", None)
            or os.path.join(args.output_dir or ".", "runs")
        )
        where = os.path.join(folder, "hookscope")
        sinks.append(TensorBoardSink(where, histograms=histograms, prefix="hookscope/"))
    return sinks
