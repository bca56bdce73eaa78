"""The ``hookscope`` command line (click). Results go to stdout (only JSON with ``--json``);
progress and messages to stderr.

Exit status, the same in every command (``nan`` adds its finding): 0 done; 1 the model failed
(its forward or backward raised; the one line printed names the layer, with its inputs); 2 a
usage error (a bad option, model or input; the command's usage line and a hint); 130
interrupted. ``nan``: 1 means a NaN or Inf was found, and a model that raised exits 3.
``-v`` prints tracebacks.
"""

from __future__ import annotations

import functools
import html
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import torch

from .._version import __version__
from ..core import call_model, leaves, names
from ..diagnose import nonfinite
from ..errors import NonFiniteError, UsageError
from ..look import summary
from ._command import EXITS, GROUP_EXITS, NAN_EXITS, NAN_FAILED, Group
from ._load import Loaded, load_inputs, prepare
from ._loss import LOSSES, labels_for, loss_of
from ._methods import (
    MethodOptions,
    base_choices,
    build,
    channel_methods,
    choices,
    draw,
    perturbation_methods,
)
from ._models import load_model, parse_kwargs
from ._report import report, report_methods, requiring_grad

__all__ = ["cli"]

F = TypeVar("F", bound=Callable[..., Any])


@click.group(
    cls=Group, context_settings={"help_option_names": ["-h", "--help"]}, epilog=GROUP_EXITS
)
@click.version_option(__version__, "--version", prog_name="hookscope")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Look inside a PyTorch model: summaries, NaN hunting, CAM maps, feature stores, reports.

    MODEL is package.module:factory (or file.py:factory), a Hugging Face model directory, or a
    TorchScript (.pt) / torch.export (.pt2) file. `hookscope COMMAND --help` for each command.
    """
    ctx.obj = {"verbose": verbose}


def _model_options(fn: F) -> F:
    decorators = [
        click.argument("model"),
        click.option(
            "--kwargs",
            "kwargs_json",
            help="JSON keywords for the factory, e.g. '{\"classes\": 3}'.",
        ),
        click.option(
            "--hf-class", help="transformers Auto class for a HF directory (default AutoModel)."
        ),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _input_options(fn: F) -> F:
    decorators = [
        click.option(
            "--input-size",
            help="Random input of this shape, e.g. 1,3,224,224, or 2,64 token ids for a model "
            "whose first layer is an embedding.",
        ),
        click.option(
            "--dtype",
            help="float16, bfloat16, float64: the model's floating weights and the inputs are "
            "cast to it. long / int: --input-size makes integer token ids. Default: token ids "
            "for a model whose first layer is an embedding, else float32.",
        ),
        click.option(
            "--input",
            "images",
            help="An image file, a folder of images, or a .npy array: the batch itself "
            "(floats cast to the model's dtype).",
        ),
        click.option(
            "--image-size",
            type=click.IntRange(min=1),
            help="Images are resized to this square for the model (default: the HF config's "
            "image_size, else 224).",
        ),
        click.option("--channels", type=click.Choice(["1", "3"]), default="3", show_default=True),
        click.option("--text", multiple=True, help="Text for a HF model's tokenizer (repeatable)."),
        click.option(
            "--device",
            help="Run on this device: cpu, cuda, cuda:1, mps (default: where the model's "
            "weights are; the CPU for a model loaded from disk).",
        ),
        click.option(
            "--seed",
            type=int,
            default=0,
            show_default=True,
            help="Seeds the factory's random weights, random --input-size inputs and "
            "SmoothGrad's noise.",
        ),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _load(o: dict[str, Any], inputs: bool = True) -> tuple[torch.nn.Module, Any]:
    """The model and its inputs, on ``--device`` in ``--dtype``."""
    if o.get("seed") is not None:
        torch.manual_seed(o["seed"])  # a factory's random weights
    model = load_model(o["model"], kwargs=parse_kwargs(o["kwargs_json"]), hf_class=o["hf_class"])
    if not inputs:
        return model, None
    loaded = load_inputs(
        model,
        o["model"],
        size=o["input_size"],
        dtype=o["dtype"],
        images=o["images"],
        image_size=o["image_size"],
        channels=int(o["channels"]),
        text=o["text"],
        seed=o["seed"],
    )
    model, batch = prepare(model, loaded.batch, device=o["device"], dtype=o["dtype"])
    click.get_current_context().meta["hookscope.run"] = (model, batch)  # to locate a failure
    for note in loaded.notes:
        click.echo(f"warning: {note}", err=True)
    return model, Loaded(batch, loaded.originals, loaded.files)


def _targets(o: dict[str, Any]) -> Any:
    """``--target`` given once: one class for every input; several: one per input; none:
    the top class."""
    targets = list(o["targets"])
    return targets[0] if len(targets) == 1 else targets or None


def _echo_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2))


def _with_options(fn: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(fn)
    def wrapper(**o: Any) -> None:
        fn(o)

    return wrapper


@cli.command()
@click.option("--quick", is_flag=True, help="A smaller run (32 px images, ~5 s of training).")
@click.option(
    "--out",
    default="hookscope-demo",
    show_default=True,
    help="Folder for report.html and weights.pt.",
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seeds the weights and the batches."
)
def demo(quick: bool, out: str, seed: int) -> None:
    """Train a small CNN on synthetic shapes here and write its report and weights."""
    from ._demo import demo as run
    from ._demo import describe

    click.echo("training a CNN on synthetic squares, disks and triangles...", err=True)
    click.echo(describe(run(out, quick=quick, seed=seed)))


@cli.command("names")
@_model_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def names_(o: dict[str, Any]) -> None:
    """List the selectable layers: name and type."""
    model, _ = _load(o, inputs=False)
    found = names(model)
    if o["as_json"]:
        _echo_json(found)
        return
    width = max((len(n) for n in found), default=0)
    for name, kind in found.items():
        click.echo(f"{name:<{width}}  {kind}")


@cli.command("summary")
@_model_options
@_input_options
@click.option("--depth", type=int, help="Fold calls deeper than this.")
@click.option(
    "--width",
    type=click.IntRange(min=40),
    default=120,
    show_default=True,
    help="Fit the table to this many columns.",
)
@click.option(
    "--full", is_flag=True, help="The whole table: every column, full names, one line a call."
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def summary_(o: dict[str, Any]) -> None:
    """Per-call table: output shapes, parameters, FLOPs."""
    model, x = _load(o)
    result = summary(model, x.batch)  # a mapping of inputs becomes keyword arguments
    if o["depth"] is not None:
        result = result.fold(o["depth"])
    if o["as_json"]:
        click.echo(result.to_json(indent=2))
        return
    text = result.to_text(max_width=None if o["full"] else o["width"])
    click.echo(text.replace("to_text(max_width=None)", "--full"))  # the command's own option


_PERTURBING = ", ".join(perturbation_methods())


@cli.command()
@_model_options
@_input_options
@click.option(
    "--method",
    default="gradcam",
    show_default=True,
    type=click.Choice(choices()),
    help="Layer methods (the CAM family, guided_gradcam, layer_integrated_gradients, "
    "layer_conductance), input methods (saliency, guided_backprop, integrated_gradients, "
    "input_x_gradient, occlusion, feature_ablation), a transformer's attention maps "
    "(attention_rollout, transformer_relevance) or smoothgrad (over --base).",
)
@click.option(
    "--layer",
    help="The layer to explain (see `hookscope names`; default: the last layer with "
    "(N, C, H, W) maps). Input methods take none; attention maps take the attention "
    "modules (default: every module that calls scaled_dot_product_attention).",
)
@click.option(
    "--fc",
    help="cam: the classifier nn.Linear (default: the last nn.Linear whose inputs are the "
    "layer's channels).",
)
@click.option(
    "--base",
    default="saliency",
    show_default=True,
    type=click.Choice(base_choices()),
    help="smoothgrad: the method averaged over noisy copies of the input.",
)
@click.option(
    "--samples",
    type=click.IntRange(min=1),
    default=25,
    show_default=True,
    help="smoothgrad: noisy copies.",
)
@click.option(
    "--noise",
    type=click.FloatRange(min=0),
    default=0.15,
    show_default=True,
    help="smoothgrad: noise std as a fraction of each image's range.",
)
@click.option(
    "--top-k",
    type=click.IntRange(min=1),
    help=f"{', '.join(channel_methods())}: explore only the K channels that matter most per "
    "image (Grad-CAM ranking; default: every channel). The extra forwards are counted before "
    "they run.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(min=1),
    help=f"{_PERTURBING}: images per extra forward (default 32).",
)
@click.option(
    "--steps",
    type=click.IntRange(min=1),
    help="integrated_gradients, layer_integrated_gradients, layer_conductance: points of the "
    "path integral (default 50, Gauss-Legendre).",
)
@click.option(
    "--window",
    type=click.IntRange(min=1),
    help="occlusion: the square window's side in pixels, over every channel (default: an "
    "eighth of the image's shorter side).",
)
@click.option(
    "--stride",
    type=click.IntRange(min=1),
    help="occlusion: pixels between window positions (default: half the window).",
)
@click.option(
    "--target", "targets", type=int, multiple=True, help="Class per image (default: top)."
)
@click.option("--out", default="cam", show_default=True, help="Folder for the overlay PNGs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def cam(o: dict[str, Any]) -> None:
    """Attribution maps (Grad-CAM and family, saliency, ...) drawn over the input images, each
    at the image's own size. The score is the target class's logit (the model's raw output)."""
    model, x = _load(o)
    options = MethodOptions(
        layer=o["layer"],
        fc=o["fc"],
        base=o["base"],
        top_k=o["top_k"],
        batch_size=o["batch_size"],
        samples=o["samples"],
        noise=o["noise"],
        seed=o["seed"],
        window=o["window"],
        stride=o["stride"],
        steps=o["steps"],
    )
    method = build(o["method"], model, x.batch, options)
    if hasattr(method, "cost"):
        _say_cost(o["method"], method.cost(x.batch), method)
    try:
        exp = method(x.batch, targets=_targets(o))
    except UsageError as e:
        raise UsageError(_cam_advice(str(e), o, model)) from None
    rows = draw(model, x, exp, Path(o["out"]), o["method"])
    if o["as_json"]:
        _echo_json(rows)
        return
    for row in rows:
        p = "" if row["probability"] is None else f", softmax {row['probability']:.3f}"
        click.echo(
            f"#{row['index']}: class {row['target']} (logit {row['score']:.4g}{p}) -> {row['png']}"
        )


def _cam_advice(message: str, o: dict[str, Any], model: torch.nn.Module) -> str:
    """The library's advice for outputs that are not class logits (a Python ``targets=``
    callable) made into what the command line can do."""
    python = "pass targets= as a callable returning one score per sample"
    if python not in message:
        return message
    if o["hf_class"] is None and hasattr(model, "config"):
        fix = (
            f"the model was loaded as {type(model).__name__} (the default --hf-class "
            "AutoModel), which has no classification head: pass --hf-class "
            "AutoModelForImageClassification (or the Auto class of the model's task)"
        )
    else:
        fix = (
            "--target picks a class of (N, classes) logits, and this model's output holds "
            "none: explain it in Python with targets= a function returning one score per input"
        )
    return message.replace(python, fix)


def _say_cost(name: str, cost: dict[str, int], method: Any) -> None:
    click.echo(
        f"{name}: {cost['forwards']:,} extra image forwards in {cost['calls']:,} calls of up to "
        f"{method.batch_size} images (budget them with --top-k and --batch-size)",
        err=True,
    )


@cli.command()
@_model_options
@_input_options
@click.option(
    "--train/--eval",
    "train",
    default=True,
    show_default=True,
    help="Run the model in training mode (dropout, BatchNorm's batch statistics: where NaNs "
    "usually come from) or in eval mode.",
)
@click.option(
    "--loss",
    type=click.Choice(sorted(LOSSES)),
    default="sum",
    show_default=True,
    help="What the backward starts from: sum (of every floating output), cross_entropy (the "
    "logits against --target or --labels classes), mse (the output against --labels).",
)
@click.option(
    "--target",
    "targets",
    type=int,
    multiple=True,
    help="cross_entropy: the class of each input (once: of every input).",
)
@click.option(
    "--labels",
    help="A .npy file, one row per input: class indices (cross_entropy) or values "
    "shaped like the output (mse).",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def nan(o: dict[str, Any]) -> None:
    """Run a forward and a backward (of --loss), in training mode unless --eval, and name the
    first NaN/Inf producer."""
    ctx = click.get_current_context()
    ctx.meta["hookscope.failed"] = NAN_FAILED
    model, x = _load(o)
    model.train(o["train"])  # the command line's own copy of the model
    ctx.meta["hookscope.train"] = o["train"]  # where a failure is looked for again
    batch = requiring_grad(x.batch)
    n = next((len(t) for _, t in leaves(batch) if t.dim()), 1)
    labels = labels_for(o["loss"], o["targets"], o["labels"], n, _device_of(batch))
    found: NonFiniteError | None = None
    try:
        with nonfinite(model):
            loss = loss_of(o["loss"], call_model(model, batch), labels)
            if loss is not None and loss.requires_grad:
                torch.autograd.backward(loss)
    except NonFiniteError as e:
        found = e
    mode = "train" if o["train"] else "eval"
    if o["as_json"]:
        fields = ("phase", "module", "call", "op") if found else ()
        _echo_json(
            {
                "finite": found is None,
                "mode": mode,
                "loss": o["loss"],
                **{k: getattr(found, k) for k in fields},
                "message": str(found) if found else None,
            }
        )
    else:
        ran = f"run in {mode} mode, loss: {LOSSES[o['loss']]}"
        clean = f"no NaN or Inf in the forward or the backward ({ran})"
        click.echo(f"{found}\n({ran})" if found else clean)
    if found:
        sys.exit(1)


def _device_of(batch: Any) -> torch.device:
    return next((t.device for _, t in leaves(batch)), torch.device("cpu"))


@cli.command("extract")
@_model_options
@click.argument("data")
@click.option("--layer", "layers", multiple=True, required=True, help="A layer (repeatable).")
@click.option("--out", required=True, help="The store's folder (Zarr).")
@click.option("--batch-size", type=int, default=64, show_default=True)
@click.option("--chunk", type=int, help="Samples per stored chunk and kept block [about 256].")
@click.option("--reduce", type=click.Choice(["spatial_mean", "token_mean"]))
@click.option("--store-dtype", help="Storage dtype, e.g. float16.")
@click.option(
    "--codec",
    type=click.Choice(["none", "lz4", "zstd"]),
    default="none",
    show_default=True,
    help="Compression of the feature arrays.",
)
@click.option("--image-size", type=int, default=224, show_default=True, help="Images: resize to.")
@click.option(
    "--on-error", type=click.Choice(["raise", "skip"]), default="raise", show_default=True
)
@click.option("--resume", is_flag=True, help="Finish an interrupted store.")
@click.option("--overwrite", is_flag=True, help="Replace an existing store.")
@click.option("--engine", type=click.Choice(["local", "ray"]), default="local", show_default=True)
@click.option("--json", "as_json", is_flag=True, help="Print the store's metadata as JSON.")
@_with_options
def extract_(o: dict[str, Any]) -> None:
    """Write LAYERs' outputs for DATA (an image folder, a .npy file, or a .txt file of one text
    per line for a HF model directory) to a Zarr store.

    Ctrl-C keeps every finished block (exit status 130); --resume then finishes the store."""
    from ..extract import extract

    model, _ = _load(o, inputs=False)
    data, tokenizer, transform = _extract_data(o)
    try:
        store = extract(
            model,
            data,
            list(o["layers"]),
            out=o["out"],
            batch_size=o["batch_size"],
            chunk=o["chunk"],
            reduce=o["reduce"],
            dtype=o["store_dtype"],
            tokenizer=tokenizer,
            transform=transform,
            on_error=o["on_error"],
            resume=o["resume"],
            overwrite=o["overwrite"],
            engine=o["engine"],
            codec=o["codec"],
        )
    except UsageError as e:
        raise UsageError(_as_flags(str(e))) from None
    except KeyboardInterrupt:
        click.echo(_interrupted(o["out"]), err=True)
        raise click.exceptions.Exit(130) from None  # the shell's status for SIGINT
    if o["as_json"]:
        _echo_json(store.meta)
        return
    shapes = ", ".join(f"{n} {tuple(store[n].shape)} {store[n].dtype}" for n in store.layers)
    click.echo(f"{len(store)} samples -> {store.path}: {shapes}")
    if store.errors:
        click.echo(f"{len(store.errors)} unreadable (rows are NaN): {', '.join(store.errors)}")


def _extract_data(o: dict[str, Any]) -> tuple[Any, Any, Any]:
    """``extract``'s DATA: (samples, tokenizer, image transform)."""
    from ._load import image_transform, texts

    data: str = o["data"]
    try:
        if data.endswith(".npy"):
            return _npy(data), None, None
        if data.endswith(".txt"):
            lines, tokenizer = texts(o["model"], data)
            return lines, tokenizer, None
    except FileNotFoundError:
        raise UsageError(f"no such file: {data!r}") from None
    return data, None, image_transform(o["model"], o["image_size"])


def _npy(path: str) -> Any:
    import numpy as np

    try:
        return np.load(path, mmap_mode="r")  # allow_pickle stays False: never pickled objects
    except ValueError as e:  # not an array file, or an array of pickled objects
        raise UsageError(f"cannot read {path!r} as a NumPy array: {e}") from None


#: hs.extract's messages name its Python arguments; the command's users know its flags.
_FLAGS = (
    (r"\bresume=True\b", "--resume"),
    (r"\boverwrite=True\b", "--overwrite"),
    (r"\bon_error='(\w+)'", r"--on-error \1"),
    (r"\breduce='(\w+)'", r"--reduce \1"),
    (r"\bengine='(\w+)'", r"--engine \1"),
    (r"\bcodec=", "--codec "),
    (r"\bbatch_size\b", "--batch-size"),
    (r"\bchunk must\b", "--chunk must"),
    (r"^dtype\b", "--store-dtype"),
    (r"\bleave dtype=None\b", "leave --store-dtype out"),
    (r"\bresume= and overwrite=", "--resume and --overwrite"),
    (r"\bfor out= ", "for --out "),
)


def _as_flags(message: str) -> str:
    for pattern, flag in _FLAGS:
        message = re.sub(pattern, flag, message)
    return message


def _interrupted(out: str) -> str:
    from ..extract import open_features

    try:
        store = open_features(out, partial=True)
    except UsageError:
        return "interrupted before anything was stored"
    return (
        f"interrupted: {store.stored} of {len(store)} samples are stored in {out}; run the "
        "same command with --resume to finish"
    )


@cli.command("report")
@_model_options
@_input_options
@click.option("--out", default="report.html", show_default=True, help="The HTML file to write.")
@click.option("--cam-layer", help="Grad-CAM layer (default: the last spatial one).")
@click.option(
    "--cam-method",
    default="gradcam",
    show_default=True,
    type=click.Choice(report_methods()),
    help="The attribution method of the report's map section (layer methods at --cam-layer).",
)
@click.option(
    "--features",
    "feature_layers",
    multiple=True,
    help="A layer whose feature maps are shown (repeatable; default: up to four convolutions).",
)
@click.option(
    "--target", "targets", type=int, multiple=True, help="Class per input (default: top)."
)
@_with_options
def report_(o: dict[str, Any]) -> None:
    """Write a self-contained HTML report (summary, statistics, feature maps, CAM, findings)."""
    model, x = _load(o)
    path = report(
        model,
        x.batch,
        o["out"],
        cam_layer=o["cam_layer"],
        cam_method=o["cam_method"],
        feature_layers=list(o["feature_layers"]) or None,
        targets=_targets(o),
    )
    click.echo(f"report: {path.resolve()}")


def _lm_options(fn: F) -> F:
    decorators = [
        click.argument("model"),
        click.option(
            "--hf-class",
            help="transformers Auto class of the directory (default AutoModelForCausalLM).",
        ),
        click.option(
            "--layer",
            "layers",
            multiple=True,
            help="A layer whose output is the residual stream (repeatable; default: every "
            "block, found as the list of config.num_hidden_layers modules).",
        ),
        click.option(
            "--device", help="Run on this device: cpu, cuda, cuda:1, mps (default: the CPU)."
        ),
        click.option("--json", "as_json", is_flag=True, help="Print JSON."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


@cli.command("patching")
@_lm_options
@click.option("--clean", required=True, help="The clean prompt.")
@click.option("--corrupted", required=True, help="The corrupted prompt (as many tokens).")
@click.option("--answer", required=True, help="The clean answer: one token, e.g. ' Paris'.")
@click.option("--wrong", required=True, help="The corrupted answer: one token, e.g. ' Rome'.")
@click.option(
    "--cells-per-forward",
    type=click.IntRange(min=1),
    default=16,
    show_default=True,
    help="Cells of the grid that share one forward.",
)
@click.option("--out", default="patching.html", show_default=True, help="The HTML page.")
@click.option("--png", help="Also draw the heatmap as this PNG file (needs matplotlib).")
@click.option(
    "--heads",
    is_flag=True,
    help="Patch each attention head at each position: the layers are the model's SDPA calls "
    "(each head's output before the output projection), found by running it once.",
)
@click.option(
    "--normalized",
    is_flag=True,
    help="Show each cell as the share of the gap it restores: (metric - corrupted run's) / "
    "(clean run's - corrupted run's), 0 corrupted, 1 clean.",
)
@_with_options
def patching_(o: dict[str, Any]) -> None:
    """Activation patching of a Hugging Face causal LM (a directory with its tokenizer): each
    layer's output at each position from the clean prompt into the corrupted one, scored by
    the logit difference answer - wrong at the last position. Prints the grid and writes it
    as a heatmap."""
    from ._interp import patching_html, patching_png
    from ._lm import load_lm, sweep, write_page

    model, tokenizer = load_lm(o["model"], o["hf_class"])
    grid, runs, what, tokens = sweep(model, tokenizer, o)
    if o["as_json"]:
        values = _finite_or_none(grid.values.tolist())
        fields = {"layers": list(grid.layers), "positions": list(grid.positions)}
        fields |= {"heads": list(grid.heads)} if grid.heads else {}
        _echo_json({"metric": what, **runs, **fields, "tokens": tokens, "values": values})
    else:
        click.echo(
            f"metric: {what}; clean run {runs['clean']:.4g}, corrupted {runs['corrupted']:.4g}"
        )
        click.echo(grid.to_text(tokens))
    body = f"<p>Metric: {html.escape(what)}: clean run {runs['clean']:.4g}, corrupted run "
    body += f"{runs['corrupted']:.4g}.</p>" + patching_html(grid, tokens)
    path = write_page(o["out"], "Activation patching", ("patching", "Activation patching", body))
    click.echo(f"heatmap: {path.resolve()}", err=True)
    if o["png"]:
        png = Path(o["png"])
        png.parent.mkdir(parents=True, exist_ok=True)
        png.write_bytes(patching_png(grid, tokens, f"Activation patching: {what}"))
        click.echo(f"png: {png.resolve()}", err=True)


def _finite_or_none(values: Any) -> Any:
    """Nested lists of floats with ``None`` for NaN and infinities (JSON has neither)."""
    if isinstance(values, list):
        return [_finite_or_none(v) for v in values]
    return values if math.isfinite(values) else None


@cli.command("lens")
@_lm_options
@click.option("--text", required=True, help="The prompt.")
@click.option("--norm", help="The final norm (default: the last norm outside the blocks).")
@click.option("--unembed", help="The unembedding (default: the model's output embedding).")
@click.option(
    "--top-k", type=click.IntRange(min=1), default=3, show_default=True, help="Tokens a cell."
)
@click.option("--out", help="Also write the table as an HTML page (.html).")
@_with_options
def lens_(o: dict[str, Any]) -> None:
    """The logit lens of a Hugging Face causal LM (a directory with its tokenizer) on one
    prompt: each block's residual stream through the final norm and the unembedding, as the
    likeliest tokens and their probabilities per layer and position."""
    from ..explain import logit_lens
    from ._interp import lens_html
    from ._lm import blocks, encode, final_norm, load_lm, unembedding, write_page

    model, tokenizer = load_lm(o["model"], o["hf_class"])
    ids, tokens = encode(tokenizer, o["text"])
    model, ids = prepare(model, ids, device=o["device"], dtype=None)
    layers = list(o["layers"]) or blocks(model)
    norm, unembed = o["norm"] or final_norm(model, layers), o["unembed"] or unembedding(model)
    lens = logit_lens(model, ids, layers, norm=norm, unembed=unembed)
    if o["as_json"]:
        probs = torch.softmax(lens.logits[:, 0].double(), dim=-1).topk(o["top_k"], dim=-1)
        cells = [
            [
                [[str(tokenizer.decode([t])), p] for t, p in zip(ids_, ps, strict=True)]
                for ids_, ps in zip(ti, pi, strict=True)
            ]
            for ti, pi in zip(probs.indices.tolist(), probs.values.tolist(), strict=True)
        ]
        fields = {"layers": list(lens.layers), "norm": norm, "unembed": unembed}
        _echo_json({**fields, "tokens": tokens, "top": cells})
    else:
        click.echo(lens.to_text(tokenizer, tokens=tokens, k=o["top_k"]))
    if o["out"]:
        body = lens_html(lens, tokens, tokenizer, o["top_k"])
        path = write_page(o["out"], "Logit lens", ("lens", "Logit lens", body))
        click.echo(f"table: {path.resolve()}", err=True)


def _verbose(ctx: click.Context, _: click.Parameter, value: bool) -> None:
    if value:
        ctx.find_root().ensure_object(dict)["verbose"] = True


# every command's --help ends with its exit statuses, and takes -v after its name too (where
# "run with -v" sends users)
for _command in cli.commands.values():
    _command.epilog = NAN_EXITS if _command.name == "nan" else EXITS
    _command.params.append(
        click.Option(
            ["-v", "--verbose"],
            is_flag=True,
            expose_value=False,
            callback=_verbose,
            help="Show tracebacks.",
        )
    )
