"""The ``hookscope`` command line (click). Results go to stdout (only JSON with ``--json``);
progress and messages to stderr. Usage errors exit with status 2 and a one-line hint, other
failures with 1; ``-v`` shows the traceback."""

from __future__ import annotations

import functools
import json
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import torch

from .._version import __version__
from ..core import call_model, leaves, names
from ..diagnose import nonfinite
from ..errors import LayerNotFoundError, NonFiniteError, UsageError
from ..explain import METHODS, overlay
from ..look import summary
from ._load import load_inputs, load_model, parse_kwargs
from ._report import image_batch, report, requiring_grad

__all__ = ["cli"]

F = TypeVar("F", bound=Callable[..., Any])


class _Group(click.Group):
    """Turns hookscope's usage errors into click's (exit 2, one line) and other failures into
    one line on stderr and exit 1, unless ``-v`` asked for tracebacks."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.ClickException, click.exceptions.Abort):
            raise
        except (UsageError, LayerNotFoundError) as e:
            if ctx.obj and ctx.obj.get("verbose"):
                traceback.print_exc()
            message = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
            raise click.UsageError(str(message), ctx) from None
        except Exception as e:
            if ctx.obj and ctx.obj.get("verbose"):
                traceback.print_exc()
            else:
                first = str(e).splitlines()[0] if str(e) else ""
                click.echo(
                    f"error: {type(e).__name__}: {first} (run with -v for the traceback)", err=True
                )
            sys.exit(1)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="hookscope")
@click.option("-v", "--verbose", is_flag=True, help="Show tracebacks.")
@click.pass_context
def cli(ctx: click.Context, verbose: bool) -> None:
    """Look inside a PyTorch model: summaries, NaN hunting, CAM maps, feature stores, reports.

    MODEL is package.module:factory (or file.py:factory), a Hugging Face model directory, or a
    TorchScript (.pt) / torch.export (.pt2) file.
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
        click.option("--input-size", help="Random input of this shape, e.g. 1,3,224,224."),
        click.option(
            "--dtype", default="float32", show_default=True, help="dtype of --input-size."
        ),
        click.option("--input", "images", help="An image file or a folder of images."),
        click.option("--image-size", type=int, help="Resize images to this side (default 224)."),
        click.option("--channels", type=click.Choice(["1", "3"]), default="3", show_default=True),
        click.option("--text", multiple=True, help="Text for a HF model's tokenizer (repeatable)."),
    ]
    for decorator in reversed(decorators):
        fn = decorator(fn)
    return fn


def _load(o: dict[str, Any], inputs: bool = True) -> tuple[torch.nn.Module, Any]:
    model = load_model(o["model"], kwargs=parse_kwargs(o["kwargs_json"]), hf_class=o["hf_class"])
    if not inputs:
        return model, None
    x = load_inputs(
        model, o["model"], size=o["input_size"], dtype=o["dtype"], images=o["images"],
        image_size=o["image_size"], channels=int(o["channels"]), text=o["text"],
    )  # fmt: skip
    return model, x


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
@click.option("--out", default="hookscope-demo", show_default=True, help="Folder for report.html.")
def demo(quick: bool, out: str) -> None:
    """Train a small CNN on synthetic shapes here and write its report."""
    from ._demo import demo as run
    from ._demo import describe

    click.echo("training a CNN on synthetic squares, disks and triangles...", err=True)
    click.echo(describe(run(out, quick=quick)))


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
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def summary_(o: dict[str, Any]) -> None:
    """Per-call table: output shapes, parameters, FLOPs."""
    model, x = _load(o)
    result = summary(model, x)  # a mapping of inputs becomes keyword arguments
    if o["depth"] is not None:
        result = result.fold(o["depth"])
    click.echo(result.to_json(indent=2) if o["as_json"] else result.to_text())


@cli.command()
@_model_options
@_input_options
@click.option("--layer", required=True, help="The layer to explain at (see `hookscope names`).")
@click.option(
    "--method",
    default="gradcam",
    show_default=True,
    type=click.Choice(
        sorted(n for n, m in METHODS.items() if m.kind == "layer" and not m.requires)
    ),
)
@click.option(
    "--target", "targets", type=int, multiple=True, help="Class per image (default: top)."
)
@click.option("--out", default="cam", show_default=True, help="Folder for the overlay PNGs.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def cam(o: dict[str, Any]) -> None:
    """Attribution maps (Grad-CAM and family) drawn over the input images."""
    model, x = _load(o)
    exp = METHODS[o["method"]].cls(model, o["layer"])(x, targets=_targets(o))
    images = image_batch(x)
    rows = []
    for i in range(len(exp.maps)):
        path = Path(o["out"]) / f"{o['method']}_{i}.png"
        image = images[i] if images is not None else None
        if image is not None:
            overlay(image.detach(), exp.maps[i].detach(), alpha=0.45, save=path)
        rows.append(
            {
                "index": i,
                "target": None if exp.targets is None else int(exp.targets[i]),
                "score": float(exp.scores[i]),
                "png": str(path) if image is not None else None,
            }
        )
    if o["as_json"]:
        _echo_json(rows)
        return
    for row in rows:
        click.echo(
            f"#{row['index']}: class {row['target']} (score {row['score']:.4g}) -> {row['png']}"
        )


@cli.command()
@_model_options
@_input_options
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
@_with_options
def nan(o: dict[str, Any]) -> None:
    """Run a forward and a backward (of the outputs' sum) and name the first NaN/Inf producer.

    Exits 0 when everything is finite, 1 when a non-finite value was found."""
    model, x = _load(o)
    x = requiring_grad(x)
    found: NonFiniteError | None = None
    try:
        with nonfinite(model):
            out = call_model(model, x)
            total = sum(t.float().sum() for _, t in leaves(out) if t.is_floating_point())
            if isinstance(total, torch.Tensor) and total.requires_grad:
                torch.autograd.backward(total)
    except NonFiniteError as e:
        found = e
    if o["as_json"]:
        fields = ("phase", "module", "call", "op") if found else ()
        _echo_json(
            {
                "finite": found is None,
                **{k: getattr(found, k) for k in fields},
                "message": str(found) if found else None,
            }
        )
    else:
        click.echo(str(found) if found else "no NaN or Inf in the forward or the backward")
    if found:
        sys.exit(1)


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
    "--codec", type=click.Choice(["none", "lz4", "zstd"]), default="none", show_default=True,
    help="Compression of the feature arrays.",
)  # fmt: skip
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
            model, data, list(o["layers"]), out=o["out"], batch_size=o["batch_size"],
            chunk=o["chunk"], reduce=o["reduce"], dtype=o["store_dtype"], tokenizer=tokenizer,
            transform=transform, on_error=o["on_error"], resume=o["resume"],
            overwrite=o["overwrite"], engine=o["engine"], codec=o["codec"],
        )  # fmt: skip
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
    "--features", "feature_layers", multiple=True,
    help="A layer whose feature maps are shown (repeatable; default: up to four convolutions).",
)  # fmt: skip
@click.option(
    "--target", "targets", type=int, multiple=True, help="Class per input (default: top)."
)
@_with_options
def report_(o: dict[str, Any]) -> None:
    """Write a self-contained HTML report (summary, statistics, feature maps, CAM, findings)."""
    model, x = _load(o)
    path = report(
        model, x, o["out"], cam_layer=o["cam_layer"],
        feature_layers=list(o["feature_layers"]) or None, targets=_targets(o),
    )  # fmt: skip
    click.echo(f"report: {path.resolve()}")
