"""``hookscope cam --method``: every attribution method of the registry
(:data:`hookscope.explain.METHODS`) whose required arguments the command line can give, built
from the command's options, and its maps drawn back on each image at the image's own size."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from ..core import (
    HookSet,
    Layers,
    ModuleCall,
    Session,
    call_model,
    features,
    leaves,
    run_eagerly,
    training_mode,
)
from ..errors import UsageError
from ..explain import METHODS, Explanation, MethodInfo, overlay
from ._load import Loaded
from ._report import image_batch, probabilities, to_plane

__all__ = [
    "MethodOptions",
    "build",
    "channel_methods",
    "choices",
    "default_fc",
    "path_methods",
    "perturbation_methods",
    "to_plane",
]

#: the constructor arguments (MethodInfo.requires) the command line fills, per kind
_FILLED = {
    "layer": {"fc"},
    "input": {"sliding_window_shapes"},
    "wrapper": {"method"},
    "attention": set(),
}


def choices() -> list[str]:
    """Registry names the command line can build, sorted."""
    return sorted(n for n, m in METHODS.items() if set(m.requires) <= _FILLED[m.kind])


def base_choices() -> list[str]:
    """Methods a wrapper (SmoothGrad) can wrap: every buildable method but the wrappers."""
    return [n for n in choices() if METHODS[n].kind != "wrapper"]


def perturbation_methods() -> list[str]:
    return sorted(n for n in choices() if METHODS[n].perturbation)


def channel_methods() -> list[str]:
    """Perturbation methods that explore a layer's channels (``--top-k``)."""
    return [n for n in perturbation_methods() if METHODS[n].kind == "layer"]


def path_methods() -> list[str]:
    """Methods that integrate along a path: their constructor takes ``n_steps`` (``--steps``)."""
    return sorted(n for n in choices() if _takes(METHODS[n].cls, "n_steps"))


def _takes(cls: type, keyword: str) -> bool:
    inits = [c.__init__ for c in cls.__mro__ if "__init__" in vars(c)]  # type: ignore[misc]
    return any(keyword in inspect.signature(init).parameters for init in inits)


@dataclass(frozen=True)
class MethodOptions:
    """The ``cam`` options that shape a method (None: not given)."""

    layer: str | None = None
    fc: str | None = None
    base: str = "saliency"
    top_k: int | None = None
    batch_size: int | None = None
    samples: int = 25
    noise: float = 0.15
    seed: int = 0
    window: int | None = None
    stride: int | None = None
    steps: int | None = None


def build(name: str, model: nn.Module, x: Any, o: MethodOptions) -> Callable[..., Explanation]:
    """The method ``name`` ready to call as ``method(x, targets=...)``."""
    info = METHODS[name]
    _check_options(info, o)
    if info.kind == "wrapper":
        if o.base not in base_choices():
            raise UsageError(f"--base {o.base!r} is not one of {', '.join(base_choices())}")
        base = build(o.base, model, x, MethodOptions(**{**o.__dict__, "top_k": None}))
        return info.cls(base, samples=o.samples, noise=o.noise, seed=o.seed)  # type: ignore[no-any-return]
    extra = _budget(info, o)
    if info.kind == "attention":
        return info.cls(model, o.layer)  # type: ignore[no-any-return]
    if info.kind == "input":
        if "sliding_window_shapes" in info.requires:
            extra.update(_window(x, o))
        return info.cls(model, **extra)  # type: ignore[no-any-return]
    layer = o.layer if o.layer is not None else last_spatial_layer(model, x)
    if "fc" in info.requires:
        extra["fc"] = o.fc if o.fc is not None else default_fc(model, x, layer)
    return info.cls(model, layer, **extra)  # type: ignore[no-any-return]


def _budget(info: MethodInfo, o: MethodOptions) -> dict[str, Any]:
    """The options that bound a method's work: extra forwards, channels, path steps."""
    extra: dict[str, Any] = {}
    if info.perturbation and o.top_k is not None:
        extra["top_k"] = o.top_k
    if info.perturbation and o.batch_size is not None:
        extra["batch_size"] = o.batch_size
    if o.steps is not None:
        extra["n_steps"] = o.steps
    return extra


def _window(x: Any, o: MethodOptions) -> dict[str, Any]:
    """Occlusion's window: ``--window`` pixels square over every channel (default: an eighth
    of the image's shorter side), moved by ``--stride`` (default: half the window)."""
    image = image_batch(x)
    if image is None:
        raise UsageError("occlusion from the command line needs an image input (N, C, H, W)")
    side = o.window if o.window is not None else max(1, min(image.shape[-2:]) // 8)
    stride = o.stride if o.stride is not None else max(1, side // 2)
    return {"sliding_window_shapes": (image.shape[1], side, side), "strides": (1, stride, stride)}


def _check_options(info: MethodInfo, o: MethodOptions) -> None:
    if info.kind == "wrapper" and o.base in METHODS:
        info = METHODS[o.base]  # --top-k and --fc go to the method SmoothGrad wraps
    if not info.perturbation and (o.top_k is not None or o.batch_size is not None):
        raise UsageError(
            f"--top-k and --batch-size budget the perturbation methods "
            f"({', '.join(perturbation_methods())}); {info.name} runs no extra forwards"
        )
    if o.top_k is not None and info.kind != "layer":
        raise UsageError(f"--top-k explores a layer's channels; {info.name} has none")
    if o.steps is not None and info.name not in path_methods():
        raise UsageError(
            f"--steps is for the path methods ({', '.join(path_methods())}), not {info.name}"
        )
    windowed = "sliding_window_shapes" in info.requires
    if (o.window is not None or o.stride is not None) and not windowed:
        raise UsageError(f"--window and --stride are occlusion's; {info.name} takes none")
    if o.fc is not None and "fc" not in info.requires:
        raise UsageError(f"--fc is the classifier layer of --method cam; {info.name} takes none")
    if info.kind == "input" and o.layer is not None:
        raise UsageError(
            f"{info.name} explains the input, not a layer: drop --layer (or pick a layer "
            "method such as gradcam)"
        )


class _LastMap(Session):
    """Remembers the last module (not the model itself) to return ``(N, C, H, W)`` maps with
    H, W > 1: a container returns after its children, so a stage (``layer4``) wins over its
    last ReLU."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model, recompile=True, this_thread=True)
        self.last: str | None = None

    def _install(self, hooks: HookSet) -> None:
        self._track(hooks, self.every_module())

    def _returned(self, call: ModuleCall, args: tuple[Any, ...], output: Any) -> Any:
        first = next((t for _, t in leaves(output)), None)
        if call.name and first is not None and first.dim() == 4 and min(first.shape[2:]) > 1:
            self.last = call.name
        return None


def last_spatial_layer(model: nn.Module, x: Any) -> str:
    """The last layer to return ``(N, C, H, W)`` maps (one forward without gradients)."""
    found = _LastMap(model)
    with found, torch.no_grad(), training_mode(model, False), run_eagerly(model):
        call_model(model, x)
    if found.last is None:
        raise UsageError(
            "no layer of this model outputs (N, C, H, W) maps: name one with --layer (see "
            "`hookscope names`)"
        )
    return found.last


def default_fc(model: nn.Module, x: Any, layer: str) -> str:
    """CAM's classifier: the model's last ``nn.Linear`` whose ``in_features`` equals the
    explained layer's channels (dim 1 of a map, the last dim of tokens)."""
    out = features(model, x, [layer])[layer]
    if not isinstance(out, Tensor) or out.dim() not in (3, 4):
        raise UsageError(f"CAM explains a layer with (N, C, H, W) maps; {layer!r} is not one")
    channels = out.shape[1] if out.dim() == 4 else out.shape[-1]
    linears = [(n, m) for n, m in Layers(model).modules.items() if isinstance(m, nn.Linear) and n]
    fits = [n for n, m in linears if m.in_features == channels]
    if not fits:
        found = ", ".join(f"{n} ({m.in_features} inputs)" for n, m in linears) or "none"
        raise UsageError(
            f"CAM needs the nn.Linear classifier fed by {layer!r}'s {channels} channels (global "
            f"pooling then one linear layer), and no nn.Linear has {channels} inputs (linear "
            f"layers: {found}): name it with --fc, or explain the layer before the classifier"
        )
    return fits[-1]


def draw(
    model: nn.Module, x: Loaded, exp: Explanation, out: Path, method: str
) -> list[dict[str, Any]]:
    """One overlay PNG per image, at the image's own size, and the row describing it."""
    with torch.no_grad():
        probs = probabilities(call_model(model, x.batch))
    planes = to_plane(exp.maps.detach()).float().cpu()
    batch = image_batch(x.batch)
    images = x.originals or (
        [t.detach().float().cpu() for t in batch] if batch is not None else None
    )
    rows = []
    for i in range(len(planes)):
        image = images[i] if images is not None else None
        path = out / f"{method}_{i}.png"
        if image is not None:  # resized to the image's own size: the inverse of the squash
            overlay(image, planes[i], alpha=0.45, save=path)
        k = None if exp.targets is None else int(exp.targets[i])
        rows.append(
            {
                "index": i,
                "image": str(x.files[i]) if x.files else None,
                "target": k,
                "score": float(exp.scores[i]),
                "probability": None if probs is None or k is None else float(probs[i, k]),
                "png": str(path) if image is not None else None,
            }
        )
    return rows
