"""``hs.report``: one self-contained HTML file about a model on some inputs.

Sections: overview; the summary table with FLOPs; activation and gradient statistics per layer
(plots and a table); feature-map grids; CAM overlays with the predicted classes; findings (dead
units, non-finite values, exploding or vanishing gradients, the layers that dominate FLOPs).
Every section is computed with hookscope's own public functions; the model is left as found
(its parameters' ``.grad`` included: the statistics' backward runs on stashed gradients).
"""

from __future__ import annotations

import contextlib
import datetime
import html
import math
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._extras import require
from .._png import pillow, png_bytes
from .._version import __version__
from ..core import LayerSelector, call_model, leaves, map_tensors, own_forward, training_mode
from ..core import names as names_of
from ..diagnose import Monitor, nonfinite
from ..errors import NonFiniteError, UsageError
from ..explain import METHODS, Explanation, Lens, MethodInfo, Patching, overlay, target_scores
from ..look import Summary, feature_grids, format_shape, summary
from . import _html
from ._findings import DEAD, Finding, by_kind, findings, findings_html
from ._interp import interp_sections
from ._plots import Panel, colour_scale, layer_panels

__all__ = ["Section", "image_batch", "probabilities", "report", "requiring_grad"]

Section = tuple[str, str, str]
"""``(id, heading, body html)`` of an extra section (the demo adds its training results)."""

_PURPOSE = "the HTML report"


def report(
    model: nn.Module,
    inputs: Any,
    out: str | os.PathLike[str] = "report.html",
    *,
    title: str | None = None,
    feature_layers: LayerSelector | None = None,
    cam_layer: str | None = None,
    cam_method: str = "gradcam",
    targets: Any = None,
    classes: Sequence[str] | None = None,
    max_images: int = 8,
    sections: Sequence[Section] = (),
    patching: Patching | Sequence[Patching] | None = None,
    lens: Lens | None = None,
    tokens: Sequence[str] | None = None,
    tokenizer: Any = None,
) -> Path:
    """Write a self-contained HTML report about ``model`` on ``inputs`` and return its path.

    Args:
        model: the model (left exactly as found).
        inputs: a tensor, a tuple of positional arguments or a mapping of keyword arguments.
        out: the ``.html`` file to write (folders are created; an existing file is replaced
            only once the new one is complete).
        title: the page's title (default: the model's class name).
        feature_layers: layers whose feature maps are shown (any selector; default: up to four
            ``nn.Conv2d`` layers, first and last included). ``[]`` shows none.
        cam_layer: the Grad-CAM layer (default: the last layer with a spatial 4-D output; for a
            vision transformer, whose last such layer is its patch embedding, name its last
            block: token outputs are put on their grid).
        cam_method: the attribution method of that section, any method of
            :data:`hookscope.explain.METHODS` that needs no other argument: ``"gradcam"``
            (default), another layer method at ``cam_layer``, an input method
            (``"integrated_gradients"``: maps per channel are drawn as their largest absolute
            value), or a transformer's ``"attention_rollout"`` / ``"transformer_relevance"``.
        targets: classes for Grad-CAM and for the gradient statistics (as for
            :class:`~hookscope.GradCAM`; default the top class per sample). A model without
            class logits gets its statistics from each sample's output norm, and no Grad-CAM
            unless ``targets`` is a callable.
        classes: class names for the CAM captions (default: ``model.config.id2label`` if any).
        max_images: CAM overlays shown at most.
        sections: extra ``(id, heading, html)`` sections placed after the overview.
        patching: a :class:`~hookscope.Patching` (what :func:`hookscope.patching` returns) or
            a list of them, each drawn as a heatmap: a row per layer (per layer and head), a
            column per position, each cell's colour on a scale diverging at 0.
        lens: a :class:`~hookscope.Lens` (what :func:`hookscope.logit_lens` returns), drawn
            as a table of its first sample: the 3 likeliest tokens and their probabilities
            per layer and position.
        tokens: the input's tokens, one string per position: the columns' labels.
        tokenizer: what turns the lens' token ids into text: a Hugging Face tokenizer (its
            ``decode``) or a function of an id (default: ``#id``).

    Needs the ``images`` and ``plots`` extras (Pillow, matplotlib).

    Example:
        >>> import torch, torch.nn as nn, hookscope as hs, tempfile, os
        >>> net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
        ...                     nn.Flatten(), nn.Linear(4, 2))
        >>> out = os.path.join(tempfile.mkdtemp(), "r.html")
        >>> path = hs.report(net, torch.randn(2, 3, 16, 16), out)
        >>> path.read_text().count("<section")
        6
    """
    path = Path(out)
    if path.suffix.lower() not in (".html", ".htm"):
        raise UsageError(f"out must be an .html file, got {str(out)!r}")
    if not isinstance(max_images, int) or max_images < 0:
        raise UsageError(f"max_images must be an int >= 0, got {max_images!r}")
    if cam_method not in report_methods():
        raise UsageError(
            f"cam_method must be one of {', '.join(report_methods())}, got {cam_method!r}"
        )
    pillow(_PURPOSE)  # fail before any work when an extra is missing
    require("matplotlib", "plots", purpose="plots in the HTML report")
    names = classes if classes is not None else _id2label(model)
    interp = interp_sections(patching, lens, tokens, tokenizer)  # bad arguments fail here

    with own_forward():  # the report's forwards are its own: open sessions do not see them
        shape = summary(model, inputs)
        records, nonfinite_found = _statistics(model, inputs, targets)
        features = _features(model, inputs, feature_layers)
        layer = cam_layer if cam_layer is not None else _last_spatial(shape)
        cams = _cams(model, inputs, METHODS[cam_method], layer, targets, names, max_images)
    types = names_of(model)
    found = findings(shape, records, nonfinite_found, _batch_size(inputs), types)
    parts: list[Section] = [("overview", "Overview", _overview(model, shape, found))]
    parts += list(sections) + interp
    parts.append(("summary", "Summary", _summary_table(shape)))
    n = _batch_size(inputs)
    parts.append(("statistics", "Activations and gradients", _statistics_html(records, types, n)))
    parts.append(("features", "Feature maps", features))
    parts.append(("cam", _title(cam_method), cams))
    parts.append(("findings", "Findings", findings_html(found)))
    text = _html.page(
        title or type(model).__name__,
        f"hookscope {__version__} · torch {torch.__version__} · "
        f"{datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        parts,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text, encoding="utf-8")
    partial.replace(path)  # never a half-written report under the final name
    return path


# -- inputs --------------------------------------------------------------------------------------


def requiring_grad(inputs: Any) -> Any:
    """``inputs`` with every floating tensor detached and requiring grad (the caller's tensors
    are left alone), so a backward reaches every layer even in a frozen model."""
    return map_tensors(
        lambda _, t: t.detach().requires_grad_() if t.is_floating_point() else t, inputs
    )


def image_batch(inputs: Any) -> Tensor | None:
    """The batch of images in ``inputs``: a floating ``(N, 1 or 3, H, W)`` tensor, if any."""
    for _, t in leaves(inputs):
        if t.is_floating_point() and t.dim() == 4 and t.shape[1] in (1, 3):
            return t
    return None


def _batch_size(inputs: Any) -> int:
    return int(next(t for _, t in leaves(inputs)).shape[0])


def probabilities(output: Any) -> Tensor | None:
    """Softmax over the classes of ``(N, classes)`` logits (``.logits`` or the output)."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, Tensor) and logits.dim() == 2 and logits.is_floating_point():
        return torch.softmax(logits.detach().float(), dim=1)
    return None


def _id2label(model: nn.Module) -> list[str] | None:
    labels = getattr(getattr(model, "config", None), "id2label", None)
    if isinstance(labels, dict) and labels:
        return [str(labels.get(i, labels.get(str(i), i))) for i in range(len(labels))]
    return None


# -- statistics ------------------------------------------------------------------------------


@contextmanager
def _stashed_grads(model: nn.Module) -> Iterator[None]:
    """Parameters start with no gradient and get their own back afterwards."""
    saved = [(p, p.grad) for p in model.parameters()]
    for p, _ in saved:
        p.grad = None
    try:
        yield
    finally:
        for p, g in saved:
            p.grad = g


def _statistics(
    model: nn.Module, inputs: Any, targets: Any
) -> tuple[list[dict[str, Any]], list[NonFiniteError]]:
    """One Monitor step over a forward and a backward of the targets' scores (eval mode),
    watched by hs.nonfinite (warn mode: recorded, not raised) to name where a NaN came from."""

    x = requiring_grad(inputs)
    n = _batch_size(x)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_stashed_grads(model))
        stack.enter_context(training_mode(model, False))
        mon = stack.enter_context(Monitor(model, every=1, recompile=True))  # runs it itself
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore", RuntimeWarning)  # nonfinite's warn mode: recorded
        found = stack.enter_context(nonfinite(model, mode="warn", recompile=True))
        with torch.enable_grad():  # (its sessions, opened inside own_forward, see it)
            output = call_model(model, x)
            score = _score(output, targets, n)
            if score.requires_grad:
                torch.autograd.backward(score.sum())
        mon.step()
    return mon.records, found.findings


def _score(output: Any, targets: Any, n: int) -> Tensor:
    """Per-sample scores whose gradients the statistics show: the CAMs' target rule, or, for a
    model without class logits (a backbone, an encoder) and no targets, the norm of each
    sample's first output."""
    try:
        score, _ = target_scores(output, targets, n)
    except UsageError:
        if targets is not None:
            raise
        first = next(t for _, t in leaves(output) if t.is_floating_point())
        score = first.float().flatten(1).norm(dim=1) if first.dim() > 1 else first.float()
    return score


def _statistics_html(records: list[dict[str, Any]], types: dict[str, str], n: int) -> str:
    acts, grads = by_kind(records, "activation"), by_kind(records, "gradient")
    layers = list(dict.fromkeys(r["layer"] for r in records if r["kind"] != "parameter"))
    if not layers:
        return "<p>No layer was watched.</p>"

    def col(table: dict[str, dict[str, Any]], key: str, scale: float = 1) -> list[float]:
        return [scale * float(table.get(name, {}).get(key, math.nan)) for name in layers]

    plots = layer_panels(
        [f"{name} ({types.get(name, '?')})" for name in layers],
        [
            Panel(
                "Activations",
                "output value: mean ± std over the batch",
                {"mean ± std": col(acts, "mean")},
                errors={"mean ± std": col(acts, "std")},
            ),
            Panel(
                "Zeros and dead units",
                "% of the layer's outputs / channels",
                {
                    "outputs exactly 0": col(acts, "zeros", 100),
                    "dead channels (no gradient passed)": col(acts, "dead", 100),
                },
                kind="bars",
            ),
            Panel(
                "Gradients",
                "L2 norm of d(score) / d(output), log scale",
                {"gradient norm": col(grads, "norm")},
                log=True,
            ),
        ],
    )
    rows = [
        [
            name,
            types.get(name, "?"),
            *(_num(acts.get(name, {}).get(k)) for k in ("mean", "std")),
            *(_percent(acts.get(name, {}).get(k)) for k in ("zeros", "dead")),
            _num(grads.get(name, {}).get("norm")),
            sum(int(t.get(name, {}).get("nonfinite", 0)) for t in (acts, grads)),
        ]
        for name in layers
    ]
    caption = (
        f"One forward and one backward of the explained scores on the {n} input(s), in eval "
        "mode. Zeros: share of a layer's output values that are exactly 0. Dead: share of its "
        f"channels through which no gradient passed on any of the {n} input(s) ({DEAD}); '-' "
        "for layers that cannot have dead units (GELU, SiLU and the like pass a gradient "
        "almost everywhere). Gradients are of the summed scores with respect to each layer's "
        "output (points left out: not finite)."
    )
    headers = ["layer", "type", "act. mean", "act. std", "zeros %", "dead %", "grad norm"]
    headers.append("non-finite")
    images = "".join(
        _html.image(png, f"per-layer statistics: {panel}")
        for png, panel in zip(
            plots, ("activations", "zeros and dead units", "gradients"), strict=True
        )
    )
    panels = f'<div class="panels">{images}</div>'
    return _html.figure(panels, caption, wide=True) + _html.table(
        headers, rows, numeric=range(2, 8)
    )


def _percent(value: Any) -> str:
    if value is None or not math.isfinite(float(value)):
        return "-" if value is None else str(float(value))
    return f"{100 * float(value):.1f}"


def _num(value: Any) -> str:
    if value is None:
        return "-"
    v = float(value)
    if not math.isfinite(v):
        return str(v)
    return f"{v:.3g}"


# -- summary, features, CAM ------------------------------------------------------------------


def _summary_table(shape: Summary) -> str:
    total = max(shape.total_flops, 1)
    rows = [
        [
            "\u2003" * row.depth + (row.name or "(model)"),
            row.type,
            format_shape(row.output),
            f"{row.params_total:,}",
            f"{row.flops_total:,}",
            f"{100 * row.flops_total / total:.1f}",
        ]
        for row in shape.rows
    ]
    totals = (
        f"<p>{shape.total_params:,} parameters ({shape.trainable_params:,} trainable, "
        f"{shape.param_bytes / 2**20:.2f} MiB); {shape.total_flops:,} FLOPs "
        f"({shape.total_macs:,} MACs) per forward of these inputs"
    )
    if shape.uncounted:
        ops = ", ".join(f"{op} x{n}" for op, n in sorted(shape.uncounted.items()))
        totals += f"; operators without a FLOP formula: {html.escape(ops)}"
    headers = ["layer", "type", "output", "params", "FLOPs", "% FLOPs"]
    return totals + ".</p>" + _html.table(headers, rows, numeric=(3, 4, 5))


def _conv_layers(model: nn.Module) -> list[str]:
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    if len(convs) <= 4:
        return convs
    picks = sorted({round(i * (len(convs) - 1) / 3) for i in range(4)})
    return [convs[i] for i in picks]


def _features(model: nn.Module, inputs: Any, layers: Any) -> str:
    chosen = _conv_layers(model) if layers is None else layers
    if isinstance(chosen, list) and not chosen:
        return "<p>No convolution layer to show.</p>"
    grids = feature_grids(model, inputs, chosen, group="layer", padding=1, pad_value=255)
    out = []
    for name, grid in grids.items():
        width = min(max(grid.shape[1] * 2, 200), 560)
        out.append(
            _html.figure(
                _html.image(_png(grid), f"feature maps of {name}", width=width, pixel=True),
                f"{name}: every channel of the first input, each scaled on its own",
            )
        )
    return "\n".join(out)


def _png(image: Tensor) -> bytes:
    return png_bytes(image, purpose=_PURPOSE)


def _last_spatial(shape: Summary) -> str | None:
    """The last layer (in execution order) whose output is ``(N, C, H, W)`` with H, W > 1."""
    for row in reversed(shape.rows[1:]):
        out = row.output
        if isinstance(out, tuple) and len(out) == 4 and out[2] > 1 and out[3] > 1:
            return row.name
    return None


def report_methods() -> list[str]:
    """The attribution methods the report can draw: those that need no other argument."""
    return sorted(n for n, i in METHODS.items() if not i.requires and i.kind != "wrapper")


def _title(method: str) -> str:
    return "Grad-CAM" if method == "gradcam" else f"Attribution: {method}"


def to_plane(maps: Tensor) -> Tensor:
    """``(N, H, W)`` maps as they are; input-space ``(N, C, H, W)`` ones as the largest
    absolute value over the channels (how saliency maps are usually drawn)."""
    return maps.abs().amax(1) if maps.dim() == 4 else maps


def _explain(
    model: nn.Module, inputs: Any, info: MethodInfo, layer: str | None, targets: Any
) -> Explanation:
    method = info.cls(model, layer) if info.kind == "layer" else info.cls(model)
    exp: Explanation = method(inputs, targets=targets)
    return exp


def _cams(
    model: nn.Module,
    inputs: Any,
    info: MethodInfo,
    layer: str | None,
    targets: Any,
    names: Sequence[str] | None,
    max_images: int,
) -> str:
    images = image_batch(inputs)
    title = _title(info.name).removeprefix("Attribution: ")
    if images is None or (layer is None and info.kind == "layer"):
        return f"<p>No image input or no spatial layer: no {title}.</p>"
    try:
        exp = _explain(model, inputs, info, layer, targets)
    except UsageError as e:  # e.g. no class logits to explain and no targets given
        return f"<p>No {title}: {html.escape(str(e))}.</p>"
    planes = to_plane(exp.maps.detach())
    with torch.no_grad(), training_mode(model, False):
        probs = probabilities(call_model(model, inputs))
    out = []
    for i in range(min(len(images), max_images)):
        picture = overlay(images[i].detach().cpu(), planes[i].cpu(), alpha=0.45)
        k = None if exp.targets is None else int(exp.targets[i])  # None: a target callable
        label = "target" if k is None else names[k] if names and k < len(names) else f"class {k}"
        p = "" if probs is None or k is None else f", softmax {float(probs[i, k]):.3f}"
        width = max(160, min(256, picture.shape[1] * 4))
        out.append(
            _html.figure(
                _html.image(_png(picture), f"{title} {i}: {label}", width=width),
                f"#{i}: {label} (logit {float(exp.scores[i]):.3g}{p})",
            )
        )
    scale = _html.figure(
        _html.image(colour_scale("jet", "0: the map's minimum", "1: its maximum"), "colour scale"),
        "Colour scale of the overlays: each map is scaled to 0..1 on its own, so colours "
        "compare places within one image, not images with each other.",
    )
    where = (
        f"at <code>{html.escape(layer)}</code> ({html.escape(type_of(model, layer))})"
        if info.kind == "layer" and layer is not None
        else "over the input"
        if info.kind == "input"
        else "over the attention's tokens"
    )
    return (
        f"<p>{html.escape(title)} {where}, "
        "for the predicted class unless targets were given. The logit is the model's raw "
        "output for that class (before softmax); softmax is its probability among the "
        "classes.</p>" + scale + "\n".join(out)
    )


def type_of(model: nn.Module, layer: str) -> str:
    return names_of(model).get(layer, "?")


def _overview(model: nn.Module, shape: Summary, found: list[Finding]) -> str:
    described = ", ".join(f"{k} {v}" for k, v in shape.inputs.items()) or "-"
    to_look_at = sum(w for w, _ in found)
    return (
        f"<p><b>{html.escape(type(model).__name__)}</b> · {shape.total_params:,} parameters · "
        f"{shape.total_flops:,} FLOPs per forward · inputs: {html.escape(described)} · "
        f'<a href="#findings">{to_look_at} finding(s) to look at</a></p>'
    )
