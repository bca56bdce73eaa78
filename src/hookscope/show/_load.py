"""The inputs a command is given (``--input-size``, ``--input``, ``--text``) turned into a
batch for the model, and the model and batch put on ``--device`` in ``--dtype``. Models are
loaded by ``_models``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .._extras import require
from .._png import image_to_tensor
from ..core import map_tensors
from ..errors import UsageError

__all__ = [
    "Loaded",
    "image_transform",
    "load_inputs",
    "parse_dtype",
    "parse_size",
    "prepare",
    "texts",
    "token_vocabulary",
    "tokenizer_of",
]

_IMAGES = {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff"}


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


@dataclass
class Loaded:
    """What ``load_inputs`` made: the model's ``batch``, and for ``--input`` the images as
    read (``(C, H, W)`` in 0..1, each at its own size) to draw maps on, and their files;
    ``notes``: what the user should know about the inputs (printed on stderr)."""

    batch: Any
    originals: list[Tensor] | None = None
    files: list[Path] | None = None
    notes: tuple[str, ...] = ()


def load_inputs(
    model: nn.Module,
    spec: str,
    *,
    size: str | None = None,
    dtype: str | None = None,
    images: str | None = None,
    image_size: int | None = None,
    channels: int = 3,
    text: tuple[str, ...] = (),
    seed: int = 0,
) -> Loaded:
    """A batch for ``model``: random ``size`` (token ids below the vocabulary size for a model
    whose first layer is an embedding, unless ``dtype`` says otherwise), ``images`` (a file or
    folder, each resized to a square of ``image_size`` and scaled to 0..1, or normalised by the
    HF directory's image processor; or a ``.npy`` array, the batch itself) or ``text`` (the HF
    directory's tokenizer)."""
    given = sum(bool(v) for v in (size, images, text))
    if given != 1:
        raise UsageError(
            "give exactly one input: --input-size 1,3,224,224, --input IMAGE_OR_FOLDER (or "
            "BATCH.npy) or --text TEXT"
        )
    kind = parse_dtype(dtype)
    if size:
        return Loaded(_random(model, parse_size(size), kind, seed))
    directory = Path(spec) if Path(spec).is_dir() else None
    if text:
        if directory is None:
            raise UsageError("--text needs a Hugging Face model directory (its tokenizer)")
        return _text_inputs(directory, list(text))
    assert images is not None  # given == 1
    if images.endswith(".npy"):
        return Loaded(_array(Path(images), model, kind))
    side = image_size or _model_side(model)
    files = _image_files(Path(images))
    batch, originals = _images(files, image_transform(spec, side, channels, squash=True))
    if kind is not None and kind.is_floating_point:
        batch = batch.to(kind)
    return Loaded(batch, originals, files)


def _array(path: Path, model: nn.Module, kind: torch.dtype | None) -> Tensor:
    """A ``.npy`` batch (samples along axis 0) as the model's input: floating values in
    ``--dtype`` or else the model's floating dtype (NumPy's float64 into a float32 model would
    fail inside it), integers (token ids) as they are. Never unpickled."""
    import numpy as np

    try:
        array = np.load(path, allow_pickle=False)
    except FileNotFoundError:
        raise UsageError(f"--input {str(path)!r}: no such file") from None
    except ValueError as e:  # not an array file, or an array of pickled objects
        raise UsageError(f"cannot read {str(path)!r} as a NumPy array: {e}") from None
    if array.ndim == 0:
        raise UsageError(f"--input {str(path)!r} holds one value: give a batch (N, ...)")
    batch = torch.from_numpy(array)
    floats = kind if kind is not None and kind.is_floating_point else floating_dtype(model)
    return batch.to(floats) if batch.is_floating_point() and floats is not None else batch


def floating_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the model's first floating parameter or buffer (None: it has none)."""
    for t in (*model.parameters(), *model.buffers()):
        if t.is_floating_point():
            return t.dtype
    return None


def parse_dtype(text: str | None) -> torch.dtype | None:
    if text is None:
        return None
    kind = getattr(torch, text, None)
    if not isinstance(kind, torch.dtype):
        raise UsageError(
            f"--dtype {text!r} is not a torch dtype such as float32, float16, bfloat16 or long"
        )
    return kind


def _random(
    model: nn.Module, shape: tuple[int, ...], kind: torch.dtype | None, seed: int
) -> Tensor:
    """Random inputs: token ids for an embedding-first model (or an integer ``kind``), else
    standard normal values of ``kind`` (float32 by default)."""
    g = torch.Generator().manual_seed(seed)
    vocabulary = token_vocabulary(model)
    if kind is None:
        kind = torch.long if vocabulary else torch.float32
    if kind.is_floating_point or kind.is_complex:
        return torch.randn(shape, generator=g).to(kind)
    return torch.randint(0, vocabulary or 100, shape, generator=g).to(kind)


def token_vocabulary(model: nn.Module) -> int | None:
    """The vocabulary size of a model that takes token ids: a Hugging Face model whose main
    input is ``input_ids``, or one whose first module with weights is an ``nn.Embedding``."""
    config = getattr(model, "config", None)
    if getattr(model, "main_input_name", None) == "input_ids":
        size = getattr(config, "vocab_size", None)
        if isinstance(size, int) and size > 0:
            return size
    for module in model.modules():
        if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
            return module.num_embeddings
        if any(True for _ in module.parameters(recurse=False)):
            return None
    return None


def prepare(
    model: nn.Module, batch: Any, *, device: str | None, dtype: str | None
) -> tuple[nn.Module, Any]:
    """The model and its inputs on ``device`` (default: where the model's weights are), the
    model's floating parameters and buffers cast to a floating ``dtype`` too, so that the
    inputs and the weights agree (a half-precision input into float32 weights fails)."""
    target = _device(device) if device else _model_device(model)
    kind = parse_dtype(dtype)
    if kind is not None and kind.is_floating_point:
        model = model.to(dtype=kind)
    model = model.to(target)
    moved = map_tensors(lambda _, t: t.to(target), batch)
    return model, moved


def _device(text: str) -> torch.device:
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(
            f"--device {text!r} is not a torch device such as cpu, cuda, cuda:1 or mps"
        ) from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {text}: CUDA is not available here (use --device cpu)")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise UsageError(
            f"--device {text}: this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UsageError(f"--device {text}: MPS is not available here (use --device cpu)")
    return device


def _model_device(model: nn.Module) -> torch.device:
    for t in (*model.parameters(), *model.buffers()):
        return t.device
    return torch.device("cpu")


def _model_side(model: nn.Module) -> int:
    side = getattr(getattr(model, "config", None), "image_size", None)
    if isinstance(side, (list, tuple)) and side:
        side = side[0]
    return side if isinstance(side, int) and side > 0 else 224


def _image_files(path: Path) -> list[Path]:
    """The image ``path``, or every image in folder ``path`` (sorted by name)."""
    files = (
        sorted(p for p in path.iterdir() if p.suffix.lower() in _IMAGES)
        if path.is_dir()
        else [path]
    )
    if not path.exists() or not files:
        raise UsageError(f"--input {str(path)!r}: no such image file or folder of images")
    return files


def _images(files: list[Path], transform: Any) -> tuple[Tensor, list[Tensor]]:
    """The images through ``transform``, stacked, and each as read (``(C, H, W)`` in 0..1,
    its own size)."""
    image_module = require("PIL.Image", "images", purpose="reading images")
    tensors, originals = [], []
    for file in files:
        try:
            with image_module.open(file) as im:
                tensors.append(transform(im))
                originals.append(image_to_tensor(im.convert("RGB")))
        except OSError as e:
            raise UsageError(f"cannot read image {str(file)!r}: {e}") from None
    return torch.stack(tensors), originals


#: files that hold a tokenizer's vocabulary (fast tokenizers, WordPiece, BPE, SentencePiece)
_TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "spiece.model", "tokenizer.model")


def tokenizer_of(directory: Path, purpose: str) -> Any:
    """The directory's tokenizer; refused when the directory holds no vocabulary, where
    ``AutoTokenizer`` would build one that turns every word into ``[UNK]``."""
    if not any((directory / f).is_file() for f in _TOKENIZER_FILES) and not any(
        directory.glob("*.model")
    ):
        raise UsageError(
            f"{str(directory)!r} has no tokenizer files ({', '.join(_TOKENIZER_FILES)}): every "
            "word would become [UNK]. Save the tokenizer next to the model "
            "(tokenizer.save_pretrained(DIR)), or give token ids: --input-size 2,64"
        )
    return _pretrained(directory, "AutoTokenizer", purpose)


def _text_inputs(directory: Path, text: list[str]) -> Loaded:
    tokenizer = tokenizer_of(directory, "tokenizing --text")
    batch = dict(tokenizer(text, padding=True, truncation=True, return_tensors="pt"))
    note = _all_unknown(tokenizer, batch["input_ids"])
    return Loaded(batch, notes=(note,) if note else ())


def _all_unknown(tokenizer: Any, ids: Tensor) -> str | None:
    """A warning if every word of the text became the unknown token."""
    unknown = getattr(tokenizer, "unk_token_id", None)
    special = set(getattr(tokenizer, "all_special_ids", []) or []) - {unknown}
    words = [i for i in ids.flatten().tolist() if i not in special]
    if unknown is None or not words or any(i != unknown for i in words):
        return None
    return (
        f"every token of --text became the unknown token {tokenizer.unk_token!r}: this "
        "tokenizer does not know the text's words, so the model sees no text"
    )


def texts(spec: str, file: str) -> tuple[list[str], Any]:
    """The lines of ``file`` (empty ones dropped) and the tokenizer of HF directory ``spec``."""
    if not Path(spec).is_dir():
        raise UsageError(
            "a .txt file of texts needs a Hugging Face model directory (its tokenizer)"
        )
    lines = [line for line in Path(file).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not lines:
        raise UsageError(f"{file!r} has no text lines")
    return lines, tokenizer_of(Path(spec), "tokenizing texts")


def image_transform(spec: str, size: int, channels: int = 3, *, squash: bool = False) -> Any:
    """PIL image -> tensor: the HF directory's image processor, else ``channels`` (1 or 3)
    resized to ``size`` and scaled to 0..1. ``squash``: every image is first resized to a
    ``size`` square and the processor only rescales and normalises it (no crop), so a map of
    the input lines up with the whole image once resized back to the image's own size."""
    directory = Path(spec)
    if directory.is_dir() and (directory / "preprocessor_config.json").is_file():
        processor = _pretrained(directory, "AutoImageProcessor", "preparing images")
        if not squash:
            return lambda im: processor(im.convert("RGB"), return_tensors="pt")["pixel_values"][0]
        return lambda im: processor(
            im.convert("RGB").resize((size, size)),
            do_resize=False,
            do_center_crop=False,
            return_tensors="pt",
        )["pixel_values"][0]
    mode = "L" if channels == 1 else "RGB"
    return lambda image: image_to_tensor(image.convert(mode).resize((size, size)))


def _pretrained(directory: Path, auto_class: str, purpose: str) -> Any:
    """``transformers.<auto_class>.from_pretrained(directory)``, offline."""
    transformers = require("transformers", "hf", purpose=purpose)
    return getattr(transformers, auto_class).from_pretrained(str(directory), local_files_only=True)
