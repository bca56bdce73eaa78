"""Peers that need help to import here, shared by the benchmark and the tests.

pytorch-grad-cam 1.5 imports torchvision at package import (for image utilities its CAM
classes never call), and torchvision cannot be installed here (ENVIRONMENT.md): the package is
imported with placeholder torchvision modules that are removed again right after.
"""

from __future__ import annotations

import sys
import types
from typing import Any

__all__ = ["pytorch_grad_cam"]


def pytorch_grad_cam() -> tuple[Any, Any]:
    """``(pytorch_grad_cam, pytorch_grad_cam.utils.model_targets)``."""
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional")
    stubs = {n: types.ModuleType(n) for n in names}
    for name in ("Compose", "Normalize", "ToTensor"):
        setattr(stubs["torchvision.transforms"], name, object)
    stubs["torchvision.transforms.functional"].resize = None  # type: ignore[attr-defined]
    saved = {n: sys.modules.get(n) for n in names}
    sys.modules.update(stubs)
    try:
        import pytorch_grad_cam
        from pytorch_grad_cam.utils import model_targets
    finally:  # the stubs out, what was there before back
        for n in names:
            del sys.modules[n]
        sys.modules.update({n: m for n, m in saved.items() if m is not None})
    return pytorch_grad_cam, model_targets
