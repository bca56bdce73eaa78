"""What the command line is given: a model spec and inputs, turned into an ``nn.Module`` and
a batch. Weights are never unpickled: factories build their own, Hugging Face directories go
through ``from_pretrained`` (safetensors, or ``torch.load(weights_only=True)``), and saved
programs are TorchScript or ``torch.export`` archives."""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._extras import require
from .._png import image_to_tensor
from ..errors import UsageError

__all__ = ["image_transform", "load_inputs", "load_model", "parse_kwargs", "parse_size", "texts"]

_SPEC_HINT = (
    "give the model as package.module:factory (or path/to/file.py:factory), a Hugging Face "
    "model directory, or a TorchScript (.pt) / torch.export (.pt2) file"
)
_IMAGES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


def parse_kwargs(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--kwargs is not valid JSON ({e.msg}): {text!r}") from None
    if not isinstance(value, dict):
        raise UsageError(
            f"--kwargs must be a JSON object such as '{{\"classes\": 3}}', got {text!r}"
        )
    return value


def parse_size(text: str) -> tuple[int, ...]:
    try:
        size = tuple(int(v) for v in text.replace("x", ",").split(","))
    except ValueError:
        size = ()
    if not size or any(v < 1 for v in size):
        raise UsageError(
            f"--input-size must be positive integers such as 1,3,224,224, got {text!r}"
        )
    return size


def load_model(
    spec: str, *, kwargs: dict[str, Any] | None = None, hf_class: str | None = None
) -> nn.Module:
    """The model ``spec`` names, in eval mode (see the module's docstring)."""
    path = Path(spec)
    if path.is_dir():
        return _hugging_face(path, hf_class, kwargs or {})
    if path.is_file():
        return _saved_program(path)
    if ":" not in spec:
        raise UsageError(f"{spec!r} is not a file, a directory or module:factory; {_SPEC_HINT}")
    module_name, _, attr = spec.rpartition(":")
    factory = getattr(_import(module_name), attr, None)
    if factory is None or not callable(factory):
        raise UsageError(f"{module_name!r} has no callable {attr!r}; {_SPEC_HINT}")
    model = factory(**(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model.eval()


def _import(name: str) -> Any:
    if name.endswith(".py"):
        file = Path(name)
        if not file.is_file():
            raise UsageError(f"no such file {name!r}; {_SPEC_HINT}")
        spec = importlib.util.spec_from_file_location(file.stem, file)
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    if "" not in sys.path:
        sys.path.insert(0, "")  # modules in the working directory, as `python -m` finds them
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as e:
        raise UsageError(f"cannot import {name!r} ({e}); {_SPEC_HINT}") from None


def _hugging_face(path: Path, hf_class: str | None, kwargs: dict[str, Any]) -> nn.Module:
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} is a directory without config.json; {_SPEC_HINT}")
    transformers = require("transformers", "hf", purpose="loading a Hugging Face model")
    cls = getattr(transformers, hf_class or "AutoModel", None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise UsageError(
            f"--hf-class {hf_class!r} is not a transformers Auto class such as "
            "AutoModelForImageClassification"
        )
    model: nn.Module = cls.from_pretrained(str(path), local_files_only=True, **kwargs)
    return model.eval()


def _saved_program(path: Path) -> nn.Module:
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module()
    try:
        with warnings.catch_warnings():  # torch deprecates TorchScript: not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            model: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError):
        raise UsageError(
            f"{str(path)!r} is not a TorchScript archive, and pickled modules are never loaded "
            f"(unsafe): save with torch.jit.save or torch.export.save, or {_SPEC_HINT}"
        ) from None
    return model.eval()


def load_inputs(
    model: nn.Module,
    spec: str,
    *,
    size: str | None = None,
    dtype: str = "float32",
    images: str | None = None,
    image_size: int | None = None,
    channels: int = 3,
    text: tuple[str, ...] = (),
) -> Any:
    """A batch for ``model``: random ``size``, ``images`` (a file or folder, scaled to 0..1 or
    by the HF directory's image processor) or ``text`` (the HF directory's tokenizer)."""
    given = sum(bool(v) for v in (size, images, text))
    if given != 1:
        raise UsageError(
            "give exactly one input: --input-size 1,3,224,224, --input IMAGE_OR_FOLDER or "
            "--text TEXT"
        )
    if size:
        kind = getattr(torch, dtype, None)
        if not isinstance(kind, torch.dtype):
            raise UsageError(f"--dtype {dtype!r} is not a torch dtype such as float32")
        g = torch.Generator().manual_seed(0)
        if kind.is_floating_point:
            return torch.randn(parse_size(size), generator=g).to(kind)
        return torch.randint(0, 100, parse_size(size), generator=g).to(kind)
    directory = Path(spec) if Path(spec).is_dir() else None
    if text:
        if directory is None:
            raise UsageError("--text needs a Hugging Face model directory (its tokenizer)")
        tokenizer = _pretrained(directory, "AutoTokenizer", "tokenizing --text")
        return dict(tokenizer(list(text), padding=True, truncation=True, return_tensors="pt"))
    assert images is not None
    side = image_size or int(getattr(getattr(model, "config", None), "image_size", 224))
    return _images(Path(images), image_transform(spec, side, channels))


def _images(path: Path, transform: Any) -> Tensor:
    """The image ``path`` (or every image in folder ``path``) through ``transform``, stacked."""
    files = (
        sorted(p for p in path.iterdir() if p.suffix.lower() in _IMAGES)
        if path.is_dir()
        else [path]
    )
    if not path.exists() or not files:
        raise UsageError(f"--input {str(path)!r}: no such image file or folder of images")
    image_module = require("PIL.Image", "images", purpose="reading images")
    tensors = []
    for file in files:
        try:
            with image_module.open(file) as im:
                tensors.append(transform(im))
        except OSError as e:
            raise UsageError(f"cannot read image {str(file)!r}: {e}") from None
    return torch.stack(tensors)


def texts(spec: str, file: str) -> tuple[list[str], Any]:
    """The lines of ``file`` (empty ones dropped) and the tokenizer of HF directory ``spec``."""
    if not Path(spec).is_dir():
        raise UsageError(
            "a .txt file of texts needs a Hugging Face model directory (its tokenizer)"
        )
    lines = [line for line in Path(file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"{file!r} has no text lines")
    return lines, _pretrained(Path(spec), "AutoTokenizer", "tokenizing texts")


def image_transform(spec: str, size: int, channels: int = 3) -> Any:
    """PIL image -> tensor: the HF directory's image processor, else ``channels`` (1 or 3)
    resized to ``size`` and scaled to 0..1."""
    directory = Path(spec)
    if directory.is_dir() and (directory / "preprocessor_config.json").is_file():
        processor = _pretrained(directory, "AutoImageProcessor", "preparing images")
        return lambda image: processor(image.convert("RGB"), return_tensors="pt")["pixel_values"][0]
    mode = "L" if channels == 1 else "RGB"
    return lambda image: image_to_tensor(image.convert(mode).resize((size, size)))


def _pretrained(directory: Path, auto_class: str, purpose: str) -> Any:
    """``transformers.<auto_class>.from_pretrained(directory)``, offline."""
    transformers = require("transformers", "hf", purpose=purpose)
    return getattr(transformers, auto_class).from_pretrained(str(directory), local_files_only=True)
