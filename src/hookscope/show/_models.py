"""The model a command names: ``package.module:factory`` (or ``file.py:factory``), a Hugging
Face directory, or a saved program. Weights are never unpickled: factories build their own,
Hugging Face directories go through ``from_pretrained`` (safetensors, or
``torch.load(weights_only=True)``), and saved programs are TorchScript or ``torch.export``
archives, told apart by their contents."""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import logging
import sys
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from .._extras import require
from ..errors import UsageError

__all__ = ["SPEC_HINT", "archive_kind", "load_model", "parse_kwargs"]

SPEC_HINT = (
    "give the model as package.module:factory (or path/to/file.py:factory), a Hugging Face "
    "model directory, or a TorchScript (.pt) / torch.export (.pt2) file"
)


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
        raise UsageError(f"{spec!r} is not a file, a directory or module:factory; {SPEC_HINT}")
    module_name, _, attr = spec.rpartition(":")
    factory = getattr(_import(module_name), attr, None)
    if factory is None or not callable(factory):
        raise UsageError(f"{module_name!r} has no callable {attr!r}; {SPEC_HINT}")
    model = factory(**(kwargs or {}))
    if not isinstance(model, nn.Module):
        raise UsageError(f"{spec} returned {type(model).__name__}, not an nn.Module")
    return model.eval()


def _import(name: str) -> Any:
    if name.endswith(".py"):
        file = Path(name)
        if not file.is_file():
            raise UsageError(f"no such file {name!r}; {SPEC_HINT}")
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
        raise UsageError(f"cannot import {name!r} ({e}); {SPEC_HINT}") from None


def _hugging_face(path: Path, hf_class: str | None, kwargs: dict[str, Any]) -> nn.Module:
    if not (path / "config.json").is_file():
        raise UsageError(f"{str(path)!r} is a directory without config.json; {SPEC_HINT}")
    transformers = require("transformers", "hf", purpose="loading a Hugging Face model")
    cls = getattr(transformers, hf_class or "AutoModel", None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise UsageError(
            f"--hf-class {hf_class!r} is not a transformers Auto class such as "
            "AutoModelForImageClassification"
        )
    with contextlib.suppress(AttributeError):  # its bar would share stderr with our messages
        transformers.utils.logging.disable_progress_bar()
    model: nn.Module = cls.from_pretrained(str(path), local_files_only=True, **kwargs)
    return model.eval()


def _saved_program(path: Path) -> nn.Module:
    """A TorchScript or ``torch.export`` archive, told apart by what the zip holds (not by the
    suffix: a pickled module named ``.pt2`` is still a pickle, refused with one line)."""
    kind = archive_kind(path)
    if kind == "export":
        with _quiet_torch_logs():  # torch logs a traceback before raising: one line is ours
            try:
                return torch.export.load(str(path)).module()
            except Exception as e:
                raise UsageError(
                    f"cannot load the torch.export archive {str(path)!r}: {e}"
                ) from None
    if kind == "pickle":
        raise UsageError(
            f"{str(path)!r} was written by torch.save (a pickled module or a state_dict): pickles "
            "are never loaded (unpickling runs code). Save the model with torch.export.save or "
            f"torch.jit.save, or give a factory that loads your weights; {SPEC_HINT}"
        )
    if kind != "script":
        raise UsageError(
            f"{str(path)!r} is not a TorchScript or torch.export archive (a zip file); {SPEC_HINT}"
        )
    try:
        with warnings.catch_warnings():  # torch deprecates TorchScript: not the user's concern
            warnings.simplefilter("ignore", DeprecationWarning)
            model: nn.Module = torch.jit.load(str(path), map_location="cpu")  # type: ignore[no-untyped-call]
    except (RuntimeError, ValueError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UsageError(f"cannot load the TorchScript archive {str(path)!r}: {first}") from None
    return model.eval()


def archive_kind(path: Path) -> Literal["export", "script", "pickle", "other"]:
    """What a saved model file is: a ``torch.export`` archive (``archive_format`` entry), a
    TorchScript one (``code/`` entries), a ``torch.save`` pickle (``data.pkl`` alone, or not
    a zip at all but a legacy pickle), or something else."""
    if not zipfile.is_zipfile(path):
        with path.open("rb") as f:
            head = f.read(2)
        return "pickle" if head[:1] == b"\x80" else "other"  # pickle protocol 2+ opcode
    with zipfile.ZipFile(path) as archive:
        entries = [name.split("/", 1)[-1] for name in archive.namelist()]
    if "archive_format" in entries:
        return "export"
    if any(name.startswith("code/") for name in entries):
        return "script"
    return "pickle" if "data.pkl" in entries else "other"


@contextlib.contextmanager
def _quiet_torch_logs() -> Iterator[None]:
    logger = logging.getLogger("torch.export")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
