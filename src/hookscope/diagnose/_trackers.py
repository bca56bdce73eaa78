"""Monitor sinks for experiment trackers: Weights & Biases and MLflow.

Each takes the records of one logged step (already read on the host: a sink never touches the
device) and sends them in one call, as the tool expects them: W&B one ``run.log`` with the
scalars and ``wandb.Histogram``s against a step metric of their own, MLflow one
``log_batch`` of metrics at the step (histograms, which MLflow has no type for, one JSON
artifact per step when asked for). A run given to a sink is used, never ended; a sink that
starts its own run ends it when the monitor closes.
"""

from __future__ import annotations

import math
import re
import time
from typing import Any

from .._extras import require
from ..errors import UsageError
from ._logsinks import histogram_name, scalars

__all__ = ["MLflowSink", "MetricsSink", "WandbSink", "merged_buckets"]

_HISTOGRAMS = (True, False, "all")


def _check_histograms(histograms: Any) -> None:
    if histograms not in _HISTOGRAMS:
        raise UsageError(f'histograms must be True, False or "all", got {histograms!r}')


def merged_buckets(
    stats: dict[str, float], counts: list[float], edges: Any, bins: int
) -> tuple[list[float], list[float]]:
    """``(counts, edges)`` of at most ``bins`` bins from the Monitor's buckets (``counts[i]``
    values in ``(edges[i-1], edges[i]]``): the buckets from the first non-empty one to the
    last, merged by runs of neighbours (so every count stays exact), the outer edges the
    minimum and the maximum. ``len(edges) == len(counts) + 1``, as ``numpy.histogram``."""
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return [], []
    first, last = used[0], used[-1]
    size = math.ceil((last - first + 1) / bins)
    merged, limits = [], [stats["min"]]
    for start in range(first, last + 1, size):
        stop = min(start + size, last + 1)
        merged.append(float(sum(counts[start:stop])))
        limits.append(float(edges[stop - 1]) if stop - 1 < len(edges) else stats["max"])
    limits[-1] = stats["max"]
    return merged, limits


class MetricsSink:
    """Monitor records to any tracker that takes a dict of numbers at a step: one call
    ``log(metrics, step)`` per logged step, the numbers named as :class:`WandbSink` names
    them (after ``prefix``).

    Args:
        log: called with ``({name: value}, step)``: a Lightning logger's ``log_metrics``
            (``lambda m, step: logger.log_metrics(m, step=step)``), a Neptune or Comet run's
            logging method, your own.
        prefix: put before every name (``""`` for none).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs
        >>> from hookscope.diagnose import MetricsSink
        >>> calls = []
        >>> net = nn.Sequential(nn.Linear(2, 2))
        >>> sink = MetricsSink(lambda metrics, step: calls.append((step, metrics)))
        >>> with hs.Monitor(net, every=1, sinks=[sink]) as mon:
        ...     net(torch.ones(1, 2)).sum().backward()
        ...     mon.step()
        >>> [(step, sorted(m)[:2]) for step, m in calls]
        [(0, ['hookscope/0/activation/max', 'hookscope/0/activation/mean'])]
    """

    def __init__(self, log: Any, *, prefix: str = "hookscope/") -> None:
        if not callable(log):
            raise UsageError(f"log must be callable as log(metrics, step), got {log!r}")
        self._log, self.prefix = log, prefix
        self._pending: dict[int, dict[str, float]] = {}

    def write(self, record: dict[str, Any]) -> None:
        """Add ``record``'s numbers to its step's call."""
        self._pending.setdefault(record["step"], {}).update(scalars(record, self.prefix))

    def flush(self) -> None:
        """One call per step written since the last flush."""
        pending, self._pending = self._pending, {}
        for step in sorted(pending):
            self._log(pending[step], step)

    def close(self) -> None:
        """Send what is left."""
        self.flush()


class WandbSink:
    """Monitor records to Weights & Biases: one ``run.log`` per logged step holding every
    scalar (named as :class:`TensorBoardSink` names them, after ``prefix``) and a
    ``wandb.Histogram`` per histogram, plotted against ``{prefix}step`` (the optimizer step),
    a step metric of the sink's own (``define_metric``): the run's own step may be a
    trainer's, which logs more often. NaN and Inf are sent as they are.

    Args:
        run: a W&B run (``wandb.init(...)``, a Lightning ``WandbLogger.experiment``); None
            starts one with ``init`` as ``wandb.init``'s arguments, finished at close.
        prefix: put before every name (``""`` for none).
        histograms: of parameters and their gradients (``True``, the default), also of
            activations and output gradients (``"all"``), or none (``False``); each has at
            most ``bins`` bins (W&B takes at most 512): the Monitor's buckets merged, counts
            exact.
        bins: the most bins of a histogram, 1..512.
        init: ``wandb.init``'s arguments when no run is given (``project=``, ``dir=``,
            ``mode="offline"``...).

    Example:
        ``hs.Monitor(model, sinks=[WandbSink(project="mnist")])``, or in a script that already
        called ``wandb.init``: ``WandbSink(wandb.run)``.
    """

    def __init__(
        self,
        run: Any = None,
        *,
        prefix: str = "hookscope/",
        histograms: bool | str = True,
        bins: int = 64,
        **init: Any,
    ) -> None:
        _check_histograms(histograms)
        if isinstance(bins, bool) or not isinstance(bins, int) or not 1 <= bins <= 512:
            raise UsageError(f"bins must be an int in 1..512 (W&B's limit), got {bins!r}")
        if run is not None and init:
            raise UsageError(f"give a run or wandb.init's arguments, not both: {sorted(init)}")
        self._wandb = require("wandb", "wandb", purpose="Weights & Biases logging")
        self._own = run is None
        self._run = self._wandb.init(**init) if run is None else run
        self.histograms, self.bins, self.prefix = histograms, bins, prefix
        self._step_key = f"{prefix}step"
        self._run.define_metric(self._step_key)
        self._run.define_metric(f"{prefix}*", step_metric=self._step_key)
        self._pending: dict[int, dict[str, Any]] = {}

    @property
    def run(self) -> Any:
        """The W&B run written to."""
        return self._run

    def _at(self, step: int) -> dict[str, Any]:
        return self._pending.setdefault(step, {self._step_key: step})

    def write(self, record: dict[str, Any]) -> None:
        """Add ``record``'s numbers to its step's call."""
        self._at(record["step"]).update(scalars(record, self.prefix))

    def histogram(
        self, tag: str, step: int, stats: dict[str, float], counts: list[float], edges: Any
    ) -> None:
        """Add a ``wandb.Histogram`` of at most ``bins`` bins to its step's call."""
        values, limits = merged_buckets(stats, counts, edges, self.bins)
        if values:
            made = self._wandb.Histogram(np_histogram=(values, limits))
            self._at(step)[histogram_name(tag, self.prefix)] = made

    def image(self, tag: str, step: int, image: Any) -> None:
        """Add a ``wandb.Image`` to its step's call (sent at the next :meth:`flush`)."""
        self._at(step)[f"{self.prefix}{tag}"] = self._wandb.Image(image)

    def flush(self) -> None:
        """One ``run.log`` per step written since the last flush."""
        pending, self._pending = self._pending, {}
        for step in sorted(pending):
            self._run.log(pending[step])

    def close(self) -> None:
        """Send what is left; finish the run if this sink started it."""
        self.flush()
        if self._own:
            self._run.finish()


_MLFLOW_NAME = re.compile(r"[^\w.\- :/]")


class MLflowSink:
    """Monitor records to MLflow: one ``log_batch`` per logged step with every scalar as a
    metric at the optimizer step (named as :class:`TensorBoardSink` names them, after
    ``prefix``; characters MLflow refuses in a name, such as ``#``, become ``_``).
    MLflow has no histogram type: with ``histograms`` each logged step's histograms are one
    JSON artifact, ``{prefix}histograms/step_{step:08d}.json``, mapping each tag to its
    bucket ``limits`` (the upper limits of the non-empty buckets) and ``counts``, with
    ``min``, ``max``, ``num``, ``sum`` and ``sum_squares`` (TensorBoard's representation).

    Args:
        client: an ``mlflow.MlflowClient``, or a tracking URI (``"file:///.../mlruns"``,
            ``"sqlite:///mlflow.db"``, a server), or None for MLflow's current tracking URI.
        run_id: the run to log to (used, never ended); None starts a run in ``experiment``,
            ended at close.
        experiment: the experiment of a run the sink starts (made if missing).
        prefix: put before every name (``""`` for none).
        histograms: ``False`` (the default), ``True`` (parameters and their gradients) or
            ``"all"`` (activations and output gradients too), as JSON artifacts.

    Example:
        ``hs.Monitor(model, sinks=[MLflowSink(run_id=mlflow.active_run().info.run_id)])``.
    """

    def __init__(
        self,
        client: Any = None,
        run_id: str | None = None,
        *,
        experiment: str = "hookscope",
        prefix: str = "hookscope/",
        histograms: bool | str = False,
    ) -> None:
        _check_histograms(histograms)
        mlflow = require("mlflow", "mlflow", purpose="MLflow logging")
        self._entities = require("mlflow.entities", "mlflow", purpose="MLflow logging")
        if client is None or isinstance(client, str):
            client = mlflow.MlflowClient(tracking_uri=client)
        self._client, self._own = client, run_id is None
        if run_id is None:
            found = client.get_experiment_by_name(experiment)
            ident = found.experiment_id if found else client.create_experiment(experiment)
            run_id = client.create_run(ident).info.run_id
        self.run_id: str = run_id
        self.histograms, self.prefix = histograms, prefix
        self._metrics: list[Any] = []
        self._hists: dict[int, dict[str, Any]] = {}

    def write(self, record: dict[str, Any]) -> None:
        """Add ``record``'s numbers to the step's batch."""
        now = int(time.time() * 1000)
        metric = self._entities.Metric
        for name, value in scalars(record, self.prefix):
            key = _MLFLOW_NAME.sub("_", name)
            self._metrics.append(metric(key, float(value), now, record["step"]))

    def histogram(
        self, tag: str, step: int, stats: dict[str, float], counts: list[float], edges: Any
    ) -> None:
        """Add one histogram to its step's artifact."""
        limits, kept = [], []
        for i, c in enumerate(counts):
            if c:
                limits.append(float(edges[i]) if i < len(edges) else stats["max"])
                kept.append(float(c))
        self._hists.setdefault(step, {})[histogram_name(tag)] = {
            "limits": limits,
            "counts": kept,
            **{k: float(v) for k, v in stats.items()},
        }

    def image(self, tag: str, step: int, image: Any) -> None:
        """One image, as MLflow logs images at a step (``log_image(key=, step=)``)."""
        key = _MLFLOW_NAME.sub("_", f"{self.prefix}{tag}")
        self._client.log_image(self.run_id, image, key=key, step=step)

    def flush(self) -> None:
        """One ``log_batch`` for the metrics written since the last flush, and one artifact
        per step with histograms."""
        metrics, self._metrics = self._metrics, []
        hists, self._hists = self._hists, {}
        if metrics:
            self._client.log_batch(self.run_id, metrics=metrics)
        for step, tags in sorted(hists.items()):
            path = f"{self.prefix}histograms/step_{step:08d}.json"
            self._client.log_dict(self.run_id, tags, path)

    def close(self) -> None:
        """Send what is left; end the run if this sink started it."""
        self.flush()
        if self._own:
            self._client.set_terminated(self.run_id)
